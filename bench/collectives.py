"""Collective bench: wanlink against gloo over loopback, nccl-tests style columns.

For world sizes 2 and 4 and sizes from 64 KiB to 256 MiB, times all_reduce, broadcast, all_gather
and reduce_scatter on a wanlink default group and a gloo group of the same processes, in the same
run. The two backends' iterations alternate, so load swings on a shared machine hit both alike.
Every iteration starts right after a barrier on a third (gloo) group, outside the timed region.
An iteration's time is its latency: from the moment the last rank called the op to the moment the
last rank returned (the ranks share this host's clock). The ranks leave that barrier apart, further
before a wanlink op than before a gloo op, each following the other (2026-11-27, median: 17-240 us
against 10-83 us with 2 ranks, 0.6-4.4 ms against 0.3-2.5 ms with 4 on 2 cores); the longest time
one rank spent in the call, which counts that skew as the op's, is kept in the JSON
(``slowest_rank_p50_s``, with ``start_skew_p50_s``). Columns follow nccl-tests: ``size`` is the per-rank
buffer (all_gather: the gathered output; reduce_scatter: the input), time percentiles p50 / p90
(and p99 in the JSON) over the iterations, ``algbw = size / p50`` and ``busbw`` algbw times the op's bus factor
(all_reduce 2(n-1)/n, all_gather and reduce_scatter (n-1)/n, broadcast 1). ``gloo/wanlink`` is
the ratio of the p50 times: above 1, wanlink is faster.

    python bench/collectives.py [--worlds 2 4] [--sizes 64K 1M 4M 16M 64M 256M] [--iters 40] [--count]

``--count`` adds, per point, what one wanlink op costs each rank's two threads (the caller's and the
wanlink-io loop's): Python calls and socket calls made from Python (sendmsg, os.readv, ...: one
system call each), both counted by a profile hook in passes of their own; thread CPU time;
read()/write() calls (``/proc``: the loop's wake-up eventfd, and the socket reads of the compiled
frame decoder, made in C; send/recv-type socket calls are not in that count) and voluntary
(sleeps: futex, epoll_wait) / involuntary context switches. Each is the difference between a
window of barrier + op iterations and one of barriers alone, divided by the iterations, so the
gloo barrier is not counted.

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

KiB, MiB = 1 << 10, 1 << 20
OPS = ("all_reduce", "broadcast", "all_gather", "reduce_scatter")
BACKENDS = ("wanlink", "gloo")


def bus_factor(op: str, world: int) -> float:
    return {"all_reduce": 2 * (world - 1) / world, "broadcast": 1.0}.get(op, (world - 1) / world)


def parse_size(text: str) -> int:
    """``64K``, ``4M``, ``1G`` or a byte count."""
    units = {"K": KiB, "M": MiB, "G": 1 << 30}
    suffix = text[-1:].upper()
    return int(text[:-1]) * units[suffix] if suffix in units else int(text)


def show_size(nbytes: int) -> str:
    return f"{nbytes // MiB} MiB" if nbytes >= MiB else f"{nbytes // KiB} KiB"


def iterations(nbytes: int, iters: int) -> int:
    """``iters`` up to 16 MiB, proportionally fewer above (at least 5)."""
    return max(5, min(iters, iters * 16 * MiB // nbytes))


def percentile(sorted_values: list[float], fraction: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, int(fraction * len(sorted_values)))]


def make_call(op: str, nbytes: int, group):
    """A function running ``op`` once on ``nbytes`` (nccl-tests' size convention) in ``group``."""
    import torch
    import torch.distributed as dist

    world = dist.get_world_size(group)
    numel = nbytes // 4 // world * world
    if op == "all_gather":
        output, source = torch.empty(numel), torch.ones(numel // world)
        return lambda: dist.all_gather_into_tensor(output, source, group=group)
    if op == "reduce_scatter":
        output, source = torch.empty(numel // world), torch.ones(numel)
        return lambda: dist.reduce_scatter_tensor(output, source, group=group)
    tensor = torch.ones(numel)
    if op == "all_reduce":
        return lambda: dist.all_reduce(tensor, group=group)
    return lambda: dist.broadcast(tensor, group_src=0, group=group)


def time_point(op: str, nbytes: int, groups: dict, sync, iters: int) -> dict[str, dict[str, list[float]]]:
    """Per backend, per iteration (iterations alternating): ``latency``, the time from the last rank's
    start to the last rank's end; ``slowest``, the longest time one rank spent in the call; ``skew``, how
    far apart the ranks started (seconds; the ranks share this host's monotonic clock)."""
    import torch
    import torch.distributed as dist

    calls = {backend: make_call(op, nbytes, group) for backend, group in groups.items()}
    for call in calls.values():
        call()  # warm-up: links, buffers
    marks = {backend: [] for backend in calls}
    for _ in range(iters):
        for backend, call in calls.items():
            dist.barrier(group=sync)
            started = time.perf_counter()
            call()
            marks[backend].append((started, time.perf_counter()))
    results = {}
    for backend, mine in marks.items():
        everyone = [torch.empty(len(mine), 2, dtype=torch.float64) for _ in range(dist.get_world_size(sync))]
        dist.all_gather(everyone, torch.tensor(mine, dtype=torch.float64), group=sync)
        starts, ends = torch.stack(everyone).unbind(2)  # (rank, iteration) each
        results[backend] = {"latency": (ends.max(0).values - starts.max(0).values).tolist(),
                            "slowest": (ends - starts).max(0).values.tolist(),
                            "skew": (starts.max(0).values - starts.min(0).values).tolist()}
    return results


THREADS = ("caller", "io")
COUNTERS = ("calls", "sock_calls", "cpu_us", "syscr", "syscw", "vcsw", "ivcsw")
HOOKED = ("calls", "sock_calls")  # counted by the profile hook, in passes of their own
SOCKET_CALLS = frozenset({"sendmsg", "send", "sendall", "recv_into", "recv", "recvmsg", "readv", "setsockopt",
                          "getsockopt"})


def thread_counters(native_id: int, ident: int) -> dict[str, float]:
    """CPU time (us), read/write-type syscalls and context switches of one thread of this process so far."""
    task = f"/proc/self/task/{native_id}"
    with open(f"{task}/io") as handle:
        io = dict(line.split(": ") for line in handle.read().splitlines())
    with open(f"{task}/status") as handle:
        status = dict(line.split(":\t") for line in handle.read().splitlines() if "ctxt_switches" in line)
    return {"cpu_us": time.clock_gettime(time.pthread_getcpuclockid(ident)) * 1e6,
            "syscr": int(io["syscr"]), "syscw": int(io["syscw"]),
            "vcsw": int(status["voluntary_ctxt_switches"]), "ivcsw": int(status["nonvoluntary_ctxt_switches"])}


class CallCounter:
    """Counts Python function calls (coroutine resumptions included) and socket method calls (each a
    system call: sendmsg, recv_into, ...) of the thread it is installed in."""

    def __init__(self):
        self.calls = self.sock_calls = 0

    def hook(self, _frame, event, arg) -> None:
        if event == "call":
            self.calls += 1
        elif event == "c_call" and getattr(arg, "__name__", None) in SOCKET_CALLS:
            self.sock_calls += 1


def count_point(call, sync, iters: int) -> dict[str, dict[str, float]]:
    """Per thread (caller, io): ``COUNTERS`` per op: a window of barrier + ``call`` iterations minus
    one of barriers alone, over ``iters``. Python and socket calls are counted in passes of their own
    (the hook costs CPU)."""
    import threading

    import torch.distributed as dist

    from wanlink.io.runtime import get_runtime

    runtime = get_runtime()
    io_thread = runtime.thread
    threads = {"caller": (threading.get_native_id(), threading.get_ident()),
               "io": (io_thread.native_id, io_thread.ident)}

    def on_loop(hook) -> None:
        done = threading.Event()

        def install() -> None:
            sys.setprofile(hook)
            done.set()

        runtime.loop.call_soon_threadsafe(install)
        done.wait(10)

    def window(op, hooked: bool) -> dict[str, dict[str, float]]:
        caller_calls, io_calls = CallCounter(), CallCounter()
        if hooked:
            on_loop(io_calls.hook)
        dist.barrier(group=sync)
        before = {name: thread_counters(*ids) for name, ids in threads.items()}
        for _ in range(iters):
            dist.barrier(group=sync)
            if hooked:
                sys.setprofile(caller_calls.hook)
            op()
            sys.setprofile(None)
        after = {name: thread_counters(*ids) for name, ids in threads.items()}
        if hooked:
            on_loop(None)
        spent = {name: {key: after[name][key] - before[name][key] for key in before[name]} for name in threads}
        for name, counter in (("caller", caller_calls), ("io", io_calls)):
            spent[name].update(calls=counter.calls, sock_calls=counter.sock_calls)
        return spent

    def nothing() -> None:
        pass

    per_op = {thread: dict.fromkeys(COUNTERS, 0.0) for thread in THREADS}
    for hooked in (False, True):
        base, with_op = window(nothing, hooked), window(call, hooked)
        for thread in THREADS:
            for key in (HOOKED if hooked else [key for key in COUNTERS if key not in HOOKED]):
                per_op[thread][key] = (with_op[thread][key] - base[thread][key]) / iters
    return per_op


def bench_rank(rank, world, store_path, sizes, iters, count_ops, queue) -> None:
    try:
        import torch
        import torch.distributed as dist

        import wanlink  # noqa: F401 - registers the backend

        torch.set_num_threads(1)
        dist.init_process_group("wanlink", store=dist.FileStore(store_path, world), rank=rank, world_size=world,
                                timeout=timedelta(seconds=600))
        groups = {"wanlink": None, "gloo": dist.new_group(backend="gloo")}
        sync = dist.new_group(backend="gloo")
        rows, counted = [], []
        for op in OPS:
            for size in sizes:
                count = iterations(size, iters)
                if count_ops:
                    mine = count_point(make_call(op, size, None), sync, count)
                    everyone = [None] * world
                    dist.all_gather_object(everyone, mine, group=sync)
                    counted += [{"op": op, "world": world, "bytes": size, "rank": r, "thread": thread, **values}
                                for r, per_thread in enumerate(everyone) for thread, values in per_thread.items()]
                for backend, times in time_point(op, size, groups, sync, count).items():
                    ordered = sorted(times["latency"])
                    p50 = percentile(ordered, 0.5)
                    algbw = size / p50 / 1e9
                    rows.append({"op": op, "world": world, "backend": backend, "bytes": size, "iters": count,
                                 "p50_s": p50, "p90_s": percentile(ordered, 0.9), "p99_s": percentile(ordered, 0.99),
                                 "min_s": ordered[0], "mean_s": sum(ordered) / len(ordered), "algbw_GBps": algbw,
                                 "busbw_GBps": algbw * bus_factor(op, world),
                                 "slowest_rank_p50_s": percentile(sorted(times["slowest"]), 0.5),
                                 "start_skew_p50_s": percentile(sorted(times["skew"]), 0.5)})
                if rank == 0:
                    p50 = {row["backend"]: row["p50_s"] for row in rows[-2:]}
                    print(f"  n={world} {op:<14} {show_size(size):>8}  p50 wanlink {p50['wanlink'] * 1e3:8.2f} ms"
                          f"  gloo {p50['gloo'] * 1e3:8.2f} ms", flush=True)
        if rank == 0:
            queue.put((rows, counted))
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported to the parent as a failed world
        import traceback

        traceback.print_exc()
        queue.put(None)
    queue.close()
    queue.join_thread()
    os._exit(0)


def run_world(world: int, sizes: list[int], iters: int, count_ops: bool = False) -> tuple[list[dict], list[dict]]:
    """The timed rows of one world size, and (``count_ops``) its per-thread counts."""
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    with tempfile.TemporaryDirectory(prefix="wanlink-bench-") as workdir:
        store_path = os.path.join(workdir, "store")
        processes = [context.Process(target=bench_rank, args=(rank, world, store_path, sizes, iters, count_ops, queue))
                     for rank in range(world)]
        for process in processes:
            process.start()
        result = queue.get(timeout=3600)
        for process in processes:
            process.join(60)
            if process.is_alive():
                process.kill()
    if result is None:
        raise SystemExit(f"bench: world of {world} failed")
    return result


def table(rows: list[dict]) -> str:
    columns = (f"{'op':<15}{'ranks':>5}{'size':>9} |{'wanlink p50':>12}{'p90':>9}{'algbw':>7}{'busbw':>7} |"
               f"{'gloo p50':>10}{'p90':>9}{'algbw':>7}{'busbw':>7} |{'gloo/wanlink':>13}")
    units = (f"{'':<15}{'':>5}{'':>9} |{'(ms)':>12}{'(ms)':>9}{'(GB/s)':>7}{'(GB/s)':>7} |"
             f"{'(ms)':>10}{'(ms)':>9}{'(GB/s)':>7}{'(GB/s)':>7} |{'(p50 time)':>13}")
    lines = [columns, units]
    keyed = {(r["op"], r["world"], r["bytes"], r["backend"]): r for r in rows}
    for op, world, size in sorted({(r["op"], r["world"], r["bytes"]) for r in rows},
                                  key=lambda k: (OPS.index(k[0]), k[1], k[2])):
        cells = []
        for backend in BACKENDS:
            row = keyed[(op, world, size, backend)]
            cells.append(f"{row['p50_s'] * 1e3:>{12 if backend == 'wanlink' else 10}.2f}{row['p90_s'] * 1e3:>9.2f}"
                         f"{row['algbw_GBps']:>7.2f}{row['busbw_GBps']:>7.2f}")
        ratio = keyed[(op, world, size, "gloo")]["p50_s"] / keyed[(op, world, size, "wanlink")]["p50_s"]
        lines.append(f"{op:<15}{world:>5}{show_size(size):>9} |{cells[0]} |{cells[1]} |{ratio:>13.2f}")
    return "\n".join(lines)


def count_table(counted: list[dict]) -> str:
    """Per op, rank and thread: what one wanlink op costs (see ``--count``)."""
    lines = [f"{'op':<15}{'ranks':>5}{'size':>9}{'rank':>5} {'thread':<7}|{'Python calls':>13}{'socket':>7}"
             f"{'CPU us':>8}{'syscr':>7}{'syscw':>7}{'vcsw':>7}{'ivcsw':>7}"]
    for row in sorted(counted, key=lambda r: (OPS.index(r["op"]), r["world"], r["bytes"], r["rank"],
                                               THREADS.index(r["thread"]))):
        lines.append(f"{row['op']:<15}{row['world']:>5}{show_size(row['bytes']):>9}{row['rank']:>5} {row['thread']:<7}|"
                     f"{row['calls']:>13.1f}{row['sock_calls']:>7.2f}{row['cpu_us']:>8.0f}{row['syscr']:>7.2f}{row['syscw']:>7.2f}"
                     f"{row['vcsw']:>7.2f}{row['ivcsw']:>7.2f}")
    return "\n".join(lines)


def plot(run: Run, rows: list[dict]) -> Path:
    worlds = sorted({r["world"] for r in rows})
    figure, axes = new_figure(len(worlds), len(OPS), figsize=(4 * len(OPS), 3.2 * len(worlds)), squeeze=False)
    palette = colours(BACKENDS)
    for i, world in enumerate(worlds):
        for j, op in enumerate(OPS):
            axis = axes[i][j]
            for backend, style in zip(BACKENDS, ("o-", "s--")):
                points = sorted((r["bytes"] / MiB, r["busbw_GBps"]) for r in rows
                                if r["world"] == world and r["op"] == op and r["backend"] == backend)
                axis.plot([p[0] for p in points], [p[1] for p in points], style, label=backend,
                          color=palette[backend])
            axis.set_xscale("log", base=2)
            axis.set_title(f"{op}, {world} ranks (loopback)")
            axis.set_xlabel("size (MiB)")
            axis.set_ylabel("busbw at p50 (GB/s)")
            axis.grid(alpha=0.3)
    legend_outside(axes[0][-1])
    return run.save_figure(figure, "collectives")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--sizes", nargs="+", default=["64K", "1M", "4M", "16M", "64M", "256M"],
                        help="per-rank sizes: 64K, 4M, ... or bytes")
    parser.add_argument("--iters", type=int, default=40, help="timed iterations per point up to 16 MiB")
    parser.add_argument("--count", action="store_true",
                        help="also count, per op, Python calls, CPU, syscalls and context switches per rank and thread")
    add_output_options(parser)
    args = parser.parse_args(argv)
    run = Run(args)
    sizes = [parse_size(size) for size in args.sizes]
    rows: list[dict] = []
    counted: list[dict] = []
    for world in args.worlds:
        print(f"world of {world} ranks on loopback", flush=True)
        timed, counts = run_world(world, sizes, args.iters, args.count)
        rows += timed
        counted += counts
    text = table(rows)
    if counted:
        text += "\n\nper wanlink op (--count: barrier + op minus barrier alone; socket: socket calls made from " \
                "Python (sendmsg, recv_into, ...: one system call each); syscr/syscw: read()/write() calls (the " \
                "loop's wake-up eventfd); vcsw/ivcsw: voluntary (sleeps) / involuntary context switches)\n" + \
                count_table(counted)
    header = run.header()
    print(f"\nwanlink vs gloo collectives over loopback; load {header['load_before'][0]} -> {header['load_after'][0]}; "
          f"up to {args.iters} timed iterations per point, backends alternating; time: from the last rank's call "
          f"to the last rank's return\n{text}")
    run.save_text("collectives.txt", text + "\n")
    run.save_json("collectives", {"rows": rows, "counts": counted})
    plot(run, rows)
    print(f"wrote {run.out}/collectives.{{txt,json,png}}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
