"""Throughput over emulated WAN paths: wanlink (probed N and N = 1, 4, 16) vs iperf3 -P 1/-P 8 vs gloo.

Each path (10, 40, 80 ms RTT at the emulator's top rate; 40 ms with 0.1% and 1% loss) is one
``bench.wanem.netns.WanPath``: two network namespaces, ``A`` (sender) and ``B`` (receiver), whose
TCP buffers are capped so one flow is window-limited as on real long paths. In the same run and on
the same path it measures:

* ``iperf3 -P 1`` and ``iperf3 -P 8`` (stock binary, A -> B, receiver-side bits/s);
* ``wanlink-iperf`` (A -> B over one wanlink Link) with the stream count probed, and with -P 1, 4, 16;
* a gloo ``broadcast`` of 256 MiB from rank 0 in A to rank 1 in B (torch.distributed, 2 ranks).
* with ``--secure``: wanlink-iperf again with ``WANLINK_SECURE=1`` on both sides (N = 4 and probed),
  to compare encrypted with plaintext links on the same path in the same run.

Socket buffers: by default nobody sets them (kernel autotuning under the namespace caps), so the
wanlink/iperf3 ratio is the gain from striping alone. With ``--window SIZE`` every case is also
run with ``-w SIZE`` for both wanlink and iperf3, and the gain from the buffer size
(iperf3 -w / iperf3) is reported apart from the gain from striping (wanlink / iperf3 at the
same buffer policy).

    sudo python3 bench/wan_throughput.py [--seconds 8] [--rate-mbit 2000] [--window 4M] [--only 40ms]
        [--cases "wanlink auto" "iperf3 -P 8"] [--buffers window] [--name wan_throughput_40ms] [--publish]
        [--secure]

Writes <name>.{json,png} (default wan_throughput) to --out (bench/results/ with --publish) and
prints a table. Needs root,
/dev/net/tun, iperf3 and torch (CPU) with gloo.
"""
from __future__ import annotations

import argparse
import json
import os
import select
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.reporting import Run, add_output_options, child_env, print_table  # noqa: E402 - after the sys.path line

MiB = 1024 * 1024
PORT = 5201
GLOO_PORT = 29512
SECRET = "wan-throughput-bench"
PATHS = [  # (label, rtt_ms, loss)
    ("10ms", 10.0, 0.0), ("40ms", 40.0, 0.0), ("80ms", 80.0, 0.0),
    ("40ms+0.1%", 40.0, 0.001), ("40ms+1%", 40.0, 0.01),
]
WANLINK_CASES = [("wanlink auto", None), ("wanlink N=1", 1), ("wanlink N=4", 4), ("wanlink N=16", 16)]
IPERF_CASES = [("iperf3 -P 1", 1), ("iperf3 -P 8", 8)]
SECURE_CASES = [("wanlink secure N=4", 4), ("wanlink secure auto", None)]  # --secure: WANLINK_SECURE=1 both sides


def _env(secure: bool = False) -> dict:
    env = child_env()
    env["WANLINK_SECURE"] = "1" if secure else "0"
    env["WANLINK_SECRET"] = SECRET
    env["GLOO_SOCKET_IFNAME"] = "wan0"  # the emulated path's device in both namespaces
    env.pop("WANLINK_STREAMS", None)
    return env


def _start_server(path, argv: list[str], env: dict | None = None) -> subprocess.Popen:
    """Start a server in namespace B and wait (unbuffered reads) for its 'Server listening' line."""
    proc = path.popen_b(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, bufsize=0, env=env or _env(),
                        cwd=ROOT)
    fd, seen = proc.stdout.fileno(), b""
    deadline = time.monotonic() + 30
    while b"Server listening" not in seen:
        ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
        data = os.read(fd, 4096) if ready else b""
        if not data:
            proc.kill()
            proc.wait()
            raise RuntimeError(f"server {argv[:3]} did not start (rc={proc.returncode}): {seen[-300:]!r}")
        seen += data
    return proc


