"""wanlink demo: data-parallel training on 4 local ranks, wanlink against gloo.

Local ranks link over Unix sockets (wanlink) and TCP loopback (gloo); WANLINK_UNIX=0 puts
wanlink on loopback too.

Trains a small MLP on a synthetic 10-class data set (generated from a fixed seed: nothing to
download or install) with DistributedDataParallel, first with backend "wanlink", then with "gloo", printing per-epoch
progress, the final test accuracy, wanlink's per-link statistics and the time ratio.

    python -m wanlink.cli.demo [--ranks 4] [--epochs 12] [--batch 32]
    python -m wanlink.cli.demo --transfer [transfer-demo options]   # striped-transfer demo
"""
from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
import tempfile
import time
import traceback
from datetime import timedelta

SAMPLES, FEATURES, CLASSES = 2000, 64, 10
NOISE = 2.0  # class centres ~11 apart in 64 dimensions: the nearest-centre rule scores 97 %, not 100 %


def load_split(seed: int = 0):
    """Synthetic data as float tensors: (train_x, train_y, test_x, test_y), a fixed 80/20 split.

    Ten Gaussian clusters in 64 dimensions, the same for every call with the same seed.
    """
    import torch

    generator = torch.Generator().manual_seed(seed)
    centres = torch.randn(CLASSES, FEATURES, generator=generator)
    labels = torch.randint(0, CLASSES, (SAMPLES,), generator=generator)
    features = centres[labels] + NOISE * torch.randn(SAMPLES, FEATURES, generator=generator)
    cut = int(0.8 * SAMPLES)
    return features[:cut], labels[:cut], features[cut:], labels[cut:]


def make_model():
    import torch

    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 128),
                               torch.nn.ReLU(), torch.nn.Linear(128, 10))


def _format_bytes(count: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if count < 1024 or unit == "GiB":
            return f"{count:.1f} {unit}" if unit != "B" else f"{int(count)} B"
        count /= 1024
    return f"{count:.1f} GiB"


def print_link_stats(rank: int) -> None:
    import wanlink

    print(f"  per-link stats on rank {rank} (wanlink.stats()):")
    print(f"    {'peer':<24} {'streams':>7} {'sent':>11} {'received':>11}  chunks sent per stream")
    for _name, link in sorted(wanlink.stats().items()):
        print(f"    {link['peer']:<24} {link['streams_alive']:>3}/{link['streams']:<3} "
              f"{_format_bytes(link['bytes_sent']):>11} {_format_bytes(link['bytes_received']):>11}  "
              f"{link['chunks_sent_per_stream']}")


def train_rank(rank: int, world: int, backend: str, store_path: str, epochs: int, batch: int, results) -> None:
    """One rank: DDP training on its shard; rank 0 reports progress."""
    try:
        import torch
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel

        import wanlink  # noqa: F401 - registers the backend

        torch.set_num_threads(1)
        store = dist.FileStore(store_path, world)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timedelta(seconds=60))
        train_x, train_y, test_x, test_y = load_split()
        shard_x, shard_y = train_x[rank::world], train_y[rank::world]
        torch.manual_seed(0)
        model = DistributedDataParallel(make_model())
        optimiser = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        generator = torch.Generator().manual_seed(rank)
        steps = len(shard_y) // batch
        dist.barrier()
        started = time.perf_counter()
        for epoch in range(1, epochs + 1):
            epoch_started = time.perf_counter()
            order = torch.randperm(len(shard_y), generator=generator)
            total_loss = torch.zeros(1)
            for step in range(steps):
                index = order[step * batch:(step + 1) * batch]
                optimiser.zero_grad()
                loss = torch.nn.functional.cross_entropy(model(shard_x[index]), shard_y[index])
                loss.backward()
                optimiser.step()
                total_loss += loss.detach()
            dist.all_reduce(total_loss)
            with torch.no_grad():
                accuracy = (model(test_x).argmax(1) == test_y).float().mean().item()
            if rank == 0:
                print(f"  [{backend:>7}] epoch {epoch:>2}/{epochs}  loss {total_loss.item() / (world * steps):.4f}  "
                      f"test accuracy {accuracy:6.2%}  {time.perf_counter() - epoch_started:6.3f} s", flush=True)
        elapsed = time.perf_counter() - started
        if rank == 0:
            print(f"  [{backend:>7}] final test accuracy {accuracy:.2%} after {epochs} epochs, "
                  f"{epochs * steps} steps on {world} ranks in {elapsed:.2f} s", flush=True)
            if backend == "wanlink":
                print_link_stats(rank)
            results.put((backend, elapsed, accuracy))
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - shown to the user, the parent reports the failure
        traceback.print_exc()
        results.put((backend, None, traceback.format_exc()))
        _exit_now(results, 1)
    _exit_now(results, 0)


def _exit_now(results, code: int) -> None:
    """Flush the result queue and stdout, then leave without waiting for leftover threads."""
    results.close()
    results.join_thread()
    sys.stdout.flush()
    os._exit(code)


def run_world(backend: str, ranks: int, epochs: int, batch: int, timeout: float) -> tuple[float, float]:
    """Spawn ``ranks`` processes training with ``backend``; returns (seconds, accuracy) from rank 0."""
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    with tempfile.TemporaryDirectory(prefix="wanlink-demo-") as workdir:
        store_path = os.path.join(workdir, "store")
        processes = [context.Process(target=train_rank,
                                     args=(rank, ranks, backend, store_path, epochs, batch, results))
                     for rank in range(ranks)]
        for process in processes:
            process.start()
        try:
            outcome = results.get(timeout=timeout)
        except Exception:  # noqa: BLE001 - queue.Empty
            outcome = (backend, None, f"no result within {timeout:g} s")
        for process in processes:
            process.join(30)
            if process.is_alive():
                process.kill()
    if outcome[1] is None:
        raise SystemExit(f"demo: training with {backend} failed: {outcome[2]}")
    return outcome[1], outcome[2]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--transfer" in argv:
        from wanlink.cli.transfer_demo import main as transfer_main

        return transfer_main([arg for arg in argv if arg != "--transfer"])
    parser = argparse.ArgumentParser(prog="wanlink-demo", description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4, help="local ranks (processes)")
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--batch", type=int, default=32, help="per-rank batch size")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per backend run")
    parser.add_argument("--transfer", action="store_true", help="run the striped-transfer demo instead")
    args = parser.parse_args(argv)
    print(f"wanlink demo: MLP on synthetic data ({SAMPLES} samples, {FEATURES} features, {CLASSES} classes), "
          f"DDP on {args.ranks} local ranks "
          f"on this host, {args.epochs} epochs, batch {args.batch} per rank", flush=True)
    timings = {}
    for backend in ("wanlink", "gloo"):
        print(f"\n== backend {backend} ==", flush=True)
        timings[backend] = run_world(backend, args.ranks, args.epochs, args.batch, args.timeout)
    (wanlink_s, wanlink_acc), (gloo_s, gloo_acc) = timings["wanlink"], timings["gloo"]
    print(f"\nwanlink {wanlink_s:.2f} s (accuracy {wanlink_acc:.2%}), gloo {gloo_s:.2f} s (accuracy {gloo_acc:.2%}): "
          f"time ratio wanlink/gloo = {wanlink_s / gloo_s:.2f}")
    print("(local links have no latency or bandwidth limit, so this compares per-call overhead on small "
          "gradients, not what wanlink is built for: long, slow links)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
