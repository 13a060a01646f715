"""wanlink-plan: profile a model, predict iteration times on a cluster, choose sites, simulate at scale.

    wanlink-plan profile mypkg.models:make -o profile.json
    wanlink-plan predict cluster.toml --profile profile.json --streams 1,8 --density dense,0.01 --staleness 0,1
    wanlink-plan predict --probe peer.example:5201 --ranks-per-site 4 --profile profile.json
    wanlink-plan sites cluster.toml --profile profile.json --global-batch 512
    wanlink-plan simulate --ranks 1024 --sites 4 --rtt 40ms --rate "10 Gbit/s" --profile profile.json

``predict`` prints one row per combination of the listed choices (``-J``: JSON; ``--png``: the
timeline of the fastest one). Errors in the cluster description or the profile name the field.
"""
from __future__ import annotations

import argparse
import importlib
import itertools
import json
import sys
import time

from wanlink.errors import ConfigError
from wanlink.plan.allocate import equal_split
from wanlink.plan.choice import Choice
from wanlink.plan.cluster import Cluster, cluster_from_dict, load_cluster
from wanlink.plan.coarse import coarse
from wanlink.plan.profile import Bucket, Profile, load_profile
from wanlink.plan.simulate import simulate
from wanlink.plan.sites import choose_sites, split_batch

BREAKDOWN = ("forward_s", "backward_s", "hook_s", "wait_s", "step_s")


def _table(rows: list[dict], columns: list[tuple[str, str, str]]) -> str:
    cells = [[format(r[k], f) if r.get(k) is not None else "-" for k, _h, f in columns] for r in rows]
    widths = [max(len(h), *(len(c[i]) for c in cells)) if cells else len(h) for i, (_k, h, _f) in enumerate(columns)]
    lines = ["  ".join(f"{h:>{w}}" for (_k, h, _f), w in zip(columns, widths))]
    lines += ["  ".join(f"{c:>{w}}" for c, w in zip(line, widths)) for line in cells]
    return "\n".join(lines)


def _list(kind, text: str, name: str) -> list:
    values = []
    for item in text.split(","):
        item = item.strip()
        try:
            values.append(kind(item))
        except ValueError:
            raise ConfigError(f"--{name}: cannot read {item!r}") from None
    return values


def _density(text: str):
    return None if text == "dense" else float(text)


def _load_model_function(spec: str):
    module_name, _, function_name = spec.partition(":")
    if not module_name or not function_name:
        raise ConfigError(f"expected MODULE:FUNCTION (e.g. mypkg.models:make), got {spec!r}")
    try:
        function = getattr(importlib.import_module(module_name), function_name)
    except ImportError as error:
        raise ConfigError(f"cannot import {module_name!r}: {error}") from None
    except AttributeError:
        raise ConfigError(f"module {module_name!r} has no {function_name!r}") from None
    made = function()
    if not isinstance(made, tuple) or len(made) not in (2, 3):
        raise ConfigError(f"{spec} must return (model, batch) or (model, batch, loss_fn), got {type(made).__name__}")
    return made if len(made) == 3 else (*made, None)


def cmd_profile(args) -> int:
    import torch

    from wanlink.plan.profiler import profile_model

    torch.set_num_threads(args.threads)
    model, batch, loss_fn = _load_model_function(args.model)
    profile = profile_model(model, batch, loss_fn=loss_fn, warmup=args.warmup, iterations=args.iterations,
                            bucket_cap_mb=args.bucket_cap_mb, density=args.density, name=args.model)
    rows = [{"name": layer.name, "forward_ms": layer.forward_s * 1e3, "backward_ms": layer.backward_s * 1e3,
             "grad_mb": layer.grad_bytes / 1e6} for layer in profile.layers]
    print(_table(rows, [("name", "layer", ""), ("forward_ms", "forward ms", ".3f"),
                        ("backward_ms", "backward ms", ".3f"), ("grad_mb", "gradient MB", ".2f")]))
    print(f"\n{len(profile.buckets)} buckets, {profile.grad_bytes / 1e6:.1f} MB of gradients; forward "
          f"{profile.forward_s * 1e3:.1f} ms, backward {profile.backward_s * 1e3:.1f} ms, step "
          f"{profile.step_s * 1e3:.1f} ms at batch {profile.batch_size}, {profile.threads} threads")
    print("wrote", profile.save(args.output))
    return 0


