"""Validate wanlink.plan's models against measured training runs on the emulated WAN.

Each configuration trains a small MLP with DDP over the wanlink backend between two network
namespaces of a ``bench.wanem`` path (2 ranks: one per namespace; 4 ranks: two per namespace,
which reach each other over Unix sockets, so the namespaces are two sites). Before training, a
configuration's ranks measure every input the models read, all at once so that they share the CPU
as in training: the calibration (two 16 MiB all-reduces warm the link, then lone all-reduces of
64 KiB, 1 MiB and 4 MiB take turns; the ranks' mean time counts), the profile of the step alone
(``profile_model`` through DDP and the hook over a one-rank group, 20 steps), and the same profile
beside the training's exchanges (about 10 s of steps, as long as training is timed; each bucket's
collective over the real group launched as DDP hands the bucket to the hook, a sparse one decoded
as the hook does, waited for
``staleness`` steps later as training does): that gives ``comm_slowdown``, the time the exchanges
took beside compute (which joins the calibration), and the CPU the rank's transport threads spent
per step. Then they train; the mean period of the slowest rank's iterations (the first 5
discarded, at least 10 s of them) is compared with the coarse and fine models, given the path's settings
(RTT, rate, the emulator's 1536 KiB window per flow, the stream count), the path's efficiency and
per-step send overhead fitted to the calibration (``calibrate_link``, never to the training
iterations), and per namespace half the host's cores less the emulator's measured share. Two more
columns: the nominal link, and the goodput wanlink-iperf measured (8 streams, 4 s, before the
path's configurations), as a probe would give it.

``--repeat N`` measures each configuration N times in a row (each run with its own calibration and
prediction); the headline compares, per configuration, the mean of its runs' measured times with
the mean of their predictions (``combine``): a lossy path switches loss regime within seconds, so a
single run's figure moved by 6 to 7 % on average between runs on this machine.

    sudo python3 dev.py bench bench/predict.py [--only NAME...] [--out DIR | --publish]
    python3 dev.py bench bench/predict.py --predict-only --out bench/results
    sudo python3 dev.py bench bench/predict.py --only A B --append --out DIR   (then C D ..., the same DIR)
    python3 dev.py bench bench/predict.py --predict-only --from DIR/predict.json --publish

``--predict-only`` recomputes the predictions from the measured runs saved in <out>/predict.json
(no emulator needed). Writes <out>/predict.{json,png} (bench/results/ with ``--publish``). The
4-rank rows are predicted with the collective wanlink runs for them (``wanlink_collective``).

``--allocation`` instead benches heterogeneous batch allocation: two ranks on loopback, rank 1
slowed by an injected sleep per sample; each rank fits f_i(x) = min(beta/alpha x, beta) from a
doubling batch sweep, ``allocate_batches`` splits the global batch, and blocks of iterations with
the equal and the allocated split alternate in the same run (bench/results/predict_allocation.*).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.reporting import child_env  # noqa: E402
from bench.wanem.netns import DEFAULT_WINDOW_KB  # noqa: E402

DEPTH_IN, WIDTH, CLASSES, BATCH = 1024, 1024, 256, 64
BUCKET_CAP_MB = 4
SKIP_FIRST = 5  # iterations not timed: DDP bucket rebuild, TCP ramp-up, the first stale step
PROFILE_WARMUP, PROFILE_ITERATIONS = 5, 20  # the profile alone (medians over the timed steps)
BUSY_WARMUP = SKIP_FIRST  # the profile beside the training's exchanges (each step waits for them): as training
TRAIN_TIMED_S = 10.0  # training times at least this long (at the busy profile's step time), after SKIP_FIRST
# the busy profile's timed steps: at least 12, and about as long as training is timed (busy_iterations): on a
# lossy path the link switches loss regime within seconds, and the calibration's sample of it should not be
# noisier than the measurement it predicts
BUSY_STEPS, BUSY_TIMED_S = 12, TRAIN_TIMED_S
LOOPBACK_UNIX = ROOT / "bench" / "results" / "loopback_unix.json"  # the 4-rank rows' ranks of one site use Unix sockets
LINK_STREAMS, LINK_SECONDS = 8, 4  # the path's goodput, measured once per path before its configurations
KEEP_FREED_MEMORY = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(1 << 40)}


WINDOW_BYTES = DEFAULT_WINDOW_KB * 1024  # the emulator's TCP window per flow


def bdp_streams(rtt_ms: float, rate_mbit: float, window_bytes: int = WINDOW_BYTES) -> int:
    """The fewest streams whose windows cover the path's bandwidth-delay product,
    ceil(rate x RTT / window), at least 1: the count ``choose_streams`` settles on over a
    window-limited path (the smallest within ``min_gain`` of the best rate, docs/probe.md). More
    streams only overflow the path's queue: 8 BBR streams on 40 ms / 500 Mbit/s (2 windows carry
    629 Mbit/s) retransmitted 540-1500 segments/s and moved the row's error by 20 % (sd) between runs."""
    return max(1, math.ceil(rate_mbit * 1e6 / 8 * rtt_ms / 1000 / window_bytes))


def _config(name, ranks, rtt_ms, rate_mbit, density=None, staleness=0, streams=None, order=None, iterations=None,
            bucket_cap_mb=BUCKET_CAP_MB):
    streams = streams or bdp_streams(rtt_ms, rate_mbit)
    order = order or ("fcfs" if density is None else "edf")  # dense DDP all-reduces carry no deadline
    return {"name": name, "ranks": ranks, "rtt_ms": rtt_ms, "rate_mbit": rate_mbit, "density": density,
            "staleness": staleness, "streams": streams, "order": order, "bucket_cap_mb": bucket_cap_mb,
            "iterations": iterations or _iterations(density, rate_mbit)}


def busy_iterations(profile, lone_s: dict[str, float], density) -> int:
    """Timed steps of the busy profile (after as many warm-up steps as training skips): at least
    BUSY_STEPS, and as many as last about BUSY_TIMED_S at the step time ``profile`` (alone) and the
    lone all-reduces (``lone_s``: bytes -> seconds) suggest, since the exchanges' time per step has
    rare long steps (a loss and its recovery, a stalled stream: 0.28 s steps with one of 0.92 s at
    80 ms / 2000 Mbit/s), whose count in a short sample moves its mean (12 steps: 8 % from one)."""
    if density is None:  # the buckets side by side, each at the 4 MiB all-reduce's rate
        exchange = max(b.bytes for b in profile.buckets) / (4 << 20) * lone_s[str(4 << 20)]
    else:  # one direct exchange per bucket
        exchange = len(profile.buckets) * lone_s[str(64 << 10)]
    return max(BUSY_STEPS, math.ceil(BUSY_TIMED_S / (profile.compute_s + exchange)))


def _iterations(density, rate_mbit) -> int:
    """Training iterations of a configuration at least (``training_iterations`` adds more where
    they take less than TRAIN_TIMED_S)."""
    if density is not None:
        return 60
    return 16 if rate_mbit <= 100 else 30 if rate_mbit <= 500 else 50


