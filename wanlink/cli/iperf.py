"""wanlink-iperf: iperf3's command line and wire protocol, with wanlink Links as the data path.

``-c HOST`` against a stock ``iperf3 -s`` runs an ordinary iperf3 TCP test. Against
``wanlink-iperf -s`` the client asks (in the parameters, invisibly to stock iperf3) for a wanlink
test: the data then goes over one wanlink Link of N striped streams on ``PROBE_DISCARD_TAG``, with
N probed automatically unless ``-P`` is given. ``-s`` serves stock iperf3 clients and
wanlink-iperf clients on the same port: it owns the listening socket, reads the first bytes of
each connection, and hands wanlink handshakes (``WLK1``) to the wanlink server.
"""
from __future__ import annotations

import argparse
import asyncio
import email.utils
import json
import logging
import os
import platform
import signal
import socket
import struct
import sys
import time
from dataclasses import dataclass, field

from wanlink.errors import (
    AuthenticationError, ConfigError, DeadlineExceeded, PeerLost, ProtocolError, UnsupportedError, WanlinkError,
)
from wanlink.probe import iperf3 as proto
from wanlink.endpoints import choose_streams
from wanlink.probe.step import inflight_bytes_for
from wanlink.probe.iperf3 import (
    NEED_DATA, ConnectionClosed, ControlConnection, Cookie, Parameters, Results, Role, ServerError, State,
    StateChange, StreamResult, TestParameters, TestResults, WanlinkAccept,
)
from wanlink.probe.rate import DeliveryRateEstimator
from wanlink.probe.report import (
    SEPARATOR, StreamSample, StreamTotals, end_json, header, interval_json, interval_lines, stream_line,
    sum_line, sum_samples, summary_lines,
)
from wanlink.settings import from_env

PROG = "wanlink-iperf"
VERSION = "wanlink-iperf 0.1.0 (iperf3 protocol)"
COOKIE_META_KEY = "iperf_cookie"
SNIFF_TIMEOUT_S = 10.0
STREAM_WAIT_S = 30.0  # server: how long CREATE_STREAMS may take (raw streams)
LINK_WAIT_S = 180.0  # server: how long the client may probe before its test link arrives
RECV_SCRATCH = 256 * 1024
_TCP_INFO = struct.Struct("=8B24I")  # linux struct tcp_info, first 104 bytes


class CliError(WanlinkError, RuntimeError):
    """A failure to report to the user as ``wanlink-iperf: error - <message>`` (exit status 1)."""


# ----------------------------------------------------------------------------- arguments
def parse_size(text: str) -> int:
    """iperf3 sizes: a number with an optional K/M/G/T suffix (powers of 1024)."""
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
    raw = text.strip()
    mult = units.get(raw[-1:].lower(), 1) if raw else 1
    number = raw[:-1] if mult != 1 else raw
    try:
        value = float(number) * mult
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid size {text!r} (e.g. 128K, 10M, 1G)") from None
    if value < 0 or value != value:
        raise argparse.ArgumentTypeError(f"size must be >= 0, got {text!r}")
    return int(value)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0],
                                epilog="The shared secret for wanlink links is read from WANLINK_SECRET "
                                       "(unset: unauthenticated).")
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("-s", "--server", action="store_true", help="run in server mode")
    mode.add_argument("-c", "--client", metavar="HOST", help="run in client mode, connecting to HOST")
    p.add_argument("-p", "--port", type=int, default=proto.DEFAULT_PORT, help="server port (default 5201)")
    p.add_argument("-B", "--bind", metavar="HOST", default=None, help="bind to this local address")
    p.add_argument("-P", "--parallel", type=_positive_int, default=None,
                   help="number of parallel streams (default: probed against a wanlink-iperf server)")
    p.add_argument("-t", "--time", type=float, default=None, help="seconds to transmit (default 10)")
    p.add_argument("-n", "--bytes", type=parse_size, default=None, help="bytes to transmit instead of -t")
    p.add_argument("-k", "--blockcount", type=parse_size, default=None, help="blocks (-l) to transmit")
    p.add_argument("-l", "--length", type=parse_size, default=proto.DEFAULT_BLOCKSIZE,
                   help="length of a write/read buffer (default 128K; plain iperf3 streams)")
    p.add_argument("-i", "--interval", type=float, default=1.0, help="seconds between reports (0 = none)")
    p.add_argument("-J", "--json", action="store_true", help="output JSON")
    p.add_argument("-R", "--reverse", action="store_true", help="reverse mode: the server sends")
    p.add_argument("--bidir", action="store_true", help="both directions at once")
    p.add_argument("-1", "--one-off", action="store_true", help="server: handle one client, then exit")
    p.add_argument("-C", "--congestion", metavar="ALGO", default=None,
                   help="TCP congestion control (default: bbr when the kernel offers it)")
    p.add_argument("-w", "--window", type=parse_size, default=None,
                   help="socket buffer size (SO_SNDBUF/SO_RCVBUF); default: kernel autotuning")
    p.add_argument("--connect-timeout", type=float, default=10000.0, metavar="MS",
                   help="timeout for connecting to the server, in ms (default 10000)")
    p.add_argument("--max-streams", type=_positive_int, default=64, help="upper bound of the stream probe")
    p.add_argument("--no-wanlink", action="store_true", help="client: plain iperf3 TCP streams only")
    p.add_argument("-v", "--version", action="version", version=VERSION)
    return p


@dataclass
class Options:
    server: bool
    host: str | None
    port: int
    bind: str | None
    parallel: int | None
    time: float
    bytes: int
    blockcount: int
    length: int
    interval: float
    json: bool
    reverse: bool
    bidir: bool
    one_off: bool
    congestion: str | None
    window: int | None
    connect_timeout: float
    max_streams: int
    wanlink: bool


def parse_args(argv=None) -> Options:
    """Parse and check the command line (argparse exits with status 2 on errors)."""
    parser = build_parser()
    a = parser.parse_args(argv)
    if not 0 <= a.port <= 65535 or (a.client and a.port == 0):
        parser.error(f"port must be in [1, 65535] (0 = any free port, server only), got {a.port}")
    if a.server and (a.reverse or a.bidir or a.parallel or a.bytes or a.blockcount or a.time is not None):
        parser.error("-R, --bidir, -P, -t, -n and -k are client options")
    if a.client and a.one_off:
        parser.error("-1 is a server option")
    if a.reverse and a.bidir:
        parser.error("-R and --bidir exclude each other")
    if sum(x is not None for x in (a.time, a.bytes, a.blockcount)) > 1:
        parser.error("give at most one of -t, -n and -k")
    duration = 10.0 if a.time is None else a.time
    if not 0 < duration <= proto.MAX_TIME and not (a.bytes or a.blockcount):
        parser.error(f"-t must be in (0, {proto.MAX_TIME}] seconds")
    if a.interval != 0 and not 0.1 <= a.interval <= 60:
        parser.error("-i must be 0 or in [0.1, 60] seconds")
    if a.parallel is not None and a.parallel > proto.MAX_STREAMS:
        parser.error(f"-P must be at most {proto.MAX_STREAMS}")
    if not 1 <= a.length <= proto.MAX_BLOCKSIZE:
        parser.error(f"-l must be in [1, {proto.MAX_BLOCKSIZE}]")
    if a.window is not None and not 1 <= a.window <= proto.MAX_WINDOW:
        parser.error(f"-w must be in [1, {proto.MAX_WINDOW}]")
    if a.connect_timeout <= 0:
        parser.error("--connect-timeout must be positive")
    return Options(server=a.server, host=a.client, port=a.port, bind=a.bind, parallel=a.parallel,
                   time=0.0 if (a.bytes or a.blockcount) else duration, bytes=a.bytes or 0,
                   blockcount=a.blockcount or 0, length=a.length, interval=a.interval, json=a.json,
                   reverse=a.reverse, bidir=a.bidir, one_off=a.one_off, congestion=a.congestion, window=a.window,
                   connect_timeout=a.connect_timeout / 1000.0, max_streams=min(a.max_streams, 64),
                   wanlink=not a.no_wanlink)


