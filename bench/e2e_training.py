"""End-to-end training across an emulated WAN: gloo DDP vs wanlink dense, block-sparse and stale-sparse.

Two ranks, one in each namespace of a ``bench.wanem`` path (40 ms RTT; 500 and 100 Mbit/s by
default), train a ~25M-parameter MLP on a synthetic teacher task (a fixed set of 32 batches per
rank, cycled) with the same seeds in every variant. Reports the median iteration time and its
phases (first iterations excluded: bucket rebuild, slow start), the speed-up over gloo, and the
loss against wall-clock time. Fast variants run more iterations so the loss curve means something.
Both namespaces run with ``net.ipv4.tcp_slow_start_after_idle=0`` (every variant alike; see
docs/sparse.md), every rank keeps freed memory in the heap (``--malloc``, see KEEP_FREED_MEMORY)
and every DDP uses ``gradient_as_bucket_view=True``. Needs root.

    python3 dev.py bench bench/e2e_training.py [--rtt-ms 40] [--rates 500 100] [--iterations N] [--secure]
"""
from __future__ import annotations

import argparse
import faulthandler
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.reporting import child_env  # noqa: E402

_NO_HOOK = {"density": None, "staleness": 0, "sparse_optimizer": False, "fp16_wire": False}
_FP16_WIRE = {**_NO_HOOK, "fp16_wire": True}  # torch's own fp16_compress_hook: halves the bytes of a dense step
_SPARSE = {"backend": "wanlink", "density": 0.01, "iterations": 150, "fp16_wire": False}
VARIANTS = {
    # no communication: one rank alone (the floor), and both ranks at once sharing this machine's cores
    "compute only": {"backend": None, "ranks": 1, "iterations": 150, **_NO_HOOK},
    "compute only, 2 ranks": {"backend": None, "ranks": 2, "iterations": 150, **_NO_HOOK},
    "gloo dense": {"backend": "gloo", "ranks": 2, "iterations": 10, **_NO_HOOK},
    "wanlink dense": {"backend": "wanlink", "ranks": 2, "iterations": 12, **_NO_HOOK},
    "gloo dense fp16 wire": {"backend": "gloo", "ranks": 2, "iterations": 10, **_FP16_WIRE},
    "wanlink dense fp16 wire": {"backend": "wanlink", "ranks": 2, "iterations": 12, **_FP16_WIRE},
    "wanlink sparse 1%": {**_SPARSE, "ranks": 2, "staleness": 0, "sparse_optimizer": False},
    "wanlink sparse 1% stale-1": {**_SPARSE, "ranks": 2, "staleness": 1, "sparse_optimizer": False},
    "wanlink sparse 1% stale-1 SparseSGD": {**_SPARSE, "ranks": 2, "staleness": 1, "sparse_optimizer": True},
}
SKIP_FIRST = 2  # iterations excluded from the median: DDP bucket rebuild and TCP slow start
WIDTH, DEPTH_IN, CLASSES, BATCH = 4096, 1024, 1024, 32
DATA_BATCHES = 32  # per rank, cycled: a finite training set the model can fit, so the loss visibly falls
# glibc hands every freed block over 32 MiB back to the kernel (mmap), so each iteration page-faults
# its ~100 MB of fresh gradients back in (about 20 ms a step here). Keeping freed memory in the heap
# is what PyTorch's CPU tuning guide gets from jemalloc or tcmalloc; every variant runs with it.
KEEP_FREED_MEMORY = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(1 << 40)}
PHASES = ("forward_s", "backward_s", "hook_s", "wait_s", "step_s", "cpu_s")
STALL_S = 180.0  # no iteration for this long is a hang (the slowest step, gloo dense at 100 Mbit/s, takes ~12 s)
STALL_EXIT = 86  # a rank's exit status when its watchdog found it stuck


