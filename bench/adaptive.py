"""Training while the WAN changes under it: gloo DDP, fixed densities and density="auto", same run.

Two ranks, one in each namespace of a ``bench.wanem`` path (40 ms RTT), train e2e_training's
~25M-parameter MLP while the path's rate follows a schedule (default 500 -> 100 -> 1000 -> 250
Mbit/s), changed in place by ``WanPath.change`` without dropping connections. Every variant runs
the same schedule for the same wall-clock time; the ranks stop together (a one-byte all-reduce on a
side group, overlapped with the next step). Sparse variants: staleness 1 with SparseSGD. The floor
is both ranks computing with no communication. Reports, per phase, the median iteration time
against that floor and the density in use; writes a PNG of iteration time and density over time
with the schedule drawn, and JSON. Needs root.

    python3 dev.py bench bench/adaptive.py [--phase-s 20] [--rates 500 100 1000 250] [--rtt-ms 40] [--publish]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.e2e_training import (  # noqa: E402
    DATA_BATCHES, KEEP_FREED_MEMORY, StallWatchdog, add_worker_options, join_world, mlp_and_batches,
    set_slow_start_after_idle, wait_ranks,
)
from bench.reporting import child_env  # noqa: E402

VARIANTS = {
    "compute only, 2 ranks": {"backend": None, "density": None},
    "gloo DDP": {"backend": "gloo", "density": None},
    "fixed 1%": {"backend": "wanlink", "density": 0.01},
    "fixed 0.1%": {"backend": "wanlink", "density": 0.001},
    "auto": {"backend": "wanlink", "density": "auto"},
}
AUTO_BOUNDS = {"min_density": 0.001, "max_density": 0.05}
FLOOR_ITERATIONS = 30
SKIP_PER_PHASE = 1  # the iteration that straddles a rate change


def worker(args) -> None:
    """One rank: trains until rank 0's clock passes the end of the schedule; writes its records."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import wanlink  # noqa: F401 - registers the backend
    from wanlink.c10d.sparse_hook import BlockSparseState, block_sparse_hook
    from wanlink.optim import SparseSGD

    variant = VARIANTS[args.variant]
    distributed = variant["backend"] is not None
    watchdog = StallWatchdog(args.stall_s, args.rank)
    join_world(args, variant["backend"])
    if distributed:
        side = dist.new_group(backend="gloo")
    model, batches = mlp_and_batches(args.rank)
    ddp = DDP(model, gradient_as_bucket_view=True) if distributed else model
    state = None
    if variant["density"] is not None:
        auto = variant["density"] == "auto"
        state = BlockSparseState(density=variant["density"], staleness=1, sparse_optimizer=True,
                                 **(AUTO_BOUNDS if auto else {}),
                                 **({"controller_options": {"margin": args.margin}} if auto and args.margin else {}))
        ddp.register_comm_hook(state, block_sparse_hook)
    optimizer = (SparseSGD if state else torch.optim.SGD)(ddp.parameters(), lr=0.01, momentum=0.9)
    if distributed:
        dist.barrier()
    start = time.monotonic()
    if args.rank == 0:
        Path(args.start_file).write_text(repr(start))
    records = []
    stop = torch.zeros(1)
    pending = None
    for iteration in range(10**9):
        if distributed:
            if pending is not None:
                pending.wait()
                if stop.item() > 0:
                    break
            stop.fill_(1.0 if time.monotonic() - start >= args.duration_s else 0.0)
            pending = dist.all_reduce(stop, op=dist.ReduceOp.MAX, group=side, async_op=True)
        elif iteration >= args.iterations:
            break
        begin = time.monotonic()
        optimizer.zero_grad()
        x, y = batches[iteration % DATA_BATCHES]
        loss = torch.nn.functional.cross_entropy(ddp(x), y)
        loss.backward()
        if state is not None:
            optimizer.step(sparse_grads=state.sparse_grads())
        else:
            optimizer.step()
        end = time.monotonic()
        density_stats = state.density_stats() if state is not None else {}
        estimate = density_stats.get("bandwidth_Bps")
        meters = {name: 8 * rate / 1e6 for name, rate in density_stats.get("meters_Bps", {}).items()}
        records.append({"iteration": iteration, "seconds": end - begin, "wall": end - start, "loss": loss.item(),
                        "density": None if state is None else state.density,
                        "estimate_mbit": None if estimate is None else 8 * estimate / 1e6,
                        **({"meters_mbit": meters, "exposed_s": density_stats["exposed_s"],
                            "compute_s": density_stats["compute_s"], "overruns": density_stats["overruns"]}
                           if meters else {})})
        watchdog.tick()
    watchdog.tick()  # the teardown's own budget
    if state is not None and state.flush():
        optimizer.step(sparse_grads=state.sparse_grads())
    if args.rank == 0:
        Path(args.rank_out).write_text(json.dumps({
            "records": records, "density_stats": state.density_stats() if state else None}))
    if distributed:
        dist.barrier()
        dist.destroy_process_group()


