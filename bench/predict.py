"""Validate wanlink.plan's models against measured training runs on the emulated WAN.

Each configuration trains a small MLP with DDP over the wanlink backend between two network
namespaces of a ``bench.wanem`` path (2 ranks: one per namespace; 4 ranks: two per namespace,
which reach each other over Unix sockets, so the namespaces are two sites). Every rank first
profiles its own training step with ``wanlink.plan.profiler.profile_model`` while the other ranks do
the same (the same CPU sharing as in training), then trains and times its iterations. The
prediction for a configuration uses the slowest rank's profile and a cluster description built
from the path's settings (RTT, rate, the emulator's 1536 KiB window per flow, 1448/1500 goodput,
the stream count), and compares the median measured iteration with the coarse and fine models.

    sudo python3 dev.py bench bench/predict.py [--only NAME...] [--predict-only]

``--predict-only`` recomputes the predictions from the measured runs saved in
bench/results/predict.json (no emulator needed). Writes bench/results/predict.{json,png}.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

DEPTH_IN, WIDTH, CLASSES, BATCH = 1024, 1024, 256, 64
BUCKET_CAP_MB = 4
SKIP_FIRST = 3  # excluded from the median: DDP bucket rebuild, TCP ramp-up, the first stale step
LAN_RATE = "20 Gbit/s"  # wanlink over Unix sockets, bench/results/loopback_unix.json (median, 1 stream)
KEEP_FREED_MEMORY = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(1 << 40)}


def _config(name, ranks, rtt_ms, rate_mbit, density=None, staleness=0, streams=8, order=None, iterations=None):
    order = order or ("fcfs" if density is None else "edf")  # dense DDP all-reduces carry no deadline
    return {"name": name, "ranks": ranks, "rtt_ms": rtt_ms, "rate_mbit": rate_mbit, "density": density,
            "staleness": staleness, "streams": streams, "order": order,
            "iterations": iterations or (10 if density is None and rate_mbit <= 100 else 20)}


CONFIGS = [
    _config("2r 10ms 2000M dense", 2, 10, 2000),
    _config("2r 40ms 500M dense", 2, 40, 500),
    _config("2r 80ms 100M dense", 2, 80, 100),
    _config("2r 80ms 2000M dense 1 stream", 2, 80, 2000, streams=1),
    _config("2r 80ms 2000M dense 8 streams", 2, 80, 2000),
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
    """One rank: profile, then train; writes its profile and iteration times as JSON."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import wanlink  # noqa: F401 - registers the backend
    from wanlink.c10d import sparse_hook
    from wanlink.plan.profiler import default_loss, profile_model

    config = json.loads(args.config)
    torch.set_num_threads(1)
    os.environ.update(WANLINK_ADDR=args.address, WANLINK_STREAMS=str(config["streams"]), GLOO_SOCKET_IFNAME="wan0")
    store = dist.TCPStore(args.master, args.port, config["ranks"], is_master=args.rank == 0,
                          timeout=timedelta(seconds=120))
    dist.init_process_group("wanlink", store=store, rank=args.rank, world_size=config["ranks"])
    torch.manual_seed(0)
    model = make_model()
    batch = make_batch(args.rank)
    dist.barrier()
    profile = profile_model(make_model(), batch, warmup=3, iterations=8, bucket_cap_mb=BUCKET_CAP_MB,
                            density=config["density"], name="bench.predict MLP")
    ddp = DDP(model, bucket_cap_mb=BUCKET_CAP_MB, gradient_as_bucket_view=True)
    state = None
    if config["density"] is not None:
        if config["order"] == "fcfs":  # every exchange gets one deadline: the link serves them in launch order
            real_scope = sparse_hook.deadline_scope
            sparse_hook.deadline_scope = lambda _deadline: real_scope(1)
        state = sparse_hook.BlockSparseState(density=config["density"], staleness=config["staleness"])
        ddp.register_comm_hook(state, sparse_hook.block_sparse_hook)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=1e-3, momentum=0.9)
    dist.barrier()
    seconds = []
    for _ in range(config["iterations"]):
        begin = time.perf_counter()
        optimizer.zero_grad()
        default_loss(ddp(batch[0]), batch).backward()
        optimizer.step()
        seconds.append(time.perf_counter() - begin)
    if state is not None and state.flush():
        optimizer.step()
    dist.barrier()
    Path(args.out_file).write_text(json.dumps({"rank": args.rank, "profile": profile.to_json(), "seconds": seconds}))
    dist.destroy_process_group()


