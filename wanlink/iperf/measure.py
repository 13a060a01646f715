"""Measuring a test: per-interval samples of every channel, CPU time, this side's results, the ``start`` document."""
from __future__ import annotations

import asyncio
import email.utils
import os
import platform
import socket
import time

from wanlink.io.sockets import TcpInfo
from wanlink.iperf.messages import StreamResult, TestParameters, TestResults
from wanlink.iperf.output import VERSION, Output
from wanlink.iperf.report import (
    SEPARATOR, SenderTcpStats, StreamSample, StreamTotals, header, interval_json, interval_lines,
)


TCP_POLL_S = 0.1


def _retransmits(info: TcpInfo | None) -> int:
    return info.total_retrans if info is not None else 0


class Meter:
    """Samples every channel each interval: prints iperf3's table and keeps the JSON intervals.

    Sending channels' TCP_INFO is also read every ``TCP_POLL_S`` (for the ``end`` summary, and so
    the totals keep the last reading of a socket the peer closed first, as a wanlink receiver does).
    """

    def __init__(self, channels: list, out: Output, *, interval: float, refresh=None, roles=None,
                 retr: bool = True, unit: str = "a"):
        self.channels, self.out, self.interval = channels, out, interval
        self.refresh = refresh or (lambda: None)
        self.roles = roles
        self.unit = unit
        self.retr = retr and any(c.sender for c in channels) and hasattr(socket, "TCP_INFO")
        self.intervals: list[dict] = []
        self.t0 = self.t_end = 0.0
        self._prev_t = 0.0
        self._prev_bytes: list[int] = []
        self._prev_retr: list[int] = []
        self._tasks: list[asyncio.Task] = []
        self._header_done = False
        self.final_info: list[TcpInfo | None] = []
        self._last_info: list[TcpInfo | None] = [None] * len(channels)
        self.sender_tcp = [SenderTcpStats() for _ in channels]

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self.refresh()
        self.t0 = self._prev_t = loop.time()
        self._prev_bytes = [c.bytes for c in self.channels]
        self._prev_retr = [_retransmits(c.tcp_info()) for c in self.channels]
        self._initial_retr = list(self._prev_retr)
        if self.interval > 0:
            self._tasks.append(loop.create_task(self._ticks()))
        if any(c.sender for c in self.channels):
            self._tasks.append(loop.create_task(self._poll_tcp_info()))

    async def _ticks(self) -> None:
        loop = asyncio.get_running_loop()
        k = 1
        while True:
            await asyncio.sleep(max(0.0, self.t0 + k * self.interval - loop.time()))
            self.sample()
            k += 1

    async def _poll_tcp_info(self) -> None:
        while True:
            await asyncio.sleep(TCP_POLL_S)
            for i in range(len(self.channels)):
                self._read_tcp_info(i)

    def sample(self, *, final: bool = False) -> None:
        loop = asyncio.get_running_loop()
        self.refresh()
        now = loop.time()
        if final and now - self._prev_t < 1e-3:
            return
        samples = []
        for i, c in enumerate(self.channels):
            info = self._read_tcp_info(i)
            b = c.bytes
            sample = StreamSample(id=c.id, start=self._prev_t - self.t0, end=now - self.t0,
                                  bytes=b - self._prev_bytes[i], sender=c.sender)
            if info is not None:
                sample.retransmits = info.total_retrans - self._prev_retr[i]
                self._prev_retr[i] = info.total_retrans
                sample.snd_cwnd, sample.snd_wnd, sample.pmtu = info.cwnd_bytes, info.snd_wnd, info.pmtu
                sample.rtt_us, sample.rttvar_us = info.rtt, info.rttvar
            samples.append(sample)
            self._prev_bytes[i] = b
        self._prev_t = now
        self.intervals.append(interval_json(samples, bidir=bool(self.roles)))
        if not self._header_done:
            self.out.line(header(retr=self.retr, cwnd=self.retr, bidir=bool(self.roles)))
            self._header_done = True
        for line in interval_lines(samples, retr=self.retr, roles=self.roles, unit=self.unit):
            self.out.line(line)
        if len(self.channels) > 1 or self.roles:
            self.out.line(SEPARATOR)

    def _read_tcp_info(self, index: int) -> TcpInfo | None:
        """The channel's TCP_INFO (None unless it sends and is open), counted into its whole-test summary."""
        info = self.channels[index].tcp_info()
        if info is not None:
            self.sender_tcp[index].add(snd_cwnd=info.cwnd_bytes, snd_wnd=info.snd_wnd, rtt=info.rtt)
            self._last_info[index] = info
        return info

    def freeze_tcp_info(self) -> None:
        """Read TCP_INFO now, for the totals (call before closing the sockets; closed ones keep their last)."""
        self.final_info = [self._read_tcp_info(i) or self._last_info[i] for i in range(len(self.channels))]

    def cancel(self) -> None:
        """Stop the periodic sampling without a last sample (on failure; ``stop`` calls it too)."""
        for task in self._tasks:
            task.cancel()
        self._tasks.clear()

    def stop(self) -> float:
        """Stop sampling (printing the last partial interval); return the measured duration."""
        self.cancel()
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
                retr = info.total_retrans - self._initial_retr[i]
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


def cpu_json(mine: TestResults, peer: TestResults) -> dict:
    """iperf3's ``end.cpu_utilization_percent`` from both sides' results."""
    return {"host_total": mine.cpu_util_total, "host_user": mine.cpu_util_user,
            "host_system": mine.cpu_util_system, "remote_total": peer.cpu_util_total,
            "remote_user": peer.cpu_util_user, "remote_system": peer.cpu_util_system}


def pair_totals(local: list[StreamSample], channels: list, peer: TestResults,
                sender_tcp: list[SenderTcpStats]) -> tuple[list, list]:
    """Join local whole-test samples with the peer's results by stream id: (forward, reverse) lists."""
    by_id = {s.id: s for s in peer.streams}
    forward, reverse = [], []
    for sample, c, tcp in zip(local, channels, sender_tcp):
        theirs = by_id.get(c.sid)
        peer_bytes = theirs.bytes if theirs else 0
        peer_secs = (theirs.end_time - theirs.start_time) if theirs else sample.end
        other = StreamSample(id=c.id, start=0.0, end=peer_secs, bytes=peer_bytes, sender=not c.sender,
                             retransmits=(theirs.retransmits if theirs and theirs.retransmits >= 0 else None))
        if c.sender:
            forward.append(StreamTotals(sent=sample, received=other, local_sender=True, sender_tcp=tcp))
        else:
            other.sender = True
            sample = StreamSample(**{**sample.__dict__, "sender": False})
            reverse.append(StreamTotals(sent=other, received=sample, local_sender=False))
    return forward, reverse


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


def connected_json(socks: list[socket.socket | None]) -> list[dict]:
    """iperf3's ``start.connected``: each open TCP data socket's descriptor and both ends."""
    entries = []
    for sock in socks:
        if sock is None or sock.family not in (socket.AF_INET, socket.AF_INET6):
            continue
        try:
            local, remote = sock.getsockname(), sock.getpeername()
        except OSError:  # closed or no longer connected
            continue
        entries.append({"socket": sock.fileno(), "local_host": local[0], "local_port": local[1],
                        "remote_host": remote[0], "remote_port": remote[1]})
    return entries


def connected_line(entry: dict) -> str:
    return (f"[{entry['socket']:3d}] local {entry['local_host']} port {entry['local_port']} connected to "
            f"{entry['remote_host']} port {entry['remote_port']}")