# ----------------------------------------------------------------------------- output
class Output:
    """Text lines to stdout, or one JSON document per test with ``-J``; messages to stderr."""

    def __init__(self, json_mode: bool, stdout=None, stderr=None):
        self.json_mode = json_mode
        self.stdout = stdout or sys.stdout
        self.stderr = stderr or sys.stderr

    def line(self, text: str = "") -> None:
        if not self.json_mode:
            print(text, file=self.stdout, flush=True)

    def warn(self, text: str) -> None:
        print(f"{PROG}: warning - {text}", file=self.stderr, flush=True)

    def error(self, text: str) -> None:
        print(f"{PROG}: error - {text}", file=self.stderr, flush=True)

    def document(self, doc: dict) -> None:
        print(json.dumps(doc, indent=2), file=self.stdout, flush=True)


def read_secret(out: Output) -> bytes:
    secret = os.environ.get("WANLINK_SECRET")
    if secret is None or secret == "":
        out.warn("WANLINK_SECRET is not set: wanlink links run unauthenticated (empty secret)")
        return b""
    return secret.encode()


class _QuietUnauthenticated(logging.Filter):
    """The transport warns once per link about an empty secret; the CLI says it once."""

    def filter(self, record):
        return "without authentication" not in record.getMessage()


def _setup_logging(out: Output):
    """Route the transport's warnings to our stderr for this run; returns the undo function."""
    logger = logging.getLogger("wanlink")
    handler = logging.StreamHandler(out.stderr)
    handler.setFormatter(logging.Formatter(f"{PROG}: %(message)s"))
    handler.addFilter(_QuietUnauthenticated())
    saved = logger.propagate, logger.level
    logger.addHandler(handler)
    logger.propagate = False
    logger.setLevel(logging.WARNING)

    def undo():
        logger.removeHandler(handler)
        logger.propagate, logger.level = saved
    return undo


# ----------------------------------------------------------------------------- sockets
def tcp_info(sock: socket.socket) -> dict | None:
    """Retransmits, cwnd (bytes), RTT and PMTU from Linux TCP_INFO; None where unavailable."""
    if not hasattr(socket, "TCP_INFO"):
        return None
    try:
        raw = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO.size)
    except OSError:
        return None
    if len(raw) < _TCP_INFO.size:
        return None
    f = _TCP_INFO.unpack(raw)
    u32 = f[8:]
    # u32 fields: rto ato snd_mss rcv_mss unacked sacked lost retrans fackets last_data_sent last_ack_sent
    # last_data_recv last_ack_recv pmtu rcv_ssthresh rtt rttvar snd_ssthresh snd_cwnd advmss reordering
    # rcv_rtt rcv_space total_retrans
    return {"retransmits": u32[23], "snd_cwnd": u32[18] * u32[2], "rtt": u32[15], "rttvar": u32[16],
            "pmtu": u32[13]}


def congestion_of(sock: socket.socket) -> str | None:
    try:
        raw = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, 16)
    except (OSError, AttributeError):
        return None
    return raw.split(b"\0", 1)[0].decode() or None


def set_congestion(sock: socket.socket, name: str) -> None:
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, name.encode())
    except (OSError, AttributeError) as exc:
        raise ConfigError(f"TCP congestion control {name!r} is not available here: {exc}") from None


def check_congestion(name: str | None) -> None:
    """Fail early (before any connection) when ``-C`` names an algorithm the kernel refuses."""
    if name:
        with socket.socket() as probe:
            set_congestion(probe, name)


def set_window(sock: socket.socket, size: int) -> None:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, size)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, size)


async def read_exactly(sock: socket.socket, n: int) -> bytes:
    loop = asyncio.get_running_loop()
    buf = bytearray()
    while len(buf) < n:
        data = await loop.sock_recv(sock, n - len(buf))
        if not data:
            raise PeerLost(f"connection closed after {len(buf)} of {n} bytes")
        buf += data
    return bytes(buf)


async def open_tcp(host: str, port: int, *, timeout: float, window: int | None = None,
                   congestion: str | None = None, bind: str | None = None) -> socket.socket:
    """A connected non-blocking TCP socket, with clear errors for the usual failures."""
    loop = asyncio.get_running_loop()
    try:
        infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise CliError(f"unable to resolve host {host!r}: {exc.strerror}") from None
    last = None
    for family, type_, protocol, _name, address in infos:
        sock = socket.socket(family, type_, protocol)
        sock.setblocking(False)
        try:
            if bind:
                sock.bind((bind, 0))
            if window:
                set_window(sock, window)
            if congestion:
                set_congestion(sock, congestion)
            async with asyncio.timeout(timeout):
                await loop.sock_connect(sock, address)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return sock
        except TimeoutError:
            sock.close()
            last = f"no answer within {timeout:g} s"
        except OSError as exc:
            sock.close()
            last = os.strerror(exc.errno) if exc.errno else str(exc)
        except BaseException:
            sock.close()
            raise
    raise CliError(f"unable to connect to server {host} port {port}: {last}")


class Control:
    """The control connection: the sans-I/O protocol plus its socket."""

    def __init__(self, sock: socket.socket, role: Role):
        self.sock = sock
        self.conn = ControlConnection(role)
        self._reader: asyncio.Task | None = None

    async def send(self, event) -> None:
        await asyncio.get_running_loop().sock_sendall(self.sock, self.conn.send(event))

    async def _next(self):
        loop = asyncio.get_running_loop()
        while True:
            event = self.conn.next_event()
            if event is not NEED_DATA:
                return event
            try:
                data = await loop.sock_recv(self.sock, 65536)
            except (ConnectionResetError, BrokenPipeError):
                data = b""
            self.conn.receive_data(data)

    def next_task(self) -> asyncio.Task:
        """The pending 'next event' read (kept across races until consumed, so no event is lost)."""
        if self._reader is None:
            self._reader = asyncio.get_running_loop().create_task(self._next())
        return self._reader

    async def next(self):
        task = self.next_task()
        try:
            return await task
        finally:
            if task.done():
                self._reader = None

    def close(self) -> None:
        if self._reader is not None and not self._reader.done():
            self._reader.cancel()
        self.sock.close()


# ----------------------------------------------------------------------------- data channels
def iperf_ids(count: int, first: int = 0) -> list[int]:
    """iperf3's stream ids in creation order: 1, 3, 4, 5, ... (it never uses 2)."""
    return [1 if first + i == 0 else first + i + 2 for i in range(count)]


class Progress:
    """Byte budget (-n / -k) shared by the senders, and completion of the test."""

    def __init__(self, budget: int):
        self.budget = budget  # 0 = unlimited
        self.remaining = budget
        self.done = asyncio.Event()

    def take(self, n: int) -> int:
        if not self.budget:
            return n
        n = min(n, self.remaining)
        self.remaining -= n
        return n

    def check_received(self, total: int) -> None:
        if self.budget and total >= self.budget:
            self.done.set()