class StallWatchdog:
    """Ends a rank that stopped making progress, saying where it stands.

    ``tick()`` after every iteration, and once before the rank's teardown (the process exits with
    the watchdog still running, so a hang in the teardown or the exit is caught too). If no tick
    comes for ``stall_s`` seconds the watchdog thread writes every thread's stack and wanlink's
    per-link state (what each link still sends and awaits, ``wanlink.io.registry.pending``, and its
    counters) to stderr and exits the process with ``STALL_EXIT``. faulthandler's C timer backs it
    up (stacks only) should a thread hold the GIL throughout."""

    def __init__(self, stall_s: float, rank: int):
        self.stall_s, self.rank = stall_s, rank
        self._last = time.monotonic()
        threading.Thread(target=self._watch, name="stall-watchdog", daemon=True).start()
        faulthandler.dump_traceback_later(stall_s + 30, exit=True)

    def tick(self) -> None:
        self._last = time.monotonic()
        faulthandler.dump_traceback_later(self.stall_s + 30, exit=True)

    def _watch(self) -> None:
        while True:
            time.sleep(1.0)
            stalled = time.monotonic() - self._last
            if stalled >= self.stall_s:
                from wanlink.io import registry

                print(f"rank {self.rank}: no progress for {stalled:.0f} s; per link, what it still sends and awaits:\n"
                      + json.dumps(registry.pending(), indent=1, default=repr) + "\nper-link counters:\n"
                      + json.dumps(registry.stats(), indent=1, default=repr), file=sys.stderr, flush=True)
                faulthandler.dump_traceback(all_threads=True)
                os._exit(STALL_EXIT)


def make_model():
    import torch

    return torch.nn.Sequential(torch.nn.Linear(DEPTH_IN, WIDTH), torch.nn.ReLU(), torch.nn.Linear(WIDTH, WIDTH),
                               torch.nn.ReLU(), torch.nn.Linear(WIDTH, CLASSES))


def timed(hook, clock: dict):
    """``hook`` wrapped to add its time to clock["hook_s"], note when a call last returned and which
    parameters each bucket holds (clock["buckets"]: index -> parameter ids)."""
    def timed_hook(state, bucket):
        clock["buckets"][bucket.index()] = [id(p) for p in bucket.parameters()]
        start = time.perf_counter()
        future = hook(state, bucket)
        clock["returned"] = time.perf_counter()
        clock["hook_s"] += clock["returned"] - start
        return future

    return timed_hook


def join_world(args, backend: str | None) -> None:
    """A rank's set-up inside its namespace: one thread, its addresses, the process group (None: alone)."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ["WANLINK_ADDR"] = args.address
    os.environ["GLOO_SOCKET_IFNAME"] = "wan0"
    if backend is not None:
        store = dist.TCPStore(args.master, args.port, 2, is_master=args.rank == 0, timeout=timedelta(seconds=120))
        dist.init_process_group(backend, store=store, rank=args.rank, world_size=2)


def mlp_and_batches(rank: int):
    """The MLP (seed 0) and this rank's fixed batches of the synthetic teacher task."""
    import torch

    torch.manual_seed(0)
    model = make_model()
    teacher = torch.nn.Linear(DEPTH_IN, CLASSES)
    data = torch.Generator().manual_seed(rank)
    inputs = [torch.randn(BATCH, DEPTH_IN, generator=data) for _ in range(DATA_BATCHES)]
    with torch.no_grad():
        return model, [(x, teacher(x).argmax(1)) for x in inputs]


