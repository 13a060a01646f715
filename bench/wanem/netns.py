"""Emulated WAN paths between two network namespaces (needs root).

``WanPath`` creates namespaces ``<prefix>-<pid>-<n>-a`` and ``-b``, starts the ``wanem``
emulator (which creates one TUN device ``wan0`` in each), addresses them from the RFC 2544
benchmarking range (198.18.0.1 <-> 198.18.0.2, visible only inside the two namespaces), caps
TCP socket buffers per namespace so one flow is window-limited as on real long paths, and
tears everything down again::

    with WanPath(rtt_ms=40, rate_mbit=2000, loss=0.001) as path:
        server = path.popen_b(["iperf3", "-s", "-1"])
        path.run_a(["iperf3", "-c", path.addr_b, "-t", "10"])

CLI: ``python3 -m bench.wanem.netns up|run|down`` (see ``--help``).
"""
from __future__ import annotations

import argparse
import atexit
import itertools
import json
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from .builder import build

ADDR_A = "198.18.0.1"
ADDR_B = "198.18.0.2"
DEV = "wan0"
NETNS_DIR = Path("/run/netns")
DEFAULT_PREFIX = "wl"
# Effective TCP window of one flow (~1.5 MB as on real long paths: ~1.2 Gbit/s at 10 ms RTT,
# ~300 Mbit/s at 40 ms). tcp_rmem max = window / RCV_WINDOW_FRACTION: the kernel advertises
# only part of the receive buffer (skb overhead), a fraction measured on this kernel.
DEFAULT_WINDOW_KB = 1536
RCV_WINDOW_FRACTION = 0.66
DEFAULT_QUEUE_MS = 20.0  # drop-tail queue when none is given: 20 ms at the bottleneck rate

_counter = itertools.count()


class WanemError(RuntimeError):
    """The emulated path could not be set up (not root, no TUN, emulator failed...)."""


@dataclass(frozen=True)
class Link:
    """One direction of the path. rate 0 = unlimited; a queue limit of None = none of that kind."""

    delay_ms: float
    rate_mbit: float = 0.0
    loss: float = 0.0
    queue_kb: float | None = None
    queue_pkts: int | None = None

    def args(self, d: str) -> list[str]:
        out = [f"--delay-ms-{d}", repr(self.delay_ms), f"--rate-mbit-{d}", repr(self.rate_mbit),
               f"--loss-{d}", repr(self.loss)]
        if self.queue_kb is not None:
            out += [f"--queue-bytes-{d}", str(int(self.queue_kb * 1024))]
        if self.queue_pkts is not None:
            out += [f"--queue-pkts-{d}", str(int(self.queue_pkts))]
        return out


def check_environment(programs: tuple[str, ...] = ()) -> None:
    """Raise WanemError saying what is missing to build namespaces with TUN devices, or to run
    the extra ``programs`` a bench needs inside them (e.g. ``("iperf3",)``)."""
    if os.geteuid() != 0:
        raise WanemError("wanem needs root (CAP_NET_ADMIN + CAP_SYS_ADMIN) to create network "
                         "namespaces and TUN devices; run as root, e.g. with sudo")
    if not os.path.exists("/dev/net/tun"):
        raise WanemError("/dev/net/tun is missing (kernel without TUN, or not exposed in this container)")
    if shutil.which("ip") is None:
        raise WanemError("the 'ip' command (iproute2) is required")
    for program in programs:
        if shutil.which(program) is None:
            raise WanemError(f"{program} is required (apt-get install -y {program})")