class RawChannel:
    """One plain iperf3 TCP data stream."""

    def __init__(self, sock: socket.socket, sid: int, sender: bool):
        self.sock, self.sid, self.sender = sock, sid, sender
        self.id = sock.fileno()
        self.bytes = 0

    def tcp_info(self):
        return tcp_info(self.sock) if self.sender else None

    async def pump(self, progress: Progress, block: memoryview, rx_total: list[int]) -> None:
        loop = asyncio.get_running_loop()
        try:
            if self.sender:
                while (n := progress.take(len(block))) > 0:
                    await loop.sock_sendall(self.sock, block[:n])
                    self.bytes += n
                if progress.budget:
                    progress.done.set()
            else:
                scratch = bytearray(RECV_SCRATCH)
                while (n := await loop.sock_recv_into(self.sock, scratch)) > 0:
                    self.bytes += n
                    rx_total[0] += n
                    progress.check_received(rx_total[0])
        except (ConnectionError, OSError):
            return  # the peer closed the stream at the end of the test


class LinkCounters:
    """Per-stream byte counts of one Link, read from ``link.stats()`` once per report."""

    def __init__(self, link, *, send_chunk: int, recv_chunk: int):
        self.link, self.send_chunk, self.recv_chunk = link, send_chunk, recv_chunk
        self.sent = [0] * link.streams
        self.received = [0] * link.streams

    def refresh(self) -> None:
        st = self.link.stats()
        self.sent = [c * self.send_chunk for c in st["chunks_sent_per_stream"]]
        self.received = [c * self.recv_chunk for c in st["chunks_received_per_stream"]]

    def socket_of(self, index: int):
        sockets = self.link.stream_sockets()
        return sockets[index] if index < len(sockets) else None


class LinkChannel:
    """One stream of a wanlink Link, seen in one direction."""

    def __init__(self, counters: LinkCounters, index: int, sid: int, sender: bool):
        self.counters, self.index, self.sid, self.sender = counters, index, sid, sender
        sock = counters.socket_of(index)
        self._sock = sock
        self.id = sock.fileno() if sock is not None and sock.fileno() >= 0 else index + 1

    @property
    def bytes(self) -> int:
        return (self.counters.sent if self.sender else self.counters.received)[self.index]

    def tcp_info(self):
        return tcp_info(self._sock) if self.sender and self._sock is not None and self._sock.fileno() >= 0 else None


async def link_sender(link, progress: Progress, message: memoryview, estimator: DeliveryRateEstimator,
                      depth: int) -> None:
    """Keep ``depth`` messages queued on PROBE_DISCARD_TAG until stopped or the budget is spent."""
    from wanlink.proto.reassembly import PROBE_DISCARD_TAG

    loop = asyncio.get_running_loop()

    async def one():
        while (n := progress.take(len(message))) > 0:
            await link.send(message[:n], tag=PROBE_DISCARD_TAG)
            estimator.on_delivery(n, loop.time())

    await asyncio.gather(*(one() for _ in range(depth)))
    if progress.budget:
        progress.done.set()


# ----------------------------------------------------------------------------- measurement
class Meter:
    """Samples every channel each interval: prints iperf3's table and keeps the JSON intervals."""

    def __init__(self, channels: list, out: Output, *, interval: float, refresh=None, roles=None,
                 retr: bool = True):
        self.channels, self.out, self.interval = channels, out, interval
        self.refresh = refresh or (lambda: None)
        self.roles = roles
        self.retr = retr and any(c.sender for c in channels) and hasattr(socket, "TCP_INFO")
        self.intervals: list[dict] = []
        self.t0 = self.t_end = 0.0
        self._prev_t = 0.0
        self._prev_bytes: list[int] = []
        self._prev_retr: list[int] = []
        self._task: asyncio.Task | None = None
        self._header_done = False
        self.final_info: list[dict | None] = []

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self.refresh()
        self.t0 = self._prev_t = loop.time()
        self._prev_bytes = [c.bytes for c in self.channels]
        self._prev_retr = [(c.tcp_info() or {}).get("retransmits", 0) for c in self.channels]
        self._initial_retr = list(self._prev_retr)
        if self.interval > 0:
            self._task = loop.create_task(self._ticks())

    async def _ticks(self) -> None:
        loop = asyncio.get_running_loop()
        k = 1
        while True:
            await asyncio.sleep(max(0.0, self.t0 + k * self.interval - loop.time()))
            self.sample()
            k += 1

    def sample(self, *, final: bool = False) -> None:
        loop = asyncio.get_running_loop()
        self.refresh()
        now = loop.time()
        if final and now - self._prev_t < 1e-3:
            return
        samples = []
        for i, c in enumerate(self.channels):
            info = c.tcp_info()
            retr = None
            if info is not None:
                retr = info["retransmits"] - self._prev_retr[i]
                self._prev_retr[i] = info["retransmits"]
            b = c.bytes
            samples.append(StreamSample(
                id=c.id, start=self._prev_t - self.t0, end=now - self.t0, bytes=b - self._prev_bytes[i],
                sender=c.sender, retransmits=retr, snd_cwnd=info and info["snd_cwnd"],
                rtt_us=info and info["rtt"], rttvar_us=info and info["rttvar"], pmtu=info and info["pmtu"]))
            self._prev_bytes[i] = b
        self._prev_t = now
        self.intervals.append(interval_json(samples, bidir=bool(self.roles)))
        if not self._header_done:
            self.out.line(header(retr=self.retr, cwnd=self.retr, bidir=bool(self.roles)))
            self._header_done = True
        for line in interval_lines(samples, retr=self.retr, roles=self.roles):
            self.out.line(line)
        if len(self.channels) > 1 or self.roles:
            self.out.line(SEPARATOR)

    def freeze_tcp_info(self) -> None:
        """Read TCP_INFO now, for the totals (call before closing the sockets)."""
        self.final_info = [c.tcp_info() for c in self.channels]

    def stop(self) -> float:
        """Stop sampling (printing the last partial interval); return the measured duration."""
        if self._task is not None:
            self._task.cancel()
            self._task = None
        if self.interval > 0:
            self.sample(final=True)
        else:
            self.refresh()
        self.t_end = asyncio.get_running_loop().time()
        if not self.final_info:
            self.freeze_tcp_info()
        return self.t_end - self.t0

    def totals(self) -> list[StreamSample]:
        """Whole-test sample per channel (bytes as counted now; retransmits since start)."""
        self.refresh()
        out = []
        for i, c in enumerate(self.channels):
            info = self.final_info[i] if i < len(self.final_info) else None
            retr = None
            if info is not None:
                retr = info["retransmits"] - self._initial_retr[i]
            out.append(StreamSample(id=c.id, start=0.0, end=self.t_end - self.t0, bytes=c.bytes, sender=c.sender,
                                    retransmits=retr))
        return out


class CpuClock:
    """Process CPU utilisation over a test, as iperf3 reports it (percent of one wall-clock second)."""

    def __init__(self):
        self.t, self.cpu = time.monotonic(), os.times()

    def percent(self) -> tuple[float, float, float]:
        wall = max(time.monotonic() - self.t, 1e-9)
        now = os.times()
        user, system = now.user - self.cpu.user, now.system - self.cpu.system
        return 100.0 * (user + system) / wall, 100.0 * user / wall, 100.0 * system / wall