def _choices(args, cluster, profile) -> list[tuple[Choice, str]]:
    out = []
    grid = itertools.product(_list(int, args.streams, "streams") if args.streams else [None],
                             _list(_density, args.density, "density"), _list(int, args.staleness, "staleness"),
                             _list(str, args.collective, "collective"), _list(int, args.cells, "cells"),
                             _list(str, args.split, "split"), _list(str, args.order, "order"))
    for streams, density, staleness, collective, cells, split, order in grid:
        if collective == "flat" and cells != 1:
            continue  # cells only mean something for site collectives
        if split not in ("equal", "balanced"):
            raise ConfigError(f"--split: expected equal or balanced, got {split!r}")
        global_batch = profile.batch_size * cluster.world_size
        batches = (split_batch(cluster, profile, global_batch) if split == "balanced"
                   else equal_split(global_batch, cluster.world_size))
        out.append((Choice(streams=streams, density=density, staleness=staleness, collective=collective, cells=cells,
                           order=order, batches=batches), split))
    return out


def _probe_cluster(args):
    """The cluster ``predict`` describes: a TOML file, a live probe of a wanlink peer, or a saved probe."""
    given = [name for name, value in (("CLUSTER", args.cluster), ("--probe", args.probe),
                                      ("--probe-json", args.probe_json)) if value]
    if len(given) != 1:
        raise ConfigError("predict needs exactly one of CLUSTER (a TOML description), --probe HOST:PORT or "
                          f"--probe-json FILE, got {' and '.join(given) or 'none'}")
    if args.ranks_per_site < 1:
        raise ConfigError(f"--ranks-per-site must be >= 1, got {args.ranks_per_site}")
    if args.cluster:
        return load_cluster(args.cluster), args.cluster
    if args.probe_json:
        try:
            doc = json.loads(open(args.probe_json).read())
        except OSError as error:
            raise ConfigError(f"cannot read --probe-json {args.probe_json}: {error.strerror}") from None
        except ValueError as error:
            raise ConfigError(f"--probe-json {args.probe_json}: not JSON ({error})") from None
        if isinstance(doc, dict) and isinstance(doc.get("wanlink"), dict):  # wanlink-iperf -J: its probe
            doc = doc["wanlink"].get("probe")
            if not doc:
                raise ConfigError(f"--probe-json {args.probe_json}: this wanlink-iperf run did not probe (it was given "
                                  "-P or WANLINK_STREAMS); run it without either to have the streams probed")
        probe, source = doc, args.probe_json
    else:
        probe, source = probe_peer(args.probe, args.probe_max_streams), f"probe of {args.probe}"
        print(f"probed {args.probe}: {probe.streams} streams, RTT {probe.rtt_s * 1e3:.1f} ms, "
              f"{probe.bits_per_second / 1e6:.0f} Mbit/s", file=sys.stderr)
    return Cluster.from_probe(probe, ranks_per_site=args.ranks_per_site), source


def probe_peer(address: str, max_streams: int = 16):
    """Probe a live wanlink peer (``wanlink-iperf -s`` or any wanlink server) at ``HOST:PORT``: the
    stream count wanlink would choose for it, the RTT and the rate delivered at that count."""
    import asyncio

    from wanlink.endpoints import choose_streams
    from wanlink.errors import WanlinkError

    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ConfigError(f"--probe: expected HOST:PORT, got {address!r}")
    try:
        return asyncio.run(choose_streams(host.strip("[]"), int(port), max_streams=max_streams))
    except (OSError, WanlinkError) as error:
        raise ConfigError(f"--probe {address}: cannot probe a wanlink server there ({error}); start one on the "
                          "peer with 'wanlink-iperf -s -p PORT'") from None


def cmd_predict(args) -> int:
    cluster, source = _probe_cluster(args)
    profile = load_profile(args.profile)
    rows, fastest = [], None
    for choice, split in _choices(args, cluster, profile):
        fine = simulate(cluster, profile, choice)
        rough = coarse(cluster, profile, choice)
        row = {"streams": choice.streams or cluster.streams,
               "density": "dense" if choice.density is None else f"{choice.density:g}",
               "staleness": choice.staleness, "collective": choice.collective, "cells": choice.cells, "split": split,
               "order": choice.order, "fine_s": fine.iteration_s, "coarse_s": rough.iteration_s,
               "wan_mb": fine.wan_bytes / 1e6, **{k: v for k, v in fine.breakdown.items()}}
        rows.append(row)
        if fastest is None or fine.iteration_s < fastest.iteration_s:
            fastest = fine
    if args.json:
        print(json.dumps({"cluster": source, "profile": args.profile, "world_size": cluster.world_size,
                          "rows": rows}, indent=1))
    else:
        print(f"{cluster.world_size} ranks in {len(cluster.sites)} sites; {profile.model}, batch {profile.batch_size} "
              f"per rank, {profile.grad_bytes / 1e6:.1f} MB of gradients in {len(profile.buckets)} buckets")
        print(_table(rows, [("streams", "streams", "d"), ("density", "density", ""), ("staleness", "stale", "d"),
                            ("collective", "collective", ""), ("cells", "cells", "d"), ("split", "split", ""),
                            ("order", "order", ""), ("fine_s", "fine s", ".4f"), ("coarse_s", "coarse s", ".4f"),
                            ("forward_s", "forward", ".4f"), ("backward_s", "backward", ".4f"),
                            ("hook_s", "hook", ".4f"),
                            ("wait_s", "wait", ".4f"), ("step_s", "step", ".4f"), ("wan_mb", "WAN MB/it", ".1f")]))
    if args.png and fastest is not None:
        from wanlink.plan.timeline import plot_timeline

        written = plot_timeline(fastest, args.png)
        print(f"wrote {written}", file=sys.stderr if args.json else sys.stdout)
    return 0


