"""Socket set-up and exact-size reads for wanlink's streams (TCP, or Unix sockets between processes of one host)."""
from __future__ import annotations

import asyncio
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
    socket (and escapes per-namespace caps): leave it None unless you mean it.
    """
    sock.setblocking(False)
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        remote = not is_loopback(peer_host)
        if congestion is not None or remote:
            _set_congestion(sock, congestion)
        if remote and hasattr(socket, "TCP_NOTSENT_LOWAT"):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NOTSENT_LOWAT, NOTSENT_LOWAT_BYTES)
    if buffer_bytes is not None:
        if buffer_bytes <= 0:
            raise ConfigError(f"socket buffer size must be positive, got {buffer_bytes}")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, buffer_bytes)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, buffer_bytes)


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


def _set_congestion(sock: socket.socket, congestion: str | None) -> None:
    if not hasattr(socket, "TCP_CONGESTION"):
        if congestion is not None:
            raise ConfigError("this platform cannot choose a TCP congestion control")
        return
    name = congestion
    if name is None:
        if DEFAULT_CONGESTION not in available_congestion_controls():
            return
        name = DEFAULT_CONGESTION
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, name.encode())
    except OSError as exc:
        raise ConfigError(f"congestion control {name!r} unavailable "
                          f"(kernel offers {available_congestion_controls()}): {exc}") from None


_TCP_INFO_BYTES_ACKED = struct.Struct("=Q")
_TCP_INFO_BYTES_ACKED_OFFSET = 120  # struct tcp_info: tcpi_bytes_acked (Linux 4.6 and later)
_TCP_INFO_U32 = struct.Struct("=I")
_TCP_INFO_SND_MSS_OFFSET, _TCP_INFO_SACKED_OFFSET = 16, 28  # tcpi_snd_mss, tcpi_sacked (segments)


def tcp_bytes_acked(sock: socket.socket) -> int | None:
    """Payload bytes the peer's kernel has acknowledged on this TCP socket; None where unknown.

    Cumulatively acknowledged bytes plus the segments acknowledged selectively (SACK) beyond a
    hole: counting only the cumulative part, a hole filled by a retransmit releases everything
    behind it at once, and short windows after a loss overstated rates (2.19 Gbit/s measured on
    a 1.93 Gbit/s path with 32 streams and 0.1 % loss).
    """
    if not hasattr(socket, "TCP_INFO"):
        return None
    end = _TCP_INFO_BYTES_ACKED_OFFSET + _TCP_INFO_BYTES_ACKED.size
    try:
        raw = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, end)
    except OSError:
        return None
    if len(raw) < end:
        return None
    sacked = _TCP_INFO_U32.unpack_from(raw, _TCP_INFO_SACKED_OFFSET)[0]
    mss = _TCP_INFO_U32.unpack_from(raw, _TCP_INFO_SND_MSS_OFFSET)[0]
    return _TCP_INFO_BYTES_ACKED.unpack_from(raw, _TCP_INFO_BYTES_ACKED_OFFSET)[0] + sacked * mss


_TCP_INFO_RTT_OFFSET = 68  # tcpi_rtt, microseconds (smoothed)


def tcp_rtt_s(sock: socket.socket) -> float | None:
    """The kernel's smoothed round-trip time of this TCP socket in seconds; None where unknown."""
    if not hasattr(socket, "TCP_INFO") or sock.family not in (socket.AF_INET, socket.AF_INET6):
        return None
    end = _TCP_INFO_RTT_OFFSET + _TCP_INFO_U32.size
    try:
        raw = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, end)
    except OSError:
        return None
    if len(raw) < end:
        return None
    return _TCP_INFO_U32.unpack_from(raw, _TCP_INFO_RTT_OFFSET)[0] / 1e6 or None


def congestion_of(sock: socket.socket) -> str:
    raw = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, 16)
    return raw.split(b"\0", 1)[0].decode()


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