CONFIGS = [
    _config("2r 10ms 2000M dense", 2, 10, 2000),
    _config("2r 40ms 500M dense", 2, 40, 500),
    _config("2r 80ms 100M dense", 2, 80, 100),
    _config("2r 80ms 2000M dense 1 stream", 2, 80, 2000, streams=1),
    _config("2r 80ms 2000M dense 8 streams", 2, 80, 2000, streams=8),
    _config("2r 80ms 2000M dense 2 buckets", 2, 80, 2000, bucket_cap_mb=25),
    _config("2r 40ms 500M sparse 1%", 2, 40, 500, density=0.01),
    _config("2r 80ms 100M sparse 1%", 2, 80, 100, density=0.01),
    _config("2r 80ms 100M sparse 1% fcfs", 2, 80, 100, density=0.01, order="fcfs"),
    _config("2r 40ms 500M sparse 1% stale-1", 2, 40, 500, density=0.01, staleness=1),
    _config("2r 10ms 100M sparse 1% stale-1", 2, 10, 100, density=0.01, staleness=1),
    _config("4r 10ms 500M dense", 4, 10, 500),
    _config("4r 40ms 100M dense", 4, 40, 100),
    _config("4r 80ms 500M sparse 1%", 4, 80, 500, density=0.01),
    _config("4r 40ms 2000M sparse 1% stale-1", 4, 40, 2000, density=0.01, staleness=1),
]


def make_model():
    import torch

    return torch.nn.Sequential(torch.nn.Linear(DEPTH_IN, WIDTH), torch.nn.ReLU(), torch.nn.Linear(WIDTH, WIDTH),
                               torch.nn.ReLU(), torch.nn.Linear(WIDTH, CLASSES))


def make_batch(rank: int, size: int = BATCH):
    import torch

    generator = torch.Generator().manual_seed(rank)
    return torch.randn(size, DEPTH_IN, generator=generator), torch.randint(0, CLASSES, (size,), generator=generator)


def worker(args) -> None:
    """One rank: calibrate, profile (alone, then beside the training's exchanges), then train;
    writes its profiles and iteration times as JSON."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import wanlink  # noqa: F401 - registers the backend
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    from wanlink.c10d import sparse_hook
    from wanlink.plan.profiler import default_loss, profile_model

    config = json.loads(args.config)
    torch.set_num_threads(1)
    os.environ.update(WANLINK_ADDR=args.address, WANLINK_STREAMS=str(config["streams"]), GLOO_SOCKET_IFNAME="wan0")
    store = dist.TCPStore(args.master, args.port, config["ranks"], is_master=args.rank == 0,
                          timeout=timedelta(seconds=120))
    dist.init_process_group("wanlink", store=store, rank=args.rank, world_size=config["ranks"])
    marks = [("start", time.time())]  # wall clock, as the emulator's drop counters are sampled (measure)
    receive = [tcp_counters("self", RECEIVE_COUNTERS)]  # this namespace's, at each mark
    torch.manual_seed(0)
    model = make_model()
    batch = make_batch(args.rank)
    probe_s = lone_allreduce_seconds(dist, torch, marks)
    alone = [dist.new_group([rank]) for rank in range(config["ranks"])][args.rank]  # every rank makes every group
    options = {"bucket_cap_mb": config["bucket_cap_mb"], "density": config["density"], "name": "bench.predict MLP"}

    def profiled(**more):
        """The step as training runs it (DDP and the hook, over this rank's one-rank group)."""
        net = make_model()
        hook = None
        if config["density"] is not None:
            hook = (sparse_hook.BlockSparseState(density=config["density"], staleness=config["staleness"],
                                                 momentum=0.9, process_group=alone), sparse_hook.block_sparse_hook)
        optimizer = torch.optim.SGD(net.parameters(), lr=1e-3, momentum=0.0 if hook else 0.9)
        if exchanges is not None:  # the busy profile: each bucket's exchange leaves as DDP hands the bucket over
            state, real = hook or (alone, allreduce_hook)

            def hook_and_exchange(hook_state, bucket):
                exchanges.launch(bucket.index())
                return real(hook_state, bucket)

            hook = (state, hook_and_exchange)
        return profile_model(net, batch, optimizer=optimizer, process_group=alone, comm_hook=hook, **options, **more)

    exchanges = None
    profile = profiled(warmup=PROFILE_WARMUP, iterations=PROFILE_ITERATIONS)
    marks.append(("profile alone", time.time()))
    exchanges = training_exchanges(dist, torch, profile, config)
    busy_steps = int(_agreed_max(dist, torch, busy_iterations(profile, probe_s, config["density"])))
    cpu, main_thread = time.process_time(), time.thread_time()
    sched = [thread_schedstat()]
    began = time.perf_counter()
    busy = profiled(warmup=BUSY_WARMUP, iterations=busy_steps, background=exchanges)
    exchanges.drain()
    busy_step_s = (time.perf_counter() - began) / (BUSY_WARMUP + busy_steps)
    sched.append(thread_schedstat())
    # the CPU the rank's other threads (wanlink's event loop, its completion thread) spent per step's exchanges
    transport_cpu_s = ((time.process_time() - cpu) - (time.thread_time() - main_thread)) / len(exchanges.seconds)
    marks.append(("profiles", time.time()))
    ddp = DDP(model, bucket_cap_mb=config["bucket_cap_mb"], gradient_as_bucket_view=True)
    state = None
    if config["density"] is not None:
        if config["order"] == "fcfs":  # every exchange gets one deadline: the link serves them in launch order
            real_scope = sparse_hook.deadline_scope
            sparse_hook.deadline_scope = lambda _deadline: real_scope(1)
        # momentum goes into the hook (SGD's own momentum on error-feedback updates diverges: docs/sparse.md)
        state = sparse_hook.BlockSparseState(density=config["density"], staleness=config["staleness"], momentum=0.9)
        ddp.register_comm_hook(state, sparse_hook.block_sparse_hook)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=1e-3, momentum=0.0 if state is not None else 0.9)
    iterations = training_iterations(config, _agreed_max(dist, torch, busy_step_s))
    dist.barrier()
    marks.append(("DDP", time.time()))  # its construction broadcasts the model's state from rank 0
    seconds, forward, backward = [], [], []
    receive.append(tcp_counters("self", RECEIVE_COUNTERS))
    cpu_begin = time.process_time()
    sched.append(thread_schedstat())
    for iteration in range(iterations):
        if iteration == SKIP_FIRST:
            marks.append(("first iterations", time.time()))
        begin = time.perf_counter()
        optimizer.zero_grad()
        loss = default_loss(ddp(batch[0]), batch)
        forward.append(time.perf_counter() - begin)
        loss.backward()  # DDP's backward returns once every bucket's collective has ended
        backward.append(time.perf_counter() - begin - forward[-1])
        optimizer.step()
        seconds.append(time.perf_counter() - begin)
    cpu_s = time.process_time() - cpu_begin
    sched.append(thread_schedstat())
    marks.append(("timed iterations", time.time()))
    receive.append(tcp_counters("self", RECEIVE_COUNTERS))
    if state is not None and state.flush():
        optimizer.step()
    dist.barrier()
    offsets = _median_offsets(exchanges.offsets[BUSY_WARMUP:])
    receive_counters = {phase: dict(zip(RECEIVE_COUNTERS, (b - a for a, b in zip(*pair))))  # this namespace's
                        for phase, pair in (("before", receive[:2]), ("training", receive[1:]))}
    Path(args.out_file).write_text(json.dumps({"rank": args.rank, "profile": profile.to_json(),
                                             "busy_profile": busy.to_json(), "transport_cpu_s": transport_cpu_s,
                                             "seconds": seconds,
                                             "forward": forward, "backward": backward, "cpu_s": cpu_s,
                                             "lone_allreduce_s": probe_s,
                                             "busy_exchange_s": statistics.median(exchanges.seconds[BUSY_WARMUP:]),
                                             "busy_exchange_steps_s": exchanges.seconds[BUSY_WARMUP:],
                                             "busy_launch_offsets_s": offsets, "marks": marks,
                                             "receive_counters": receive_counters, "busy_step_s": busy_step_s,
                                             "schedstat": {"busy": _delta(*sched[:2]), "training": _delta(*sched[2:]),
                                                           "busy_steps": busy_steps + BUSY_WARMUP}}))
    dist.destroy_process_group()