def worker(args) -> None:
    """One rank: runs inside its namespace, writes its timings as JSON."""
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    import wanlink  # noqa: F401 - registers the backend
    from wanlink.c10d.sparse_hook import BlockSparseState, block_sparse_hook
    from wanlink.optim import SparseSGD

    variant = VARIANTS[args.variant]
    distributed = variant["backend"] is not None
    watchdog = StallWatchdog(args.stall_s, args.rank)
    join_world(args, variant["backend"])
    if args.shape:  # one of bench/fidelity.py's shapes: its model and its own real batches
        from bench.fidelity import SHAPES, Task

        torch.manual_seed(0)
        task = Task(SHAPES[args.shape], 0, args.rank, 2)
        model = task.model
        batches = [task.batch(i) for i in range(DATA_BATCHES)]
    else:
        model, batches = mlp_and_batches(args.rank)
    ddp = DDP(model, gradient_as_bucket_view=True) if distributed else model
    state = None
    clock = {"hook_s": 0.0, "returned": None, "buckets": {}}
    forwards = []  # (iteration, layer, time its forward began): when the layer needs its parameters
    if variant["density"] is not None:
        # SGD's momentum goes into the hook unless SparseSGD keeps it (docs/sparse.md)
        state = BlockSparseState(density=variant["density"], staleness=variant["staleness"],
                                 sparse_optimizer=variant["sparse_optimizer"],
                                 momentum=0.0 if variant["sparse_optimizer"] else 0.9)
        ddp.register_comm_hook(state, timed(block_sparse_hook, clock))
        state.exchange_log = []
        for layer, module in enumerate(m for m in model.modules() if list(m.parameters(recurse=False))):
            module.register_forward_pre_hook(
                lambda _m, _in, layer=layer: forwards.append((len(records), layer, time.perf_counter() - start)))
    elif variant["fp16_wire"]:
        ddp.register_comm_hook(None, fp16_compress_hook)
    momentum = 0.0 if state is not None and state.momentum else 0.9
    optimizer = (SparseSGD if variant["sparse_optimizer"] else torch.optim.SGD)(ddp.parameters(), lr=0.01,
                                                                                momentum=momentum)
    records = []
    if distributed:
        dist.barrier()
    start = time.perf_counter()
    for iteration in range(args.iterations):
        begin, cpu_begin = time.perf_counter(), time.process_time()
        clock.update(hook_s=0.0, returned=None)
        optimizer.zero_grad()
        inputs, labels = batches[iteration % DATA_BATCHES]
        output = ddp(inputs)
        loss = torch.nn.functional.cross_entropy(output.reshape(-1, output.shape[-1]), labels.reshape(-1))
        forward_end = time.perf_counter()
        loss.backward()
        backward_end = time.perf_counter()
        if variant["sparse_optimizer"]:
            optimizer.step(sparse_grads=state.sparse_grads())
        else:
            optimizer.step()
        end = time.perf_counter()
        record = {"iteration": iteration, "seconds": end - begin, "wall": end - start, "loss": loss.item(),
                  "forward_s": forward_end - begin, "backward_s": backward_end - forward_end,
                  "step_s": end - backward_end, "cpu_s": time.process_time() - cpu_begin}
        if state is not None:  # backward = compute + hooks (sparsify, launch) + waiting for the exchanges
            record.update(hook_s=clock["hook_s"], wait_s=backward_end - clock["returned"])
        records.append(record)
        watchdog.tick()
    watchdog.tick()  # the teardown's own budget
    if state is not None and state.flush():
        optimizer.step(**({"sparse_grads": state.sparse_grads()} if variant["sparse_optimizer"] else {}))
    if distributed:
        dist.barrier()
    params = sum(p.numel() for p in model.parameters())
    timeline = None
    if state is not None:
        layer_of = {id(p): layer for layer, module in enumerate(m for m in model.modules()
                                                                 if list(m.parameters(recurse=False)))
                    for p in module.parameters(recurse=False)}
        bucket_layers = {index: sorted({layer_of[p] for p in ids}) for index, ids in clock["buckets"].items()}
        timeline = {"arrivals": [(it, index, t - start) for it, index, t in state.exchange_log],
                    "forwards": forwards, "bucket_layers": bucket_layers}
    if args.rank == 0:
        Path(args.rank_out).write_text(json.dumps({"records": records, "params": params, "timeline": timeline,
                                              "sparse_bytes_sent": state.bytes_sent if state else None}))
    if distributed:
        dist.destroy_process_group()


def wait_ranks(name: str, ranks: list, stall_s: float) -> None:
    """Wait for the rank processes (each ends itself once stalled for ``stall_s``, see StallWatchdog);
    RuntimeError naming the variant when one failed or stalled."""
    codes = [rank.wait(timeout=1800) for rank in ranks]
    if STALL_EXIT in codes:
        stalled = [rank for rank, code in enumerate(codes) if code == STALL_EXIT]
        raise RuntimeError(f"{name}: rank(s) {stalled} made no progress for {stall_s:g} s (exit codes {codes}); "
                           "their stacks and per-link state are in the output above")
    if any(codes):
        raise RuntimeError(f"{name}: ranks exited with {codes}")