def _client(path, argv: list[str], timeout: float, env: dict | None = None) -> tuple[dict, float]:
    t0 = time.monotonic()
    done = path.run_a(argv, capture_output=True, text=True, env=env or _env(), cwd=ROOT, timeout=timeout)
    wall = time.monotonic() - t0
    try:
        doc = json.loads(done.stdout)
    except ValueError:
        raise RuntimeError(f"{argv[:3]} printed no JSON (rc={done.returncode}): {done.stderr[-400:]}") from None
    if done.returncode != 0 or "error" in doc:
        raise RuntimeError(f"{argv[:3]} failed: {doc.get('error') or done.stderr[-400:]}")
    return doc, wall


def _finish(proc: subprocess.Popen) -> None:
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def run_iperf3(path, streams: int, seconds: float, window: str | None) -> dict:
    server = _start_server(path, ["iperf3", "-s", "-1", "--forceflush", "-B", path.addr_b, "-p", str(PORT)])
    try:
        argv = ["iperf3", "-c", path.addr_b, "-p", str(PORT), "-t", str(int(seconds)), "-P", str(streams), "-J"]
        if window:
            argv += ["-w", window]
        doc, _wall = _client(path, argv, timeout=seconds + 60)
    finally:
        _finish(server)
    end = doc["end"]
    return {"gbps": end["sum_received"]["bits_per_second"] / 1e9, "streams": streams,
            "retransmits": end["sum_sent"].get("retransmits")}


def run_wanlink(path, streams: int | None, seconds: float, window: str | None, secure: bool = False) -> dict:
    env = _env(secure)
    cli = [sys.executable, "-m", "wanlink.iperf"]
    server_argv = cli + ["-s", "-1", "-B", path.addr_b, "-p", str(PORT), "-i", "0"]
    if window:  # wanlink links take socket options from each side's own -w (the server's is per server)
        server_argv += ["-w", window]
    server = _start_server(path, server_argv, env)
    try:
        argv = cli + ["-c", path.addr_b, "-p", str(PORT), "-t", str(seconds), "-J", "-i", "0"]
        if streams is not None:
            argv += ["-P", str(streams)]
        if window:
            argv += ["-w", window]
        doc, wall = _client(path, argv, timeout=seconds + 180, env=env)
    finally:
        _finish(server)
    end, wl = doc["end"], doc["wanlink"]
    return {"gbps": end["sum_received"]["bits_per_second"] / 1e9, "streams": wl["streams"],
            "retransmits": end["sum_sent"].get("retransmits"), "rtt_ms": wl["rtt_ms"],
            "chunk_size": wl["chunk_size"], "probe": wl["probe"],
            "setup_s": max(0.0, wall - seconds)}