def local_results(channels: list, totals: list[StreamSample], *, cpu: tuple, congestion: str | None,
                  extra: dict) -> TestResults:
    """This side's results message (ids as iperf3 numbers streams; bytes and retransmits measured here)."""
    streams = []
    for c, t in zip(channels, totals):
        retr = t.retransmits if c.sender and t.retransmits is not None else -1
        streams.append(StreamResult(id=c.sid, bytes=c.bytes, retransmits=retr, start_time=0.0, end_time=t.end))
    has_retr = 1 if any(c.sender for c in channels) and hasattr(socket, "TCP_INFO") else -1
    return TestResults(streams=streams, cpu_util_total=cpu[0], cpu_util_user=cpu[1], cpu_util_system=cpu[2],
                       sender_has_retransmits=has_retr, congestion_used=congestion, extra=extra)


def pair_totals(local: list[StreamSample], channels: list, peer: TestResults) -> tuple[list, list]:
    """Join local whole-test samples with the peer's results by stream id: (forward, reverse) lists."""
    by_id = {s.id: s for s in peer.streams}
    forward, reverse = [], []
    for sample, c in zip(local, channels):
        theirs = by_id.get(c.sid)
        peer_bytes = theirs.bytes if theirs else 0
        peer_secs = (theirs.end_time - theirs.start_time) if theirs else sample.end
        other = StreamSample(id=c.id, start=0.0, end=peer_secs, bytes=peer_bytes, sender=not c.sender,
                             retransmits=(theirs.retransmits if theirs and theirs.retransmits >= 0 else None))
        if c.sender:
            forward.append(StreamTotals(sent=sample, received=other, local_sender=True))
        else:
            other.sender = True
            sample = StreamSample(**{**sample.__dict__, "sender": False})
            reverse.append(StreamTotals(sent=other, received=sample, local_sender=False))
    return forward, reverse


# ----------------------------------------------------------------------------- JSON document
def start_json(*, control: socket.socket, cookie: bytes, params: TestParameters, host: str, port: int,
               connected: list[dict], window: int | None) -> dict:
    try:
        mss = control.getsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG)
        sndbuf = control.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
        rcvbuf = control.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)
    except OSError:
        mss = sndbuf = rcvbuf = 0
    now = time.time()
    return {
        "connected": connected, "version": VERSION, "system_info": " ".join(platform.uname()),
        "timestamp": {"time": email.utils.formatdate(now, usegmt=True), "timesecs": int(now)},
        "connecting_to": {"host": host, "port": port}, "cookie": cookie.rstrip(b"\0").decode(),
        "tcp_mss_default": mss, "target_bitrate": 0, "sock_bufsize": window or 0,
        "sndbuf_actual": sndbuf, "rcvbuf_actual": rcvbuf,
        "test_start": {"protocol": "TCP", "num_streams": params.parallel, "blksize": params.len,
                       "omit": params.omit, "duration": params.time, "bytes": params.num,
                       "blocks": params.blockcount, "reverse": int(params.reverse), "tos": 0,
                       "target_bitrate": 0, "bidir": int(params.bidirectional)},
    }


def connected_json(sock: socket.socket) -> dict:
    try:
        local, remote = sock.getsockname(), sock.getpeername()
    except OSError:
        local = remote = ("?", 0)
    return {"socket": sock.fileno(), "local_host": local[0], "local_port": local[1],
            "remote_host": remote[0], "remote_port": remote[1]}


def connected_line(entry: dict) -> str:
    return (f"[{entry['socket']:3d}] local {entry['local_host']} port {entry['local_port']} connected to "
            f"{entry['remote_host']} port {entry['remote_port']}")


@dataclass
class WanlinkInfo:
    """What the ``wanlink`` section of ``-J`` reports."""

    mode: str = "iperf3"  # "wanlink" when the data went over a wanlink Link
    streams: int = 0
    streams_auto: bool = False
    rtt_s: float | None = None
    chunk_size: int | None = None
    probe: dict | None = None
    congestion: str | None = None
    sock_buffer: int | None = None
    authenticated: bool | None = None
    estimate_bps: float | None = None
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        return {"mode": self.mode, "streams": self.streams, "streams_auto": self.streams_auto,
                "rtt_ms": None if self.rtt_s is None else self.rtt_s * 1e3, "chunk_size": self.chunk_size,
                "estimate_bits_per_second": self.estimate_bps, "congestion": self.congestion,
                "sock_buffer": self.sock_buffer, "authenticated": self.authenticated, "probe": self.probe,
                "notes": self.notes}

    def line(self) -> str:
        parts = [f"{self.streams} stream{'s' if self.streams != 1 else ''}"
                 + (" (probed)" if self.streams_auto else "")]
        if self.rtt_s is not None:
            parts.append(f"RTT {self.rtt_s * 1e3:.2f} ms")
        if self.chunk_size:
            parts.append(f"chunk {self.chunk_size // 1024} KiB")
        if self.estimate_bps:
            from wanlink.probe.report import format_bits
            parts.append(f"estimate {format_bits(self.estimate_bps)}")
        return f"wanlink: {', '.join(parts)}"