def _sh(argv: list[str], **kw) -> subprocess.CompletedProcess:
    proc = subprocess.run(argv, capture_output=True, text=True, **kw)
    if proc.returncode != 0:
        raise WanemError(f"{' '.join(argv)} failed: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc


def _netns_pids(ns: str) -> list[int]:
    proc = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
    return [int(p) for p in proc.stdout.split()] if proc.returncode == 0 else []


def _delete_netns(ns: str) -> None:
    """Kill what still runs inside namespace `ns` (we started it there), then delete it."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        pids = _netns_pids(ns)
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 1.0
        while pids and _netns_pids(ns) and time.monotonic() < deadline:
            time.sleep(0.02)
    subprocess.run(["ip", "netns", "delete", ns], capture_output=True)


def list_namespaces(prefix: str = DEFAULT_PREFIX) -> list[str]:
    """Namespaces named like ours (``<prefix>-<pid>-<n>-a|b``, sites: ``-a0``, ``-asw``...)."""
    pat = re.compile(rf"^{re.escape(prefix)}-\d+-\d+-[ab](\d+|sw)?$")
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line and pat.match(line.split()[0])]


def cleanup_stale(prefix: str = DEFAULT_PREFIX, everything: bool = False) -> list[str]:
    """Delete leftover namespaces of ours whose creating process is gone (all of ours with
    `everything`); return their names."""
    removed = []
    for ns in list_namespaces(prefix):
        pid = int(ns[len(prefix) + 1:].split("-")[0])
        if everything or not os.path.exists(f"/proc/{pid}"):
            _delete_netns(ns)
            removed.append(ns)
    return removed


def _cpu_seconds(pid: int) -> float:
    """utime + stime of a process (all threads) from /proc/<pid>/stat."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wan_link(rtt_ms: float, rate_mbit: float, loss: float, queue_kb: float | None, queue_pkts: int | None) -> Link:
    """One direction of a path of ``rtt_ms``; the queue defaults to 20 ms at the rate."""
    if queue_kb is None and queue_pkts is None and rate_mbit > 0:
        queue_kb = max(64.0, rate_mbit * 1e6 / 8 * DEFAULT_QUEUE_MS / 1e3 / 1024)
    return Link(rtt_ms / 2, rate_mbit, loss, queue_kb, queue_pkts)


def check_link(link: Link) -> None:
    if link.delay_ms < 0 or link.rate_mbit < 0 or not 0 <= link.loss <= 1:
        raise ValueError(f"invalid link {link}")


def check_cc(*names: str | None) -> None:
    available = Path("/proc/sys/net/ipv4/tcp_available_congestion_control")
    for name in set(names) - {None}:
        if available.exists() and name not in available.read_text().split():
            raise ValueError(f"congestion control {name!r} not available; the kernel has: "
                             f"{available.read_text().strip()}")


def route_to(prefix: str, dev: str, src: str, cc: str | None, extra: str = "") -> str:
    """An ``ip route`` command; congestion control as a route attribute works for any available
    algorithm, not only the namespace's "allowed" ones."""
    route = f"route replace {prefix} dev {dev} {extra} src {src}".replace("  ", " ")
    return route + (f" congctl {cc}" if cc else "")


class Emulator:
    """One running ``wanem`` process joining device ``dev_a`` in ``ns_a`` to ``dev_b`` in ``ns_b``."""

    def __init__(self, binary: Path, workdir: str, name: str, ns_a: str, ns_b: str, ab: Link, ba: Link, *,
                 seed: int, offload: bool, dev_a: str = DEV, dev_b: str = DEV):
        self.stats_path = os.path.join(workdir, f"{name}.stats.json")
        self._stderr_path = os.path.join(workdir, f"{name}.stderr")
        argv = [str(binary), "--ns-a", str(NETNS_DIR / ns_a), "--ns-b", str(NETNS_DIR / ns_b),
                "--dev", dev_a, "--dev-b", dev_b, "--stats", self.stats_path, "--seed", str(seed),
                "--parent", str(os.getpid()), *ab.args("ab"), *ba.args("ba")]
        if not offload:
            argv.append("--no-offload")
        with open(self._stderr_path, "w") as err:
            self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=err, text=True)
        ready, _, _ = select.select([self.proc.stdout], [], [], 10.0)
        line = self.proc.stdout.readline() if ready else ""
        if line.strip() != "READY":
            self.proc.kill()
            self.proc.wait()
            self.proc.stdout.close()
            raise WanemError(f"wanem did not start: {self._stderr() or 'no READY within 10 s'}")

    def cpu_seconds(self) -> float:
        return _cpu_seconds(self.proc.pid)

    def stats(self) -> dict:
        """Counters per direction ("ab", "ba"), written by the emulator on SIGUSR1."""
        if self.proc.poll() is not None:
            raise WanemError("emulator is not running")
        before = os.stat(self.stats_path).st_mtime_ns if os.path.exists(self.stats_path) else 0
        self.proc.send_signal(signal.SIGUSR1)
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:
            if os.path.exists(self.stats_path) and os.stat(self.stats_path).st_mtime_ns != before:
                return self.read_stats()
            time.sleep(0.005)
        raise WanemError("emulator did not write its stats")

    def stop(self) -> dict | None:
        """Terminate it (the TUN devices go with it); return its last counters."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=3)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc.stdout.close()
        return self.read_stats()

    def read_stats(self) -> dict | None:
        try:
            with open(self.stats_path) as f:
                return json.load(f)
        except (OSError, ValueError):
            return None

    def _stderr(self) -> str:
        try:
            return Path(self._stderr_path).read_text().strip()
        except OSError:
            return ""


class Topology:
    """Namespaces and emulators this process created, and the processes it started in them.

    Subclasses lay out their namespaces in ``_build``; ``down()`` undoes everything (idempotent,
    also registered with ``atexit``).
    """

    def __init__(self, prefix: str):
        self.name = f"{prefix}-{os.getpid()}-{next(_counter)}"
        self.sysctls: dict[str, dict[str, str]] = {}
        self._tmp: str | None = None
        self._children: list[subprocess.Popen] = []
        self._emulators: list[Emulator] = []
        self._created: list[str] = []

    def __enter__(self):
        return self.up()

    def __exit__(self, *exc) -> None:
        self.down()

    def up(self):
        """Create the namespaces, start the emulators, configure addresses, routes and sysctls."""
        check_environment()
        binary = build()
        atexit.register(self.down)
        try:
            self._tmp = tempfile.mkdtemp(prefix="wanem-")
            self._build(binary)
        except BaseException:
            self.down()
            raise
        return self

    def _build(self, binary: Path) -> None:
        raise NotImplementedError

    def _add_namespace(self, suffix: str) -> str:
        ns = f"{self.name}-{suffix}"
        _sh(["ip", "netns", "add", ns])
        self._created.append(ns)
        return ns

    def _start_emulator(self, binary: Path, ns_a: str, ns_b: str, ab: Link, ba: Link, **kw) -> Emulator:
        emulator = Emulator(binary, self._tmp, f"e{len(self._emulators)}", ns_a, ns_b, ab, ba, **kw)
        self._emulators.append(emulator)
        return emulator

    def _set_sysctls(self, ns: str, window_kb: float | None, extra: dict[str, str] | None = None) -> None:
        """No cached ssthresh, no IPv6, the TCP buffer caps of ``window_kb``; read back into ``sysctls``."""
        want = {"net.ipv4.tcp_no_metrics_save": "1",  # no cached ssthresh between runs
                "net.ipv6.conf.all.disable_ipv6": "1",  # before link up: no IPv6 chatter
                "net.ipv6.conf.default.disable_ipv6": "1", **(extra or {})}
        if window_kb is not None:
            rmem = int(window_kb * 1024 / RCV_WINDOW_FRACTION)
            want["net.ipv4.tcp_rmem"] = f"4096 131072 {rmem}"
            want["net.ipv4.tcp_wmem"] = f"4096 16384 {2 * rmem}"
        _sh(["ip", "netns", "exec", ns, "sysctl", "-q", "-w", *[f"{k}={v}" for k, v in want.items()]])
        if window_kb is not None:
            # Per-netns on recent kernels but read-only outside the initial namespace on some
            # (as here); the effective values are read back below into self.sysctls.
            subprocess.run(["ip", "netns", "exec", ns, "sysctl", "-q", "-w",
                            f"net.core.rmem_max={rmem}", f"net.core.wmem_max={2 * rmem}"],
                           capture_output=True)
        keys = [*want, "net.core.rmem_max", "net.core.wmem_max", "net.ipv4.tcp_congestion_control"]
        out = _sh(["ip", "netns", "exec", ns, "sysctl", *keys]).stdout
        self.sysctls[ns] = dict(line.split(" = ", 1) for line in out.splitlines() if " = " in line)

    def down(self) -> None:
        """Stop processes we started, the emulators, and delete our namespaces (idempotent)."""
        atexit.unregister(self.down)
        for proc in self._children:
            if proc.poll() is None:
                proc.terminate()
        for proc in self._children:
            try:
                proc.wait(timeout=2)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._children.clear()
        self._final_stats([e.stop() for e in self._emulators])
        self._emulators.clear()
        for ns in self._created:
            _delete_netns(ns)
        self._created.clear()
        if self._tmp:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None

    def _final_stats(self, stats: list[dict | None]) -> None:
        """Keep the emulators' last counters (subclasses say where)."""

    # -- running things inside ---------------------------------------------------------------

    @staticmethod
    def cmd_in(ns: str, argv: list[str]) -> list[str]:
        """`argv` wrapped to run in namespace `ns`."""
        return ["ip", "netns", "exec", ns, *argv]

    def popen_in(self, ns: str, argv: list[str], **kw) -> subprocess.Popen:
        """subprocess.Popen in namespace `ns`; terminated by down() if still running."""
        proc = subprocess.Popen(self.cmd_in(ns, argv), **kw)
        self._children.append(proc)
        return proc


