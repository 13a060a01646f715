"""CPU the block-sparse hook adds per training step, thread by thread, on bench/fidelity.py's model shapes.

Two ranks over loopback train each shape (its model, its real batches, seed 0) for --warmup steps,
then --steps timed steps; rank 0 reads every thread's CPU time from /proc before and after. The
variants: the model alone in each rank (no DDP, no communication: the compute floor), and the
README's sparse path at 1 % with staleness 1, with torch SGD behind momentum correction
(``BlockSparseState(momentum=0.9)``: the dense result path) and with SparseSGD
(``sparse_optimizer=True``: the sparse result path). The extra CPU per step of a variant over the
floor is the hook's: sparsification and encoding in the backward pass (main thread), the exchange
(the transport's I/O thread) and decoding (the thread that completes the exchange). Loopback keeps
the link out of it (bench/e2e_training.py --shape times the same variants across an emulated WAN).
Writes hook_cpu.json to --out (bench/results/ with --publish).

    python3 dev.py bench bench/hook_cpu.py [--shapes digits-mlp digits-cnn stdlib-lm] [--steps 300]
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.distributed as dist

from bench.fidelity import DEFAULT_SHAPES, MOMENTUM, SHAPES, Task, make_training

# variant -> the fidelity job's mode and optimizer (None: the model alone, no DDP)
VARIANTS = {"compute only": None, "sparse 1% stale-1, SGD": ("sparse s1", "sgd"),
            "sparse 1% stale-1, SparseSGD": ("sparse s1", "sparse-sgd-hook")}


def thread_cpu_s() -> dict[str, float]:
    """CPU seconds of each thread of this process (the scheduler's nanosecond count), keyed 'name/tid'."""
    times = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as stat, open(f"/proc/self/task/{tid}/comm") as comm:
                nanoseconds, name = int(stat.read().split()[0]), comm.read().strip()
        except OSError:  # the thread ended
            continue
        times[f"{name}/{tid}"] = nanoseconds / 1e9
    return times


def measure(shape: str, variant: str, rank: int, world: int, group, warmup: int, steps: int) -> dict:
    task = Task(SHAPES[shape], 0, rank, world)
    if VARIANTS[variant] is None:
        model = task.model
        optimizer = torch.optim.SGD(model.parameters(), lr=SHAPES[shape].sgd_lr, momentum=MOMENTUM)
        step = optimizer.step
    else:
        mode, name = VARIANTS[variant]
        model, _state, optimizer, step = make_training({"shape": shape, "mode": mode, "optimizer": name},
                                                       task.model, group)

    def train(first: int, count: int) -> None:
        for iteration in range(first, first + count):
            optimizer.zero_grad()
            x, y = task.batch(iteration)
            task.loss(model(x), y).backward()
            step()

    train(0, warmup)
    dist.barrier(group)
    before, started = thread_cpu_s(), time.perf_counter()
    train(warmup, steps)
    wall = time.perf_counter() - started
    after = thread_cpu_s()
    threads = {name: (after[name] - before.get(name, 0.0)) / steps for name in after}
    main = f"{open('/proc/self/comm').read().strip()}/{os.getpid()}"
    dist.barrier(group)
    return {"shape": shape, "variant": variant, "steps": steps, "wall_s": wall / steps,
            "cpu_s": sum(threads.values()), "main_thread_s": threads.get(main, 0.0),
            "other_threads_s": sum(t for name, t in threads.items() if name != main),
            "threads_s": {name: t for name, t in threads.items() if t > 0}}


def _worker(rank: int, world: int, init_file: str, jobs: list[tuple], warmup: int, steps: int, results) -> None:
    import wanlink  # noqa: F401 - registers the backend

    torch.set_num_threads(1)
    dist.init_process_group("wanlink", init_method=f"file://{init_file}", rank=rank, world_size=world)
    group = dist.new_group(backend="gloo")
    try:
        for shape, variant in jobs:
            row = measure(shape, variant, rank, world, group, warmup, steps)
            if rank == 0:
                results.put(row)
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    import torch.multiprocessing as mp

    from bench.reporting import Run, add_output_options, print_table

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=list(DEFAULT_SHAPES), choices=sorted(SHAPES))
    parser.add_argument("--steps", type=int, default=300, help="timed steps per variant")
    parser.add_argument("--warmup", type=int, default=60, help="untimed steps first (past the dense warm-up)")
    parser.add_argument("--name", default="hook_cpu", help="file name of the JSON")
    add_output_options(parser)
    args = parser.parse_args(argv)
    run = Run(args)
    jobs = [(shape, variant) for shape in args.shapes for variant in VARIANTS]
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    results = mp.get_context("spawn").Queue()
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_worker, args=(2, os.path.join(tmp, "rendezvous"), jobs, args.warmup, args.steps, results),
                           nprocs=2, start_method="spawn")
    rows = [results.get() for _ in jobs]
    for row in rows:
        floor = next(r for r in rows if r["shape"] == row["shape"] and VARIANTS[r["variant"]] is None)
        row["extra_cpu_s"] = row["cpu_s"] - floor["cpu_s"]
        row["extra_main_thread_s"] = row["main_thread_s"] - floor["main_thread_s"]
    ms = [{**r, **{k: 1e3 * r[k] for k in ("wall_s", "cpu_s", "main_thread_s", "other_threads_s", "extra_cpu_s",
                                           "extra_main_thread_s")}} for r in rows]
    print_table(ms, [("shape", "shape", ""), ("variant", "variant", ""), ("wall_s", "ms/step", ".2f"),
                     ("cpu_s", "CPU ms/step", ".2f"), ("extra_cpu_s", "hook CPU ms", ".2f"),
                     ("extra_main_thread_s", "of it main thread", ".2f"), ("other_threads_s", "other threads", ".2f")])
    print(f"rank 0, means over {args.steps} steps after {args.warmup}; load before {run.load_before}, "
          f"after {[round(x, 2) for x in os.getloadavg()]}")
    run.save_json(args.name, {"steps": args.steps, "warmup": args.warmup, "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