def measure(path, config: dict, port: int) -> dict:
    """Run one configuration's ranks (half in each namespace) and collect their outputs."""
    ranks = config["ranks"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), **KEEP_FREED_MEMORY}
    with tempfile.TemporaryDirectory() as tmp:
        procs, outs = [], []
        for rank in range(ranks):
            in_a = rank < ranks // 2
            out = os.path.join(tmp, f"rank{rank}.json")
            outs.append(out)
            argv = [sys.executable, str(Path(__file__).resolve()), "--worker", "--config", json.dumps(config),
                    "--rank", str(rank), "--master", path.addr_a, "--port", str(port), "--out-file", out,
                    "--address", path.addr_a if in_a else path.addr_b]
            procs.append((path.popen_a if in_a else path.popen_b)(argv, env=env))
        codes = [proc.wait(timeout=900) for proc in procs]
        if any(codes):
            raise RuntimeError(f"{config['name']}: ranks exited with {codes}")
        results = [json.loads(Path(out).read_text()) for out in outs]
    per_rank = [statistics.median(r["seconds"][SKIP_FIRST:]) for r in results]
    return {**config, "measured_s": max(per_rank), "per_rank_median_s": per_rank,
            "seconds": [r["seconds"] for r in results], "profiles": [r["profile"] for r in results]}


def predict(row: dict) -> dict:
    """Coarse and fine predictions for a measured row (from its own ranks' profiles)."""
    from wanlink.plan import Choice, coarse, cluster_from_dict, profile_from_json, simulate

    profiles = [profile_from_json(doc) for doc in row["profiles"]]
    profile = max(profiles, key=lambda p: p.compute_s)
    half = row["ranks"] // 2
    cluster = cluster_from_dict({
        "defaults": {"streams": row["streams"], "window": "1536 KiB", "lan_rate": LAN_RATE},
        "site": [{"name": "a", "ranks": half}, {"name": "b", "ranks": row["ranks"] - half}],
        "path": [{"sites": ["a", "b"], "rtt": f"{row['rtt_ms']} ms", "rate": f"{row['rate_mbit']} Mbit/s"}]})
    choice = Choice(density=row["density"], staleness=row["staleness"], order=row["order"])
    fine, rough = simulate(cluster, profile, choice), coarse(cluster, profile, choice)
    measured = row["measured_s"]
    return {"fine_s": fine.iteration_s, "coarse_s": rough.iteration_s,
            "fine_error": (fine.iteration_s - measured) / measured,
            "coarse_error": (rough.iteration_s - measured) / measured,
            "profile_compute_s": profile.compute_s, "fine_breakdown": fine.breakdown}


def plot(rows: list[dict], out: str):
    from bench.reporting import new_figure, save_figure

    fig, ax = new_figure(figsize=(7, 6.5))
    measured = [r["measured_s"] for r in rows]
    ax.scatter(measured, [r["fine_s"] for r in rows], label="fine (discrete-event)", marker="o")
    ax.scatter(measured, [r["coarse_s"] for r in rows], label="coarse (closed form)", marker="x")
    low = min(measured + [r["fine_s"] for r in rows] + [r["coarse_s"] for r in rows]) * 0.8
    high = max(measured + [r["fine_s"] for r in rows] + [r["coarse_s"] for r in rows]) * 1.25
    ax.plot([low, high], [low, high], color="grey", linewidth=1, label="predicted = measured")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("measured seconds per iteration (median, slowest rank)")
    ax.set_ylabel("predicted seconds per iteration")
    for r in rows:
        ax.annotate(r["name"], (r["measured_s"], r["fine_s"]), fontsize=6, xytext=(3, -3), textcoords="offset points")
    ax.legend(fontsize=8)
    return save_figure(fig, out)


