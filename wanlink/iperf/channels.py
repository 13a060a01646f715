"""The sockets of an iperf3 test: the control connection, plain iperf3 data streams, and a wanlink Link's streams."""
from __future__ import annotations

import asyncio
import os
import socket

from wanlink.io.sockets import TcpInfo, set_buffer_sizes, set_congestion, tcp_info
from wanlink.iperf.output import CliError
from wanlink.iperf.protocol import NEED_DATA, ControlConnection, Role
from wanlink.probe.rate import DeliveryRateEstimator
from wanlink.probe.step import inflight_bytes_for
from wanlink.proto.reassembly import PROBE_DISCARD_TAG

RECV_SCRATCH = 256 * 1024


def check_congestion(name: str | None) -> None:
    """Fail early (before any connection) when ``-C`` names an algorithm the kernel refuses."""
    if name:
        with socket.socket() as probe:
            set_congestion(probe, name)


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
                set_buffer_sizes(sock, window)
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

    def tcp_info(self) -> TcpInfo | None:
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

    def tcp_info(self) -> TcpInfo | None:
        return tcp_info(self._sock) if self.sender and self._sock is not None else None  # None once closed


def link_channels(counters: LinkCounters, streams: int, senders: list[bool]) -> list[LinkChannel]:
    """Every stream of the Link once per direction in ``senders`` (True: this side sends), numbered as iperf3."""
    channels: list[LinkChannel] = []
    for sender in senders:
        ids = iperf_ids(streams, first=len(channels))
        channels += [LinkChannel(counters, i, ids[i], sender) for i in range(streams)]
    return channels


async def link_sender(link, progress: Progress, estimator: DeliveryRateEstimator) -> None:
    """Send on PROBE_DISCARD_TAG until stopped or the budget is spent, in messages of one chunk per stream.

    Enough messages stay queued to keep ``inflight_bytes_for(streams)`` unacknowledged, as the probe does.
    """
    loop = asyncio.get_running_loop()
    message = memoryview(bytes(link.chunk_size * link.streams))
    depth = max(4, -(-inflight_bytes_for(link.streams) // len(message)))

    async def one():
        while (n := progress.take(len(message))) > 0:
            await link.send(message[:n], tag=PROBE_DISCARD_TAG)
            estimator.on_delivery(n, loop.time())

    await asyncio.gather(*(one() for _ in range(depth)))
    if progress.budget:
        progress.done.set()