def run_gloo(path, size_mib: int, timeout: float) -> dict:
    me = [sys.executable, str(Path(__file__).resolve()), "--gloo-worker", "--master", path.addr_a,
          "--size-mib", str(size_mib)]
    rank0 = path.popen_a(me + ["--rank", "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=_env(), cwd=ROOT)
    try:
        done = path.run_b(me + ["--rank", "1"], capture_output=True, text=True, env=_env(), cwd=ROOT,
                          timeout=timeout)
    finally:
        _finish(rank0)
    if done.returncode != 0:
        raise RuntimeError(f"gloo worker failed: {done.stderr[-400:]}")
    seconds = json.loads(done.stdout.strip().splitlines()[-1])["seconds"]
    return {"gbps": size_mib * MiB * 8 / seconds / 1e9, "streams": 1, "seconds": seconds}


def gloo_worker(rank: int, master: str, size_mib: int) -> None:
    """One rank of the gloo baseline: broadcast size_mib from rank 0, timed on rank 1."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://{master}:{GLOO_PORT}", rank=rank, world_size=2,
                            timeout=__import__("datetime").timedelta(seconds=300))
    warm = torch.zeros(MiB // 4)
    dist.broadcast(warm, src=0)
    data = torch.ones(size_mib * MiB // 4) if rank == 0 else torch.zeros(size_mib * MiB // 4)
    dist.barrier()
    t0 = time.perf_counter()
    dist.broadcast(data, src=0)
    seconds = time.perf_counter() - t0
    if rank == 1:
        assert bool(data[-1] == 1.0), "broadcast delivered wrong data"
        print(json.dumps({"seconds": seconds}))
    dist.barrier()
    dist.destroy_process_group()


def run_wanlink_secure(path, streams: int | None, seconds: float, window: str | None) -> dict:
    return run_wanlink(path, streams, seconds, window, secure=True)


def plan_cases(window: str | None, gloo_mib: int, *, cases: list[str] = (), buffers: str = "all",
               secure: bool = False) -> list[tuple]:
    """(name, buffer policy or None, runner, stream count) per case of one path, filtered.

    ``cases`` keeps the cases whose name starts with one of its strings (all when empty);
    ``buffers`` is "all", "autotune" (kernel buffers only) or "window" (only the ``-w`` runs).
    """
    if buffers not in ("all", "autotune", "window"):
        raise ValueError(f"buffers must be all, autotune or window, got {buffers!r}")
    if buffers == "window" and not window:
        raise ValueError("--buffers window needs --window")
    policies = {"all": [None] + ([window] if window else []), "autotune": [None], "window": [window]}[buffers]
    planned = [(name, policy, runner, n) for policy in policies
               for runner, named in ((run_iperf3, IPERF_CASES), (run_wanlink, WANLINK_CASES),
                                     (run_wanlink_secure, SECURE_CASES if secure else []))
               for name, n in named]
    if buffers != "window":
        planned.append((f"gloo broadcast {gloo_mib} MiB", None, run_gloo, None))
    return [case for case in planned if not cases or any(case[0].startswith(prefix) for prefix in cases)]


def measure(seconds: float, rate_mbit: float, window: str | None, gloo_mib: int, only: list[str],
            cases: list[str] = (), buffers: str = "all", secure: bool = False) -> list[dict]:
    from bench.wanem.netns import WanPath

    rows = []
    planned = plan_cases(window, gloo_mib, cases=cases, buffers=buffers, secure=secure)
    for label, rtt, loss in PATHS:
        if only and label not in only:
            continue
        with WanPath(rtt_ms=rtt, rate_mbit=rate_mbit, loss=loss) as path:
            for name, policy, runner, n in planned:
                row = {"path": label, "rtt_ms": rtt, "loss": loss, "rate_mbit": rate_mbit, "case": name,
                       "buffers": policy or "autotune"}
                try:
                    row.update(run_gloo(path, gloo_mib, 600) if runner is run_gloo
                               else runner(path, n, seconds, policy))
                except (RuntimeError, subprocess.TimeoutExpired, OSError, ValueError, KeyError) as exc:
                    row["error"] = str(exc)[:300]
                print(f"  {label:>10} {name:<22} {row['buffers']:>8}: "
                      + (f"{row['gbps']:.3f} Gbit/s ({row.get('streams')} streams)" if "gbps" in row
                         else f"ERROR {row['error']}"), flush=True)
                rows.append(row)
            try:
                rows[-1]["emulator_stats"] = path.stats()
            except Exception as exc:  # noqa: BLE001 - stats are informative only
                rows[-1]["emulator_stats_error"] = str(exc)
    return rows


def ratios(rows: list[dict]) -> list[dict]:
    """Gain from striping (wanlink / iperf3 -P 1 at the same buffer policy) and from buffers."""
    out = []
    by = {(r["path"], r["case"], r["buffers"]): r.get("gbps") for r in rows}
    for label, _rtt, _loss in PATHS:
        for policy in sorted({r["buffers"] for r in rows if r["path"] == label}):
            base = by.get((label, "iperf3 -P 1", policy))
            auto = by.get((label, "wanlink auto", policy))
            if auto:
                entry = {"path": label, "buffers": policy}
                if base:
                    entry["striping_gain"] = auto / base
                p8 = by.get((label, "iperf3 -P 8", policy))
                if p8:
                    entry["vs_iperf3_P8"] = auto / p8
                gloo = next((r.get("gbps") for r in rows if r["path"] == label and r["case"].startswith("gloo")),
                            None)
                if gloo:
                    entry["vs_gloo"] = auto / gloo
                if policy != "autotune":
                    default = by.get((label, "iperf3 -P 1", "autotune"))
                    if default and base:
                        entry["buffer_gain_iperf3_P1"] = base / default
                out.append(entry)
    return out


def plot(run, rows: list[dict], name: str = "wan_throughput") -> Path:
    """One bar group per path, one colour per case and buffer policy; the legend beside the axes."""
    from bench.reporting import colours, legend_outside, new_figure

    labels = [p for p, _r, _l in PATHS if any(r["path"] == p for r in rows)]
    cases = list(dict.fromkeys((r["case"], r["buffers"]) for r in rows))
    palette = colours(cases)
    fig, ax = new_figure(figsize=(12, 5))
    width = 0.8 / max(1, len(cases))
    for k, (case, policy) in enumerate(cases):
        values = [next((r.get("gbps") or 0.0 for r in rows if r["path"] == p and r["case"] == case
                        and r["buffers"] == policy), 0.0) for p in labels]
        name_shown = case if policy == "autotune" else f"{case} -w {policy}"
        ax.bar([i + k * width for i in range(len(labels))], values, width, label=name_shown,
               color=palette[(case, policy)], hatch=None if policy == "autotune" else "//", edgecolor="white")
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(labels))])
    ax.set_xticklabels(labels)
    ax.set_ylabel("Gbit/s (receiver)")
    ax.set_title("Throughput over emulated WAN paths (bench/wan_throughput.py)")
    legend_outside(ax, fontsize=8)
    return run.save_figure(fig, name)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=8.0, help="duration of each iperf3/wanlink run")
    p.add_argument("--rate-mbit", type=float, default=2000.0, help="bottleneck rate (the emulator's top rate)")
    p.add_argument("--window", default=None, help="also run every case with this -w (e.g. 4M)")
    p.add_argument("--gloo-mib", type=int, default=256)
    p.add_argument("--only", nargs="*", default=[], help="path labels to run (default all)")
    p.add_argument("--cases", nargs="*", default=[],
                   help="run only cases whose name starts with one of these (e.g. 'wanlink auto' 'iperf3 -P 8')")
    p.add_argument("--buffers", choices=("all", "autotune", "window"), default="all",
                   help="buffer policies to run: both, kernel autotuning only, or only --window")
    p.add_argument("--secure", action="store_true",
                   help="also run wanlink with WANLINK_SECURE=1 on both sides (cases 'wanlink secure ...')")
    p.add_argument("--name", default="wan_throughput", help="file name of the JSON and PNG")
    p.add_argument("--replot", type=Path, metavar="JSON", help="only redraw the PNG from a result JSON")
    add_output_options(p)
    p.add_argument("--gloo-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    p.add_argument("--master", help=argparse.SUPPRESS)
    p.add_argument("--size-mib", type=int, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.gloo_worker:
        gloo_worker(a.rank, a.master, a.size_mib)
        return 0
    run = Run(a)
    if a.replot:
        print(plot(run, json.loads(a.replot.read_text())["rows"], a.name))
        return 0
    from bench.wanem.netns import WanemError, check_environment

    try:
        check_environment(programs=("iperf3",))
    except WanemError as exc:
        print(f"wan_throughput: {exc}", file=sys.stderr)
        return 1
    try:
        plan_cases(a.window, a.gloo_mib, buffers=a.buffers)
    except ValueError as exc:
        p.error(str(exc))
    rows = measure(a.seconds, a.rate_mbit, a.window, a.gloo_mib, a.only, a.cases, a.buffers, a.secure)
    print()
    shown = [{k: ("" if v is None else v) for k, v in r.items()} for r in rows]
    print_table(shown, [("path", "path", ""), ("case", "case", ""), ("buffers", "buffers", ""),
                       ("streams", "streams", ""), ("gbps", "Gbit/s", ".3f"), ("retransmits", "retr", "")])
    gains = ratios(rows)
    print()
    print_table([{k: ("" if v is None else v) for k, v in g.items()} for g in gains],
                [("path", "path", ""), ("buffers", "buffers", ""), ("striping_gain", "wl/ip3-P1", ".2f"),
                 ("vs_iperf3_P8", "wl/ip3-P8", ".2f"), ("vs_gloo", "wl/gloo", ".2f"),
                 ("buffer_gain_iperf3_P1", "buf gain", ".2f")])
    path = run.save_json(a.name, {"seconds": a.seconds, "rate_mbit": a.rate_mbit, "window": a.window,
                                  "rows": rows, "gains": gains})
    png = plot(run, rows, a.name)
    print(f"\nwrote {path} and {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