def run_variant(path, name: str, rates: list[float], phase_s: float, port: int, stall_s: float,
                margin: float | None = None) -> dict:
    """Runs one variant while changing the path's rate at each phase boundary (rank 0's clock)."""
    distributed = VARIANTS[name]["backend"] is not None
    with tempfile.TemporaryDirectory() as tmp:
        out, start_file = os.path.join(tmp, "rank0.json"), os.path.join(tmp, "start")
        common = [sys.executable, str(Path(__file__).resolve()), "--worker", "--variant", name,
                  "--duration-s", repr(phase_s * len(rates)), "--iterations", str(FLOOR_ITERATIONS),
                  "--master", path.addr_a, "--port", str(port), "--rank-out", out, "--start-file", start_file,
                  "--stall-s", repr(stall_s), *(["--margin", repr(margin)] if margin else [])]
        env = child_env(**KEEP_FREED_MEMORY)
        path.change(rate_mbit=rates[0])
        ranks = [path.popen_a([*common, "--rank", "0", "--address", path.addr_a], env=env),
                 path.popen_b([*common, "--rank", "1", "--address", path.addr_b], env=env)]
        changes = []
        if distributed:
            while not os.path.exists(start_file) and all(rank.poll() is None for rank in ranks):
                time.sleep(0.05)
            start = float(Path(start_file).read_text()) if os.path.exists(start_file) else time.monotonic()
            for index, rate in enumerate(rates[1:], 1):
                time.sleep(max(0.0, start + index * phase_s - time.monotonic()))
                path.change(rate_mbit=rate)
                changes.append((time.monotonic() - start, rate))
        wait_ranks(name, ranks, stall_s)
        result = json.loads(Path(out).read_text())
    return {"variant": name, **VARIANTS[name], "rate_changes": changes, **result}


def phase_rows(row: dict, rates: list[float], phase_s: float, floor_s: float) -> list[dict]:
    """Per phase: iterations that ended inside it (the first skipped), median time, density."""
    out = []
    for index, rate in enumerate(rates):
        inside = [r for r in row["records"] if index * phase_s <= r["wall"] < (index + 1) * phase_s]
        steady = inside[SKIP_PER_PHASE:] or inside
        median = statistics.median(r["seconds"] for r in steady) if steady else float("nan")
        densities = [r["density"] for r in steady if r["density"] is not None]
        exposed = [r["exposed_s"] for r in steady if "exposed_s" in r]  # auto: the wait for the exchange
        out.append({"variant": row["variant"], "phase": index, "rate_mbit": rate, "iterations": len(inside),
                     "median_iteration_s": median, "x_floor": median / floor_s,
                     "median_density": statistics.median(densities) if densities else None,
                     "median_exposed_s": statistics.median(exposed) if exposed else None})
    return out