# ----------------------------------------------------------------------------- client
class Client:
    def __init__(self, opts: Options, out: Output, stop: asyncio.Event):
        self.opts, self.out, self.stop = opts, out, stop
        self.ctrl: Control | None = None
        self.link = None
        self.raw: list[RawChannel] = []
        self.tasks: list[asyncio.Task] = []
        self.doc: dict = {"start": {}, "intervals": [], "end": {}}
        self.wl = WanlinkInfo()
        self.estimator = DeliveryRateEstimator()

    async def run(self) -> int:
        try:
            return await self._run()
        finally:
            await self._cleanup()

    async def _cleanup(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        for c in self.raw:
            c.sock.close()
        if self.link is not None:
            await self.link.close()
        if self.ctrl is not None:
            self.ctrl.close()

    async def _expect(self, *states: State):
        """The next control event, which must be one of ``states`` (or a Results/WanlinkAccept)."""
        stop_task = asyncio.ensure_future(self.stop.wait())
        try:
            done, _ = await asyncio.wait({self.ctrl.next_task(), stop_task}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop_task.cancel()
        if self.ctrl.next_task() not in done:
            await self._terminate()
            raise CliError("interrupt - the client has terminated")
        event = await self.ctrl.next()
        return self._check(event, states)

    def _check(self, event, states):
        if isinstance(event, ServerError):
            reason = proto.IPERF_ERRORS.get(event.i_errno, f"iperf3 error {event.i_errno}")
            extra = f" ({os.strerror(event.errno)})" if event.errno else ""
            raise CliError(f"the server reported an error: {reason}{extra}")
        if isinstance(event, ConnectionClosed):
            raise CliError("the server has unexpectedly closed the connection")
        if isinstance(event, StateChange):
            if event.state is State.ACCESS_DENIED:
                raise CliError("the server is busy running a test. try again later")
            if event.state is State.SERVER_TERMINATE:
                raise CliError("the server has terminated")
            if event.state not in states:
                raise CliError(f"unexpected iperf3 state {event.state.name} from the server")
        return event

    async def _terminate(self) -> None:
        try:
            await self.ctrl.send(StateChange(State.CLIENT_TERMINATE))
        except (OSError, WanlinkError):
            pass

    async def _run(self) -> int:
        o, out = self.opts, self.out
        check_congestion(o.congestion)
        out.line(f"Connecting to host {o.host}, port {o.port}")
        sock = await open_tcp(o.host, o.port, timeout=o.connect_timeout, bind=o.bind)
        self.ctrl = Control(sock, Role.CLIENT)
        cookie = proto.make_cookie()
        await self.ctrl.send(Cookie(cookie))
        await self._expect(State.PARAM_EXCHANGE)
        auto = o.parallel is None
        params = TestParameters(time=int(round(o.time)) if o.time else 0, num=o.bytes,
                                blockcount=o.blockcount, parallel=o.parallel or 1, len=o.length,
                                reverse=o.reverse, bidirectional=o.bidir, window=o.window or 0,
                                congestion=o.congestion, client_version=VERSION,
                                wanlink={"version": 1, "auto": auto} if o.wanlink else None)
        if o.time and abs(o.time - round(o.time)) > 1e-9:
            params.time = max(1, int(o.time + 0.999))  # iperf3 sends whole seconds; the client times itself
        await self.ctrl.send(Parameters(params.to_json()))
        event = await self._expect(State.CREATE_STREAMS, State.WANLINK_ACCEPT)
        wanlink_mode = isinstance(event, StateChange) and event.state is State.WANLINK_ACCEPT
        server_info: dict = {}
        if wanlink_mode:
            server_info = (await self.ctrl.next())
            if not isinstance(server_info, WanlinkAccept):
                self._check(server_info, ())
            server_info = server_info.info
            await self._expect(State.CREATE_STREAMS)
            channels, refresh = await self._open_link(cookie, auto, server_info)
        else:
            if auto:
                why = "the server is a stock iperf3" if o.wanlink else "--no-wanlink"
                self.wl.notes.append(f"{why}: no probing, 1 stream (iperf3's default)")
            channels, refresh = await self._open_raw(cookie, params.parallel)
        connected = [connected_json(c.sock) for c in self.raw] if self.raw else []
        for entry in connected:
            out.line(connected_line(entry))
        if wanlink_mode:
            out.line(self.wl.line())
        if o.reverse:
            out.line(f"Reverse mode, remote host {o.host} is sending")
        self.doc["start"] = start_json(control=sock, cookie=cookie, params=params, host=o.host, port=o.port,
                                       connected=connected, window=o.window)
        self.doc["start"]["test_start"]["num_streams"] = self.wl.streams
        await self._expect(State.TEST_START)
        await self._expect(State.TEST_RUNNING)
        return await self._test(channels, refresh, wanlink_mode, params)

    async def _open_raw(self, cookie: bytes, count: int):
        o = self.opts
        directions = [True, False] if o.bidir else [not o.reverse]
        channels = []
        for sender in directions:
            for sid in iperf_ids(count, first=len(channels)):
                sock = await open_tcp(o.host, o.port, timeout=o.connect_timeout, window=o.window,
                                      congestion=o.congestion, bind=o.bind)
                channels.append(RawChannel(sock, sid, sender))
                self.raw.append(channels[-1])
                await asyncio.get_running_loop().sock_sendall(sock, cookie)
        self.wl.streams = count
        self.wl.congestion = congestion_of(channels[0].sock)
        self.wl.sock_buffer = o.window
        return channels, None

    async def _open_link(self, cookie: bytes, auto: bool, server_info: dict):
        import wanlink

        o = self.opts
        secret = read_secret(self.out)
        self.wl.mode, self.wl.authenticated, self.wl.sock_buffer = "wanlink", bool(secret), o.window
        if o.window:
            self.wl.notes.append("-w sets this side's buffers; the server's own -w sets its side of a wanlink link")
        meta = {COOKIE_META_KEY: cookie.rstrip(b"\0").decode()}
        chunk = None
        count = o.parallel
        try:
            if auto:
                configured = from_env().streams
                if isinstance(configured, int):
                    count = configured
                else:
                    self.out.line(f"Probing {o.host} port {o.port}: streams 1, 2, 4, ... up to {o.max_streams}")
                    result = await choose_streams(o.host, o.port, secret=secret, meta=meta,
                                                  max_streams=o.max_streams, congestion=o.congestion,
                                                  sock_buffer=o.window, timeout=o.connect_timeout + 20)
                    count, chunk = result.streams, result.chunk_size
                    self.wl.probe, self.wl.rtt_s, self.wl.streams_auto = result.to_json(), result.rtt_s, True
            from wanlink.sched.chunking import chunk_size_from
            chunk = chunk_size_from(from_env().chunk_size if chunk is None else chunk)
            meta["chunk_size"] = chunk
            self.link = await wanlink.connect(o.host, o.port, streams=count, secret=secret, meta=meta,
                                              timeout=o.connect_timeout + 20, chunk_size=chunk,
                                              congestion=o.congestion, sock_buffer=o.window)
        except AuthenticationError as exc:
            await self._terminate()
            raise CliError(f"authentication failed - {exc}; WANLINK_SECRET must be the same on both sides") from None
        except (PeerLost, DeadlineExceeded, ProtocolError) as exc:
            await self._terminate()
            raise CliError(f"cannot open a wanlink link to {o.host} port {o.port}: {exc}") from None
        link = self.link
        if self.wl.rtt_s is None:  # not probed: the kernel's smoothed RTT of the control connection
            info = tcp_info(self.ctrl.sock)
            self.wl.rtt_s = info["rtt"] / 1e6 if info else None
        self.wl.streams, self.wl.chunk_size = link.streams, link.chunk_size
        self.wl.congestion = next((c for c in link.stats()["congestion"] if c), None)
        counters = LinkCounters(link, send_chunk=link.chunk_size,
                                recv_chunk=int(server_info.get("chunk_size") or link.chunk_size))
        directions = [True, False] if o.bidir else [not o.reverse]
        channels = []
        for sender in directions:
            ids = iperf_ids(link.streams, first=len(channels))
            channels += [LinkChannel(counters, i, ids[i], sender) for i in range(link.streams)]
        return channels, counters.refresh

    async def _test(self, channels, refresh, wanlink_mode: bool, params: TestParameters) -> int:
        o, out, loop = self.opts, self.out, asyncio.get_running_loop()
        budget = o.bytes or o.blockcount * o.length
        progress = Progress(budget)
        roles = {True: "[TX-C]", False: "[RX-C]"} if o.bidir else None
        meter = Meter(channels, out, interval=o.interval, refresh=refresh, roles=roles)
        cpu = CpuClock()
        meter.start()
        rx_total = [0]
        if wanlink_mode:
            link = self.link
            if any(c.sender for c in channels):
                message = memoryview(bytes(link.chunk_size * link.streams))
                depth = max(4, -(-inflight_bytes_for(self.link.streams) // len(message)))
                self.tasks.append(loop.create_task(link_sender(link, progress, message, self.estimator, depth)))
            if any(not c.sender for c in channels):
                self.tasks.append(loop.create_task(self._watch_link_rx(channels, progress, refresh)))
        else:
            block = memoryview(bytes(o.length))
            for c in channels:
                self.tasks.append(loop.create_task(c.pump(progress, block, rx_total)))
            self.tasks.append(loop.create_task(self._watch_raw(channels)))
        waiters = {asyncio.ensure_future(progress.done.wait()), asyncio.ensure_future(self.stop.wait()),
                   self.ctrl.next_task()}
        for task in self.tasks:
            waiters.add(task)
        try:
            done, _ = await asyncio.wait(waiters, timeout=o.time if o.time else None,
                                         return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waiters:
                if w is not self.ctrl.next_task() and w not in self.tasks:
                    w.cancel()
        for task in self.tasks:
            if task in done and task.exception() is not None:
                raise CliError(f"data transfer failed: {task.exception()}")
        if self.stop.is_set():
            await self._terminate()
            raise CliError("interrupt - the client has terminated")
        if self.ctrl.next_task() in done:
            self._check(await self.ctrl.next(), ())
        # stop sending; keep receiving (draining) until the server answers
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        self.tasks.clear()
        if wanlink_mode:  # freeze the counters: queued chunks would otherwise keep flowing
            meter.freeze_tcp_info()
            await self.link.close()
        drain = [loop.create_task(c.pump(Progress(0), memoryview(b""), [0]))
                 for c in channels if isinstance(c, RawChannel) and not c.sender]
        self.tasks += drain
        meter.stop()
        await self.ctrl.send(StateChange(State.TEST_END))
        await self._expect(State.EXCHANGE_RESULTS)
        extra = {"wanlink": self._finish_wanlink()} if wanlink_mode else {}
        mine = local_results(channels, meter.totals(), cpu=cpu.percent(), congestion=self.wl.congestion,
                             extra=extra)
        await self.ctrl.send(Results(mine.to_json()))
        theirs = await self.ctrl.next()
        if not isinstance(theirs, Results):
            self._check(theirs, ())
            raise CliError("the server sent no results")
        peer = TestResults.from_json(theirs.results)
        await self._expect(State.DISPLAY_RESULTS)
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        self.tasks.clear()
        for c in self.raw:
            c.sock.close()
        self.raw = []
        if self.link is not None:
            await self.link.close()
            self.link = None
        try:
            await self.ctrl.send(StateChange(State.IPERF_DONE))
        except OSError:
            pass
        self._report(meter, channels, peer, mine, wanlink_mode)
        return 0

    def _finish_wanlink(self) -> dict:
        est = self.estimator.estimate()
        self.wl.estimate_bps = None if est is None else est * 8.0
        return self.wl.to_json()

    async def _watch_link_rx(self, channels, progress: Progress, refresh) -> None:
        """Receiver side of a wanlink test: poll the link's counters (for -n and the estimate)."""
        loop = asyncio.get_running_loop()
        receivers = [c for c in channels if not c.sender]
        last = 0
        while True:
            await asyncio.sleep(0.1)
            refresh()
            total = sum(c.bytes for c in receivers)
            self.estimator.on_delivery(total - last, loop.time())
            last = total
            progress.check_received(total)

    async def _watch_raw(self, channels) -> None:
        """Feed the estimator from plain streams (received bytes when receiving, else bytes sent)."""
        loop = asyncio.get_running_loop()
        chosen = [c for c in channels if not c.sender] or channels
        last = 0
        while True:
            await asyncio.sleep(0.1)
            total = sum(c.bytes for c in chosen)
            self.estimator.on_delivery(total - last, loop.time())
            last = total

    def _report(self, meter: Meter, channels, peer: TestResults, mine: TestResults, wanlink_mode: bool) -> None:
        o, out = self.opts, self.out
        local = meter.totals()
        forward, reverse = pair_totals(local, channels, peer)
        if not wanlink_mode:
            est = self.estimator.estimate()
            self.wl.estimate_bps = None if est is None else est * 8.0
        cpu_j = {"host_total": mine.cpu_util_total, "host_user": mine.cpu_util_user,
                 "host_system": mine.cpu_util_system, "remote_total": peer.cpu_util_total,
                 "remote_user": peer.cpu_util_user, "remote_system": peer.cpu_util_system}
        local_cc, remote_cc = self.wl.congestion, peer.congestion_used
        if o.bidir:
            end = end_json(forward, local_sender_reverse=reverse, cpu=cpu_j, sender_congestion=local_cc,
                           receiver_congestion=remote_cc)
        elif o.reverse:
            end = end_json(reverse, cpu=cpu_j, sender_congestion=remote_cc, receiver_congestion=local_cc)
        else:
            end = end_json(forward, cpu=cpu_j, sender_congestion=local_cc, receiver_congestion=remote_cc)
        self.doc["intervals"] = meter.intervals
        self.doc["end"] = end
        self.doc["wanlink"] = self.wl.to_json()
        if o.json:
            out.document(self.doc)
            return
        retr = hasattr(socket, "TCP_INFO")
        out.line(header(retr=retr, cwnd=False, bidir=o.bidir))
        if o.bidir:
            for line in summary_lines(forward, retr=retr, role="[TX-C]"):
                out.line(line)
            for line in summary_lines(reverse, retr=retr, role="[RX-C]"):
                out.line(line)
        else:
            for line in summary_lines(reverse if o.reverse else forward, retr=retr):
                out.line(line)
        out.line(self.wl.line() if wanlink_mode else
                 f"wanlink: plain iperf3 streams ({self.wl.streams}); " + "; ".join(self.wl.notes or ["no probing"]))
        out.line()
        out.line("iperf Done.")


# ----------------------------------------------------------------------------- server
class Session:
    """One test on the server: a control connection and its data streams or Link."""

    def __init__(self, server: "IperfServer", ctrl_sock: socket.socket, cookie_bytes: bytes, peer: str):
        self.server, self.out, self.opts = server, server.out, server.opts
        self.ctrl = Control(ctrl_sock, Role.SERVER)
        self.ctrl.conn.receive_data(cookie_bytes)
        self.peer = peer
        self.cookie = proto.check_cookie(cookie_bytes)
        self.params: TestParameters | None = None
        self.wanlink = False
        self.expected = 0
        self.raw_pending: list[tuple[int, socket.socket]] = []
        self.link = None
        self.streams_ready = asyncio.Event()
        self.accepting = False
        self.tasks: list[asyncio.Task] = []
        self.estimator = DeliveryRateEstimator()
        self.finishing = False  # results sent: the server may take the next client

    def wants_stream(self, cookie: bytes) -> bool:
        return (self.accepting and not self.wanlink and cookie == self.cookie
                and len(self.raw_pending) < self.expected)

    def add_stream(self, seq: int, sock: socket.socket) -> None:
        if self.params.window:
            set_window(sock, self.params.window)
        if self.params.congestion:
            try:
                set_congestion(sock, self.params.congestion)
            except ConfigError as exc:
                self.out.warn(str(exc))
        self.raw_pending.append((seq, sock))
        if len(self.raw_pending) == self.expected:
            self.streams_ready.set()

    def wants_link(self, link) -> bool:
        meta = link.peer_meta or {}
        return (self.accepting and self.wanlink and self.link is None
                and meta.get(COOKIE_META_KEY) == self.cookie.rstrip(b"\0").decode())

    def add_link(self, link) -> None:
        self.link = link
        self.streams_ready.set()

    async def run(self) -> None:
        out = self.out
        host, _, port = self.peer.rpartition(":")
        out.line(f"Accepted connection from {host}, port {port}")
        try:
            await self._run()
        except CliError as exc:
            out.error(str(exc))
        except (WanlinkError, OSError) as exc:
            out.error(f"test from {self.peer} failed: {exc}")
        finally:
            await self._cleanup()

    async def _cleanup(self) -> None:
        self.accepting = False
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        for _seq, sock in self.raw_pending:
            sock.close()
        if self.link is not None:
            await self.link.close()
        self.ctrl.close()

    async def _next(self):
        event = await self.ctrl.next()
        if isinstance(event, ConnectionClosed):
            raise CliError("the client has unexpectedly closed the connection")
        if isinstance(event, StateChange) and event.state in (State.CLIENT_TERMINATE, State.IPERF_DONE):
            raise CliError("the client has terminated")
        return event

    async def _refuse(self, i_errno: int, message: str) -> None:
        try:
            await self.ctrl.send(ServerError(i_errno, 0))
        except OSError:
            pass
        raise CliError(message)

    async def _run(self) -> None:
        o, out, loop = self.opts, self.out, asyncio.get_running_loop()
        self.ctrl.conn.next_event()  # the cookie, already checked
        await self.ctrl.send(StateChange(State.PARAM_EXCHANGE))
        event = await self._next()
        if not isinstance(event, Parameters):
            raise CliError("the client sent no parameters")
        try:
            params = TestParameters.from_json(event.params)
        except UnsupportedError as exc:
            await self._refuse(proto.IE_PROTOCOL, str(exc))
        except ProtocolError as exc:
            await self._refuse(proto.IE_RECVPARAMS, f"bad parameters from {self.peer}: {exc}")
        self.params = params
        self.wanlink = params.wanlink is not None and self.server.wanlink is not None
        if self.wanlink:
            await self.ctrl.send(WanlinkAccept({"version": 1, "chunk_size": self.server.chunk_size}))
        directions = 2 if params.bidirectional else 1
        self.expected = params.parallel * directions
        self.accepting = True
        await self.ctrl.send(StateChange(State.CREATE_STREAMS))
        wait = asyncio.ensure_future(self.streams_ready.wait())
        control = self.ctrl.next_task()
        done, _ = await asyncio.wait({wait, control}, timeout=LINK_WAIT_S if self.wanlink else STREAM_WAIT_S,
                                     return_when=asyncio.FIRST_COMPLETED)
        wait.cancel()
        if control in done:
            await self._next()
            raise CliError("the client stopped before its streams arrived")
        if not done:
            await self._refuse(proto.IE_STREAMACCEPT, f"the streams of {self.peer} did not arrive in time")
        self.accepting = False
        client_sends = not params.reverse
        if self.wanlink:
            link = self.link
            meta = link.peer_meta or {}
            counters = LinkCounters(link, send_chunk=link.chunk_size,
                                    recv_chunk=int(meta.get("chunk_size") or link.chunk_size))
            channels = []
            firsts = [client_sends] if not params.bidirectional else [True, False]
            for client_dir in firsts:
                ids = iperf_ids(link.streams, first=len(channels))
                channels += [LinkChannel(counters, i, ids[i], sender=not client_dir) for i in range(link.streams)]
            refresh = counters.refresh
            out.line(f"wanlink: link of {link.streams} streams from {link.peer}")
        else:
            socks = [s for _seq, s in sorted(self.raw_pending, key=lambda p: p[0])]
            self.raw_pending = [(0, s) for s in socks]
            channels = []
            # iperf3's server takes the client-to-server streams first, then the others
            firsts = [True, False] if params.bidirectional else [client_sends]
            k = 0
            for client_dir in firsts:
                ids = iperf_ids(params.parallel, first=k)
                for sid in ids:
                    channels.append(RawChannel(socks[k], sid, sender=not client_dir))
                    k += 1
            for c in channels:
                out.line(connected_line(connected_json(c.sock)))
            refresh = None
        if self.wanlink:
            cc = next((c for c in self.link.stats()["congestion"] if c), None)
        else:
            cc = congestion_of(channels[0].sock) if channels else None
        await self.ctrl.send(StateChange(State.TEST_START))
        await self.ctrl.send(StateChange(State.TEST_RUNNING))
        roles = {True: "[TX-S]", False: "[RX-S]"} if params.bidirectional else None
        meter = Meter(channels, out, interval=o.interval, refresh=refresh, roles=roles)
        cpu = CpuClock()
        meter.start()
        progress = Progress(0)
        if self.wanlink:
            if any(c.sender for c in channels):
                message = memoryview(bytes(self.link.chunk_size * self.link.streams))
                depth = max(4, -(-inflight_bytes_for(self.link.streams) // len(message)))
                self.tasks.append(loop.create_task(
                    link_sender(self.link, progress, message, self.estimator, depth)))
        else:
            block = memoryview(bytes(params.len))
            rx = [0]
            for c in channels:
                self.tasks.append(loop.create_task(c.pump(progress, block, rx)))
        guard = (params.time + params.omit + 40) if params.time else None
        control = self.ctrl.next_task()
        done, _ = await asyncio.wait({control}, timeout=guard)
        if not done:
            raise CliError(f"the test from {self.peer} ran past its duration; giving up")
        event = await self._next()
        if not (isinstance(event, StateChange) and event.state is State.TEST_END):
            raise CliError(f"unexpected message from the client: {event!r}")
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        self.tasks.clear()
        if self.wanlink:  # freeze the counters (and stop queued chunks) before reporting
            meter.freeze_tcp_info()
            await self.link.close()
        meter.stop()
        for _seq, sock in self.raw_pending:
            sock.close()
        self.raw_pending = []
        await self.ctrl.send(StateChange(State.EXCHANGE_RESULTS))
        theirs = await self._next()
        if not isinstance(theirs, Results):
            raise CliError("the client sent no results")
        peer = TestResults.from_json(theirs.results)
        extra = {}
        if self.wanlink:
            est = self.estimator.estimate()
            extra = {"wanlink": {"mode": "wanlink", "streams": self.link.streams, "chunk_size": self.link.chunk_size,
                                 "estimate_bits_per_second": None if est is None else est * 8.0}}
        mine = local_results(channels, meter.totals(), cpu=cpu.percent(), congestion=cc, extra=extra)
        await self.ctrl.send(Results(mine.to_json()))
        await self.ctrl.send(StateChange(State.DISPLAY_RESULTS))
        self.finishing = True
        try:
            await asyncio.wait_for(self.ctrl.next(), 10.0)  # IPERF_DONE (or the client closing)
        except (asyncio.TimeoutError, ProtocolError, OSError):
            pass
        self._report(meter, channels, peer, mine, params)

    def _report(self, meter: Meter, channels, peer: TestResults, mine: TestResults, params) -> None:
        out = self.out
        local = meter.totals()
        forward, reverse = pair_totals(local, channels, peer)
        if self.opts.json:
            cpu_j = {"host_total": mine.cpu_util_total, "host_user": mine.cpu_util_user,
                     "host_system": mine.cpu_util_system, "remote_total": peer.cpu_util_total,
                     "remote_user": peer.cpu_util_user, "remote_system": peer.cpu_util_system}
            items = forward if params.reverse else reverse
            end = end_json(items, local_sender_reverse=(forward if params.bidirectional else None), cpu=cpu_j,
                           sender_congestion=None, receiver_congestion=mine.congestion_used)
            out.document({"start": {"cookie": self.cookie.rstrip(b"\0").decode(), "accepted_connection":
                                    {"host": self.peer.rpartition(":")[0],
                                     "port": int(self.peer.rpartition(":")[2] or 0)}},
                          "intervals": meter.intervals, "end": end,
                          "wanlink": mine.extra.get("wanlink", {"mode": "iperf3"})})
            return
        retr = hasattr(socket, "TCP_INFO")
        out.line(header(retr=retr and any(c.sender for c in channels), cwnd=False, bidir=params.bidirectional))
        for sender in (True, False):
            group = [s for s in local if s.sender == sender]
            if not group:
                continue
            role = ("[TX-S]" if sender else "[RX-S]") if params.bidirectional else ""
            suffix = "sender" if sender else "receiver"
            for s in group:
                out.line(stream_line(s, role=role, retr=retr, suffix=suffix))
            if len(group) > 1 or role:
                out.line(sum_line(sum_samples(group, sender), role=role, retr=retr and sender, suffix=suffix))


class IperfServer:
    """``-s``: owns the listening socket and dispatches each connection by its first bytes."""

    def __init__(self, opts: Options, out: Output, stop: asyncio.Event, on_listening=None):
        self.opts, self.out, self.stop = opts, out, stop
        self.on_listening = on_listening
        self.session: Session | None = None
        self.session_task: asyncio.Task | None = None
        self.handlers: set[asyncio.Task] = set()
        self.wanlink = None
        self.chunk_size = None
        self.listener: socket.socket | None = None
        self._seq = 0
        self._changed = asyncio.Event()  # a session started: the accept loop must watch it

    def _listen(self) -> socket.socket:
        o = self.opts
        host = o.bind or ""
        try:
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            listener = socket.create_server((host, o.port), family=family, backlog=128)
        except OSError as exc:
            reason = os.strerror(exc.errno) if exc.errno else str(exc)
            raise CliError(f"unable to start listener for connections on port {o.port}: {reason}") from None
        listener.setblocking(False)
        return listener

    def _wanlink_server(self, listener: socket.socket):
        from wanlink.io.link import DEFAULT_TIMEOUT
        from wanlink.io.server import Server
        from wanlink.proto.limits import DEFAULT_LIMITS
        from wanlink.sched.chunking import chunk_size_from

        secret = read_secret(self.out)
        self.chunk_size = chunk_size_from(from_env().chunk_size)
        options = {"chunk_size": self.chunk_size, "congestion": self.opts.congestion,
                   "sock_buffer": self.opts.window, "compress": False, "checksum": False}
        # wanlink.serve() always listens itself; the iperf server needs handshakes on its own socket,
        # so it builds the Server around its listener and never starts its accept loop.
        return Server(listener, secret=secret, on_link=self._on_link, limits=DEFAULT_LIMITS,
                      timeout=DEFAULT_TIMEOUT, link_options=options)

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        try:
            check_congestion(self.opts.congestion)
        except ConfigError as exc:
            raise CliError(str(exc)) from None
        self.listener = self._listen()
        port = self.listener.getsockname()[1]
        self.wanlink = self._wanlink_server(self.listener)
        self.out.line("-----------------------------------------------------------")
        self.out.line(f"Server listening on {port} (wanlink-iperf)")
        self.out.line("-----------------------------------------------------------")
        if self.on_listening is not None:
            self.on_listening(port)
        accept = None
        stop_wait = asyncio.ensure_future(self.stop.wait())
        try:
            while True:
                if accept is None:
                    accept = asyncio.ensure_future(loop.sock_accept(self.listener))
                changed = asyncio.ensure_future(self._changed.wait())
                waiters = {accept, stop_wait, changed}
                if self.session_task is not None:
                    waiters.add(self.session_task)
                done, _ = await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
                changed.cancel()
                self._changed.clear()
                if stop_wait in done:
                    if self.session is not None:
                        try:
                            await self.session.ctrl.send(StateChange(State.SERVER_TERMINATE))
                        except (OSError, WanlinkError):
                            pass
                    return 0
                if self.session_task is not None and self.session_task.done():
                    self.session_task, self.session = None, None
                    if self.opts.one_off:
                        return 0
                    self.out.line("-----------------------------------------------------------")
                    self.out.line(f"Server listening on {port} (wanlink-iperf)")
                    self.out.line("-----------------------------------------------------------")
                if accept in done:
                    done_accept, accept = accept, None
                    try:
                        sock, _addr = done_accept.result()
                    except OSError as exc:
                        self.out.warn(f"accept failed: {exc}")
                        await asyncio.sleep(0.1)
                        continue
                    self._seq += 1
                    task = loop.create_task(self._dispatch(sock, self._seq))
                    self.handlers.add(task)
                    task.add_done_callback(self.handlers.discard)
        finally:
            stop_wait.cancel()
            if accept is not None:
                accept.cancel()
            await self._shutdown()

    async def _shutdown(self) -> None:
        tasks = list(self.handlers) + ([self.session_task] if self.session_task else [])
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self.wanlink is not None:
            self.wanlink.close()
            await self.wanlink.wait_closed()
        elif self.listener is not None:
            self.listener.close()

    async def _dispatch(self, sock: socket.socket, seq: int) -> None:
        loop = asyncio.get_running_loop()
        sock.setblocking(False)
        try:
            peer = sock.getpeername()
            peer_name = f"{peer[0]}:{peer[1]}"
            async with asyncio.timeout(SNIFF_TIMEOUT_S):
                prefix = await read_exactly(sock, len(proto.WANLINK_MAGIC))
                if proto.is_wanlink_prefix(prefix):
                    handoff = True
                else:
                    handoff = False
                    cookie = prefix + await read_exactly(sock, proto.COOKIE_SIZE - len(prefix))
        except (TimeoutError, OSError, WanlinkError):
            sock.close()
            return
        if handoff:
            await self.wanlink.accept_socket(sock, prefix)
            return
        session = self.session
        if session is not None and session.wants_stream(cookie):
            session.add_stream(seq, sock)
            return
        if session is None or (session.finishing and not self.opts.one_off):
            try:
                proto.check_cookie(cookie)
            except ProtocolError:
                sock.close()
                return
            if session is not None:  # the previous test is only waiting for IPERF_DONE
                self.handlers.add(self.session_task)
                self.session_task.add_done_callback(self.handlers.discard)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.session = Session(self, sock, cookie, peer_name)
            self.session_task = loop.create_task(self.session.run())
            self._changed.set()
            return
        try:  # busy: as iperf3, answer ACCESS_DENIED without reading further
            await loop.sock_sendall(sock, struct.pack("b", State.ACCESS_DENIED))
        except OSError:
            pass
        sock.close()

    async def _on_link(self, link) -> None:
        session = self.session
        if session is not None and session.wants_link(link):
            session.add_link(link)
            return
        self.out.warn(f"closing a wanlink link from {link.peer} that belongs to no test")
        await link.close()


# ----------------------------------------------------------------------------- entry points
async def run(argv=None, *, stdout=None, stderr=None, on_listening=None, stop: asyncio.Event | None = None) -> int:
    """Run wanlink-iperf inside a running event loop; returns the exit status."""
    opts = parse_args(argv)
    out = Output(opts.json, stdout, stderr)
    undo_logging = _setup_logging(out)
    loop = asyncio.get_running_loop()
    installed = []
    own_signals = stop is None and threading_is_main()  # a caller that passes ``stop`` handles signals
    stop = stop if stop is not None else asyncio.Event()
    if own_signals:
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                loop.add_signal_handler(sig, stop.set)
                installed.append(sig)
            except (NotImplementedError, RuntimeError, ValueError):
                pass
    try:
        if opts.server:
            return await IperfServer(opts, out, stop, on_listening).run()
        client = Client(opts, out, stop)
        try:
            return await client.run()
        except (CliError, ConfigError) as exc:
            return _fail(out, opts, client.doc, str(exc))
        except (ProtocolError, PeerLost) as exc:
            return _fail(out, opts, client.doc, f"protocol error talking to {opts.host}: {exc}")
    except CliError as exc:
        out.error(str(exc))
        return 1
    finally:
        for sig in installed:
            loop.remove_signal_handler(sig)
        undo_logging()


def threading_is_main() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


def _fail(out: Output, opts: Options, doc: dict, message: str) -> int:
    out.error(message)
    if opts.json:
        out.document({**doc, "error": message})
    return 1


def main(argv=None) -> int:
    """Console entry point: ``wanlink-iperf``."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a Linux dependency
        uvloop = None
    try:
        if uvloop is not None:
            return uvloop.run(run(argv))
        return asyncio.run(run(argv))
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
