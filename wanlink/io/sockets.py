"""Socket set-up and exact-size reads for wanlink's streams (TCP, or Unix sockets between processes of one host)."""
from __future__ import annotations

import _socket
import asyncio
import dataclasses
import ipaddress
import logging
import os
import socket
import struct

from wanlink.errors import ConfigError, PeerLost

log = logging.getLogger("wanlink.io")
DEFAULT_CONGESTION = "bbr"
# Unsent bytes a stream socket towards a remote peer accepts before it stops taking more. Without a
# limit, writers pour chunks into multi-MB send buffers as fast as the kernel takes them, so a few
# streams hoard the queue while others sit idle (40 ms path, 8 streams: 1.58 vs 1.83 Gbit/s).
NOTSENT_LOWAT_BYTES = 1 << 20
UNIX_BUFFER_BYTES = 4 << 20
"""SO_SNDBUF of a Unix stream socket (capped by net.core.wmem_max). Unix sockets have no autotuning:
at the default (net.core.wmem_default, 208 KiB) a 1 MiB chunk took five "socket full, wait until
writable" turns of both processes' loops (0.5-1.5 ms); with a whole chunk of room it goes in one send."""


def available_congestion_controls() -> list[str]:
    try:
        with open("/proc/sys/net/ipv4/tcp_available_congestion_control") as f:
            return f.read().split()
    except OSError:
        return []


def configure_stream_socket(sock: socket.socket, *, congestion: str | None = None,
                            buffer_bytes: int | None = None, peer_host: str | None = None) -> None:
    """Non-blocking, no Nagle, deliberate congestion control, optional fixed socket buffers.

    ``congestion=None`` picks bbr where the kernel offers it (one cubic flow collapses on a lossy
    long path; bbr does not), except towards a loopback ``peer_host``, where bbr's pacing only
    costs CPU (about 35 % more per byte, bench/loopback_throughput.py --congestion) and the system
    default stays. An explicitly named algorithm the kernel lacks is a ConfigError.
    Towards a remote peer, TCP_NOTSENT_LOWAT keeps at most about ``NOTSENT_LOWAT_BYTES`` unsent in
    the kernel, so each stream pulls its next chunk only as fast as it actually sends.
    ``buffer_bytes`` sets SO_SNDBUF/SO_RCVBUF, which disables the kernel's autotuning for this
    socket (and escapes per-namespace caps): leave it None unless you mean it. A Unix socket, which
    has no autotuning, gets ``UNIX_BUFFER_BYTES`` of send buffer unless ``buffer_bytes`` says otherwise.
    """
    sock.setblocking(False)
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        remote = not is_loopback(peer_host)
        if congestion is not None or remote:
            _set_congestion_or_default(sock, congestion)
        if remote and hasattr(socket, "TCP_NOTSENT_LOWAT"):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NOTSENT_LOWAT, NOTSENT_LOWAT_BYTES)
    if buffer_bytes is not None:
        set_buffer_sizes(sock, buffer_bytes)
    elif sock.family == socket.AF_UNIX:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, UNIX_BUFFER_BYTES)


def set_buffer_sizes(sock: socket.socket, nbytes: int) -> None:
    """Fixed SO_SNDBUF and SO_RCVBUF (this turns the kernel's autotuning off for the socket)."""
    if nbytes <= 0:
        raise ConfigError(f"socket buffer size must be positive, got {nbytes}")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, nbytes)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, nbytes)