def run_variant(path, name: str, iterations: int, port: int, keep_freed_memory: bool, shape: str = "",
                chunk_order: str = "edf", secure: bool = False, stall_s: float = STALL_S) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rank0.json")
        common = [sys.executable, str(Path(__file__).resolve()), "--worker", "--variant", name, "--shape", shape,
                  "--iterations", str(iterations), "--master", path.addr_a, "--port", str(port), "--rank-out", out,
                  "--stall-s", repr(stall_s)]
        env = child_env(WANLINK_CHUNK_ORDER=chunk_order, WANLINK_SECURE="1" if secure else "0",
                        **(KEEP_FREED_MEMORY if keep_freed_memory else {}))
        ranks = [path.popen_a([*common, "--rank", "0", "--address", path.addr_a], env=env)]
        if VARIANTS[name]["ranks"] == 2:
            ranks.append(path.popen_b([*common, "--rank", "1", "--address", path.addr_b], env=env))
        wait_ranks(name, ranks, stall_s)
        result = json.loads(Path(out).read_text())
    steady = result["records"][SKIP_FIRST:]
    medians = {f"median_{phase}": statistics.median(r[phase] for r in steady)
               for phase in PHASES if phase in steady[0]}
    return {"variant": name, **VARIANTS[name], "iterations": iterations, "chunk_order": chunk_order, "secure": secure,
            "median_iteration_s": statistics.median(r["seconds"] for r in steady), **medians,
            # throughput: with staleness 1 the step times can alternate (a long wait, then short steps)
            "mean_iteration_s": (steady[-1]["wall"] - steady[0]["wall"]) / max(len(steady) - 1, 1),
            "final_loss": statistics.mean(r["loss"] for r in result["records"][-DATA_BATCHES:]), **result}


def median_exchange_s(row: dict) -> float:
    """Median time from a step's last bucket hook returning (its exchange launched) to the last byte of
    that step's last exchange arriving (rank 0): the one-way delay plus transfer and the transport's CPU."""
    arrivals = {}
    for iteration, _index, arrived in (row.get("timeline") or {}).get("arrivals", []):
        arrivals[iteration] = max(arrived, arrivals.get(iteration, arrived))
    records = row["records"]
    spans = [arrivals[r["iteration"]] - (r["wall"] - r["step_s"] - r["wait_s"])
             for r in records[SKIP_FIRST:] if r["iteration"] in arrivals]
    return statistics.median(spans) if spans else float("nan")


def _label(row: dict) -> str:
    order = " fcfs" if row.get("chunk_order") == "fcfs" else ""
    secure = " secure" if row.get("secure") else ""
    return f"{row['variant']}{order}{secure} @ {row['rate_mbit']:g} Mbit/s"


def add_worker_options(parser: argparse.ArgumentParser, port: int, extra: tuple[str, ...] = ()) -> None:
    """The hidden options a bench passes to the rank processes it starts (``--worker ...``)."""
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    for hidden in ("--variant", "--master", "--rank-out", "--address", *extra):
        parser.add_argument(hidden, help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=port, help=argparse.SUPPRESS)
    parser.add_argument("--stall-s", type=float, default=STALL_S,
                        help="a rank with no finished iteration for this long prints its stacks and per-link "
                        "state and exits; the bench then fails naming the variant")


def set_slow_start_after_idle(path, value: int) -> None:
    """Set net.ipv4.tcp_slow_start_after_idle (per network namespace) on both ends of the path."""
    for run in (path.run_a, path.run_b):
        run(["sysctl", "-q", "-w", f"net.ipv4.tcp_slow_start_after_idle={value}"], check=True)


