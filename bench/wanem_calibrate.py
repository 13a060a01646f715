"""Calibrate the wanem WAN emulator with iperf3 (needs root and iperf3).

Runs iperf3 between the two namespaces of emulated paths: 1 and 8 (and 16) flows at 10, 40
and 80 ms RTT at 2 Gbit/s with the default per-namespace window caps; cubic vs bbr under
0.1% and 1% loss at 40 ms; a socket that sets its own buffers (iperf3 -w 4M); and the
emulator's ceiling (no rate limit, large windows; with and without offloads). Each run
records the emulator's CPU (from /proc/<pid>/stat), iperf3's, the CPU used by unrelated
processes (others' load disturbs the numbers; such runs are repeated once), the rest of the
machine's busy time ("unattributed": kernel network work not charged to a process, and
processes that came and went within the run), and the 1-min load average.

    sudo python3 -m bench.wanem_calibrate            # ~6-10 min
    sudo python3 -m bench.wanem_calibrate --scale 0.3 --only loss

Writes wanem_calibration.{json,png} to --out (bench/results/ with --publish).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from bench.reporting import Run, add_output_options
from bench.wanem import WanemError, WanPath, build, check_environment
from bench.wanem.netns import DEFAULT_WINDOW_KB

NAME = "wanem_calibration"
CLK_TCK = os.sysconf("SC_CLK_TCK")


@dataclass
class Case:
    group: str
    name: str
    rtt_ms: float
    flows: int = 1
    rate_mbit: float = 2000.0
    loss: float = 0.0
    cc: str = "cubic"
    window_kb: float | None = DEFAULT_WINDOW_KB
    iperf_args: list[str] = field(default_factory=list)
    offload: bool = True
    seconds: float = 10.0
    expect_mbit: float | None = None  # what the task/real paths say it should be, if anything


GOODPUT = 1448 / 1500  # iperf3 counts payload; the emulator's rate counts IP bytes (MSS 1448 + TS option)


def window_limited(rtt_ms: float, flows: int, rate_mbit: float, window_kb: float = DEFAULT_WINDOW_KB) -> float:
    """Goodput model: each flow at most window/RTT, all together at most the rate."""
    return min(rate_mbit * GOODPUT, flows * window_kb * 1024 * 8 / (rtt_ms / 1e3) / 1e6)


def cases() -> list[Case]:
    out = []
    for rtt in (10, 40, 80):
        for flows in (1, 8):
            out.append(Case("window", f"{flows} flow{'s' * (flows > 1)} @{rtt}ms", rtt, flows,
                            expect_mbit=window_limited(rtt, flows, 2000)))
    out.append(Case("window", "16 flows @80ms", 80, 16, expect_mbit=window_limited(80, 16, 2000)))
    for loss, exp in ((0.001, {"cubic": 14, "bbr": 190}), (0.01, {})):
        for cc in ("cubic", "bbr"):
            out.append(Case("loss", f"{cc} loss {loss:.1%} @40ms", 40, loss=loss, cc=cc, seconds=30,
                            expect_mbit=exp.get(cc)))
    out.append(Case("sockbuf", "1 flow @40ms (caps)", 40, expect_mbit=window_limited(40, 1, 2000)))
    out.append(Case("sockbuf", "1 flow @40ms -w 4M", 40, iperf_args=["-w", "4M"]))
    out.append(Case("ceiling", "8 flows @80ms unlimited", 80, 8, rate_mbit=0, window_kb=16384))
    out.append(Case("ceiling", "1 flow @80ms unlimited", 80, 1, rate_mbit=0, window_kb=65536))
    out.append(Case("ceiling", "8 flows @80ms unlimited, no offload", 80, 8, rate_mbit=0, window_kb=16384,
                    offload=False))
    out.append(Case("ceiling", "8 flows @40ms, no offload", 40, 8, offload=False,
                    expect_mbit=window_limited(40, 8, 2000)))
    return out


def _ticks(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])
    except (OSError, IndexError):
        return None


def _process_ticks() -> dict[int, int]:
    """utime + stime of every user-space process (kernel threads left out)."""
    out = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if not int(fields[6]) & 0x00200000:  # PF_KTHREAD
                out[int(d)] = int(fields[11]) + int(fields[12])
    return out


def _machine_busy() -> tuple[int, int]:
    """(busy, total) jiffies over all CPUs from /proc/stat."""
    with open("/proc/stat") as f:
        vals = [int(v) for v in f.readline().split()[1:]]
    idle = vals[3] + vals[4]
    total = sum(vals[:8])
    return total - idle, total


def others_busy(seconds: float = 1.0) -> float:
    """CPU cores used by other user-space processes over the next `seconds`."""
    me = os.getpid()
    t0, a = time.monotonic(), _process_ticks()
    time.sleep(seconds)
    b, dt = _process_ticks(), time.monotonic() - t0
    return sum(t - a[p] for p, t in b.items() if p in a and p != me) / CLK_TCK / dt


def wait_for_quiet(max_cores: float, timeout: float) -> float:
    """Wait (up to `timeout` s) until other processes use at most `max_cores`; return their use."""
    deadline = time.monotonic() + timeout
    while (busy := others_busy()) > max_cores and time.monotonic() < deadline:
        time.sleep(1)
    return busy


def run_case(c: Case, scale: float) -> dict:
    seconds = max(3, round(c.seconds * scale))
    with tempfile.TemporaryDirectory() as tmp, \
            WanPath(rtt_ms=c.rtt_ms, rate_mbit=c.rate_mbit, loss=c.loss, window_kb=c.window_kb, cc=c.cc,
                    offload=c.offload) as path:
        server = path.popen_b(["iperf3", "-s", "-1"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(0.3)
        load1 = os.getloadavg()[0]
        procs0 = _process_ticks()
        emu0, busy0, wall0 = _ticks(path.emulator_pid), _machine_busy(), time.monotonic()
        report = os.path.join(tmp, "iperf3.json")  # a file, not a pipe: -J output can exceed 64 KiB
        with open(report, "w") as f:
            client = path.popen_a(["iperf3", "-c", path.addr_b, "-t", str(seconds), "-P", str(c.flows), "-J",
                                   *c.iperf_args], stdout=f, stderr=subprocess.STDOUT)
        ours = {"client": 0, "server": 0}
        deadline = time.monotonic() + seconds + 30
        while client.poll() is None:  # last CPU reading of the iperf3 processes before they exit
            for key, proc in (("client", client), ("server", server)):
                ours[key] = _ticks(proc.pid) or ours[key]
            if time.monotonic() > deadline:
                client.kill()
            time.sleep(0.2)
        out = Path(report).read_text()
        emu1, busy1, wall1 = _ticks(path.emulator_pid), _machine_busy(), time.monotonic()
        procs1 = _process_ticks()
        mine = {path.emulator_pid, client.pid, server.pid, os.getpid()}
        stats = path.stats()
    if client.returncode != 0:
        raise RuntimeError(f"iperf3 failed for {c.name} (rc {client.returncode}): {out[-500:]}")
    rep = json.loads(out)
    end = rep["end"]
    ivals = [i["sum"]["bits_per_second"] / 1e6 for i in rep["intervals"]]
    half = ivals[len(ivals) // 2:]
    wall = wall1 - wall0
    ncpu = os.cpu_count() or 1
    machine_cores = (busy1[0] - busy0[0]) / max(1, busy1[1] - busy0[1]) * ncpu
    emu_cores = (emu1 - emu0) / CLK_TCK / wall
    iperf_cores = (ours["client"] + ours["server"]) / CLK_TCK / wall  # since start, ~ all in-run
    others = sum(t - procs0.get(pid, 0) for pid, t in procs1.items() if pid not in mine)  # new ones: all
    others = others / CLK_TCK / wall
    return {
        **asdict(c), "seconds": seconds,
        "mbit": end["sum_received"]["bits_per_second"] / 1e6,
        "mbit_2nd_half": sum(half) / len(half),
        "retransmits": end["sum_sent"].get("retransmits"),
        "emulator_cores": emu_cores,
        "iperf3_cores": iperf_cores,
        "machine_cores": machine_cores,
        # processes not of this run (others' load), and the rest of the machine's busy time: kernel
        # network work not charged to a process, and processes that came and went within the run
        "others_cores": others,
        "unattributed_cores": max(0.0, machine_cores - emu_cores - iperf_cores - others),
        "load1": load1,
        "emulator": stats,
    }


def table(rows: list[dict]) -> str:
    head = (f"{'case':38} {'Mbit/s':>8} {'2nd half':>8} {'expect':>7} {'retr':>6} "
            f"{'emu cpu':>7} {'iperf3':>6} {'unattr':>6} {'others':>6} {'load1':>5}")
    lines = [head, "-" * len(head)]
    for r in rows:
        exp = f"{r['expect_mbit']:.0f}" if r["expect_mbit"] else "-"
        lines.append(f"{r['name']:38} {r['mbit']:8.1f} {r['mbit_2nd_half']:8.1f} {exp:>7} "
                     f"{r['retransmits'] if r['retransmits'] is not None else '-':>6} "
                     f"{r['emulator_cores']:7.2f} {r['iperf3_cores']:6.2f} {r['unattributed_cores']:6.2f} "
                     f"{r['others_cores']:6.2f} "
                     f"{r['load1']:5.2f}")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["name"] for r in rows]
    y = range(len(rows))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 0.42 * len(rows) + 1.5), sharey=True,
                                   gridspec_kw={"width_ratios": [3, 1]})
    ax1.barh(y, [r["mbit_2nd_half"] for r in rows], color="tab:blue", label="measured, 2nd half of run")
    ax1.scatter([r["mbit"] for r in rows], y, color="black", marker="o", s=12, zorder=3,
                label="measured, whole run")
    ax1.scatter([r["expect_mbit"] or float("nan") for r in rows], y, color="tab:red", marker="|", s=300,
                zorder=3, label="expected")
    ax1.set_xscale("log")
    ax1.set_xlim(left=1)
    ax1.set_xlabel("iperf3 throughput, Mbit/s (log)")
    ax1.set_yticks(list(y), names, fontsize=8)
    ax1.invert_yaxis()
    ax1.legend(loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=3, fontsize=8)
    ax1.grid(axis="x", which="both", alpha=0.3)
    ax2.barh(y, [r["emulator_cores"] for r in rows], color="tab:orange", label="emulator")
    ax2.barh(y, [r["iperf3_cores"] for r in rows], left=[r["emulator_cores"] for r in rows],
             color="tab:green", label="iperf3")
    ax2.barh(y, [r["unattributed_cores"] for r in rows],
             left=[r["emulator_cores"] + r["iperf3_cores"] for r in rows], color="tab:purple",
             label="unattributed (kernel, short-lived processes)")
    ax2.barh(y, [r["others_cores"] for r in rows],
             left=[r["emulator_cores"] + r["iperf3_cores"] + r["unattributed_cores"] for r in rows],
             color="tab:gray", label="other processes (load)")
    ax2.set_xlabel("CPU cores")
    ax2.legend(loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=1, fontsize=8)
    ax2.grid(axis="x", alpha=0.3)
    fig.suptitle("wanem calibration: iperf3 between namespaces (window caps %d KB/flow)" % DEFAULT_WINDOW_KB)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--scale", type=float, default=1.0, help="multiply run durations")
    p.add_argument("--only", default=None, help="run only this group (window, loss, sockbuf, ceiling)")
    p.add_argument("--wait", type=float, default=30, help="s to wait for others' CPU use to drop before a run")
    p.add_argument("--retries", type=int, default=1,
                   help="repeat a run when other processes used more than --max-other cores")
    p.add_argument("--max-other", type=float, default=0.3, help="cores")
    add_output_options(p)
    p.add_argument("--replot", action="store_true", help="only redraw table and PNG from the JSON in the output dir")
    p.add_argument("--merge", action="store_true",
                   help="replace same-named runs in the output dir's JSON (e.g. after --only) instead of all")
    a = p.parse_args(argv)
    run = Run(a)
    json_path = run.out / f"{NAME}.json"
    if a.replot:
        rows = json.loads(json_path.read_text())["runs"]
        print(table(rows))
        plot(rows, run.path(f"{NAME}.png"))
        return 0
    try:
        check_environment(programs=("iperf3",))
    except WanemError as e:
        print(f"wanem_calibrate: {e}", file=sys.stderr)
        return 1
    build()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: paths get torn down
    rows = []
    for c in cases():
        if a.only and c.group != a.only:
            continue
        for attempt in range(a.retries + 1):
            wait_for_quiet(a.max_other, timeout=a.wait)
            r = run_case(c, a.scale)
            r["attempt"] = attempt
            if r["others_cores"] <= a.max_other:
                break
        rows.append(r)
        print(table([r]).splitlines()[-1], flush=True)
    if a.merge and json_path.exists():
        fresh = {r["name"]: r for r in rows}
        old = json.loads(json_path.read_text())["runs"]
        rows = [fresh.pop(r["name"], r) for r in old] + list(fresh.values())
    print()
    print(table(rows))
    iperf3 = subprocess.run(["iperf3", "--version"], capture_output=True, text=True).stdout.split("\n")[0]
    written = run.save_json(NAME, {"iperf3": iperf3, "window_kb": DEFAULT_WINDOW_KB, "merged": bool(a.merge),
                                   "only": a.only, "runs": rows})
    plot(rows, run.path(f"{NAME}.png"))
    print(f"\nwrote {written} and .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