def same_host_key() -> str:
    """Who can reach this process's abstract Unix sockets: this boot of this kernel, this network namespace."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        netns = os.stat("/proc/self/ns/net").st_ino
    except OSError:  # not Linux: no abstract sockets to offer
        return ""
    return f"{boot}/{netns}"


def unix_listener(backlog: int) -> tuple[socket.socket, str]:
    """A listening socket in the abstract Unix namespace (no file, gone with the process) and its name."""
    name = f"wanlink-{os.getpid()}-{os.urandom(6).hex()}"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(unix_address(name))
        listener.listen(backlog)
    except OSError:
        close_quietly(listener)
        raise
    listener.setblocking(False)
    return listener, name


def unix_address(name: str) -> str:
    """The address to connect to for an abstract socket ``name``."""
    return "\0" + name


def is_local_socket(sock: socket.socket) -> bool:
    """A Unix socket, or TCP to a loopback address: a path with nothing to probe."""
    if sock.family == socket.AF_UNIX:
        return True
    try:
        return is_loopback(sock.getpeername()[0])
    except (OSError, IndexError, TypeError):  # unconnected
        return False


def is_loopback(host: str | None) -> bool:
    try:
        return host is not None and ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _set_congestion_or_default(sock: socket.socket, congestion: str | None) -> None:
    if congestion is not None:
        set_congestion(sock, congestion)
    elif hasattr(socket, "TCP_CONGESTION") and DEFAULT_CONGESTION in available_congestion_controls():
        set_congestion(sock, DEFAULT_CONGESTION)


def set_congestion(sock: socket.socket, name: str) -> None:
    """Use TCP congestion control ``name`` on ``sock``; ConfigError naming what the kernel offers if it refuses."""
    if not hasattr(socket, "TCP_CONGESTION"):
        raise ConfigError("this platform cannot choose a TCP congestion control")
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, name.encode())
    except OSError as exc:
        raise ConfigError(f"congestion control {name!r} unavailable "
                          f"(kernel offers {available_congestion_controls()}): {exc}") from None


# Linux ``struct tcp_info`` (include/uapi/linux/tcp.h), every field in order with its C type, so
# each offset follows from the ones before it (all fields are naturally aligned: no padding).
# The kernel copies min(requested, its own size) bytes: a field past what it returned is one this
# kernel does not have, and reads as None.
_TCP_INFO_LAYOUT: tuple[tuple[str, str], ...] = (
    ("state", "B"), ("ca_state", "B"), ("retransmits", "B"), ("probes", "B"), ("backoff", "B"),
    ("options", "B"), ("wscale", "B"),  # snd_wscale:4, rcv_wscale:4
    ("app_limited_flags", "B"),  # delivery_rate_app_limited:1, fastopen_client_fail:2
    ("rto", "I"), ("ato", "I"), ("snd_mss", "I"), ("rcv_mss", "I"),
    ("unacked", "I"), ("sacked", "I"), ("lost", "I"), ("retrans", "I"), ("fackets", "I"),
    ("last_data_sent", "I"), ("last_ack_sent", "I"), ("last_data_recv", "I"), ("last_ack_recv", "I"),
    ("pmtu", "I"), ("rcv_ssthresh", "I"), ("rtt", "I"), ("rttvar", "I"), ("snd_ssthresh", "I"),
    ("snd_cwnd", "I"), ("advmss", "I"), ("reordering", "I"), ("rcv_rtt", "I"), ("rcv_space", "I"),
    ("total_retrans", "I"),  # 104 bytes up to here: every Linux since 2.6
    ("pacing_rate", "Q"), ("max_pacing_rate", "Q"),  # 3.15
    ("bytes_acked", "Q"), ("bytes_received", "Q"), ("segs_out", "I"), ("segs_in", "I"),  # 4.1-4.2
    ("notsent_bytes", "I"), ("min_rtt", "I"), ("data_segs_in", "I"), ("data_segs_out", "I"),  # 4.6
    ("delivery_rate", "Q"),  # 4.9
    ("busy_time", "Q"), ("rwnd_limited", "Q"), ("sndbuf_limited", "Q"),  # 4.10
    ("delivered", "I"), ("delivered_ce", "I"),  # 4.18
    ("bytes_sent", "Q"), ("bytes_retrans", "Q"), ("dsack_dups", "I"), ("reord_seen", "I"),  # 4.19
    ("rcv_ooopack", "I"), ("snd_wnd", "I"),  # 5.4
)


def _tcp_info_offsets() -> dict[str, tuple[int, struct.Struct]]:
    offsets, offset = {}, 0
    for name, code in _TCP_INFO_LAYOUT:
        field = struct.Struct("=" + code)
        offsets[name] = (offset, field)
        offset += field.size
    return offsets


_TCP_INFO_OFFSETS = _tcp_info_offsets()
TCP_INFO_BYTES = sum(struct.calcsize("=" + code) for _name, code in _TCP_INFO_LAYOUT)
_TCP_INFO_BASE_BYTES = _TCP_INFO_OFFSETS["total_retrans"][0] + 4


@dataclasses.dataclass(frozen=True)
class TcpInfo:
    """The fields of Linux TCP_INFO that wanlink reads (names as in ``struct tcp_info``, less ``tcpi_``).

    Times are microseconds, windows and counters as the kernel keeps them (``snd_cwnd`` in
    segments: ``cwnd_bytes`` is cwnd x MSS). The fields after ``total_retrans`` are None on
    kernels older than the one that added them (``bytes_acked`` 4.1, ``min_rtt`` 4.6,
    ``delivery_rate`` 4.9, ``bytes_sent`` 4.19, ``snd_wnd`` 5.4).
    """

    snd_mss: int
    unacked: int  # segments in flight
    sacked: int  # segments selectively acknowledged beyond a hole
    lost: int
    retrans: int  # segments retransmitted and not yet acknowledged
    pmtu: int
    rtt: int  # smoothed round-trip time
    rttvar: int
    snd_ssthresh: int
    snd_cwnd: int  # segments
    total_retrans: int  # segments retransmitted over the connection's life
    pacing_rate: int | None = None  # bytes per second
    bytes_acked: int | None = None  # payload bytes cumulatively acknowledged by the peer
    bytes_received: int | None = None
    notsent_bytes: int | None = None
    min_rtt: int | None = None
    delivery_rate: int | None = None  # bytes per second
    bytes_sent: int | None = None
    bytes_retrans: int | None = None
    snd_wnd: int | None = None  # the peer's advertised receive window, scaled, in bytes

    @property
    def cwnd_bytes(self) -> int:
        return self.snd_cwnd * self.snd_mss


def parse_tcp_info(raw: bytes) -> TcpInfo | None:
    """A :class:`TcpInfo` from the bytes the kernel returned; None when shorter than the 2.6 struct."""
    if len(raw) < _TCP_INFO_BASE_BYTES:
        return None
    values = {}
    for item in dataclasses.fields(TcpInfo):
        offset, field = _TCP_INFO_OFFSETS[item.name]
        if offset + field.size <= len(raw):
            values[item.name] = field.unpack_from(raw, offset)[0]
    return TcpInfo(**values)


def tcp_info(sock: socket.socket) -> TcpInfo | None:
    """This TCP socket's TCP_INFO; None where the platform has none or the socket is closed."""
    if not hasattr(socket, "TCP_INFO"):
        return None
    try:
        raw = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, TCP_INFO_BYTES)
    except OSError:
        return None
    return parse_tcp_info(raw)


