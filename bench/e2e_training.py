"""End-to-end training across an emulated WAN: gloo DDP vs wanlink dense, block-sparse and stale-sparse.

Two ranks, one in each namespace of a ``bench.wanem`` path (40 ms RTT; 500 and 100 Mbit/s by
default), train a ~25M-parameter MLP on a synthetic teacher task with the same seeds in every
variant. Reports the median iteration time (first iterations excluded: bucket rebuild, slow
start), the speed-up over gloo, and the loss against wall-clock time. Needs root.

    python3 dev.py bench bench/e2e_training.py [--rtt-ms 40] [--rates 500 100] [--iterations 10]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

VARIANTS = {
    "compute only": {"backend": None, "density": None, "staleness": 0},  # one rank, no communication: the floor
    "gloo dense": {"backend": "gloo", "density": None, "staleness": 0},
    "wanlink dense": {"backend": "wanlink", "density": None, "staleness": 0},
    "wanlink sparse 1%": {"backend": "wanlink", "density": 0.01, "staleness": 0},
    "wanlink sparse 1% stale-1": {"backend": "wanlink", "density": 0.01, "staleness": 1},
}
SKIP_FIRST = 2  # iterations excluded from the median: DDP bucket rebuild and TCP slow start
WIDTH, DEPTH_IN, CLASSES, BATCH = 4096, 1024, 1024, 32


def make_model():
    import torch

    return torch.nn.Sequential(torch.nn.Linear(DEPTH_IN, WIDTH), torch.nn.ReLU(), torch.nn.Linear(WIDTH, WIDTH),
                               torch.nn.ReLU(), torch.nn.Linear(WIDTH, CLASSES))


def worker(args) -> None:
    """One rank: runs inside its namespace, writes its timings as JSON."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import wanlink  # noqa: F401 - registers the backend
    from wanlink.c10d.sparse_hook import BlockSparseState, block_sparse_hook

    variant = VARIANTS[args.variant]
    torch.set_num_threads(1)
    os.environ["WANLINK_ADDR"] = args.address
    os.environ["GLOO_SOCKET_IFNAME"] = "wan0"
    distributed = variant["backend"] is not None
    if distributed:
        store = dist.TCPStore(args.master, args.port, 2, is_master=args.rank == 0, timeout=timedelta(seconds=120))
        dist.init_process_group(variant["backend"], store=store, rank=args.rank, world_size=2)
    torch.manual_seed(0)
    model = make_model()
    teacher = torch.nn.Linear(DEPTH_IN, CLASSES)
    ddp = DDP(model) if distributed else model
    state = None
    if variant["density"] is not None:
        state = BlockSparseState(density=variant["density"], staleness=variant["staleness"])
        ddp.register_comm_hook(state, block_sparse_hook)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
    data = torch.Generator().manual_seed(args.rank)
    records = []
    if distributed:
        dist.barrier()
    start = time.perf_counter()
    for iteration in range(args.iterations):
        begin = time.perf_counter()
        x = torch.randn(BATCH, DEPTH_IN, generator=data)
        with torch.no_grad():
            y = teacher(x).argmax(1)
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(ddp(x), y)
        loss.backward()
        optimizer.step()
        end = time.perf_counter()
        records.append({"iteration": iteration, "seconds": end - begin, "wall": end - start, "loss": loss.item()})
    if state is not None and state.flush():
        optimizer.step()
    if distributed:
        dist.barrier()
    params = sum(p.numel() for p in model.parameters())
    if args.rank == 0:
        Path(args.out).write_text(json.dumps({"records": records, "params": params,
                                              "sparse_bytes_sent": state.bytes_sent if state else None}))
    if distributed:
        dist.destroy_process_group()


def run_variant(path, name: str, iterations: int, port: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rank0.json")
        common = [sys.executable, str(Path(__file__).resolve()), "--worker", "--variant", name,
                  "--iterations", str(iterations), "--master", path.addr_a, "--port", str(port), "--out", out]
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        ranks = [path.popen_a([*common, "--rank", "0", "--address", path.addr_a], env=env)]
        if VARIANTS[name]["backend"] is not None:
            ranks.append(path.popen_b([*common, "--rank", "1", "--address", path.addr_b], env=env))
        codes = [rank.wait(timeout=1800) for rank in ranks]
        if any(codes):
            raise RuntimeError(f"{name}: ranks exited with {codes}")
        result = json.loads(Path(out).read_text())
    steady = [r["seconds"] for r in result["records"][SKIP_FIRST:]]
    return {"variant": name, **VARIANTS[name], "median_iteration_s": statistics.median(steady), **result}


def main(argv: list[str] | None = None) -> int:
    from bench.reporting import new_figure, print_table, save_figure, save_json
    from bench.wanem.netns import WanPath

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rtt-ms", type=float, default=40)
    parser.add_argument("--rates", type=float, nargs="+", default=[500, 100])
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    for hidden in ("--variant", "--master", "--out", "--address"):
        parser.add_argument(hidden, help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=29600, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    rows = []
    for rate in args.rates:
        with WanPath(rtt_ms=args.rtt_ms, rate_mbit=rate) as path:
            for index, name in enumerate(args.variants):
                row = run_variant(path, name, args.iterations, 29600 + index)
                row.update(rate_mbit=rate, rtt_ms=args.rtt_ms)
                rows.append(row)
                print(f"{rate:g} Mbit/s {name}: {row['median_iteration_s']:.3f} s/iteration", flush=True)
    for row in rows:
        gloo = next((r for r in rows if r["rate_mbit"] == row["rate_mbit"] and r["variant"] == "gloo dense"), None)
        row["speedup_vs_gloo"] = gloo["median_iteration_s"] / row["median_iteration_s"] if gloo else float("nan")
        # a dense all-reduce of 2 ranks moves every gradient byte once each way: the bandwidth floor
        row["dense_floor_s"] = 8 * 4 * row["params"] / (row["rate_mbit"] * 1e6)
    print(f"\n{rows[0]['params'] / 1e6:.1f}M parameters, batch {BATCH}, 2 ranks, {args.rtt_ms:g} ms RTT; "
          f"load {os.getloadavg()[0]:.2f}")
    print_table(rows, [("rate_mbit", "Mbit/s", "g"), ("variant", "variant", ""),
                       ("median_iteration_s", "s/iteration", ".3f"), ("speedup_vs_gloo", "x gloo", ".1f"),
                       ("dense_floor_s", "dense bw floor s", ".2f")])
    save_json("e2e_training", {"rows": rows, "skip_first": SKIP_FIRST})
    fig, (ax_time, ax_loss) = new_figure(1, 2, figsize=(12, 4.5))
    labels = [f"{r['variant']}\n{r['rate_mbit']:g} Mbit/s" for r in rows]
    ax_time.barh(labels, [r["median_iteration_s"] for r in rows])
    ax_time.set_xscale("log")
    ax_time.set_xlabel("median seconds per iteration (log)")
    for r in rows:
        ax_loss.plot([p["wall"] for p in r["records"]], [p["loss"] for p in r["records"]],
                     label=f"{r['variant']} @ {r['rate_mbit']:g} Mbit/s", marker=".")
    ax_loss.set_xscale("log")
    ax_loss.set_xlabel("wall-clock seconds (log)")
    ax_loss.set_ylabel("training loss")
    ax_loss.legend(fontsize=7)
    print("wrote", save_figure(fig, "e2e_training"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