def plot(run, rows: list[dict], name: str) -> Path:
    """Three questions, one panel each, one colour per variant in every panel; legends beside the axes."""
    from bench.reporting import colours, legend_outside, new_figure

    palette = colours(VARIANTS)
    fig, (ax_time, ax_phases, ax_loss) = new_figure(3, 1, figsize=(11, 15))
    fig.subplots_adjust(hspace=0.35)
    labels = [_label(r) for r in rows]
    ax_time.barh(labels, [r["median_iteration_s"] for r in rows], color=[palette[r["variant"]] for r in rows])
    ax_time.invert_yaxis()
    ax_time.set_xscale("log")
    ax_time.set_xlabel("median seconds per iteration (log)")
    ax_time.set_title("How long does an iteration take?")
    fast = [r for r in rows if r["backend"] is None or r["density"] is not None]  # the compute-bound variants
    left = [0.0] * len(fast)
    for phase, label in (("forward_s", "forward"), ("backward_compute_s", "backward compute"),
                         ("hook_s", "hook: sparsify + launch"), ("wait_s", "wait for exchange + DDP copy"),
                         ("step_s", "optimizer step")):
        widths = [r.get(f"median_{phase}", r["median_backward_s"] if phase == "backward_compute_s" else 0.0)
                  for r in fast]
        ax_phases.barh([_label(r) for r in fast], widths, left=left, label=label)
        left = [a + b for a, b in zip(left, widths)]
    ax_phases.invert_yaxis()
    ax_phases.set_xlabel("median seconds per phase (backward compute = backward - hook - wait)")
    ax_phases.set_title("Where does a compute-bound iteration spend its time?")
    legend_outside(ax_phases, fontsize=8)
    styles = {rate: style for rate, style in zip(dict.fromkeys(r["rate_mbit"] for r in rows), ("-", "--", ":", "-."))}
    for r in rows:
        ax_loss.plot([p["wall"] for p in r["records"]], [p["loss"] for p in r["records"]], linewidth=0.8,
                     color=palette[r["variant"]], linestyle=styles[r["rate_mbit"]],
                     label=_label(r))
    ax_loss.set_xscale("log")
    ax_loss.set_xlabel("wall-clock seconds (log)")
    ax_loss.set_ylabel("training loss (rank 0's batch)")
    ax_loss.set_title("How fast does the loss fall in wall-clock time?")
    legend_outside(ax_loss, fontsize=8)
    return run.save_figure(fig, name)


def slack_of(row: dict) -> list[dict]:
    """Per (iteration, bucket): when its exchange's last byte arrived (rank 0) and when the forward
    that first uses the update began (the bucket's earliest layer, ``1 + staleness`` iterations
    later); slack = needed - arrived. DDP applies no update before all its buckets arrived, so the
    slack is never negative: how small it gets says how close the exchange came to the critical path."""
    timeline = row.get("timeline")
    if not timeline:
        return []
    forward = {(it, layer): t for it, layer, t in timeline["forwards"]}
    layers = {int(index): layers for index, layers in timeline["bucket_layers"].items()}
    out = []
    for it, index, arrived in timeline["arrivals"]:
        if it < SKIP_FIRST or index not in layers:
            continue
        first_layer = min(layers[index])
        needed = forward.get((it + 1 + row["staleness"], first_layer))
        if needed is not None:
            out.append({"iteration": it, "bucket": index, "layer": first_layer, "arrived": arrived,
                        "needed": needed, "slack": needed - arrived})
    return out


def slack_summary(rows: list[dict]) -> list[dict]:
    """Median slack per layer for every row with a timeline."""
    out = []
    for row in rows:
        by_layer: dict[int, list[float]] = {}
        for item in slack_of(row):
            by_layer.setdefault(item["layer"], []).append(item["slack"])
        for layer, slacks in sorted(by_layer.items()):
            out.append({"rate_mbit": row["rate_mbit"], "variant": row["variant"], "chunk_order": row["chunk_order"],
                        "layer": layer, "median_slack_s": statistics.median(slacks), "min_slack_s": min(slacks)})
    return out


