"""Collective bench: wanlink against gloo over loopback, nccl-tests style columns.

For world sizes 2 and 4 and message sizes 4 MiB .. 256 MiB, times all_reduce, broadcast and
all_gather on a wanlink default group and a gloo group of the same processes, in the same run.
Columns follow nccl-tests: ``size`` is the per-rank buffer (all_gather: the gathered output),
``time`` the slowest rank's mean, ``algbw = size / time`` and ``busbw`` algbw scaled by the
op's bus factor (all_reduce 2(n-1)/n, all_gather (n-1)/n, broadcast 1).

    python bench/collectives.py [--worlds 2 4] [--sizes-mib 4 16 64 256] [--iters 3]

Writes bench/results/collectives.{txt,json,png}.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import sys
import time
from datetime import timedelta
from pathlib import Path

MiB = 1 << 20
RESULTS = Path(__file__).resolve().parent / "results"
OPS = ("all_reduce", "broadcast", "all_gather")


def bus_factor(op: str, world: int) -> float:
    return {"all_reduce": 2 * (world - 1) / world, "all_gather": (world - 1) / world, "broadcast": 1.0}[op]


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def time_op(op: str, nbytes: int, group, iters: int) -> float:
    """Mean seconds of ``op`` on ``nbytes`` (per nccl-tests' size convention), slowest rank."""
    import torch
    import torch.distributed as dist

    world = dist.get_world_size(group)
    numel = nbytes // 4
    if op == "all_gather":
        output = torch.empty(numel // world * world)
        source = torch.ones(numel // world)
        run = lambda: dist.all_gather_into_tensor(output, source, group=group)  # noqa: E731
    else:
        tensor = torch.ones(numel)
        run = (lambda: dist.all_reduce(tensor, group=group)) if op == "all_reduce" else \
            (lambda: dist.broadcast(tensor, group_src=0, group=group))
    run()  # warm-up (links, buffers)
    dist.barrier(group=group)
    started = time.perf_counter()
    for _ in range(iters):
        run()
    elapsed = torch.tensor([(time.perf_counter() - started) / iters], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=group)
    return elapsed.item()


def bench_rank(rank, world, port, sizes, iters, queue) -> None:
    try:
        import torch
        import torch.distributed as dist

        import wanlink  # noqa: F401

        torch.set_num_threads(1)
        store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=timedelta(seconds=120))
        dist.init_process_group("wanlink", store=store, rank=rank, world_size=world,
                                timeout=timedelta(seconds=600))
        groups = {"wanlink": None, "gloo": dist.new_group(backend="gloo")}
        rows = []
        for op in OPS:
            for size in sizes:
                for backend, group in groups.items():
                    seconds = time_op(op, size, group, iters)
                    algbw = size / seconds / 1e9
                    rows.append({"op": op, "world": world, "backend": backend, "bytes": size, "time_s": seconds,
                                 "algbw_GBps": algbw, "busbw_GBps": algbw * bus_factor(op, world)})
                    if rank == 0:
                        print(f"  n={world} {op:<10} {size // MiB:>4} MiB {backend:<7} {seconds * 1e3:9.1f} ms",
                              flush=True)
        if rank == 0:
            import wanlink as wl

            rows.append({"link_stats": wl.stats()})
            queue.put(rows)
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001
        import traceback

        traceback.print_exc()
        queue.put(None)
    queue.close()
    queue.join_thread()
    os._exit(0)


def run_world(world: int, sizes: list[int], iters: int) -> list[dict]:
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    port = _free_port()
    processes = [context.Process(target=bench_rank, args=(rank, world, port, sizes, iters, queue))
                 for rank in range(world)]
    for process in processes:
        process.start()
    rows = queue.get(timeout=3600)
    for process in processes:
        process.join(60)
        if process.is_alive():
            process.kill()
    if rows is None:
        raise SystemExit(f"bench: world of {world} failed")
    return [row for row in rows if "op" in row]


def table(rows: list[dict]) -> str:
    lines = [f"{'op':<11}{'ranks':>5}{'size':>10}  {'wanlink time':>13}{'algbw':>8}{'busbw':>8}  "
             f"{'gloo time':>11}{'algbw':>8}{'busbw':>8}  {'gloo/wanlink':>12}",
             f"{'':<11}{'':>5}{'(MiB)':>10}  {'(ms)':>13}{'(GB/s)':>8}{'(GB/s)':>8}  {'(ms)':>11}{'(GB/s)':>8}"
             f"{'(GB/s)':>8}  {'time ratio':>12}"]
    keyed = {(r["op"], r["world"], r["bytes"], r["backend"]): r for r in rows}
    for op, world, size in sorted({(r["op"], r["world"], r["bytes"]) for r in rows},
                                  key=lambda k: (OPS.index(k[0]), k[1], k[2])):
        ours, theirs = keyed[(op, world, size, "wanlink")], keyed[(op, world, size, "gloo")]
        lines.append(f"{op:<11}{world:>5}{size // MiB:>10}  {ours['time_s'] * 1e3:>13.1f}{ours['algbw_GBps']:>8.2f}"
                     f"{ours['busbw_GBps']:>8.2f}  {theirs['time_s'] * 1e3:>11.1f}{theirs['algbw_GBps']:>8.2f}"
                     f"{theirs['busbw_GBps']:>8.2f}  {theirs['time_s'] / ours['time_s']:>12.2f}")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    worlds = sorted({r["world"] for r in rows})
    figure, axes = plt.subplots(len(worlds), len(OPS), figsize=(4 * len(OPS), 3.2 * len(worlds)), squeeze=False)
    for i, world in enumerate(worlds):
        for j, op in enumerate(OPS):
            axis = axes[i][j]
            for backend, style in (("wanlink", "o-"), ("gloo", "s--")):
                points = sorted((r["bytes"] / MiB, r["busbw_GBps"]) for r in rows
                                if r["world"] == world and r["op"] == op and r["backend"] == backend)
                axis.plot([p[0] for p in points], [p[1] for p in points], style, label=backend)
            axis.set_xscale("log", base=2)
            axis.set_title(f"{op}, {world} ranks (loopback)")
            axis.set_xlabel("size (MiB)")
            axis.set_ylabel("busbw (GB/s)")
            axis.grid(alpha=0.3)
            axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--sizes-mib", type=int, nargs="+", default=[4, 16, 64, 256])
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    sizes = [size * MiB for size in args.sizes_mib]
    load_before = os.getloadavg()
    started = time.time()
    rows: list[dict] = []
    for world in args.worlds:
        print(f"world of {world} ranks on loopback", flush=True)
        rows += run_world(world, sizes, args.iters)
    load_after = os.getloadavg()
    text = table(rows)
    header = (f"wanlink vs gloo collectives over loopback; {os.cpu_count()} CPUs, {platform.machine()}, "
              f"python {platform.python_version()}; load average before {load_before[0]:.2f}, "
              f"after {load_after[0]:.2f}; {args.iters} timed iterations per point; "
              f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(started))}")
    print("\n" + header + "\n" + text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "collectives.txt").write_text(header + "\n" + text + "\n")
    (args.out / "collectives.json").write_text(json.dumps(
        {"header": header, "load_average_before": load_before, "load_average_after": load_after,
         "iters": args.iters, "rows": rows}, indent=1))
    plot(rows, args.out / "collectives.png")
    print(f"wrote {args.out}/collectives.{{txt,json,png}}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