def tcp_bytes_acked(sock: socket.socket) -> int | None:
    """Payload bytes the peer's kernel has acknowledged on this TCP socket; None where unknown.

    Cumulatively acknowledged bytes plus the segments acknowledged selectively (SACK) beyond a
    hole: counting only the cumulative part, a hole filled by a retransmit releases everything
    behind it at once, and short windows after a loss overstated rates (2.19 Gbit/s measured on
    a 1.93 Gbit/s path with 32 streams and 0.1 % loss).
    """
    info = tcp_info(sock)
    if info is None or info.bytes_acked is None:
        return None
    return info.bytes_acked + info.sacked * info.snd_mss


def _tcp_info_fields(sock: socket.socket, fields: tuple, nbytes: int) -> tuple | None:
    """The values of ``fields`` ((offset, struct) pairs of TCP_INFO), reading only its first
    ``nbytes``; None where the kernel cannot say (not TCP, closed, too old)."""
    try:
        raw = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, nbytes)
    except (OSError, AttributeError):
        return None
    if len(raw) < nbytes:
        return None
    return tuple(field.unpack_from(raw, offset)[0] for offset, field in fields)


def _tcp_info_layout(*names: str) -> tuple[tuple, int]:
    """The (offset, struct) pairs of TCP_INFO's fields ``names`` for :func:`_tcp_info_fields`, and how
    many of its first bytes hold them all."""
    fields = tuple(_TCP_INFO_OFFSETS[name] for name in names)
    return fields, max(offset + field.size for offset, field in fields)