def plot_timeline(run, rows: list[dict], name: str, window: int = 4) -> Path | None:
    """Per (rate, variant), both chunk orders: for ``window`` steady iterations, when each bucket's
    last byte arrived (dot) and when the forward that needs it began (bar), per layer."""
    from bench.reporting import legend_outside, new_figure

    traced = [r for r in rows if r.get("timeline")]
    configs = list(dict.fromkeys((r["rate_mbit"], r["variant"]) for r in traced))
    if not configs:
        return None
    fig, axes = new_figure(len(configs), 1, figsize=(11, 3.2 * len(configs)), squeeze=False)
    fig.subplots_adjust(hspace=0.6)
    orders = {"edf": ("tab:blue", -0.15), "fcfs": ("tab:red", 0.15)}
    for ax, (rate, variant) in zip(axes[:, 0], configs):
        for row in (r for r in traced if (r["rate_mbit"], r["variant"]) == (rate, variant)):
            colour, offset = orders[row["chunk_order"]]
            items = slack_of(row)
            first = max(SKIP_FIRST, len(row["records"]) // 2)
            shown = [i for i in items if first <= i["iteration"] < first + window]
            if not shown:
                continue
            origin = min(i["arrived"] for i in shown)
            for i in shown:
                y = i["layer"] + offset
                ax.plot([i["arrived"] - origin, i["needed"] - origin], [y, y], color=colour, linewidth=0.8)
                ax.plot(i["arrived"] - origin, y, "o", color=colour, markersize=4)
                ax.plot(i["needed"] - origin, y, "|", color=colour, markersize=12)
            slacks = [i["slack"] for i in items]
            ax.plot([], [], "o-", color=colour, label=f"{row['chunk_order']}: last byte arrived -> | forward needs "
                    f"it (median slack {1000 * statistics.median(slacks):.0f} ms, min {1000 * min(slacks):.0f} ms)")
        ax.set_title(f"{variant} @ {rate:g} Mbit/s: iterations {first}-{first + window - 1}", fontsize=9)
        ax.set_yticks(sorted({i["layer"] for r in traced for i in slack_of(r)}))
        ax.set_ylabel("layer (0 = first in forward)")
        ax.set_xlabel("seconds since the window's first arrival")
        legend_outside(ax, fontsize=7)
    return run.save_figure(fig, name)


def main(argv: list[str] | None = None) -> int:
    from bench.reporting import Run, add_output_options, print_table

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rtt-ms", type=float, default=40)
    parser.add_argument("--rates", type=float, nargs="+", default=[500, 100])
    parser.add_argument("--iterations", type=int, default=None,
                        help="iterations of every variant (default: each variant's own count)")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--slow-start-after-idle", type=int, choices=(0, 1), default=0,
                        help="net.ipv4.tcp_slow_start_after_idle in both namespaces (the kernel default is 1)")
    parser.add_argument("--malloc", choices=("keep-freed", "glibc-default"), default="keep-freed",
                        help="keep-freed: every rank runs with "
                        + " ".join(f"{k}={v}" for k, v in KEEP_FREED_MEMORY.items()))
    parser.add_argument("--chunk-orders", nargs="+", choices=("edf", "fcfs"), default=["edf"],
                        help="WANLINK_CHUNK_ORDER of the ranks: each wanlink variant runs once per order")
    parser.add_argument("--secure", action="store_true",
                        help="run every wanlink variant twice: plaintext and WANLINK_SECURE=1 (AES-GCM)")
    parser.add_argument("--name", default="e2e_training", help="file name of the JSON and PNG")
    parser.add_argument("--shape", default="", help="train one of bench/fidelity.py's SHAPES on its data "
                        f"instead of the {WIDTH}-wide MLP on a teacher task")
    parser.add_argument("--replot", type=Path, metavar="JSON", help="only redraw the PNG from a result JSON")
    add_output_options(parser)
    add_worker_options(parser, port=29600)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    run = Run(args)
    if args.replot:
        saved_rows = json.loads(args.replot.read_text())["rows"]
        print("wrote", plot(run, saved_rows, args.name), plot_timeline(run, saved_rows, f"{args.name}_timeline"))
        return 0
    from bench.wanem.netns import WanPath

    if args.iterations is not None and args.iterations <= SKIP_FIRST:
        parser.error(f"--iterations must be more than the {SKIP_FIRST} skipped ones")
    rows = []
    for rate in args.rates:
        with WanPath(rtt_ms=args.rtt_ms, rate_mbit=rate) as path:
            set_slow_start_after_idle(path, args.slow_start_after_idle)
            wanlink = [name for name in args.variants if VARIANTS[name]["backend"] == "wanlink"]
            runs = [(name, order, secure) for name in args.variants
                    for order in (args.chunk_orders if name in wanlink else ["edf"])
                    for secure in ((False, True) if args.secure and name in wanlink else (False,))]
            for index, (name, order, secure) in enumerate(runs):
                row = run_variant(path, name, args.iterations or VARIANTS[name]["iterations"], 29600 + index,
                                  keep_freed_memory=args.malloc == "keep-freed", shape=args.shape, chunk_order=order,
                                  secure=secure, stall_s=args.stall_s)
                row.update(shape=args.shape or "mlp-teacher", rate_mbit=rate, rtt_ms=args.rtt_ms,
                           slow_start_after_idle=args.slow_start_after_idle,
                           malloc=args.malloc)
                if "median_hook_s" in row:
                    row["median_backward_compute_s"] = (row["median_backward_s"] - row["median_hook_s"]
                                                        - row["median_wait_s"])
                    row["median_exchange_s"] = median_exchange_s(row)
                rows.append(row)
                print(f"{rate:g} Mbit/s {name} ({order}{', secure' if secure else ''}): "
                      f"{row['median_iteration_s']:.3f} s/iteration", flush=True)
                run.save_json(args.name, {"rows": rows, "partial": True})  # kept should a later run fail
    for row in rows:
        gloo = next((r for r in rows if r["rate_mbit"] == row["rate_mbit"] and r["variant"] == "gloo dense"), None)
        row["speedup_vs_gloo"] = gloo["median_iteration_s"] / row["median_iteration_s"] if gloo else float("nan")
        same_wire = next((r for r in rows if r["rate_mbit"] == row["rate_mbit"] and r["backend"] == "gloo"
                          and r["fp16_wire"] == row["fp16_wire"]), None)  # fp16 against fp16, the rest against fp32
        row["speedup_vs_gloo_same_wire"] = (same_wire["median_iteration_s"] / row["median_iteration_s"]
                                            if same_wire else float("nan"))
        # a dense all-reduce of 2 ranks moves every gradient byte once each way: the bandwidth floor
        row["dense_floor_s"] = 8 * 4 * row["params"] / (row["rate_mbit"] * 1e6)
    batch = 16 if args.shape else BATCH  # bench.fidelity.BATCH
    print(f"\n{args.shape or 'MLP'}: {rows[0]['params'] / 1e6:.2f}M parameters, batch {batch}, 2 ranks, "
          f"{args.rtt_ms:g} ms RTT, "
          f"tcp_slow_start_after_idle={args.slow_start_after_idle}; load {os.getloadavg()[0]:.2f}; "
          "phases are medians (hook and wait: sparse variants only)")
    print_table(rows, [("rate_mbit", "Mbit/s", "g"), ("variant", "variant", ""), ("chunk_order", "order", ""),
                       ("secure", "secure", ""),
                       ("iterations", "iters", "d"),
                       ("median_iteration_s", "s/iteration", ".3f"), ("mean_iteration_s", "mean", ".3f"),
                       ("speedup_vs_gloo", "x gloo", ".1f"),
                       ("speedup_vs_gloo_same_wire", "x gloo same wire", ".1f"),
                       ("median_forward_s", "forward", ".3f"), ("median_backward_s", "backward", ".3f"),
                       ("median_hook_s", "hook", ".3f"), ("median_wait_s", "wait", ".3f"),
                       ("median_exchange_s", "exchange", ".3f"),
                       ("median_step_s", "step", ".3f"), ("median_cpu_s", "CPU s", ".3f"),
                       ("final_loss", "final loss", ".2f"), ("dense_floor_s", "dense bw floor s", ".2f")])
    slack = slack_summary(rows)
    if slack:
        print("\nper layer: when its bucket's last byte arrived vs when the forward that uses it began (rank 0)")
        print_table(slack, [("rate_mbit", "Mbit/s", "g"), ("variant", "variant", ""), ("chunk_order", "order", ""),
                            ("layer", "layer", "d"), ("median_slack_s", "median slack s", ".3f"),
                            ("min_slack_s", "min slack s", ".3f")])
    print("wrote", run.save_json(args.name, {"rows": rows, "skip_first": SKIP_FIRST, "slack": slack}))
    print("wrote", plot(run, rows, args.name))
    timeline = plot_timeline(run, rows, f"{args.name}_timeline")
    if timeline:
        print("wrote", timeline)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