def plot(run, rows: list[dict], rates: list[float], phase_s: float, floor_s: float, name: str) -> Path:
    from bench.reporting import colours, new_figure

    fig, (ax_time, ax_density) = new_figure(2, 1, figsize=(11, 8))
    palette = colours(VARIANTS)
    edges = [i * phase_s for i in range(len(rates) + 1)]
    for row in rows:
        if row["backend"] is None:
            continue
        walls = [r["wall"] for r in row["records"]]
        colour = palette[row["variant"]]
        ax_time.plot(walls, [r["seconds"] for r in row["records"]], marker=".", linewidth=0.7, label=row["variant"],
                     color=colour)
        if row["density"] is not None:
            ax_density.step(walls, [100 * r["density"] for r in row["records"]], where="post", label=row["variant"],
                            color=colour)
    ax_time.axhline(floor_s, color="black", linestyle=":", label="compute floor (2 ranks, no network)")
    ax_time.set_yscale("log")
    ax_time.set_ylabel("seconds per iteration (log)")
    ax_rate = ax_time.twinx()
    ax_rate.step(edges, [rates[0], *rates], where="pre", color="grey", alpha=0.5)
    for row in rows:  # what the controller believed the link delivers (auto only)
        estimates = [(r["wall"], r["estimate_mbit"]) for r in row["records"] if r.get("estimate_mbit")]
        if estimates:
            ax_rate.plot(*zip(*estimates), color="grey", linestyle="--", linewidth=0.8)
    ax_rate.set_ylabel("path rate, Mbit/s (grey); the controller's estimate (dashed)")
    ax_time.legend(fontsize=7, loc="upper left")
    ax_density.set_yscale("log")
    ax_density.set_ylabel("density in use, % (log)")
    ax_density.set_xlabel("wall-clock seconds since the first step")
    for edge in edges[1:-1]:
        for ax in (ax_time, ax_density):
            ax.axvline(edge, color="grey", linewidth=0.5)
    ax_density.legend(fontsize=7)
    return run.save_figure(fig, name)


def main(argv: list[str] | None = None) -> int:
    from bench.reporting import Run, add_output_options, print_table
    from bench.wanem.netns import WanPath

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rtt-ms", type=float, default=40)
    parser.add_argument("--rates", type=float, nargs="+", default=[500, 100, 1000, 250])
    parser.add_argument("--phase-s", type=float, default=30.0)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS),
                        help="run in this order; the floor may be named twice (first and last), its runs are averaged")
    parser.add_argument("--name", default="adaptive", help="file name of the JSON and PNG")
    parser.add_argument("--margin", type=float, help="auto's DensityController margin (default: the controller's)")
    parser.add_argument("--replot", type=Path, metavar="JSON", help="only redraw the PNG from a result JSON")
    add_output_options(parser)
    add_worker_options(parser, port=29700, extra=("--start-file",))
    parser.add_argument("--duration-s", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--iterations", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    run = Run(args)
    if args.replot:
        saved = json.loads(args.replot.read_text())
        print("wrote", plot(run, saved["runs"], saved["rates_mbit"], saved["phase_s"], saved["floor_s"], args.name))
        return 0
    runs = []
    with WanPath(rtt_ms=args.rtt_ms, rate_mbit=args.rates[0]) as path:
        set_slow_start_after_idle(path, 0)  # as e2e_training: no slow start after an idle gap
        for index, variant in enumerate(args.variants):
            runs.append(run_variant(path, variant, args.rates, args.phase_s, args.port + index, args.stall_s,
                                    args.margin))
            print(f"{variant}: {len(runs[-1]['records'])} iterations", flush=True)
            run.save_json(args.name, {"runs": runs, "partial": True})  # kept should a later variant fail
    # the floor may run more than once (first and last: the machine's load moves during a call)
    floors = [statistics.median(r["seconds"] for r in run_["records"][2:]) for run_ in runs if run_["backend"] is None]
    floor_s = statistics.mean(floors) if floors else float("nan")
    rows = [p for r in runs if r["backend"] is not None for p in phase_rows(r, args.rates, args.phase_s, floor_s)]
    print(f"\n2 ranks, {args.rtt_ms:g} ms RTT, phases of {args.phase_s:g} s at {args.rates} Mbit/s; compute floor "
          f"{floor_s:.3f} s/iteration (each floor run: {', '.join(f'{f:.3f}' for f in floors)}); "
          f"load before {run.load_before[0]:.1f}, after {os.getloadavg()[0]:.1f}")
    printable = [{k: ("" if v is None else v) for k, v in row.items()} for row in rows]
    print_table(printable, [("variant", "variant", ""), ("rate_mbit", "Mbit/s", "g"), ("iterations", "iters", "d"),
                       ("median_iteration_s", "s/iteration", ".3f"), ("x_floor", "x floor", ".2f"),
                       ("median_density", "density", ".4g"), ("median_exposed_s", "exchange wait s", ".3f")])
    run.save_json(args.name, {"phases": rows, "runs": runs, "floor_s": floor_s, "floor_runs_s": floors,
                              "rates_mbit": args.rates,
                              "phase_s": args.phase_s, "rtt_ms": args.rtt_ms, "auto_bounds": AUTO_BOUNDS,
                              "auto_margin": args.margin})
    print("wrote", plot(run, runs, args.rates, args.phase_s, floor_s, args.name))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