_SEND_PROGRESS_FIELDS, _SEND_PROGRESS_BYTES = _tcp_info_layout("bytes_acked", "notsent_bytes", "bytes_sent",
                                                               "bytes_retrans")
_SEND_ROOM_FIELDS, _SEND_ROOM_BYTES = _tcp_info_layout("snd_mss", "unacked", "snd_cwnd", "notsent_bytes")
_NOTSENT_FIELDS, _NOTSENT_BYTES = _tcp_info_layout("notsent_bytes")


_raw_family = _socket.socket.family.__get__
"""A socket's family as a plain int: ``sock.family`` builds an AddressFamily enum in Python (about
five calls), too much for what runs for every chunk a link writes."""
_TCP_FAMILIES = (int(socket.AF_INET), int(socket.AF_INET6))


def tcp_send_room(sock: socket.socket) -> int | None:
    """Bytes this TCP socket's congestion window lets leave now: the window less the segments in
    flight and the bytes queued but not sent yet (may be negative). None where unknown (not TCP,
    closed, before 4.6). Reads only these fields: a link asks it for each stream it writes to."""
    if _raw_family(sock) not in _TCP_FAMILIES:
        return None
    fields = _tcp_info_fields(sock, _SEND_ROOM_FIELDS, _SEND_ROOM_BYTES)
    if fields is None:
        return None
    mss, unacked, cwnd, notsent = fields
    return (cwnd - unacked) * mss - notsent


def tcp_notsent_bytes(sock: socket.socket) -> int | None:
    """Bytes this TCP socket's kernel buffer holds that have not been sent yet (TCP_INFO
    ``notsent_bytes``); None where unknown (not TCP, closed, before 4.6)."""
    if _raw_family(sock) not in _TCP_FAMILIES:
        return None
    fields = _tcp_info_fields(sock, _NOTSENT_FIELDS, _NOTSENT_BYTES)
    return None if fields is None else fields[0]


def tcp_send_progress(sock: socket.socket) -> tuple[int, int] | None:
    """(bytes given to the kernel, bytes the peer's kernel acknowledged) on this TCP socket: payload
    bytes sent less those retransmitted plus those not sent yet, and ``bytes_acked`` (which counts
    the SYN on the connecting side: one ahead there). None where unknown (not TCP, closed, before 4.19).
    Reads only these fields: ``KernelAcks``' polls call it often."""
    fields = _tcp_info_fields(sock, _SEND_PROGRESS_FIELDS, _SEND_PROGRESS_BYTES)
    if fields is None:
        return None
    acked, notsent, sent, retrans = fields
    return sent - retrans + notsent, acked


def congestion_of(sock: socket.socket) -> str | None:
    """The socket's TCP congestion control; None where the platform or the socket cannot say."""
    try:
        raw = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, 16)
    except (OSError, AttributeError):
        return None
    return raw.split(b"\0", 1)[0].decode() or None


def tcp_rtt_s(sock: socket.socket) -> float | None:
    """The kernel's smoothed round-trip time of this TCP socket in seconds; None where unknown."""
    if sock.family not in (socket.AF_INET, socket.AF_INET6):
        return None
    info = tcp_info(sock)
    if info is None or not info.rtt:
        return None
    return info.rtt / 1e6


async def recv_exactly(loop: asyncio.AbstractEventLoop, sock: socket.socket, nbytes: int) -> bytes:
    """Read exactly ``nbytes`` (never more); PeerLost when the peer closes first."""
    buf = bytearray(nbytes)
    view = memoryview(buf)
    filled = 0
    while filled < nbytes:
        n = await loop.sock_recv_into(sock, view[filled:])
        if n == 0:
            raise PeerLost(f"peer closed the connection after {filled} of {nbytes} handshake bytes")
        filled += n
    return bytes(buf)


def close_quietly(sock: socket.socket) -> None:
    try:
        sock.close()
    except OSError:
        pass
