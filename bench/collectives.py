"""Collective bench: wanlink against gloo over loopback, nccl-tests style columns.

For world sizes 2 and 4 and message sizes 4 MiB .. 256 MiB, times all_reduce, broadcast and
all_gather on a wanlink default group and a gloo group of the same processes, in the same run.
Columns follow nccl-tests: ``size`` is the per-rank buffer (all_gather: the gathered output),
``time`` the slowest rank's mean, ``algbw = size / time`` and ``busbw`` algbw scaled by the
op's bus factor (all_reduce 2(n-1)/n, all_gather (n-1)/n, broadcast 1).

    python bench/collectives.py [--worlds 2 4] [--sizes-mib 4 16 64 256] [--iters 3]

Writes collectives.{txt,json,png} to --out (bench/results/ with --publish).
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.reporting import Run, add_output_options, colours, legend_outside, new_figure

MiB = 1 << 20
OPS = ("all_reduce", "broadcast", "all_gather")


def bus_factor(op: str, world: int) -> float:
    return {"all_reduce": 2 * (world - 1) / world, "all_gather": (world - 1) / world, "broadcast": 1.0}[op]


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


def bench_rank(rank, world, store_path, sizes, iters, queue) -> None:
    try:
        import torch
        import torch.distributed as dist

        import wanlink  # noqa: F401

        torch.set_num_threads(1)
        store = dist.FileStore(store_path, world)
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
    with tempfile.TemporaryDirectory(prefix="wanlink-bench-") as workdir:
        store_path = os.path.join(workdir, "store")
        processes = [context.Process(target=bench_rank, args=(rank, world, store_path, sizes, iters, queue))
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


def plot(run: Run, rows: list[dict]) -> Path:
    worlds = sorted({r["world"] for r in rows})
    figure, axes = new_figure(len(worlds), len(OPS), figsize=(4 * len(OPS), 3.2 * len(worlds)), squeeze=False)
    palette = colours(("wanlink", "gloo"))
    for i, world in enumerate(worlds):
        for j, op in enumerate(OPS):
            axis = axes[i][j]
            for backend, style in (("wanlink", "o-"), ("gloo", "s--")):
                points = sorted((r["bytes"] / MiB, r["busbw_GBps"]) for r in rows
                                if r["world"] == world and r["op"] == op and r["backend"] == backend)
                axis.plot([p[0] for p in points], [p[1] for p in points], style, label=backend,
                          color=palette[backend])
            axis.set_xscale("log", base=2)
            axis.set_title(f"{op}, {world} ranks (loopback)")
            axis.set_xlabel("size (MiB)")
            axis.set_ylabel("busbw (GB/s)")
            axis.grid(alpha=0.3)
    legend_outside(axes[0][-1])
    return run.save_figure(figure, "collectives")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--sizes-mib", type=int, nargs="+", default=[4, 16, 64, 256])
    parser.add_argument("--iters", type=int, default=3)
    add_output_options(parser)
    args = parser.parse_args(argv)
    run = Run(args)
    sizes = [size * MiB for size in args.sizes_mib]
    rows: list[dict] = []
    for world in args.worlds:
        print(f"world of {world} ranks on loopback", flush=True)
        rows += run_world(world, sizes, args.iters)
    text = table(rows)
    facts = run.header()
    summary = (f"wanlink vs gloo collectives over loopback; {facts['machine']['cpus']} CPUs, "
               f"{facts['machine']['platform']}, python {facts['versions']['python']}; load average before "
               f"{facts['load_before'][0]:.2f}, after {facts['load_after'][0]:.2f}; {args.iters} timed iterations "
               f"per point; {facts['date_utc']}")
    print("\n" + summary + "\n" + text)
    run.save_text("collectives.txt", summary + "\n" + text + "\n")
    run.save_json("collectives", {"iters": args.iters, "rows": rows})
    plot(run, rows)
    print(f"wrote {run.out}/collectives.{{txt,json,png}}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
