"""Sites bench: 2 sites x 2 hosts on the wanem sites emulator, site-aware collectives against
wanlink's flat ring and gloo, in the same run.

Each host (network namespace) runs one rank: a0 and a1 are ranks 0 and 1, b0 and b1 ranks 2
and 3. Every host's WAN egress is capped on its own (``--rates``, Mbit/s per host) with
``--rtt-ms`` between the sites; inside a site the hosts share an uncapped bridge. Modes:

- ``site-aware``: ``WANLINK_SITE`` is ``a`` or ``b`` per host, so wanlink runs its site-aware
  algorithms (every member's WAN link carries a share);
- ``flat ring``: ``WANLINK_SITE`` is the same on every rank (one site), so wanlink runs its ring;
- ``gloo``: a gloo group of the same processes as the flat ring.

Part ``collectives``: all_reduce of ``--sizes-mib`` (per-rank buffer): the slowest rank's mean
seconds, algbw and the ratio to the flat ring. Part ``ddp``: DDP iterations of the ~25M-parameter
MLP of bench/e2e_training.py across the 4 ranks, dense and block-sparse (1 %), median seconds per
iteration after the first two (site-aware and flat ring; no gloo). Needs root (namespaces).

    sudo python3 -m bench.sites [--parts collectives ddp] [--rates 250 500] [--sizes-mib 64 256] [--iters 2]

Writes bench/results/<--out>.{json,png} (default ``sites``).
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

ROOT = Path(__file__).resolve().parents[1]
MiB = 1 << 20
HOSTS = ("a0", "a1", "b0", "b1")
MODES = {"site-aware": lambda host: host[0], "flat ring": lambda host: "one-site"}
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
    store = dist.TCPStore(args.master, args.port, len(HOSTS), is_master=args.rank == 0,
                          timeout=timedelta(seconds=300))
    dist.init_process_group("wanlink", store=store, rank=args.rank, world_size=len(HOSTS))
    groups = {args.mode: None}
    if args.gloo:
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
    if args.rank == 0:
        Path(args.rank_out).write_text(json.dumps({"rows": rows, "stats": site_map()}))
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


def run_mode(sites, mode: str, args, gloo: bool) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rank0.json")
        master = sites.host("a0").addr
        common = [sys.executable, "-m", "bench.sites", "--worker", "--mode", mode, "--master", master,
                  "--port", str(PORT), "--rank-out", out, "--iters", str(args.iters),
                  "--ddp-iterations", str(args.ddp_iterations), "--parts", *args.parts,
                  "--sizes-mib", *map(str, args.sizes_mib), *(["--gloo"] if gloo else [])]
        procs = []
        for rank, name in enumerate(HOSTS):
            env = {**os.environ, "PYTHONPATH": str(ROOT), "WANLINK_SITE": MODES[mode](name)}
            procs.append(sites.popen(name, [*common, "--rank", str(rank), "--address", sites.host(name).addr],
                                     env=env, cwd=ROOT))
        codes = [proc.wait(timeout=3600) for proc in procs]
        if any(codes):
            raise RuntimeError(f"{mode}: ranks exited with {codes}")
        return json.loads(Path(out).read_text())


def case_label(row: dict) -> str:
    return f"{row['op']} {row['size_mib']} MiB" if row["size_mib"] else row["op"]


def plot(run, rows: list[dict], name: str) -> Path:
    from bench.reporting import colours, legend_outside, new_figure

    palette = colours(r["mode"] for r in rows)  # one colour per mode in every panel
    rates = sorted({r["rate_mbit"] for r in rows})
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
    legend_outside(axes[0][-1])
    return run.save_figure(fig, name)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", type=float, nargs="+", default=[250, 500], help="WAN egress cap per host, Mbit/s")
    parser.add_argument("--rtt-ms", type=float, default=40)
    parser.add_argument("--sizes-mib", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--iters", type=int, default=2)
    parser.add_argument("--parts", nargs="+", choices=("collectives", "ddp"), default=["collectives", "ddp"])
    parser.add_argument("--ddp-iterations", type=int, default=6, help="per variant; the first two are not counted")
    parser.add_argument("--name", default="sites", help="file name of the JSON and PNG")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--gloo", action="store_true", help=argparse.SUPPRESS)
    for hidden in ("--mode", "--master", "--rank-out", "--address"):
        parser.add_argument(hidden, help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=PORT, help=argparse.SUPPRESS)
    from bench.reporting import Run, add_output_options

    add_output_options(parser)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return 0

    from bench.reporting import print_table
    from bench.wanem.sites import WanSites

    run = Run(args)
    rows, stats = [], {}
    for rate in args.rates:
        with WanSites(hosts=2, rtt_ms=args.rtt_ms, rate_mbit=rate) as sites:
            for mode in MODES:
                result = run_mode(sites, mode, args, gloo=mode == "flat ring" and "collectives" in args.parts)
                stats[mode] = result["stats"]
                rows += [{**row, "rate_mbit": rate} for row in result["rows"]]
    for row in rows:
        flat = next(r["seconds"] for r in rows if r["mode"] == "flat ring" and r["size_mib"] == row["size_mib"]
                    and r["op"] == row["op"] and r["rate_mbit"] == row["rate_mbit"])
        if row["size_mib"]:
            row["algbw_mbit"] = row["size_mib"] * MiB * 8 / row["seconds"] / 1e6
        row["speedup_vs_flat"] = flat / row["seconds"]
    print_table(rows, [("rate_mbit", "Mbit/s/host", "g"), ("op", "op", "s"), ("size_mib", "MiB", "d"),
                       ("mode", "mode", "s"), ("seconds", "seconds", ".2f"), ("algbw_mbit", "algbw Mbit/s", ".0f"),
                       ("speedup_vs_flat", "x flat ring", ".2f")])
    print(f"load before {run.load_before}, after {os.getloadavg()}")
    print("wrote", run.save_json(args.name, {"rtt_ms": args.rtt_ms, "iters": args.iters, "rows": rows,
                                             "site_maps": stats}))
    print("wrote", plot(run, rows, args.name))
    return 0


if __name__ == "__main__":
    sys.exit(main())