def cmd_sites(args) -> int:
    cluster = load_cluster(args.cluster)
    profile = load_profile(args.profile)
    base = Choice(density=_list(_density, args.density, "density")[0], staleness=args.staleness, streams=args.streams)
    results = choose_sites(cluster, profile, args.global_batch, max_cells=args.max_cells,
                           order=_list(str, args.order, "order") if args.order else None, base=base)
    if args.json:
        print(json.dumps({"global_batch": args.global_batch, "choices": [r.to_json() for r in results]}, indent=1))
        return 0
    rows = [{**r.to_json(), "sites": "+".join(r.sites), "wait_s": r.fine.breakdown["wait_s"]} for r in results]
    print(_table(rows, [("sites", "sites", ""), ("ranks", "ranks", "d"), ("collective", "collective", ""),
                        ("cells", "cells", "d"), ("fine_s", "fine s", ".4f"), ("coarse_s", "coarse s", ".4f"),
                        ("wait_s", "wait s", ".4f"), ("samples_per_s", "samples/s", ".1f")]))
    best = results[0]
    print(f"\nbest: {'+'.join(best.sites)}, {best.collective} collective, {best.cells} cell(s): "
          f"{best.samples_per_s:.1f} samples/s")
    return 0


def synthetic_profile(gradient_mb: float, compute_ms: float, buckets: int, batch: int) -> Profile:
    """A profile for scales past this machine: ``buckets`` equal buckets ready evenly through backward
    (forward : backward : step = 1 : 2 : 0.2 of ``compute_ms``)."""
    if gradient_mb <= 0 or compute_ms < 0 or buckets < 1 or batch < 1:
        raise ConfigError("need --gradient-mb > 0, --compute-ms >= 0, --buckets >= 1, --batch >= 1")
    total = compute_ms / 1e3
    forward, backward, step = total / 3.2, 2 * total / 3.2, 0.2 * total / 3.2
    size = int(gradient_mb * 1e6 / buckets)
    return Profile("synthetic", batch, forward, backward, step,
                   tuple(Bucket(size, backward * (i + 1) / buckets, (size // 4,)) for i in range(buckets)))


def cmd_simulate(args) -> int:
    if args.ranks < 1 or args.sites < 1 or args.ranks < args.sites:
        raise ConfigError(f"need ranks >= sites >= 1, got --ranks {args.ranks} --sites {args.sites}")
    names = [f"site{i}" for i in range(args.sites)]
    sites = [{"name": n, "ranks": args.ranks // args.sites + (1 if i < args.ranks % args.sites else 0)}
             for i, n in enumerate(names)]
    if args.host_cap:
        for site in sites:
            site["host_cap"] = args.host_cap
    paths = [{"sites": [a, b], "rtt": args.rtt, "rate": args.rate} for a, b in itertools.combinations(names, 2)]
    cluster = cluster_from_dict({"defaults": {"streams": args.streams}, "site": sites, "path": paths},
                                source="simulate options")
    profile = (load_profile(args.profile) if args.profile
               else synthetic_profile(args.gradient_mb, args.compute_ms, args.buckets, args.batch))
    choice = Choice(density=_list(_density, args.density, "density")[0], staleness=args.staleness,
                    collective=args.collective, cells=args.cells, order=args.order)
    started = time.perf_counter()
    fine = simulate(cluster, profile, choice)
    elapsed = time.perf_counter() - started
    rough = coarse(cluster, profile, choice)
    doc = {"ranks": args.ranks, "sites": args.sites, "choice": choice.describe(), "fine_s": fine.iteration_s,
           "coarse_s": rough.iteration_s, "breakdown": fine.breakdown, "wan_bytes": fine.wan_bytes,
           "simulation_wall_s": elapsed}
    if args.json:
        print(json.dumps(doc, indent=1))
    else:
        print(f"{args.ranks} ranks in {args.sites} sites, {choice.describe()}: fine {fine.iteration_s:.4f} s, "
              f"coarse {rough.iteration_s:.4f} s per iteration (simulated in {elapsed:.2f} s)")
        print("  " + ", ".join(f"{k[:-2]} {v:.4f} s" for k, v in fine.breakdown.items()))
    if args.png:
        from wanlink.plan.timeline import plot_timeline

        plot_timeline(fine, args.png)
    return 0


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="wanlink-plan", description=__doc__.splitlines()[0])
    commands = top.add_subparsers(dest="command", required=True)

    p = commands.add_parser("profile", help="measure a model's per-layer compute and gradient buckets")
    p.add_argument("model", help="MODULE:FUNCTION returning (model, batch) or (model, batch, loss_fn)")
    p.add_argument("-o", "--output", default="profile.json")
    p.add_argument("--iterations", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1)")
    p.add_argument("--bucket-cap-mb", type=float, default=25.0, help="DDP's bucket_cap_mb")
    p.add_argument("--density", type=float, default=None, help="also time sparsifying each bucket at this density")
    p.set_defaults(run=cmd_profile)

    p = commands.add_parser("predict", help="iteration time on a cluster for every combination of choices")
    p.add_argument("cluster", nargs="?", help="cluster description (TOML); or --probe / --probe-json")
    p.add_argument("--probe", metavar="HOST:PORT",
                   help="instead of CLUSTER: probe a live wanlink server (e.g. 'wanlink-iperf -s') for the link's "
                        "streams, RTT and rate; two sites of --ranks-per-site ranks joined by that link")
    p.add_argument("--probe-json", metavar="FILE",
                   help="instead of CLUSTER: a saved probe result (ProbeResult.to_json(), or wanlink-iperf -J)")
    p.add_argument("--ranks-per-site", type=int, default=1, help="with --probe / --probe-json (default 1)")
    p.add_argument("--probe-max-streams", type=int, default=16, help="--probe tries 1, 2, 4, ... up to this many")
    p.add_argument("--profile", required=True, help="a profile written by 'wanlink-plan profile'")
    p.add_argument("--streams", default=None, help="comma-separated stream counts (default: the cluster's)")
    p.add_argument("--density", default="dense", help="comma-separated: dense and/or densities, e.g. dense,0.01")
    p.add_argument("--staleness", default="0", help="comma-separated: 0 and/or 1")
    p.add_argument("--collective", default="flat", help="comma-separated: flat and/or site")
    p.add_argument("--cells", default="1", help="comma-separated DP-cell counts (site collectives)")
    p.add_argument("--split", default="equal", help="comma-separated: equal and/or balanced (by site speed)")
    p.add_argument("--order", default="edf", help="comma-separated chunk orders: fcfs and/or edf")
    p.add_argument("-J", "--json", action="store_true", help="JSON instead of a table")
    p.add_argument("--png", help="write a timeline of the fastest choice to this PNG")
    p.set_defaults(run=cmd_predict)

    p = commands.add_parser("sites", help="choose sites and DP-cells (Atlas Algorithm 1)")
    p.add_argument("cluster")
    p.add_argument("--profile", required=True)
    p.add_argument("--global-batch", type=int, required=True)
    p.add_argument("--max-cells", type=int, default=4)
    p.add_argument("--order", default=None, help="comma-separated site order (default: most ranks first)")
    p.add_argument("--density", default="dense")
    p.add_argument("--staleness", type=int, default=0)
    p.add_argument("--streams", type=int, default=None)
    p.add_argument("-J", "--json", action="store_true")
    p.set_defaults(run=cmd_sites)

    p = commands.add_parser("simulate", help="simulate a uniform cluster of any size")
    p.add_argument("--ranks", type=int, required=True)
    p.add_argument("--sites", type=int, default=2)
    p.add_argument("--rtt", default="40 ms")
    p.add_argument("--rate", default="10 Gbit/s", help="every path's rate")
    p.add_argument("--host-cap", default=None, help="per-host WAN cap, e.g. '1 Gbit/s'")
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--profile", help="a profile JSON (default: a synthetic one from the options below)")
    p.add_argument("--gradient-mb", type=float, default=100.0)
    p.add_argument("--compute-ms", type=float, default=100.0)
    p.add_argument("--buckets", type=int, default=4)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--density", default="dense")
    p.add_argument("--staleness", type=int, default=0)
    p.add_argument("--collective", default="flat", choices=("flat", "site"))
    p.add_argument("--cells", type=int, default=1)
    p.add_argument("--order", default="edf", choices=("fcfs", "edf"))
    p.add_argument("-J", "--json", action="store_true")
    p.add_argument("--png")
    p.set_defaults(run=cmd_simulate)
    return top


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return args.run(args)
    except (ConfigError, ValueError) as error:
        print(f"wanlink-plan: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