class WanPath(Topology):
    """Two namespaces joined by the wanem emulator; symmetric unless `ab`/`ba` are given.

    rtt_ms: base RTT (half each way); rate_mbit: bottleneck rate (0 = unlimited); loss: random
    loss probability per segment, each direction; queue_kb / queue_pkts: drop-tail limits
    (default: 20 ms at the rate); window_kb: effective TCP window per flow, set through
    tcp_rmem/tcp_wmem in both namespaces (None = kernel defaults); cc: congestion control of
    both namespaces, or a pair (cc_a, cc_b), set per route so any available algorithm works;
    offload: TSO super-packets between emulator and kernel (much faster, same per-segment
    behaviour); ab/ba: explicit per-direction Links (their queue defaults to none).
    """

    def __init__(self, rtt_ms: float = 40.0, rate_mbit: float = 2000.0, loss: float = 0.0,
                 queue_kb: float | None = None, queue_pkts: int | None = None, *,
                 window_kb: float | None = DEFAULT_WINDOW_KB, cc: str | tuple[str, str] | None = None,
                 seed: int = 1, ab: Link | None = None, ba: Link | None = None, mtu: int = 1500,
                 offload: bool = True, prefix: str = DEFAULT_PREFIX):
        super().__init__(prefix)
        sym = wan_link(rtt_ms, rate_mbit, loss, queue_kb, queue_pkts)
        self.ab = ab or sym
        self.ba = ba or sym
        check_link(self.ab)
        check_link(self.ba)
        self.cc_a, self.cc_b = (cc, cc) if cc is None or isinstance(cc, str) else cc
        check_cc(self.cc_a, self.cc_b)
        self.window_kb, self.seed, self.mtu, self.offload = window_kb, seed, mtu, offload
        self.ns_a = f"{self.name}-a"
        self.ns_b = f"{self.name}-b"
        self.addr_a, self.addr_b = ADDR_A, ADDR_B
        self.final_stats: dict | None = None

    def _build(self, binary: Path) -> None:
        for ns in (self.ns_a, self.ns_b):
            self._add_namespace(ns.rsplit("-", 1)[1])
        self._start_emulator(binary, self.ns_a, self.ns_b, self.ab, self.ba, seed=self.seed, offload=self.offload)
        self._configure(self.ns_a, self.addr_a, self.addr_b, self.cc_a)
        self._configure(self.ns_b, self.addr_b, self.addr_a, self.cc_b)

    def _configure(self, ns: str, local: str, peer: str, cc: str | None) -> None:
        self._set_sysctls(ns, self.window_kb)
        cmds = ["link set lo up", f"link set {DEV} mtu {self.mtu} txqueuelen 1000 up",
                f"addr add {local}/32 peer {peer}/32 dev {DEV}",
                route_to(f"{peer}/32", DEV, local, cc, "proto kernel scope link")]
        _sh(["ip", "-n", ns, "-batch", "-"], input="\n".join(cmds) + "\n")

    def _final_stats(self, stats: list[dict | None]) -> None:
        if stats:
            self.final_stats = stats[0]

    # -- running things inside ---------------------------------------------------------------

    def cmd_a(self, argv: list[str]) -> list[str]:
        """`argv` wrapped to run in namespace A."""
        return self.cmd_in(self.ns_a, argv)

    def cmd_b(self, argv: list[str]) -> list[str]:
        """`argv` wrapped to run in namespace B."""
        return self.cmd_in(self.ns_b, argv)

    def run_a(self, argv: list[str], **kw) -> subprocess.CompletedProcess:
        """subprocess.run in namespace A."""
        return subprocess.run(self.cmd_a(argv), **kw)

    def run_b(self, argv: list[str], **kw) -> subprocess.CompletedProcess:
        """subprocess.run in namespace B."""
        return subprocess.run(self.cmd_b(argv), **kw)

    def popen_a(self, argv: list[str], **kw) -> subprocess.Popen:
        """subprocess.Popen in namespace A; terminated by down() if still running."""
        return self.popen_in(self.ns_a, argv, **kw)

    def popen_b(self, argv: list[str], **kw) -> subprocess.Popen:
        """subprocess.Popen in namespace B; terminated by down() if still running."""
        return self.popen_in(self.ns_b, argv, **kw)

    # -- emulator introspection ---------------------------------------------------------------

    @property
    def emulator(self) -> subprocess.Popen | None:
        return self._emulators[0].proc if self._emulators else None

    @property
    def stats_path(self) -> str:
        return self._emulators[0].stats_path if self._emulators else ""

    @property
    def emulator_pid(self) -> int | None:
        return self.emulator.pid if self.emulator else None

    def cpu_seconds(self) -> float:
        """CPU time (user + system, both directions) the emulator has used so far."""
        if not self._emulators:
            raise WanemError("path is not up")
        return self._emulators[0].cpu_seconds()

    def stats(self) -> dict:
        """Emulator counters per direction ("ab", "ba"): packets, segments, bytes, drops."""
        if not self._emulators:
            raise WanemError("emulator is not running")
        return self._emulators[0].stats()


