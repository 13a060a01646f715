"""Sites bench: 2 sites x 2 hosts on the wanem sites emulator, site-aware collectives against
wanlink's flat ring and gloo, in the same run.

Each host (network namespace) runs one rank: a0 and a1 are ranks 0 and 1, b0 and b1 ranks 2
and 3. Every host's WAN egress is capped on its own (``--rates``, Mbit/s per host) with
``--rtt-ms`` between the sites; inside a site the hosts share an uncapped bridge. Modes:

- ``site-aware``: ``WANLINK_SITE`` is ``a`` or ``b`` per host, so wanlink runs its site-aware
  algorithms (every member's WAN link carries a share);
- ``flat ring``: ``WANLINK_SITE`` is the same on every rank (one site), so wanlink runs its ring;
- ``gloo``: a gloo group of the same processes as the flat ring.

Part ``p2p`` (cell-striped point-to-point, docs/sites.md), between ``striped`` (site-aware,
sends of 16 MiB and more striped over the cell) and ``direct`` (site-aware, ``WANLINK_STRIPE_MIN_BYTES=0``):
(b) ``--send-mib`` from a0 to b0 alone; (c) two pipelines at once, a0 -> b0 and a1 -> b1, of
``--pipeline-mib`` each (striped: they take turns over the cell; direct: each over its own host's
link, fair sharing); before them each pipeline sends WARM_UP_MIB untimed, so that the cell's scheduler has
measured every member in both roles (own share, relayed share), as in a pipeline's steady state. Seconds
from a common barrier to each receive's completion (the bytes are checked after). Every rank
samples its WAN egress (bytes sent on links to the other site) every 50 ms for the PNG's timeline.

Case ``alternating`` ((c) again, the figure to quote): the per-launch cases put each mode on its own
links and at its own time since they opened, so events of the path fall on one mode by the schedule:
BBR's ProbeRTT (a stream drains to 4 segments for ~250 ms every ~10 s, the first ~10 s after the
links open) and a link idle since the warm-up restarting from a small window. Here the striped launch
times both modes on the same links, ``--alternations`` iterations of both (16 runs by default): every
rank switches striping on (turns) or off (fair sharing: every send direct) between the same two
barriers, in the Thue-Morse order (alternation_order), so an event every 1, 2, 4 or 8 runs falls on
both modes alike. Reported: each mode's mean over all iterations of the mean and of the last
pipeline's completion and their ratios, the ratio of the slowest last pipelines, every iteration's
ratios, and with ``--trace`` how many runs of each mode met a window of 4 segments or less on a link
carrying data (the JSON's ``alternating``; docs/sites.md).

Part ``collectives``: all_reduce of ``--sizes-mib`` (per-rank buffer): the slowest rank's mean
seconds, algbw and the ratio to the flat ring. Part ``ddp``: DDP iterations of the ~25M-parameter
MLP of bench/e2e_training.py across the 4 ranks, dense and block-sparse (1 %), median seconds per
iteration after the first two (site-aware and flat ring; no gloo). Needs root (namespaces).

``--streams N`` sets ``WANLINK_STREAMS`` on every rank (both modes alike; unset, each link probes its
own count when it opens); ``--congestion NAME`` sets ``WANLINK_CONGESTION`` on every rank alike
(unset: wanlink's default, bbr). ``--trace`` (part p2p) records every rank's striping steps (control messages,
the cell leader's actions, each send and receive of 1 MiB or more per hop with its start and end, where
each rank's timing of a case starts), each WAN link's streams every 50 ms where they retransmitted, stalled,
or a window fell to 4 segments or less or opened again, each rank's and the machine's CPU every 100 ms
and every link's stream count, into <name>_trace.txt. The p2p parts' published figures pin ``--streams 2``:
the emulator caps each socket's window at 1536 KB, two carry 500 Mbit/s at 40 ms, and the probe, with
four links probing at once on a loaded box, draws different counts per link and run (docs/sites.md).

    sudo python3 -m bench.sites [--parts collectives ddp p2p] [--rates 250 500] [--sizes-mib 64 256] [--iters 2]
        [--streams N] [--congestion NAME] [--p2p-cases send pipelines alternating] [--alternations 8] [--trace]
        [--name sites] [--out DIR | --publish]

Writes <name>.{json,png} to --out (bench/results/ with --publish).
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path

from bench.reporting import add_output_options, child_env

ROOT = Path(__file__).resolve().parents[1]
MiB = 1 << 20
HOSTS = ("a0", "a1", "b0", "b1")
MODES = {"site-aware": lambda host: host[0], "flat ring": lambda host: "one-site"}
P2P_MODES = {"striped": {}, "direct": {"WANLINK_STRIPE_MIN_BYTES": "0"}}  # both site-aware
TURNS, FAIR = "turns (alternating)", "fair sharing (alternating)"  # part p2p, case "alternating"
BASELINES = {"striped": "direct", "direct": "direct", TURNS: FAIR, FAIR: FAIR}  # any other mode: the flat ring
SAMPLE_S = 0.05
WARM_UP_MIB = 32  # part p2p: each pipeline's untimed first send (striped: above the 16 MiB threshold)
SMOOTH = 5  # samples the timeline's rates are averaged over


class EgressSampler:
    """Samples this rank's WAN egress (bytes sent on links to another site) every SAMPLE_S seconds."""

    def __init__(self):
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    @staticmethod
    def wan_bytes() -> int:
        import wanlink

        return sum(link["bytes_sent"] for link in wanlink.stats().values()
                   if link.get("peer_site") not in (None, link.get("site")))

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_S):
            self.samples.append((time.time(), self.wan_bytes()))
            if TRACING:
                _sample_wan_links()

    def stop(self) -> list[tuple[float, int]]:
        self._stop.set()
        self._thread.join()
        return self.samples