def report(rows: list[dict], load: dict, out: str) -> None:
    from bench.reporting import print_table, save_json

    for row in rows:
        row.update(predict(row))
        row["fine_error_pct"], row["coarse_error_pct"] = 100 * row["fine_error"], 100 * row["coarse_error"]
    print_table(rows, [("name", "configuration", ""), ("iterations", "iters", "d"),
                       ("profile_compute_s", "compute s", ".3f"), ("measured_s", "measured s", ".3f"),
                       ("coarse_s", "coarse s", ".3f"), ("coarse_error_pct", "coarse err %", "+.1f"),
                       ("fine_s", "fine s", ".3f"), ("fine_error_pct", "fine err %", "+.1f")])
    fine = [abs(r["fine_error"]) for r in rows]
    rough = [abs(r["coarse_error"]) for r in rows]
    summary = {"fine_mean_abs_error": statistics.mean(fine), "fine_max_abs_error": max(fine),
               "coarse_mean_abs_error": statistics.mean(rough), "coarse_max_abs_error": max(rough)}
    print(f"\nfine: mean |error| {100 * summary['fine_mean_abs_error']:.1f} %, max {100 * summary['fine_max_abs_error']:.1f} %;"
          f" coarse: mean {100 * summary['coarse_mean_abs_error']:.1f} %, max {100 * summary['coarse_max_abs_error']:.1f} %"
          f"; load {load}")
    save_json(out, {"rows": rows, "summary": summary, "load": load, "skip_first": SKIP_FIRST})
    print("wrote", plot(rows, out))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", choices=[c["name"] for c in CONFIGS], help="configurations to run")
    parser.add_argument("--predict-only", action="store_true",
                        help="recompute predictions from the measured rows in bench/results/<out>.json")
    parser.add_argument("--out", default="predict", help="result name under bench/results/")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    for hidden in ("--config", "--master", "--address"):
        parser.add_argument(hidden, help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--out-file", dest="out_file", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    from bench.reporting import RESULTS

    if args.predict_only:
        saved = json.loads((RESULTS / f"{args.out}.json").read_text())
        report(saved["rows"], saved["load"], args.out)
        return 0
    from bench.wanem.netns import WanPath

    chosen = [c for c in CONFIGS if not args.only or c["name"] in args.only]
    load = {"before": os.getloadavg()[0]}
    rows = []
    paths = sorted({(c["rtt_ms"], c["rate_mbit"]) for c in chosen})
    for rtt_ms, rate_mbit in paths:
        with WanPath(rtt_ms=rtt_ms, rate_mbit=rate_mbit) as path:
            for run in (path.run_a, path.run_b):  # every variant alike: no slow start after idle
                run(["sysctl", "-q", "-w", "net.ipv4.tcp_slow_start_after_idle=0"], check=True)
            for config in [c for c in chosen if (c["rtt_ms"], c["rate_mbit"]) == (rtt_ms, rate_mbit)]:
                started = time.monotonic()
                row = measure(path, config, 29700 + len(rows))
                row.update(load1=os.getloadavg()[0], wall_s=time.monotonic() - started)
                rows.append(row)
                print(f"{config['name']}: {row['measured_s']:.3f} s/iteration ({row['wall_s']:.0f} s, "
                      f"load {row['load1']:.2f})", flush=True)
    load["after"] = os.getloadavg()[0]
    report(rows, load, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