def training_iterations(config: dict, step_s: float) -> int:
    """Training iterations: the configuration's count, or more where its timed steps (at ``step_s``
    each, the busy profile's) would last less than TRAIN_TIMED_S: the mean period of a few seconds
    moved 5 to 7 % between runs (the 20 to 30 ms rows timed 1.4 s)."""
    return SKIP_FIRST + max(config["iterations"] - SKIP_FIRST, math.ceil(TRAIN_TIMED_S / step_s))


def _agreed_max(dist, torch, value: float) -> float:
    """The largest of the ranks' ``value`` (every rank calls it)."""
    tensor = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return float(tensor.item())


def thread_schedstat() -> dict[str, list[int]]:
    """This process's threads' (CPU ns, ns waiting runnable on a run queue): the training (calling)
    thread's, and all threads' together (/proc/self/task/*/schedstat)."""
    import threading

    def read(tid):
        try:
            return [int(v) for v in Path(f"/proc/self/task/{tid}/schedstat").read_text().split()[:2]]
        except OSError:  # a thread that ended between the listing and the read
            return [0, 0]

    threads = {int(tid): read(tid) for tid in os.listdir("/proc/self/task")}  # one read each: main's is in all's
    return {"main": threads[threading.get_native_id()], "all": [sum(t[i] for t in threads.values()) for i in range(2)]}


def _delta(before: dict, after: dict) -> dict[str, list[int]]:
    return {key: [b - a for a, b in zip(before[key], after[key])] for key in before}


def _median_offsets(steps: list[dict]) -> dict[str, float]:
    """Median launch offset of every bucket over the busy profile's timed steps (JSON keys)."""
    return {str(index): statistics.median(step[index] for step in steps if index in step) for index in steps[-1]}


def _stamp(done, ends: list) -> None:
    """On wanlink's completion thread: when an exchange (and its decode) ended; raises what it raised."""
    done.value()
    ends.append(time.perf_counter())