# -- CLI ---------------------------------------------------------------------------------------

def _path_from_args(a: argparse.Namespace) -> WanPath:
    return WanPath(rtt_ms=a.rtt_ms, rate_mbit=a.rate_mbit, loss=a.loss, queue_kb=a.queue_kb,
                   queue_pkts=a.queue_pkts, window_kb=None if a.window_kb <= 0 else a.window_kb,
                   cc=a.cc, seed=a.seed, offload=not a.no_offload, prefix=a.prefix)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python3 -m bench.wanem.netns",
                                description="Emulated WAN path between two network namespaces (needs root).")
    sub = p.add_subparsers(dest="cmd", required=True)
    for name, help_ in (("up", "bring a path up and hold it until Ctrl-C / SIGTERM"),
                        ("run", "bring a path up, run a command (in the root namespace, with "
                                "WANEM_NS_A/B and WANEM_ADDR_A/B set), tear down")):
        s = sub.add_parser(name, help=help_)
        s.add_argument("--rtt-ms", type=float, default=40.0)
        s.add_argument("--rate-mbit", type=float, default=2000.0, help="0 = unlimited")
        s.add_argument("--loss", type=float, default=0.0, help="per-segment probability, each direction")
        s.add_argument("--queue-kb", type=float, default=None)
        s.add_argument("--queue-pkts", type=int, default=None)
        s.add_argument("--window-kb", type=float, default=DEFAULT_WINDOW_KB, help="<= 0: kernel defaults")
        s.add_argument("--cc", default=None, help="congestion control in both namespaces")
        s.add_argument("--seed", type=int, default=1)
        s.add_argument("--no-offload", action="store_true")
        s.add_argument("--prefix", default=DEFAULT_PREFIX)
        if name == "run":
            s.add_argument("command", nargs=argparse.REMAINDER, help="-- CMD ARGS...")
    d = sub.add_parser("down", help="delete leftover namespaces of dead processes (with our prefix)")
    d.add_argument("--all", action="store_true", help="also those of live processes")
    d.add_argument("--prefix", default=DEFAULT_PREFIX)
    a = p.parse_args(argv)
    try:
        if a.cmd == "down":
            check_environment()
            for ns in cleanup_stale(a.prefix, everything=a.all):
                print(f"deleted {ns}")
            return 0
        if a.cmd == "run":
            cmd = a.command[1:] if a.command[:1] == ["--"] else a.command
            if not cmd:
                p.error("run needs a command after --")
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
        with _path_from_args(a) as path:
            env = dict(os.environ, WANEM_NS_A=path.ns_a, WANEM_NS_B=path.ns_b,
                       WANEM_ADDR_A=path.addr_a, WANEM_ADDR_B=path.addr_b)
            if a.cmd == "run":
                return subprocess.run(cmd, env=env).returncode
            print("\n".join(f"export {k}={env[k]}" for k in
                            ("WANEM_NS_A", "WANEM_NS_B", "WANEM_ADDR_A", "WANEM_ADDR_B")), flush=True)
            print(f"# emulator pid {path.emulator_pid}; Ctrl-C to tear down", flush=True)
            try:
                signal.pause()
            except KeyboardInterrupt:
                pass
            return 0
    except WanemError as e:
        print(f"wanem: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