def time_sends(rank: int, pairs: list[tuple[int, int]], nbytes: int, label: str = "") -> dict:
    """Send ``nbytes`` along every (source, destination) pair at once; seconds from a common barrier
    to each receive's completion, and the wall-clock window, as every rank reports them."""
    import torch
    import torch.distributed as dist

    tensor = torch.full((nbytes // 4,), float(rank))
    dist.barrier()
    started, wall = time.perf_counter(), time.time()
    if TRACING:
        _record("timed from here", [f"{src}->{dst}" for src, dst in pairs], label)
    works = [(dist.isend(tensor, dst) if rank == src else dist.irecv(tensor, src), src, dst)
             for src, dst in pairs if rank in (src, dst)]
    done = {}
    for work, src, dst in works:
        work.wait()
        if rank == dst:
            done[f"{src}->{dst}"] = time.perf_counter() - started  # the check below is not timed
            if not bool((tensor == src).all()):
                raise RuntimeError(f"rank {dst} received wrong bytes from rank {src}")
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, {"done": done, "wall": (wall, time.time())})
    return {"done": {k: v for part in everyone for k, v in part["done"].items()},
            "wall": (min(p["wall"][0] for p in everyone), max(p["wall"][1] for p in everyone))}


def pipeline_row(mode: str, op: str, mib: int, result: dict) -> dict:
    """A timed case's row: the last receive's seconds, the mean over its receives, each receive's."""
    times = list(result["done"].values())
    return {"mode": mode, "op": op, "size_mib": mib, "seconds": max(times), "mean_s": statistics.mean(times),
            "per_pair": result["done"]}


def alternation_order(iteration: int) -> tuple[str, str]:
    """Case "alternating": the two modes of one iteration. Run n of the case (iteration n // 2) is turns
    when n has an even number of 1 bits, else fair sharing (the Thue-Morse sequence: T F F T F T T F ...),
    so that an event of the path that comes every 1, 2, 4 or 8 runs (BBR's ProbeRTT, about every 10 s
    on each stream: ~2 runs at 250 Mbit/s, ~4 at 500) falls on either mode as often as on the other.
    Alternating T F, F T (T F F T T F F T) would not do: its pattern repeats every 4 runs, and at
    500 Mbit/s ProbeRTT's dips locked onto one of those places for a whole call."""
    return (TURNS, FAIR) if bin(iteration).count("1") % 2 == 0 else (FAIR, TURNS)


def alternation_summary(rows: list[dict]) -> dict:
    """Case "alternating" at one rate: each mode's mean over all iterations of the mean and of the last
    pipeline's completion, their ratios (fair sharing over turns), and every iteration's ratios."""
    per_mode = {mode: {r["iteration"]: r for r in rows if r["mode"] == mode} for mode in (TURNS, FAIR)}
    iterations = sorted(set(per_mode[TURNS]) & set(per_mode[FAIR]))
    if not iterations:
        return {}
    means = {mode: {key: statistics.mean(per_mode[mode][i][field] for i in iterations)
                    for key, field in (("mean_s", "mean_s"), ("last_s", "seconds"))} for mode in (TURNS, FAIR)}
    traced = all("small_windows" in per_mode[mode][i] for mode in (TURNS, FAIR) for i in iterations)
    return {"iterations": len(iterations), "turns": means[TURNS], "fair sharing": means[FAIR],
            **({"runs_with_small_windows": {name: sum(bool(per_mode[mode][i]["small_windows"]) for i in iterations)
                                            for name, mode in (("turns", TURNS), ("fair sharing", FAIR))}}
               if traced else {}),
            "mean_ratio": means[FAIR]["mean_s"] / means[TURNS]["mean_s"],
            "last_ratio": means[FAIR]["last_s"] / means[TURNS]["last_s"],
            "worst_last_ratio": max(r["seconds"] for r in per_mode[FAIR].values())
            / max(r["seconds"] for r in per_mode[TURNS].values()),
            "per_iteration": [{"iteration": i, "turns_first": per_mode[TURNS][i]["position"] == 0,
                               "mean_ratio": per_mode[FAIR][i]["mean_s"] / per_mode[TURNS][i]["mean_s"],
                               "last_ratio": per_mode[FAIR][i]["seconds"] / per_mode[TURNS][i]["seconds"]}
                              for i in iterations]}


def alternation_text(summary: dict) -> str:
    """alternation_summary on one line; each iteration as T (turns first) or F, then its mean/last ratios."""
    dips = summary.get("runs_with_small_windows")
    return (f"{summary['iterations']} iterations, mean {summary['mean_ratio']:.2f}x, last {summary['last_ratio']:.2f}x "
            f"(slowest last {summary['worst_last_ratio']:.2f}x); per iteration " + ", ".join(
                f"{'TF'[not it['turns_first']]} {it['mean_ratio']:.2f}/{it['last_ratio']:.2f}"
                for it in summary["per_iteration"])
            + (f"; runs with a window of <= {TINY_WINDOW} segments on a link carrying data: turns {dips['turns']}, "
               f"fair sharing {dips['fair sharing']}" if dips else ""))


def p2p_rows(rank: int, args, mode: str) -> tuple[list[dict], list]:
    """Parts (b) and (c), with every rank's egress samples for the timeline."""
    import torch.distributed as dist

    from wanlink.c10d import mesh as mesh_module

    sampler = EgressSampler()
    dist.barrier()
    time_sends(rank, [(0, 2)], MiB)  # warm-up: links
    if {"pipelines", "alternating"} & set(args.p2p_cases):
        # warm-up: striped, both pipelines' turns measure each member in both roles
        time_sends(rank, [(0, 2), (1, 3)], WARM_UP_MIB * MiB)
    rows, windows = [], []
    cases = {"send": ("send", [(0, 2)], args.send_mib),
             "pipelines": ("two pipelines", [(0, 2), (1, 3)], args.pipeline_mib)}
    for op, pairs, mib in (cases[name] for name in args.p2p_cases if name in cases):
        for _ in range(args.iters):
            result = time_sends(rank, pairs, mib * MiB)
            rows.append(pipeline_row(mode, op, mib, result))
            windows.append({"op": op, "mode": mode, "wall": result["wall"]})
    if "alternating" in args.p2p_cases and mode == "striped":
        service = mesh_module._world_mesh.striping
        striping_on = service.min_bytes
        for iteration in range(args.alternations):
            for position, alternate in enumerate(alternation_order(iteration)):
                # every rank switches between the same two barriers: both ends decide alone whether a send is striped
                service.min_bytes = striping_on if alternate == TURNS else 1 << 62
                result = time_sends(rank, [(0, 2), (1, 3)], args.pipeline_mib * MiB, label=alternate)
                rows.append({**pipeline_row(alternate, "two pipelines", args.pipeline_mib, result),
                             "iteration": iteration, "position": position})
                windows.append({"op": f"{'TF'[alternate == FAIR]}{iteration}", "mode": alternate,
                                "wall": result["wall"]})
        service.min_bytes = striping_on
    samples: list = [None] * dist.get_world_size()
    dist.all_gather_object(samples, sampler.stop())
    timeline = {"windows": windows, "egress": samples}
    if args.trace:
        trace_links()
        timeline["trace"] = [None] * dist.get_world_size()
        dist.all_gather_object(timeline["trace"], TRACE_EVENTS)
    return rows, [timeline]
PORT = 29700


def time_all_reduce(nbytes: int, group, iters: int) -> float:
    """Mean seconds of an all_reduce of ``nbytes`` per rank on ``group``, slowest rank."""
    import torch
    import torch.distributed as dist

    tensor = torch.ones(nbytes // 4)
    dist.all_reduce(tensor, group=group)  # warm-up: links, buffers
    expected = float(dist.get_world_size(group))
    if not torch.all(tensor == expected):
        raise RuntimeError(f"all_reduce gave {tensor[:4].tolist()}..., expected {expected}")
    dist.barrier(group=group)
    started = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(tensor, group=group)
    elapsed = torch.tensor([(time.perf_counter() - started) / iters], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=group)
    return float(elapsed)


def worker(args) -> None:
    """One rank, inside its host's namespace: times every size on wanlink (and gloo when asked)."""
    import torch.distributed as dist

    from wanlink.c10d import site_map

    os.environ["WANLINK_ADDR"] = args.address
    os.environ["GLOO_SOCKET_IFNAME"] = "lan0"
    if args.trace:
        install_trace()
    store = dist.TCPStore(args.master, args.port, len(HOSTS), is_master=args.rank == 0,
                          timeout=timedelta(seconds=300))
    dist.init_process_group("wanlink", store=store, rank=args.rank, world_size=len(HOSTS))
    groups = {args.mode: None}
    if args.gloo and "collectives" in args.parts:
        groups["gloo"] = dist.new_group(backend="gloo")
    rows = []
    if "collectives" in args.parts:
        for size in args.sizes_mib:
            for mode, group in groups.items():
                seconds = time_all_reduce(size * MiB, group, args.iters)
                rows.append({"mode": mode, "size_mib": size, "op": "all_reduce", "seconds": seconds})
    if "ddp" in args.parts:
        for density in (None, 0.01):
            seconds = time_ddp(density, args.ddp_iterations, args.rank)
            rows.append({"mode": args.mode, "op": "DDP dense" if density is None else "DDP sparse 1%",
                         "size_mib": 0, "seconds": seconds})
    timeline = []
    if "p2p" in args.parts:
        p2p, timeline = p2p_rows(args.rank, args, args.mode)
        rows += p2p
    if args.rank == 0:
        Path(args.rank_out).write_text(json.dumps({"rows": rows, "stats": site_map(), "timeline": timeline}))
    dist.destroy_process_group()


def time_ddp(density: float | None, iterations: int, rank: int) -> float:
    """Median seconds per DDP iteration (after the first two) of bench/e2e_training.py's model, slowest rank."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from bench.e2e_training import BATCH, CLASSES, DEPTH_IN, make_model
    from wanlink.c10d.sparse_hook import BlockSparseState, block_sparse_hook

    torch.manual_seed(0)
    ddp = DDP(make_model(), gradient_as_bucket_view=True)
    if density is not None:
        ddp.register_comm_hook(BlockSparseState(density=density), block_sparse_hook)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)
    generator = torch.Generator().manual_seed(rank)
    inputs = torch.randn(BATCH, DEPTH_IN, generator=generator)
    labels = torch.randint(0, CLASSES, (BATCH,), generator=generator)
    seconds = []
    dist.barrier()
    for _ in range(iterations):
        started = time.perf_counter()
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(ddp(inputs), labels).backward()
        optimizer.step()
        seconds.append(time.perf_counter() - started)
    median = torch.tensor([statistics.median(seconds[2:])], dtype=torch.float64)
    dist.all_reduce(median, op=dist.ReduceOp.MAX)
    return float(median)


def run_mode(sites, mode: str, args, gloo: bool, parts: list[str], extra_env: dict | None = None) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rank0.json")
        master = sites.host("a0").addr
        common = [sys.executable, "-m", "bench.sites", "--worker", "--mode", mode, "--master", master,
                  "--port", str(PORT), "--rank-out", out, "--iters", str(args.iters),
                  "--ddp-iterations", str(args.ddp_iterations), "--parts", *parts,
                  "--send-mib", str(args.send_mib), "--pipeline-mib", str(args.pipeline_mib),
                  "--sizes-mib", *map(str, args.sizes_mib), *(["--gloo"] if gloo else []),
                  "--p2p-cases", *args.p2p_cases, "--alternations", str(args.alternations),
                  *(["--trace"] if args.trace else [])]
        procs = []
        for rank, name in enumerate(HOSTS):
            env = child_env(WANLINK_SITE=MODES.get(mode, MODES["site-aware"])(name),
                            **({"WANLINK_STREAMS": str(args.streams)} if args.streams else {}),
                            **({"WANLINK_CONGESTION": args.congestion} if args.congestion else {}), **(extra_env or {}))
            procs.append(sites.popen(name, [*common, "--rank", str(rank), "--address", sites.host(name).addr],
                                     env=env, cwd=ROOT))
        codes = [proc.wait(timeout=3600) for proc in procs]
        if any(codes):
            raise RuntimeError(f"{mode}: ranks exited with {codes}")
        return json.loads(Path(out).read_text())


def children_cpu_seconds() -> float:
    """CPU seconds of this process's finished children (the ranks, once waited for)."""
    import resource

    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def emulated_packets(sites) -> dict:
    """What the hosts' WAN emulators forwarded so far: packets read (TSO super-packets), their MSS
    segments and bytes, summed over hosts and both directions."""
    counters = [direction for host in sites.stats().values() for direction in host.values()]
    return {"packets": sum(c["rx_pkts"] for c in counters), "segments": sum(c["rx_segs"] for c in counters),
            "bytes": sum(c["rx_bytes"] for c in counters)}


def case_label(row: dict) -> str:
    return f"{row['op']} {row['size_mib']} MiB" if row["size_mib"] else row["op"]


def plot(rows: list[dict], run, name: str) -> Path:
    from bench.reporting import colours, legend_outside, new_figure

    rates = sorted({r["rate_mbit"] for r in rows})
    palette = colours(r["mode"] for r in rows)
    fig, axes = new_figure(1, len(rates), figsize=(6 * len(rates), 4.5), squeeze=False)
    for ax, rate in zip(axes[0], rates):
        subset = [r for r in rows if r["rate_mbit"] == rate]
        cases = list(dict.fromkeys(case_label(r) for r in subset))
        modes = list(dict.fromkeys(r["mode"] for r in subset))
        width = 0.8 / len(modes)
        for i, mode in enumerate(modes):
            seconds = {case_label(r): r["seconds"] for r in subset if r["mode"] == mode}
            ax.bar([k + i * width for k, case in enumerate(cases)], [seconds.get(case, 0.0) for case in cases],
                   width, label=mode, color=palette[mode])
        ax.set_xticks([k + width * (len(modes) - 1) / 2 for k in range(len(cases))], cases, fontsize=8)
        ax.set_yscale("log")
        ax.set_ylabel("seconds (slowest rank; DDP: median per iteration)")
        ax.set_title(f"2 sites x 2 hosts, {rate:g} Mbit/s WAN egress per host")
        legend_outside(ax)
    return run.save_figure(fig, name)


def plot_timeline(timelines: list[dict], run, name: str) -> Path:
    """One panel per (rate, mode): each member's WAN egress rate over time, the sends' windows shaded."""
    from bench.reporting import colours, legend_outside, new_figure

    palette = colours(HOSTS)
    fig, axes = new_figure(len(timelines), 1, figsize=(10, 3 * len(timelines)), squeeze=False)
    for ax, timeline in zip(axes[:, 0], timelines):
        origin = min(samples[0][0] for samples in timeline["egress"] if samples)
        for host, samples in zip(HOSTS, timeline["egress"]):
            # over SMOOTH samples: bytes are counted when they enter the socket, not when they leave the host
            pairs = list(zip(samples, samples[SMOOTH:]))
            ax.plot([(t0 + t1) / 2 - origin for (t0, _), (t1, _) in pairs],
                    [8 * (b1 - b0) / (t1 - t0) / 1e6 for (t0, b0), (t1, b1) in pairs],
                    label=f"{host} (rank {HOSTS.index(host)}) WAN egress", color=palette[host])
        for window in timeline["windows"]:
            start, end = (w - origin for w in window["wall"])
            ax.axvspan(start, end, alpha=0.08, color="grey")
            ax.text(start, ax.get_ylim()[1] * 0.9, window["op"], fontsize=7)
        ax.set_ylabel("Mbit/s")
        ax.set_title(f"{timeline['windows'][0]['mode']}, {timeline['rate_mbit']:g} Mbit/s per host")
        legend_outside(ax)
    axes[-1, 0].set_xlabel("seconds")
    return run.save_figure(fig, name)


# -- --trace: what every rank's striping did, when ------------------------------------------------
TRACE_MIN_BYTES = 1 << 20  # sends and receives traced: of this size or more
TRACE_CPU_S = 0.1
STALL_BYTES = 1 << 20  # a WAN link's sample is traced when it acknowledged less with STALL_SEGMENTS in flight
STALL_SEGMENTS = 64
TINY_WINDOW = 4  # a stream's sample is traced when its congestion window is this small (BBR's ProbeRTT, a timeout)
TRACE_EVENTS: list[tuple] = []  # (wall seconds, event, fields...) of this rank
TRACING = False  # install_trace ran: time_sends records where each rank's timing starts


def _record(*event) -> None:
    TRACE_EVENTS.append((time.time(), *event))


def install_trace() -> None:
    """Wrap the striping service and the links' sends and receives (once per process): control messages,
    the cell leader's actions, every send and receive of TRACE_MIN_BYTES or more with its start and end;
    and sample this rank's CPU and the machine's every TRACE_CPU_S."""
    global TRACING
    from wanlink.c10d import striped_p2p
    from wanlink.io import link as link_module

    TRACING = True
    service = striped_p2p.StripedP2P
    original_dispatch, original_carry_out = service._dispatch, service._carry_out

    def dispatch(self, peer, message):
        if isinstance(message, list) and message:
            _record("control", peer, message[0], message[1:4] if message[0] != "grant" else message[1:])
        return original_dispatch(self, peer, message)

    def carry_out(self, actions):
        _record("actions", [type(a).__name__ + repr(getattr(a, "key", "")) for a in actions])
        return original_carry_out(self, actions)

    service._dispatch, service._carry_out = dispatch, carry_out
    threading.Thread(target=_sample_cpu, daemon=True).start()
    link_class = link_module.Link
    for name in ("send", "recv_into"):
        setattr(link_class, name, _timed(getattr(link_class, name), name))


def _sample_wan_links() -> None:
    """--trace: each WAN link's TCP streams (bytes acknowledged, segments in flight, congestion window,
    retransmissions so far) and what wanlink holds for it (chunks queued, messages flow control holds,
    eager credit left; read from this thread without the loop's lock: a diagnostic)."""
    from wanlink.c10d import mesh as mesh_module
    from wanlink.io.sockets import tcp_info

    mesh = mesh_module._world_mesh
    if mesh is None:
        return
    sites = mesh.sites
    for peer in range(mesh.size):
        link = mesh.cached(peer) if sites.site(peer) != sites.site(mesh.rank) else None
        if link is None:
            continue
        infos = [tcp_info(sock) if sock is not None else None for sock in link.stream_sockets()]
        streams = [(i.bytes_acked or 0, i.unacked, i.snd_cwnd, i.total_retrans) for i in infos if i is not None]
        TRACE_EVENTS.append((time.time(), "tcp", peer, streams, len(link.queue), link.flow.held_messages,
                             link.flow.credit))


def window_dips(per_rank: list[list[tuple]], windows: list[dict]) -> list[list[str]]:
    """--trace: per timed window, the WAN links ("a0->b0") that carried STALL_BYTES or more in it and had a
    stream at a congestion window of TINY_WINDOW segments or less in a sample within it (BBR's ProbeRTT)."""
    dips = []
    for window in windows:
        start, end = window["wall"]
        hit = set()
        for rank, events in enumerate(per_rank):
            series: dict[int, list] = {}
            for event in events:
                if event[1] == "tcp" and start <= event[0] <= end:
                    series.setdefault(event[2], []).append(event[3])
            for peer, samples in series.items():
                acked = sum(s[0] for s in samples[-1]) - sum(s[0] for s in samples[0])
                if acked >= STALL_BYTES and any(s[2] <= TINY_WINDOW for streams in samples for s in streams):
                    hit.add(f"{HOSTS[rank]}->{HOSTS[peer]}")
        dips.append(sorted(hit))
    return dips


def trace_links() -> None:
    """Every link's stream count, chunk size (the probe chose them when the link opened) and its streams'
    congestion controls."""
    import wanlink

    _record("links", {key: (link["streams"], link["chunk_size"] >> 10, sorted(set(filter(None, link["congestion"]))))
                      for key, link in wanlink.stats().items()})


def _sample_cpu() -> None:
    """Every TRACE_CPU_S: this process's CPU seconds and the machine's busy and total jiffies."""
    while True:
        with open("/proc/stat") as stat:
            fields = [int(x) for x in stat.readline().split()[1:]]
        TRACE_EVENTS.append((time.time(), "cpu", time.process_time(), sum(fields) - fields[3] - fields[4], sum(fields)))
        time.sleep(TRACE_CPU_S)


def _timed(method, name: str):
    @functools.wraps(method)
    async def wrapper(self, buffer, *args, **kwargs):
        size = memoryview(buffer).nbytes
        if size < TRACE_MIN_BYTES:
            return await method(self, buffer, *args, **kwargs)
        started = time.time()
        try:
            return await method(self, buffer, *args, **kwargs)
        finally:
            peer = self.labels.get("peer_rank", self.peer)
            TRACE_EVENTS.append((started, name, peer, kwargs.get("tag"), size, time.time()))
    return wrapper


def trace_summary(per_rank: list[list[tuple]], hosts: tuple[str, ...]) -> str:
    """The ranks' events in time order, one a line, peers named by host: the striping service's
    control messages and actions, and per (rank, send or receive, peer, tag) the first start, the
    last end, how many messages and MiB; then the CPU samples."""
    origin = min(event[0] for events in per_rank for event in events)
    transfers: dict[tuple, list] = {}
    lines = []
    previous_tcp: dict = {}
    for rank, events in enumerate(per_rank):
        for event in events:
            if event[1] in ("send", "recv_into") and event[3] is not None and event[3] >= 0:
                started, kind, peer, tag, size, ended = event
                key = (hosts[rank], kind, hosts[peer] if isinstance(peer, int) else peer, tag)
                entry = transfers.setdefault(key, [started, ended, 0, 0])
                entry[0], entry[1] = min(entry[0], started), max(entry[1], ended)
                entry[2] += 1
                entry[3] += size
            elif event[1] == "tcp":
                line = _tcp_line(event, previous_tcp, hosts[rank], hosts)
                if line:
                    lines.append((event[0], f"{event[0] - origin:8.3f} {'':8s} {line}"))
            elif event[1] not in ("send", "recv_into", "cpu"):
                text = " ".join(map(str, event[1:]))
                lines.append((event[0], f"{event[0] - origin:8.3f} {'':8s} {hosts[rank]} {text}"))
    for (host, kind, peer, tag), (started, ended, count, size) in transfers.items():
        lines.append((started, f"{started - origin:8.3f} {ended - origin:8.3f} {host} {kind:9s} "
                               f"{'->' if kind == 'send' else '<-'} {peer} {count} x {size / count / 2**20:.1f} MiB "
                               f"tag {tag:#x}"))
    return "\n".join([line for _t, line in sorted(lines)] + _cpu_lines(per_rank, hosts, origin)) + "\n"


def _tcp_line(event: tuple, previous: dict, host: str, hosts: tuple[str, ...]) -> str | None:
    """A WAN link's sample as a line when, since the link's sample before, its streams retransmitted,
    or it had STALL_SEGMENTS or more in flight but fewer than STALL_BYTES were acknowledged, or a stream's
    congestion window fell to TINY_WINDOW segments or less or came back from there (None otherwise)."""
    stamp, _kind, peer, streams, queued, held, credit = event
    before = previous.get((host, peer))
    previous[(host, peer)] = (stamp, streams)
    if before is None or len(before[1]) != len(streams):
        return None
    acked = sum(s[0] - b[0] for s, b in zip(streams, before[1]))
    retrans = [s[3] - b[3] for s, b in zip(streams, before[1])]
    in_flight = sum(s[1] for s in streams)
    tiny = [s[2] <= TINY_WINDOW for s in streams] != [b[2] <= TINY_WINDOW for b in before[1]]
    if not any(retrans) and not tiny and (in_flight < STALL_SEGMENTS or acked >= STALL_BYTES):
        return None
    return (f"{host} tcp -> {hosts[peer]} acked {acked / 2**20:.2f} MiB in {1e3 * (stamp - before[0]):.0f} ms, "
            f"in flight {in_flight} segs, cwnd {[s[2] for s in streams]}, retrans +{retrans}, "
            f"queued {queued} chunks, held {held} msgs, credit {credit / 2**20:.0f} MiB")


def _cpu_lines(per_rank: list[list[tuple]], hosts: tuple[str, ...], origin: float) -> list[str]:
    """Per TRACE_CPU_S: the machine's busy share (of all cores) and each rank's CPU share of one core."""
    samples = [[e for e in events if e[1] == "cpu"] for events in per_rank]
    lines = ["cpu: seconds, machine busy % of all cores, then each rank's % of one core"]
    for i in range(1, min(map(len, samples))):
        (_t0, _c, _p0, busy0, total0), (t1, _c1, _p1, busy1, total1) = samples[0][i - 1], samples[0][i]
        ranks = [(s[i][2] - s[i - 1][2]) / max(s[i][0] - s[i - 1][0], 1e-9) for s in samples]
        lines.append(f"cpu {t1 - origin:8.2f} {100 * (busy1 - busy0) / max(total1 - total0, 1):4.0f} "
                     + " ".join(f"{host}={100 * r:3.0f}" for host, r in zip(hosts, ranks)))
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", type=float, nargs="+", default=[250, 500], help="WAN egress cap per host, Mbit/s")
    parser.add_argument("--rtt-ms", type=float, default=40)
    parser.add_argument("--sizes-mib", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--iters", type=int, default=2)
    parser.add_argument("--parts", nargs="+", choices=("collectives", "ddp", "p2p"),
                        default=["collectives", "ddp", "p2p"])
    parser.add_argument("--send-mib", type=int, default=256, help="part p2p (b): one send")
    parser.add_argument("--pipeline-mib", type=int, default=128, help="part p2p (c): each pipeline's send")
    parser.add_argument("--ddp-iterations", type=int, default=6, help="per variant; the first two are not counted")
    parser.add_argument("--streams", type=int, default=None,
                        help="TCP streams per link on every rank (WANLINK_STREAMS; default: each link probes its own)")
    parser.add_argument("--congestion", default=None,
                        help="TCP congestion control of every rank's streams (WANLINK_CONGESTION; default: bbr)")
    parser.add_argument("--p2p-cases", nargs="+", choices=("send", "pipelines", "alternating"),
                        default=["send", "pipelines", "alternating"],
                        help="part p2p: (b) one send, (c) two pipelines per mode, (c) with the modes alternating")
    parser.add_argument("--alternations", type=int, default=8,
                        help="part p2p, case alternating: iterations (each times both modes)")
    parser.add_argument("--trace", action="store_true",
                        help="part p2p: record every rank's striping steps and sends (<name>_trace.txt)")
    parser.add_argument("--name", default="sites", help="file name of the JSON and PNG")
    add_output_options(parser)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--gloo", action="store_true", help=argparse.SUPPRESS)
    for hidden in ("--mode", "--master", "--rank-out", "--address"):
        parser.add_argument(hidden, help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=PORT, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return 0

    from bench.reporting import Run, print_table
    from bench.wanem.sites import WanSites

    run = Run(args)
    rows, stats, timelines, cpu = [], {}, [], {}
    collective_parts = [part for part in args.parts if part != "p2p"]
    for rate in args.rates:
        with WanSites(hosts=2, rtt_ms=args.rtt_ms, rate_mbit=rate) as sites:
            runs = [(mode, collective_parts, None) for mode in MODES if collective_parts]
            runs += [(mode, ["p2p"], env) for mode, env in P2P_MODES.items() if "p2p" in args.parts
                     and (mode == "striped" or {"send", "pipelines"} & set(args.p2p_cases))]
            for mode, parts, env in runs:
                emulators, ranks, wall = sites.cpu_seconds(), children_cpu_seconds(), time.monotonic()
                packets = emulated_packets(sites)
                result = run_mode(sites, mode, args, gloo=mode == "flat ring", parts=parts, extra_env=env)
                cpu[f"{rate:g} {mode}"] = {"emulators": sites.cpu_seconds() - emulators,
                                           "ranks": children_cpu_seconds() - ranks, "wall": time.monotonic() - wall,
                                           **{k: v - packets[k] for k, v in emulated_packets(sites).items()}}
                stats[mode] = result["stats"]
                for timeline in (t for t in result["timeline"] if "trace" in t):
                    for row, dips in zip(result["rows"], window_dips(timeline["trace"], timeline["windows"])):
                        row["small_windows"] = dips
                rows += [{**row, "rate_mbit": rate} for row in result["rows"]]
                timelines += [{**part, "rate_mbit": rate} for part in result["timeline"]]
    for row in rows:
        baseline = BASELINES.get(row["mode"], "flat ring")
        base = [r for r in rows if r["mode"] == baseline and r["size_mib"] == row["size_mib"]
                and r["op"] == row["op"] and r["rate_mbit"] == row["rate_mbit"]]
        if row["size_mib"]:
            row["algbw_mbit"] = row["size_mib"] * MiB * 8 / row["seconds"] / 1e6
        row["speedup"] = statistics.mean(r["seconds"] for r in base) / row["seconds"]
        if "mean_s" in row:
            row["mean_speedup"] = statistics.mean(r["mean_s"] for r in base) / row["mean_s"]
    print_table(rows, [("rate_mbit", "Mbit/s/host", "g"), ("op", "op", "s"), ("size_mib", "MiB", "d"),
                       ("mode", "mode", "s"), ("seconds", "seconds (max)", ".2f"), ("mean_s", "mean s", ".2f"),
                       ("algbw_mbit", "algbw Mbit/s", ".0f"),
                       ("speedup", "x baseline (flat ring / direct)", ".2f"), ("mean_speedup", "x mean", ".2f")])
    alternating = {f"{rate:g}": alternation_summary([r for r in rows if r["rate_mbit"] == rate and "iteration" in r])
                   for rate in args.rates}
    for rate, summary in alternating.items():
        if summary:
            print(f"(c) alternating at {rate} Mbit/s: {alternation_text(summary)}")
    print(f"CPU seconds per mode (emulators, ranks) and its wall seconds: {cpu}")
    print(f"load before {run.load_before}, after {run.header()['load_after']}")
    traces = [(t["rate_mbit"], t["windows"][0]["mode"], t.pop("trace")) for t in timelines if "trace" in t]
    print(run.save_json(args.name, {"rtt_ms": args.rtt_ms, "iters": args.iters, "rows": rows, "site_maps": stats,
                                    "alternating": {rate: summary for rate, summary in alternating.items() if summary},
                                    "emulator_cpu_s": cpu, "timelines": timelines}))
    if rows and any(part != "p2p" for part in args.parts):
        print(plot([r for r in rows if r["mode"] not in BASELINES], run, args.name))
    if traces:
        print(run.save_text(f"{args.name}_trace.txt", "".join(
            f"== {rate:g} Mbit/s per host, {mode}\n" + trace_summary(trace, HOSTS) for rate, mode, trace in traces)))
    if timelines:
        print(plot_timeline(timelines, run, f"{args.name}_timeline"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