def training_exchanges(dist, torch, profile, config: dict):
    """The exchanges one training step makes, for the busy profile: ``start`` is
    ``profile_model``'s ``background`` (called as each step begins, it returns the wait for the
    step's exchanges), ``start.launch(index)`` launches bucket ``index``'s collective (an
    all-reduce of the bucket dense, an all-gather of its sparse message, asynchronously), called
    by the profile's comm hook the moment DDP hands the bucket over, as in training. So the busy
    profile times compute beside the transport's CPU as training runs it. A step waits for the
    exchanges of the step ``staleness`` before it, as training's optimizer step does (with
    staleness 1 the ranks compute without a pause, beside the previous step's exchange: waiting
    for each step's own exchanges gave their compute idle cores that training does not have);
    ``start.drain()`` waits for those still in flight after the last step. Per step,
    ``start.seconds`` collects how long its exchanges took (first launch to the last one's end)
    and ``start.offsets`` each bucket's launch after the first: the link's calibration under
    training's conditions. A sparse exchange carries a block-COO message of the bucket (the
    rank's own, sparsified from random values once) and ends, as the sparse hook's does, once every
    rank's message is decoded and averaged into a bucket-sized buffer on wanlink's completion
    thread: CPU the hook over the profile's one-rank group never spends (one message there)."""
    from wanlink.c10d.sparse_hook import BucketCodec, all_gather_single
    from wanlink.plan.choice import Choice, bucket_message_bytes

    world = config["ranks"]
    if config["density"] is None:
        tensors = [torch.ones(size // 4) for size in bucket_message_bytes(profile, Choice())]

        def collective(index):
            return dist.all_reduce(tensors[index], async_op=True).get_future()
    else:
        generator = torch.Generator().manual_seed(dist.get_rank())
        codecs = [BucketCodec(list(bucket.numels), config["density"]) for bucket in profile.buckets]
        messages = [codec.encode(torch.randn(sum(codec.numels), generator=generator)) for codec in codecs]
        gathered = [torch.empty(world * message.numel(), dtype=torch.uint8) for message in messages]
        outs = [torch.empty(sum(codec.numels)) for codec in codecs]

        def collective(index):
            codec = codecs[index]
            work = all_gather_single(gathered[index], messages[index], async_op=True)
            if config["staleness"]:  # the hook's decode: into the next of the bucket's two result buffers
                result = codec.next_result()
                return work.get_future().then(lambda _f: result.fill(codec, gathered[index], world))
            return work.get_future().then(lambda _f: codec.average_into(gathered[index], world, outs[index]))

    in_flight = []  # the steps whose exchanges are not yet waited for, oldest first

    def launch(index):
        step = in_flight[-1]
        step["launched"][index] = time.perf_counter()
        step["done"].append(collective(index).then(lambda done: _stamp(done, step["ends"])))

    def wait(step):
        for done in step["done"]:
            done.wait()
        first = min(step["launched"].values())
        start.seconds.append(max(step["ends"]) - first)
        start.offsets.append({index: moment - first for index, moment in step["launched"].items()})

    def start():
        in_flight.append({"launched": {}, "done": [], "ends": []})

        def finish():
            while len(in_flight) > config["staleness"]:
                wait(in_flight.pop(0))

        return finish

    def drain():
        while in_flight:
            wait(in_flight.pop(0))

    start.launch, start.drain, start.seconds, start.offsets = launch, drain, [], []
    return start


PROBE_SIZES = (64 * 1024, 1024 * 1024, 4 * 1024 * 1024)  # a direct exchange (as a sparse bucket's), two rings
PROBE_ROUNDS, PROBE_WARMUP = 5, 1  # rounds of every size in turn (medians over the timed ones)
WARM_BYTES, WARM_REPEATS = 16 * 1024 * 1024, 2  # first: every stream carries chunks, its congestion window grows


def lone_allreduce_seconds(dist, torch, marks: list) -> dict[str, float]:
    """Median time of lone all-reduces of each of PROBE_SIZES bytes over the configuration's ranks:
    the calibration runs, separate from the training that is validated. The link is warmed first
    (training keeps every stream busy; a fresh stream's congestion window starts at 10 segments),
    then the sizes take turns. Appends to ``marks`` when the warm-up and the probes end."""
    warm = torch.ones(WARM_BYTES // 4)
    for _ in range(WARM_REPEATS):
        dist.all_reduce(warm)
    marks.append(("warm-up", time.time()))
    tensors = {size: torch.ones(size // 4) for size in PROBE_SIZES}
    times: dict = {size: [] for size in PROBE_SIZES}
    for round_ in range(PROBE_ROUNDS + PROBE_WARMUP):
        for size, tensor in tensors.items():
            dist.barrier()
            begin = time.perf_counter()
            dist.all_reduce(tensor)
            if round_ >= PROBE_WARMUP:
                times[size].append(time.perf_counter() - begin)
    marks.append(("probes", time.time()))
    return {str(size): statistics.median(values) for size, values in times.items()}


def _lone_probes(row: dict) -> dict[int, float]:
    """Bytes -> measured seconds of the row's lone all-reduces: the mean over the ranks where the row
    has each rank's time (``_rank_mean``), else the slowest rank's (rows measured before
    2026-11-26: 4 MiB only)."""
    if "per_rank_lone_allreduce_s" in row:
        per_rank = row["per_rank_lone_allreduce_s"]
        return {int(size): _rank_mean([times[size] for times in per_rank]) for size in per_rank[0]}
    if "lone_allreduce_s" in row:
        return {int(size): seconds for size, seconds in row["lone_allreduce_s"].items()}
    return {4 * 1024 * 1024: row["probe_allreduce_s"]}


def _rank_mean(seconds: list[float]) -> float:
    """What one exchange costs, from each rank's time for it. Ranks never start an exchange
    together: a barrier hands its exit skew on (each rank leaves it one delivery after the other
    entered), and so does every exchange after it, so one rank starts ``s`` earlier and times
    ``d + s`` where the other times ``d - s`` (traced: docs/plan.md, "Delivery and phase offset").
    The mean over the ranks is ``d``; the slowest rank's time counts the skew as well."""
    return statistics.fmean(seconds)


def _launch_offsets(row: dict, profile) -> list[float]:
    """Each bucket's launch after the first one's in the busy profile (mean over ranks); rows measured
    before 2026-11-26 16:30 launched every bucket at once."""
    if "per_rank_busy_launch_offsets_s" not in row:
        return [0.0] * len(profile.buckets)
    per_rank = row["per_rank_busy_launch_offsets_s"]
    return [statistics.fmean(offsets.get(str(index), 0.0) for offsets in per_rank)
            for index in range(len(profile.buckets))]


def _busy_exchange(row: dict) -> float:
    """Seconds of the training's exchanges beside the busy profile: the mean over the ranks of each
    rank's mean over its timed steps (as training's iteration time is a mean period; rows measured
    before 2026-11-26 22:40 kept each rank's median, before 2026-11-26 14:00 the slowest rank's)."""
    if "per_rank_busy_exchange_steps_s" in row:
        return _rank_mean([statistics.fmean(steps) for steps in row["per_rank_busy_exchange_steps_s"]])
    if "per_rank_busy_exchange_s" in row:
        return _rank_mean(row["per_rank_busy_exchange_s"])
    return row["busy_exchange_s"]


EFFICIENCIES = [e / 100 for e in range(1, 101)]  # of the nominal rate; a cluster allows (0, 1]
BUSY_WEIGHT = 1  # the training's exchanges timed beside compute count as much as all lone all-reduces together
# (a floor of 0.20 pinned the window-limited 80 ms / 2000 Mbit/s paths' fits to it: they fit 0.09 to 0.17)


def calibrate_link(row: dict, choice, profile=None) -> tuple[float, float]:
    """(efficiency, send overhead in ms) of the path, fitted to the exchanges the row's ranks timed
    before training (never to the training iterations): the lone all-reduces, and (rows measured
    since 2026-11-26 13:30, given ``profile``) the training's own exchanges launched beside the busy
    profile's compute, as training's conditions (the ranks' CPU busy) make them. For each efficiency
    on a grid, the overhead (>= 0) that best fits (the model's time is linear in it), and the pair
    with the least squared relative error over the probes. Where the row has them, the exchanges
    beside compute weigh as much as all lone all-reduces together (BUSY_WEIGHT): they are the
    calibration's sample of what training sends, back to back; a lone all-reduce starts from a
    barrier and bursts every stream's window at once, which on a path whose queue overflows
    samples another loss regime (4 MiB at 80 ms / 100 Mbit/s: a rank's median 0.50 to 1.24 s across
    runs). The lone ones then pick among the links that fit the exchanges about as well (the rate
    against the per-step overhead)."""
    from dataclasses import replace

    from wanlink.plan import Bucket, Profile, simulate

    dense = replace(choice, density=None, staleness=0, order="fcfs")
    lone = _lone_probes(row)
    probes = [(Profile("probe", 1, 0.0, 0.0, 0.0, (Bucket(size, 0.0, (size // 4,)),)), dense, seconds, 1.0)
              for size, seconds in lone.items()]
    if profile is not None and "busy_exchange_s" in row:  # the step's exchanges, no compute
        exchanges = replace(profile, forward_s=0.0, backward_s=0.0, step_s=0.0, comm_slowdown=1.0,
                            buckets=tuple(replace(b, ready_s=offset, sparsify_s=0.0)
                                          for b, offset in zip(profile.buckets, _launch_offsets(row, profile))))
        probes.append((exchanges, replace(choice, staleness=0), _busy_exchange(row), BUSY_WEIGHT * len(lone)))
    measured = [seconds for _p, _c, seconds, _w in probes]
    weights = [weight for _p, _c, _s, weight in probes]
    best = None
    for efficiency in EFFICIENCIES:
        base, slope = [], []
        for probe, probe_choice, _seconds, _weight in probes:
            at = [simulate(_cluster(row, row["rate_mbit"], efficiency, ms), probe, probe_choice,
                           iterations=2).iteration_s for ms in (0.0, 1.0)]
            base.append(at[0])
            slope.append(at[1] - at[0])
        # minimise sum(w ((base + slope x) - m) / m)^2 over x >= 0
        num = sum(w * s * (m - b) / m ** 2 for b, s, m, w in zip(base, slope, measured, weights))
        den = sum(w * s * s / m ** 2 for s, m, w in zip(slope, measured, weights))
        overhead = max(0.0, num / den) if den > 0 else 0.0
        error = sum(w * ((b + s * overhead) - m) ** 2 / m ** 2 for b, s, m, w in zip(base, slope, measured, weights))
        if best is None or error < best[0]:
            best = (error, efficiency, overhead)
    return best[1], best[2]


def wanlink_collective(ranks: int) -> str:
    """What wanlink's backend runs for a group of ``ranks`` split over the two namespaces (two sites):
    its site-aware all-reduce where that pays off, else flat rings (the model's "site" / "flat")."""
    from wanlink.collectives.hierarchical import pays_off
    from wanlink.sched.sites import SiteMap

    half = ranks // 2
    return "site" if pays_off(SiteMap(["a"] * half + ["b"] * (ranks - half))) else "flat"


DROP_SAMPLE_S = 0.1  # how often measure reads the emulator's drop counters during a configuration
TCP_COUNTERS = ("TCPTimeouts", "TCPLossProbes")  # a namespace's retransmission timeouts and tail-loss probes


# what a namespace's receivers did when their buffers overflowed (pruning clamps a stream's window)
RECEIVE_COUNTERS = ("PruneCalled", "RcvPruned", "OfoPruned", "TCPRcvQDrop", "TCPOFODrop", "TCPRcvCollapsed")


def tcp_counters(pid: int | str, counters: tuple[str, ...] = TCP_COUNTERS) -> tuple[int, ...]:
    """``counters`` of the network namespace process ``pid`` runs in (/proc/PID/net/netstat)."""
    names, values = (line.split()[1:] for line in Path(f"/proc/{pid}/net/netstat").read_text().splitlines()[:2])
    return tuple(int(values[names.index(name)]) for name in counters)


def host_cpu_ticks() -> tuple[int, int, int]:
    """The host's CPU time so far in clock ticks (/proc/stat, all cores): at nice > 0 (other
    sessions' jobs: they run at nice 19, the bench at 0), idle (with I/O wait), and in all."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    return fields[1], fields[3] + fields[4], sum(fields)


class DropSampler:
    """What a configuration lost, sampled every DROP_SAMPLE_S in a thread, stamped with the wall
    clock the ranks' phase marks use (``phase_counts`` says which phase lost what): the emulator's
    dropped segments (its queues' and random loss) per direction "ab", "ba", once ``watch`` names
    a process in each namespace, their TCP_COUNTERS (the senders' timeouts, then probes), and the
    host's CPU ticks (``host_cpu_ticks``: niced, idle, all)."""

    def __init__(self, path):
        import threading

        self.path, self.samples, self.pids, self._stop = path, [], (), threading.Event()
        self._tcp = self._base = (0,) * 2 * len(TCP_COUNTERS)
        self._thread = threading.Thread(target=self._run, name="drop-sampler", daemon=True)

    def watch(self, pid_a: int, pid_b: int) -> None:
        """Count the TCP_COUNTERS of these processes' namespaces from now on (earlier samples: 0)."""
        self._base = tuple(value for pid in (pid_a, pid_b) for value in tcp_counters(pid))
        self.pids = (pid_a, pid_b)

    def _sample(self) -> None:
        stats = self.path.stats()
        try:
            now = tuple(value for pid in self.pids for value in tcp_counters(pid))
            self._tcp = tuple(value - base for value, base in zip(now, self._base)) or self._tcp
        except OSError:  # a rank has exited: its namespace's last counters stay
            pass
        self.samples.append((time.time(), *(stats[d]["drop_queue"] + stats[d]["drop_loss"] for d in ("ab", "ba")),
                             *self._tcp, *host_cpu_ticks()))

    def _run(self) -> None:
        while not self._stop.wait(DROP_SAMPLE_S):
            self._sample()

    def __enter__(self):
        self._sample()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()


def phase_counts(samples: list[tuple], marks: list[tuple[str, float]]) -> dict[str, list[int]]:
    """How much each counter of ``samples`` (time, counters...) grew in each phase a rank marked:
    ``marks`` are (phase, its end) in order after ("start", ...); the counters a phase ends with
    are the first sample at or after its end (so a drop is put at most DROP_SAMPLE_S late),
    "before" are the configuration's set-up (store, process group), "after" its teardown."""
    def at(moment):
        return next((sample[1:] for sample in samples if sample[0] >= moment), samples[-1][1:])

    counts = [samples[0][1:]] + [at(moment) for _phase, moment in marks] + [samples[-1][1:]]
    names = ["before"] + [phase for phase, _moment in marks[1:]] + ["after"]
    return {name: [b - a for a, b in zip(counts[i], counts[i + 1])] for i, name in enumerate(names)}


def measure(path, config: dict, port: int) -> dict:
    """Run one configuration's ranks (half in each namespace) and collect their outputs."""
    ranks = config["ranks"]
    env = child_env(**KEEP_FREED_MEMORY)
    emulator_cpu, started = path.cpu_seconds(), time.monotonic()
    with tempfile.TemporaryDirectory() as tmp, DropSampler(path) as drops:
        procs, outs = [], []
        for rank in range(ranks):
            in_a = rank < ranks // 2
            out = os.path.join(tmp, f"rank{rank}.json")
            outs.append(out)
            argv = [sys.executable, str(Path(__file__).resolve()), "--worker", "--config", json.dumps(config),
                    "--rank", str(rank), "--master", path.addr_a, "--port", str(port), "--out-file", out,
                    "--address", path.addr_a if in_a else path.addr_b]
            procs.append((path.popen_a if in_a else path.popen_b)(argv, env=env))
        drops.watch(procs[0].pid, procs[-1].pid)  # `ip netns exec` execs the rank: its pid, its namespace
        codes = [proc.wait(timeout=900) for proc in procs]
        if any(codes):
            raise RuntimeError(f"{config['name']}: ranks exited with {codes}")
        results = [json.loads(Path(out).read_text()) for out in outs]
    emulator_cores = (path.cpu_seconds() - emulator_cpu) / (time.monotonic() - started)
    row = {**config, "collective": wanlink_collective(ranks),
           "seconds": [r["seconds"] for r in results], "profiles": [r["profile"] for r in results],
            "busy_profiles": [r["busy_profile"] for r in results],
            "transport_cpu_s": [r["transport_cpu_s"] for r in results],
            "train_forward_s": [statistics.median(r["forward"][SKIP_FIRST:]) for r in results],
            "train_backward_s": [statistics.median(r["backward"][SKIP_FIRST:]) for r in results],
            "rank_cpu_s_per_iteration": [r["cpu_s"] / len(r["seconds"]) for r in results],
            "emulator_cores": emulator_cores, "host_cores": os.cpu_count(), "bench_nice_zero": os.nice(0) == 0,
            # the slowest rank's view (as measured_s): the rank that leaves the barrier first waits longest
            "lone_allreduce_s": {size: max(r["lone_allreduce_s"][size] for r in results)
                                 for size in results[0]["lone_allreduce_s"]},
            "busy_exchange_s": max(r["busy_exchange_s"] for r in results),
            "per_rank_lone_allreduce_s": [r["lone_allreduce_s"] for r in results],
            "per_rank_busy_exchange_s": [r["busy_exchange_s"] for r in results],
            "per_rank_busy_exchange_steps_s": [r["busy_exchange_steps_s"] for r in results],
            "per_rank_busy_launch_offsets_s": [r["busy_launch_offsets_s"] for r in results],
            "marks": results[0]["marks"], "receive_counters": [r["receive_counters"] for r in results],
            "iterations": len(results[0]["seconds"]), "busy_step_s": [r["busy_step_s"] for r in results],
            "schedstat": [r["schedstat"] for r in results]}
    counts = phase_counts(drops.samples, results[0]["marks"])
    tcp = 2 + 2 * len(TCP_COUNTERS)
    row.update(drops={phase: c[:2] for phase, c in counts.items()},  # segments, per direction (ab, ba)
               timeouts={phase: c[2:tcp:2] for phase, c in counts.items()},  # TCP's, per namespace (a, b)
               loss_probes={phase: c[3:tcp:2] for phase, c in counts.items()},
               host_cpu_ticks={phase: c[tcp:] for phase, c in counts.items()})  # niced, idle, all
    return {**row, **measured(row, SKIP_FIRST)}


def measured(row: dict, skip: int) -> dict:
    """The iteration time of a row: the slowest rank's mean period over its iterations after the
    first ``skip`` (iterations per second is what a plan is for; the periods of some
    configurations alternate between a long and a short one, where a median picks either), and the
    means of the two halves of those iterations (how much the figure moves within one run)."""
    timed = [seconds[skip:] for seconds in row["seconds"]]
    half = len(timed[0]) // 2
    return {"measured_s": max(statistics.fmean(values) for values in timed),
            "median_s": max(statistics.median(values) for values in timed),
            "halves_s": [max(statistics.fmean(values[:half]) for values in timed),
                         max(statistics.fmean(values[half:]) for values in timed)]}


def lan_rate(source: Path = LOOPBACK_UNIX) -> str:
    """Rate between ranks of one site: wanlink over Unix sockets, one stream, median of the
    published loopback bench (bench/loopback_throughput.py --paths unix)."""
    rows = json.loads(source.read_text())["rows"]
    for row in rows:
        if (row["mode"], row["path"], row["streams"]) == ("wanlink", "unix", 1):
            return f"{row['median_gbps']:.3f} Gbit/s"
    raise ValueError(f"{source}: no wanlink row over Unix sockets with 1 stream")


def site_cores(row: dict) -> float | None:
    """Cores each namespace's ranks have: the two sites share the host's cores, less what the
    emulator used during the configuration (None for rows whose profiles lack their CPU time,
    measured since 2026-11-26 14:30). What other (niced) processes took (``others_cores``) is not
    taken off: at nice 19 they mostly fill cores the ranks leave idle, and taking it off made the
    staleness-1 rows of both validation runs of 2026-11-27 01:00-01:30 read 5 % slower than without
    (docs/plan.md)."""
    if "host_cores" not in row or not all(doc.get("cpu_s") for doc in row["profiles"]):
        return None  # without the profiles' CPU time their wall time (shared cores) would count twice
    return max(row["host_cores"] - row["emulator_cores"], 0.1) / 2


def others_cores(row: dict) -> float:
    """The cores other processes took while the ranks ran the busy profile (all of them busy, in
    training's rhythm, before training): the host's CPU at nice > 0 in that phase, reported with
    the machine's load (other sessions' jobs run at nice 19 here), not given to the models
    (``site_cores``). 0 for rows measured before 2026-11-27 and for a bench run niced itself (then
    the ranks' own CPU is niced)."""
    if not row.get("bench_nice_zero") or "profiles" not in row.get("host_cpu_ticks", {}):
        return 0.0
    nice, _idle, total = row["host_cpu_ticks"]["profiles"]
    return row["host_cores"] * nice / total if total else 0.0


def _cluster(row: dict, rate_mbit: float, efficiency: float, overhead_ms: float = 0.0):
    from wanlink.plan import cluster_from_dict

    half = row["ranks"] // 2
    sites = [{"name": "a", "ranks": half}, {"name": "b", "ranks": row["ranks"] - half}]
    cores = site_cores(row)
    if cores:
        for site in sites:
            site["cores"] = cores
    return cluster_from_dict({
        "defaults": {"streams": row["streams"], "window": "1536 KiB", "lan_rate": lan_rate(), "efficiency": efficiency,
                     "send_overhead": f"{overhead_ms} ms"},
        "site": sites,
        "path": [{"sites": ["a", "b"], "rtt": f"{row['rtt_ms']} ms", "rate": f"{rate_mbit} Mbit/s"}]})


def predict(row: dict) -> dict:
    """Coarse and fine predictions for a measured row, from inputs measured apart from its training.

    "profile only": the slowest rank's pre-run profile and the path's nominal settings (rate x
    1448/1500, the emulator's 1536 KiB window, no overhead). The headline ("calibrated") uses the
    same profile and the path as the calibration runs measured it: the efficiency and per-step send
    overhead that make the model's lone all-reduces of PROBE_SIZES last as long as the row's ranks
    measured them just before profiling (``calibrate_link``). Every column's profile carries the
    CPU contention its rank measured (``comm_slowdown``: the step profiled beside the training's
    exchanges against the step alone, and the step's CPU time as the busy profile spent it) where
    the row has it, with the ranks' mean CPU per step (training thread and transport threads) for
    the sites' cores bound; "uncontended" is the headline without it. Nothing is fitted to the
    training iterations. ``running_compute_s`` (the profile scaled by the forward passes timed
    during training) is reported to show how much compute slows under communication; no
    prediction uses it.
    """
    from dataclasses import replace

    from wanlink.plan import Choice, coarse, profile_from_json, simulate

    site = row.get("collective", "flat") == "site"  # rows measured before site-aware collectives ran flat rings
    choice = Choice(density=row["density"], staleness=row["staleness"], order=row["order"],
                    collective="site" if site else "flat", cells=row["ranks"] // 2 if site else 1)
    profiles = [profile_from_json(doc) for doc in row["profiles"]]
    if "busy_profiles" in row:  # rows measured before 2026-11-26 13:30 have no busy profile
        profiles = [p.while_exchanging(profile_from_json(busy)) for p, busy in zip(profiles, row["busy_profiles"])]
    if "transport_cpu_s" in row:
        profiles = [replace(p, transport_cpu_s=cpu) for p, cpu in zip(profiles, row["transport_cpu_s"])]
    # the slowest rank's step; its CPU the ranks' mean (a site's cores carry the sum of its ranks' CPU)
    profile = replace(max(profiles, key=lambda p: p.compute_s * p.comm_slowdown),
                      cpu_s=statistics.fmean(p.cpu_s for p in profiles),
                      transport_cpu_s=statistics.fmean(p.transport_cpu_s for p in profiles))
    nominal = _cluster(row, row["rate_mbit"], 1448 / 1500)
    scaled = [p.scaled(speed=p.forward_s / measured) for p, measured in zip(profiles, row["train_forward_s"])]
    efficiency, overhead_ms = calibrate_link(row, choice, profile)
    row.update(efficiency=efficiency, send_overhead_ms=overhead_ms,
               iperf_efficiency=row["link_mbit"] / row["rate_mbit"])
    calibrated = _cluster(row, row["rate_mbit"], efficiency, overhead_ms)
    measured = row["measured_s"]
    out = {"profile_compute_s": profile.compute_s, "running_compute_s": max(p.compute_s for p in scaled),
           "comm_slowdown": profile.comm_slowdown,
           "uncontended_fine_s": simulate(calibrated, replace(profile, comm_slowdown=1.0, transport_cpu_s=0.0),
                                                 choice).iteration_s}
    probed = _cluster(row, row["link_mbit"], 1.0)  # the link as a probe reports it: wanlink-iperf's goodput
    for label, cluster in (("", calibrated), ("profile_only_", nominal), ("iperf_", probed)):
        fine, rough = simulate(cluster, profile, choice), coarse(cluster, profile, choice)
        out.update({f"{label}fine_s": fine.iteration_s, f"{label}coarse_s": rough.iteration_s,
                    f"{label}fine_error": (fine.iteration_s - measured) / measured,
                    f"{label}coarse_error": (rough.iteration_s - measured) / measured})
        if not label:
            out["fine_breakdown"] = fine.breakdown
    return out


def plot(run, rows: list[dict], name: str, runs: list[dict] = ()):
    """Predicted against measured: ``rows`` (the configurations' means), and the fine prediction of
    each of ``runs`` where a configuration was measured more than once."""
    from bench.reporting import legend_outside, new_figure

    fig, ax = new_figure(figsize=(7, 6.5))
    measured = [r["measured_s"] for r in rows]
    if len(runs) > len(rows):
        ax.scatter([r["measured_s"] for r in runs], [r["fine_s"] for r in runs], label="fine, each run", marker=".",
                   color="lightgrey")
    ax.scatter(measured, [r["fine_s"] for r in rows], label="fine (discrete-event)", marker="o")
    ax.scatter(measured, [r["coarse_s"] for r in rows], label="coarse (closed form)", marker="x")
    ax.scatter(measured, [r["profile_only_fine_s"] for r in rows], label="fine, profile and nominal link only",
               marker="o", facecolors="none", edgecolors="C2")
    values = measured + [r[k] for r in rows for k in ("fine_s", "coarse_s", "profile_only_fine_s")]
    low, high = min(values) * 0.8, max(values) * 1.25
    ax.plot([low, high], [low, high], color="grey", linewidth=1, label="predicted = measured")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("measured seconds per iteration (mean period, slowest rank; mean of the runs)")
    ax.set_ylabel("predicted seconds per iteration")
    for r in rows:
        ax.annotate(r["name"], (r["measured_s"], r["fine_s"]), fontsize=6, xytext=(3, -3), textcoords="offset points")
    legend_outside(ax, fontsize=8)
    return run.save_figure(fig, name)


KEYS = ("fine", "coarse", "profile_only_fine", "profile_only_coarse", "iperf_fine", "iperf_coarse")


def _groups(rows: list[dict]) -> list[list[dict]]:
    """The rows of each configuration (NAME and NAME (repeat K)), in the order measured."""
    groups: dict[str, list[dict]] = {}
    for row in rows:
        groups.setdefault(row.get("configuration", row["name"]), []).append(row)
    return list(groups.values())


def combine(rows: list[dict]) -> list[dict]:
    """Per configuration (``_groups``), the mean of its runs' measured times, of each run's
    predictions (every run calibrated on its own) and of their loads, and the errors of those means;
    ``measured_spread_pct``: how far its runs' measured times lie apart, against their mean."""
    out = []
    for runs in _groups(rows):
        measured = [r["measured_s"] for r in runs]
        means = {key: statistics.fmean(r[key] for r in runs)
                 for key in ("measured_s", "load1", *(f"{k}_s" for k in KEYS))}
        combined = {"name": runs[0].get("configuration", runs[0]["name"]), "runs": len(runs), **means,
                    "run_measured_s": measured, "run_fine_error_pct": [r["fine_error_pct"] for r in runs],
                    "measured_spread_pct": 100 * (max(measured) - min(measured)) / means["measured_s"]}
        for key in KEYS:
            combined[f"{key}_error"] = combined[f"{key}_s"] / combined["measured_s"] - 1
            combined[f"{key}_error_pct"] = 100 * combined[f"{key}_error"]
        out.append(combined)
    return out


def _errors(rows: list[dict]) -> dict[str, float]:
    summary = {}
    for key in KEYS:
        errors = [abs(r[f"{key}_error"]) for r in rows]
        summary.update({f"{key}_mean_abs_error": statistics.mean(errors), f"{key}_max_abs_error": max(errors)})
    return summary


def _summary_line(summary: dict[str, float]) -> str:
    return "; ".join(f"{key.replace('_', ' ')}: mean |error| {100 * summary[key + '_mean_abs_error']:.1f} %, "
                     f"max {100 * summary[key + '_max_abs_error']:.1f} %" for key in KEYS)


def report(run, rows: list[dict], load: dict | list, name: str, skip: int = SKIP_FIRST) -> None:
    from bench.reporting import print_table

    for row in rows:
        row.update(measured(row, skip))  # rows saved before 2026-11-26 14:10 held the median
        row.update(predict(row))
        row["fine_error_pct"], row["coarse_error_pct"] = 100 * row["fine_error"], 100 * row["coarse_error"]
        row["others_cores"] = others_cores(row)
        row["profile_only_fine_error_pct"] = 100 * row["profile_only_fine_error"]
        row["iperf_fine_error_pct"] = 100 * row["iperf_fine_error"]
        row["uncontended_fine_error_pct"] = 100 * (row["uncontended_fine_s"] / row["measured_s"] - 1)
        if "halves_s" in row:
            row["halves_spread_pct"] = 100 * abs(row["halves_s"][0] - row["halves_s"][1]) / row["measured_s"]
        if "drops" in row:  # rows measured since 2026-11-26 18:00: segments the emulator dropped
            row["dropped_timed"] = sum(row["drops"]["timed iterations"])
            row["dropped_before"] = sum(sum(row["drops"][phase]) for phase in row["drops"]
                                        if phase not in ("timed iterations", "after"))
    print_table(rows, [("name", "configuration", ""), ("iterations", "iters", "d"), ("load1", "load", ".1f"),
                       ("link_mbit", "iperf Mbit/s", ".0f"), ("profile_compute_s", "profiled compute s", ".3f"),
                       ("running_compute_s", "running compute s", ".3f"), ("comm_slowdown", "busy/alone", ".2f"),
                       ("emulator_cores", "emulator cores", ".2f"), ("others_cores", "others' cores", ".2f"),
                       ("measured_s", "measured s", ".3f"),
                       ("halves_spread_pct", "halves %", ".1f"),
                       ("dropped_before", "dropped before", "d"), ("dropped_timed", "dropped timed", "d"),
                       ("coarse_s", "coarse s", ".3f"), ("coarse_error_pct", "coarse err %", "+.1f"),
                       ("fine_s", "fine s", ".3f"), ("fine_error_pct", "fine err %", "+.1f"),
                       ("uncontended_fine_s", "fine, uncontended s", ".3f"),
                       ("uncontended_fine_error_pct", "err %", "+.1f"),
                       ("profile_only_fine_s", "fine, profile only s", ".3f"),
                       ("profile_only_fine_error_pct", "err %", "+.1f"),
                       ("iperf_fine_s", "fine, iperf link s", ".3f"), ("iperf_fine_error_pct", "err %", "+.1f"),
                       ("iperf_efficiency", "iperf/nominal", ".2f"),
                       ("efficiency", "fitted eff", ".2f"), ("send_overhead_ms", "overhead ms", ".1f")])
    configurations = combine(rows)
    # each run alone: the K-th run of every configuration measured at least K times
    by_run = [[group[k] for group in _groups(rows) if len(group) > k]
              for k in range(max(c["runs"] for c in configurations))]
    run_summaries = [{"rows": len(runs), **_errors(runs)} for runs in by_run]
    if len(rows) > len(configurations):
        print("\nPer configuration, the mean of its runs (measured and each prediction):")
        print_table(configurations, [
            ("name", "configuration", ""), ("runs", "runs", "d"), ("load1", "load", ".1f"),
            ("measured_s", "measured s", ".3f"), ("measured_spread_pct", "runs apart %", ".1f"),
            ("coarse_s", "coarse s", ".3f"), ("coarse_error_pct", "coarse err %", "+.1f"),
            ("fine_s", "fine s", ".3f"), ("fine_error_pct", "fine err %", "+.1f"),
            ("profile_only_fine_error_pct", "nominal link err %", "+.1f"),
            ("iperf_fine_error_pct", "iperf link err %", "+.1f")])
        for k, summary in enumerate(run_summaries):
            print(f"run {k + 1} alone ({summary['rows']} configurations): {_summary_line(summary)}")
    summary = _errors(configurations)
    print("\n" + _summary_line(summary) + f"; load {load}")
    print("wrote", run.save_json(name, {"rows": rows, "configurations": configurations, "summary": summary,
                                        "run_summaries": run_summaries, "load": load, "skip_first": skip}))
    print("wrote", plot(run, configurations, name, rows))


SLOW_RANK_S_PER_SAMPLE = 0.001  # rank 1's injected slowdown: it sleeps this long per sample each step
ALLOCATION_GLOBAL_BATCH = 128
ALLOCATION_ROUNDS, ALLOCATION_BLOCK = 3, 6  # equal and allocated splits alternate in blocks of iterations


def allocation_worker(args) -> None:
    """One rank of the allocation bench (loopback): fit f_i, allocate, then alternate equal and
    allocated splits, timing every iteration."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import wanlink  # noqa: F401 - registers the backend
    from wanlink.plan.allocate import allocate_batches, equal_split, fit_throughput, loss_weight, probe_batch_sizes
    from wanlink.plan.profiler import default_loss

    torch.set_num_threads(1)
    slow = SLOW_RANK_S_PER_SAMPLE if args.rank == 1 else 0.0
    store = dist.TCPStore("127.0.0.1", args.port, 2, is_master=args.rank == 0, timeout=timedelta(seconds=120))
    dist.init_process_group("wanlink", store=store, rank=args.rank, world_size=2)
    torch.manual_seed(0)
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)

    def local_step(batch, weight=1.0, net=model):
        optimizer.zero_grad()
        loss = default_loss(net(batch[0]), batch)
        time.sleep(slow * len(batch[0]))
        (loss * weight).backward()
        optimizer.step()

    def measure(size):
        batch = make_batch(args.rank, size)
        local_step(batch)
        times = []
        for _ in range(3):
            begin = time.perf_counter()
            local_step(batch)
            times.append(time.perf_counter() - begin)
        return statistics.median(times)

    samples, largest = probe_batch_sizes(measure, start=8, limit=ALLOCATION_GLOBAL_BATCH)
    mine = fit_throughput(samples, max_batch=largest)
    fits = [None, None]
    dist.all_gather_object(fits, mine)
    plan = allocate_batches(ALLOCATION_GLOBAL_BATCH, fits)
    splits = {"equal": equal_split(ALLOCATION_GLOBAL_BATCH, 2), "allocated": plan.batches}
    ddp = DDP(model, bucket_cap_mb=BUCKET_CAP_MB)
    batches = {name: make_batch(args.rank, split[args.rank]) for name, split in splits.items()}
    times = {name: [] for name in splits}
    for _round in range(ALLOCATION_ROUNDS):
        for name, split in splits.items():
            weight = loss_weight(split[args.rank], ALLOCATION_GLOBAL_BATCH, 2)
            for iteration in range(ALLOCATION_BLOCK):
                dist.barrier()
                begin = time.perf_counter()
                local_step(batches[name], weight, ddp)
                if iteration:  # the first of a block re-warms buffers for the new batch size
                    times[name].append(time.perf_counter() - begin)
    if args.rank == 0:
        predicted = {name: max(f.seconds(b) for f, b in zip(fits, split)) for name, split in splits.items()}
        Path(args.out_file).write_text(json.dumps({
            "fits": [f.__dict__ for f in fits], "samples_rank0": samples, "splits": splits, "times": times,
            "predicted_compute_s": predicted}))
    dist.destroy_process_group()


def allocation_bench(run, name: str) -> None:
    import subprocess

    from bench.reporting import legend_outside, new_figure, print_table

    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        result_file = os.path.join(tmp, "allocation.json")
        port = 29790
        procs = [subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--allocation-worker",
                                   "--rank", str(rank), "--port", str(port), "--out-file", result_file],
                                  env=child_env(**KEEP_FREED_MEMORY))
                 for rank in range(2)]
        codes = [proc.wait(timeout=900) for proc in procs]
        if any(codes):
            raise RuntimeError(f"allocation bench ranks exited with {codes}")
        result = json.loads(Path(result_file).read_text())
    rows = [{"split": split, "batches": "/".join(map(str, result["splits"][split])),
             "median_s": statistics.median(result["times"][split]),
             "predicted_compute_s": result["predicted_compute_s"][split]}
            for split in ("equal", "allocated")]
    speedup = rows[0]["median_s"] / rows[1]["median_s"]
    load = {"before": load_before, "after": os.getloadavg()[0]}
    print(f"2 ranks on loopback (wanlink backend), global batch {ALLOCATION_GLOBAL_BATCH}, rank 1 sleeps "
          f"{SLOW_RANK_S_PER_SAMPLE * 1e3:g} ms per sample; fits (alpha, beta samples/s): "
          + ", ".join(f"({f['alpha']:.1f}, {f['beta']:.0f})" for f in result["fits"]) + f"; load {load}")
    print_table(rows, [("split", "split", ""), ("batches", "local batches", ""),
                       ("median_s", "median s/iteration", ".3f"),
                       ("predicted_compute_s", "predicted slowest compute s", ".3f")])
    print(f"allocated vs equal split: {speedup:.2f}x faster (same run, blocks alternating)")
    run.save_json(name, {"rows": rows, "speedup": speedup, "load": load, **result,
                         "slow_rank_s_per_sample": SLOW_RANK_S_PER_SAMPLE, "global_batch": ALLOCATION_GLOBAL_BATCH})
    fig, ax = new_figure(figsize=(6, 4))
    labels = [f"{r['split']}\n{r['batches']}" for r in rows]
    ax.bar([0, 1], [r["median_s"] for r in rows], width=0.4, label="measured (median)")
    ax.bar([0.4, 1.4], [r["predicted_compute_s"] for r in rows], width=0.4, label="predicted slowest rank's compute")
    ax.set_xticks([0.2, 1.2], labels)
    ax.set_ylabel("seconds per iteration")
    legend_outside(ax, fontsize=8)
    print("wrote", run.save_figure(fig, name))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", choices=[c["name"] for c in CONFIGS], help="configurations to run")
    parser.add_argument("--predict-only", action="store_true",
                        help="recompute predictions from the measured rows in <out>/<name>.json")
    parser.add_argument("--name", default="predict", help="file name of the JSON and PNG")
    parser.add_argument("--append", action="store_true",
                        help="merge this call's rows into <out>/<name>.json (rows of the same name are replaced), "
                             "so that the configurations can be measured in several short calls")
    parser.add_argument("--repeat", type=int, default=1,
                        help="measure each configuration this many times in a row (a noise study: the later "
                             "ones are saved as '<name> (repeat K)')")
    parser.add_argument("--from", dest="source", type=Path,
                        help="the saved rows to read with --predict-only / --append (default <out>/<name>.json)")
    parser.add_argument("--allocation", action="store_true",
                        help="instead: the heterogeneous batch allocation bench (loopback, no emulator)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--allocation-worker", action="store_true", help=argparse.SUPPRESS)
    for hidden in ("--config", "--master", "--address"):
        parser.add_argument(hidden, help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--out-file", dest="out_file", help=argparse.SUPPRESS)
    from bench.reporting import Run, add_output_options

    add_output_options(parser)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    if args.allocation_worker:
        allocation_worker(args)
        return 0
    run = Run(args)
    if args.allocation:
        allocation_bench(run, args.name if args.name != "predict" else "predict_allocation")
        return 0
    saved_file = args.source or run.out / f"{args.name}.json"
    if args.predict_only:
        saved = json.loads(Path(saved_file).read_text())
        report(run, saved["rows"], saved["load"], args.name, saved.get("skip_first", SKIP_FIRST))
        return 0
    from bench.wan_throughput import run_wanlink
    from bench.wanem.netns import WanPath

    chosen = [c for c in CONFIGS if not args.only or c["name"] in args.only]
    load = {"before": os.getloadavg()[0], "configurations": [c["name"] for c in chosen]}
    rows = []
    paths = sorted({(c["rtt_ms"], c["rate_mbit"]) for c in chosen})
    for rtt_ms, rate_mbit in paths:
        with WanPath(rtt_ms=rtt_ms, rate_mbit=rate_mbit) as path:
            for run_in in (path.run_a, path.run_b):  # every variant alike: no slow start after idle
                run_in(["sysctl", "-q", "-w", "net.ipv4.tcp_slow_start_after_idle=0"], check=True)
            link_mbit = run_wanlink(path, LINK_STREAMS, LINK_SECONDS, None)["gbps"] * 1e3
            print(f"{rtt_ms:g} ms {rate_mbit:g} Mbit/s: wanlink-iperf -P {LINK_STREAMS}: {link_mbit:.0f} Mbit/s",
                  flush=True)
            for config, repeat in [(c, k) for c in chosen if (c["rtt_ms"], c["rate_mbit"]) == (rtt_ms, rate_mbit)
                                   for k in range(args.repeat)]:
                started = time.monotonic()
                row = measure(path, config, 29700 + len(rows))
                row.update(load1=os.getloadavg()[0], wall_s=time.monotonic() - started, link_mbit=link_mbit,
                           configuration=config["name"])
                if repeat:
                    row["name"] = f"{config['name']} (repeat {repeat + 1})"
                rows.append(row)
                lone = ", ".join(f"{int(size) >> 10} KiB {seconds * 1e3:.0f} ms"
                                 for size, seconds in row["lone_allreduce_s"].items())
                dropped = ", ".join(f"{phase} {sum(counts)}/{sum(row['timeouts'][phase])}"
                                    for phase, counts in row["drops"].items())
                print(f"{config['name']}: {row['measured_s']:.3f} s/iteration, lone all-reduces {lone} "
                      f"({row['wall_s']:.0f} s, load {row['load1']:.2f}); segments dropped / TCP timeouts: "
                      f"{dropped}", flush=True)
    load["after"] = os.getloadavg()[0]
    calls = [load]
    if args.append and Path(saved_file).exists():  # this call's rows replace the saved ones of the same name
        saved = json.loads(Path(saved_file).read_text())
        calls = _calls(saved["load"]) + calls
        rows += [r for r in saved["rows"] if r.get("configuration", r["name"]) not in {c["name"] for c in chosen}]
        rows.sort(key=lambda r: [c["name"] for c in CONFIGS].index(r.get("configuration", r["name"])))
    report(run, rows, calls if args.append else load, args.name)
    return 0


def _calls(load) -> list[dict]:
    """The load of each bench call that measured rows of a saved file (one dict: one call)."""
    return load if isinstance(load, list) else [load]


if __name__ == "__main__":
    raise SystemExit(main())
