"""Late receivers: wanlink against gloo when one rank joins seconds after the others (loopback).

The two programs of issue 14: a ``dist.send`` of 1.5 GiB to a rank that calls ``recv`` 5, 30 or
120 s later, and a 2.25 GiB ``all_reduce`` on 2 ranks with one rank 6 s late. Each case runs in a
fresh world per backend (so each rank's peak RSS is that case's), wanlink and gloo in the same run.
Times are from the common start (a barrier) to each rank's return; the late rank sleeps before
its call. For wanlink the table also shows the most bytes any link staged (its bound is
WANLINK_STAGING_BYTES, 128 MiB by default).

    python3 dev.py bench bench/late_receiver.py [--late 5 30 120] [--send-mib 1536]
        [--all-reduce-mib 2304] [--all-reduce-late 6] [--ranks 2] [--backends wanlink gloo]
        [--cases send all_reduce] [--name late_receiver] [--out DIR | --publish]

(The full run takes about 10 minutes on 2 CPUs; ``--cases`` and ``--late`` split it into shorter calls,
each with its gloo baseline, written under its own ``--name``.)

Writes late_receiver.{json,png} (bench/results/ with --publish).
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import socket
import sys
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.reporting import Run, add_output_options, colours, legend_outside, new_figure, print_table

MiB = 1 << 20


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _peak_rss_mib() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def _rank(rank, world, port, backend, case, nbytes, late_s, queue) -> None:
    try:
        import torch
        import torch.distributed as dist

        import wanlink

        torch.set_num_threads(1)
        store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=timedelta(seconds=120))
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timedelta(seconds=900))
        late = rank == world - 1
        tensor = torch.full((nbytes // 4,), float(rank + 1))
        dist.barrier()
        started = time.perf_counter()  # the common start
        if late:
            time.sleep(late_s)
        if case == "send":
            if rank == 0:
                dist.send(tensor, dst=1)
            else:
                dist.recv(tensor, src=0)
        else:
            dist.all_reduce(tensor)
        seconds = time.perf_counter() - started
        expected = 1.0 if case == "send" else world * (world + 1) / 2
        exact = (case == "send" and rank == 0) or bool((tensor == expected).all())
        staged = max((s["peak_unexpected_bytes"] for s in wanlink.stats().values()), default=0)
        result = {"rank": rank, "late": late, "seconds": seconds, "peak_rss_mib": _peak_rss_mib(), "exact": exact}
        if backend == "wanlink":
            result["staged_peak_mib"] = staged / MiB
        queue.put(result)
        dist.destroy_process_group()
    except BaseException as error:  # noqa: BLE001 - reported to the parent
        import traceback

        traceback.print_exc()
        queue.put({"rank": rank, "error": repr(error)})
    queue.close()
    queue.join_thread()
    os._exit(0)


def run_case(backend: str, case: str, world: int, nbytes: int, late_s: float) -> list[dict]:
    context = mp.get_context("spawn")
    queue = context.Queue()
    port = _free_port()
    processes = [context.Process(target=_rank, args=(rank, world, port, backend, case, nbytes, late_s, queue))
                 for rank in range(world)]
    for process in processes:
        process.start()
    results = [queue.get(timeout=late_s + 900) for _ in range(world)]
    for process in processes:
        process.join(60)
        if process.is_alive():
            process.kill()
    return sorted(results, key=lambda r: r["rank"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--late", type=float, nargs="+", default=[5, 30, 120],
                        help="receiver lateness (s) of the send case")
    parser.add_argument("--send-mib", type=int, default=1536)
    parser.add_argument("--all-reduce-mib", type=int, default=2304)
    parser.add_argument("--all-reduce-late", type=float, default=6)
    parser.add_argument("--ranks", type=int, nargs="+", default=[2], help="world sizes of the all_reduce case")
    parser.add_argument("--backends", nargs="+", default=["wanlink", "gloo"], choices=["wanlink", "gloo"])
    parser.add_argument("--cases", nargs="+", default=["send", "all_reduce"], choices=["send", "all_reduce"])
    parser.add_argument("--name", default="late_receiver")
    add_output_options(parser)
    args = parser.parse_args(argv)
    run = Run(args)
    cases = [("send", 2, args.send_mib, late) for late in args.late if "send" in args.cases]
    cases += [("all_reduce", world, args.all_reduce_mib, args.all_reduce_late) for world in args.ranks
              if "all_reduce" in args.cases]
    rows = []
    for case, world, mib, late in cases:
        for backend in args.backends:
            print(f"{case} {mib} MiB, {world} ranks, last rank {late:g} s late, {backend} ...", flush=True)
            for result in run_case(backend, case, world, mib * MiB, late):
                rows.append({"case": case, "MiB": mib, "ranks": world, "late_s": late, "backend": backend, **result})
    header = run.header()
    print(f"\nloopback, {os.cpu_count()} CPUs; load average before {header['load_before'][0]:.2f}, "
          f"after {header['load_after'][0]:.2f}")
    print_table(rows, [("case", "case", ""), ("MiB", "MiB", "d"), ("ranks", "ranks", "d"), ("late_s", "late (s)", "g"),
                       ("backend", "backend", ""), ("rank", "rank", "d"), ("seconds", "time (s)", ".1f"),
                       ("peak_rss_mib", "peak RSS (MiB)", ".0f"), ("staged_peak_mib", "staged peak (MiB)", ".0f"),
                       ("exact", "exact", ""), ("error", "error", "")])
    print("wrote", run.save_json(args.name, {"rows": rows}))
    print("wrote", plot(run, rows, args.name))
    return 0 if all(row.get("exact") for row in rows) else 1


def plot(run: Run, rows: list[dict], name: str) -> Path:
    cases = sorted({(r["case"], r["ranks"], r["late_s"]) for r in rows}, key=lambda c: (c[0] != "send", c[1], c[2]))
    figure, (time_axis, rss_axis) = new_figure(1, 2, figsize=(12, 4))
    width = 0.8 / 2
    palette = colours(["wanlink", "gloo"])
    for offset, backend in enumerate(("wanlink", "gloo")):
        times, rss = [], []
        for case in cases:
            ranks = [r for r in rows if (r["case"], r["ranks"], r["late_s"]) == case and r["backend"] == backend
                     and "seconds" in r]
            times.append(max((r["seconds"] for r in ranks), default=0))
            rss.append(max((r["peak_rss_mib"] for r in ranks if r["late"]), default=0))
        positions = [i + (offset - 0.5) * width for i in range(len(cases))]
        time_axis.bar(positions, times, width, label=backend, color=palette[backend])
        rss_axis.bar(positions, rss, width, label=backend, color=palette[backend])
    labels = [f"{case}\n{ranks} ranks, {late:g} s late" for case, ranks, late in cases]
    for axis, title in ((time_axis, "time to finish, slowest rank (s)"), (rss_axis, "late rank's peak RSS (MiB)")):
        axis.set_xticks(range(len(cases)), labels, fontsize=8)
        axis.set_title(title)
        axis.grid(axis="y", alpha=0.3)
    legend_outside(rss_axis)
    return run.save_figure(figure, name)


if __name__ == "__main__":
    sys.exit(main())
