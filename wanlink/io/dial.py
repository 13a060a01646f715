"""Opening a Link's streams: connect, authenticate (retrying BUSY with backoff) and, later, re-open
one that died, under the same link id with a fresh handshake."""
from __future__ import annotations

import asyncio
import os
import random
import socket

from wanlink.errors import ConfigError, DeadlineExceeded, PeerLost, ServerBusy, WanlinkError
from wanlink.io.link import DEFAULT_TIMEOUT, Link
from wanlink.io.sockets import close_quietly, configure_stream_socket, log, recv_exactly, unix_address
from wanlink.proto.handshake import ClientHandshake, normalize_secret
from wanlink.proto.limits import DEFAULT_LIMITS, Limits
from wanlink.proto.seal import stream_keys
from wanlink.sched.chunking import chunk_size_from
from wanlink.sched.edf import check_chunk_order

BUSY_BACKOFF_S = (0.02, 1.0)  # a stream the server refused BUSY retries after 20 ms, doubling up to 1 s (jittered)
REOPEN_BACKOFF_S = (0.1, 5.0)  # a dead stream is re-dialled after 0.1 s, doubling up to 5 s (jittered)
REOPEN_ATTEMPTS = 8  # then the link carries on with the streams it has


class Dialer:
    """Opens streams of one link (``link_id``, ``count`` streams) to one server."""

    def __init__(self, host: str, port: int, *, key: bytes, link_id: bytes, count: int, meta: dict | None,
                 limits: Limits, congestion: str | None, sock_buffer: int | None, unix_name: str | None,
                 secure: bool):
        self.host, self.port = host, port
        self.key, self.link_id, self.count, self.meta = key, link_id, count, meta
        self.limits, self.congestion, self.sock_buffer = limits, congestion, sock_buffer
        self.unix_name, self.secure = unix_name, secure
        self.busy_refusals = 0

    @property
    def peer(self) -> str:
        return f"{self.host}:{self.port}" if self.unix_name is None else f"unix:{self.unix_name}"

    async def open_streams(self, indices, timeout: float) -> list[tuple[socket.socket, tuple | None]]:
        """(socket, keys) for each stream index, authenticated, within ``timeout`` s; nothing is left
        open on failure (DeadlineExceeded, PeerLost, AuthenticationError, RemoteProtocolError)."""
        loop = asyncio.get_running_loop()
        socks: dict[int, socket.socket | None] = {index: None for index in indices}
        keys: dict[int, tuple | None] = {}
        tasks = [loop.create_task(self._open(index, socks, keys), name=f"wanlink-connect-{index}")
                 for index in indices]
        try:
            async with asyncio.timeout(timeout):
                await asyncio.gather(*tasks)
        except BaseException as exc:
            # the other streams may still wait on their sockets: closing a socket under a pending read
            # breaks the event loop's bookkeeping for its descriptor, so end every task first
            await cancel_and_wait(tasks)
            for sock in socks.values():
                if sock is not None:
                    close_quietly(sock)
            if isinstance(exc, TimeoutError) and not isinstance(exc, DeadlineExceeded):
                busy = f" (the server answered BUSY {self.busy_refusals} times)" if self.busy_refusals else ""
                raise DeadlineExceeded(f"connecting to {self.peer} took more than {timeout:g} s{busy}") from None
            if isinstance(exc, OSError) and not isinstance(exc, WanlinkError):
                raise PeerLost(f"cannot connect to {self.peer}: {exc}") from exc
            raise
        return [(socks[index], keys[index]) for index in indices]

    async def reopen(self, link: Link, index: int) -> None:
        """Re-open stream ``index`` of ``link`` in the background: up to REOPEN_ATTEMPTS tries, with
        jittered exponential backoff, each bounded by the link's timeout. A peer that is gone fails
        the link through its other streams meanwhile (which cancels this)."""
        delay = REOPEN_BACKOFF_S[0]
        for attempt in range(1, REOPEN_ATTEMPTS + 1):
            await asyncio.sleep(delay * random.uniform(0.5, 1.5))
            delay = min(2 * delay, REOPEN_BACKOFF_S[1])
            try:
                [(sock, keys)] = await self.open_streams([index], link.timeout)
            except (WanlinkError, OSError) as exc:
                log.info("re-opening stream %d of %s, attempt %d of %d: %s", index, link.name, attempt,
                         REOPEN_ATTEMPTS, exc)
                continue
            link.replace_stream(index, sock, keys)
            log.info("stream %d of %s re-opened (attempt %d)", index, link.name, attempt)
            return
        log.warning("stream %d of %s not re-opened after %d attempts; %d of %d streams carry the link",
                    index, link.name, REOPEN_ATTEMPTS, link.streams_alive, link.streams)

    async def _open(self, index: int, socks: dict, keys: dict) -> None:
        delay = BUSY_BACKOFF_S[0]
        while True:
            try:
                keys[index] = await self._attempt(index, socks)
                return
            except ServerBusy:
                self.busy_refusals += 1
                close_quietly(socks[index])  # the handshake read completed: nothing is registered on it
                socks[index] = None
                await asyncio.sleep(delay * random.uniform(0.5, 1.5))
                delay = min(2 * delay, BUSY_BACKOFF_S[1])

    async def _attempt(self, index: int, socks: dict) -> tuple | None:
        loop = asyncio.get_running_loop()
        if self.unix_name is not None:
            family, proto, address, peer_host = socket.AF_UNIX, 0, unix_address(self.unix_name), None
        else:
            infos = await loop.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM)
            family, _type, proto, _name, address = infos[0]
            peer_host = address[0]
        sock = socket.socket(family, socket.SOCK_STREAM, proto)
        socks[index] = sock
        configure_stream_socket(sock, congestion=self.congestion, buffer_bytes=self.sock_buffer, peer_host=peer_host)
        await loop.sock_connect(sock, address)
        handshake = ClientHandshake(self.key, self.link_id, index, self.count, self.meta, limits=self.limits,
                                    secure=self.secure)
        await loop.sock_sendall(sock, handshake.hello())
        while handshake.bytes_wanted():
            reply = handshake.receive(await recv_exactly(loop, sock, handshake.bytes_wanted()))
            if reply:
                await loop.sock_sendall(sock, reply)
        return stream_keys(self.key, *handshake.transcript(), client=True) if self.secure else None


async def cancel_and_wait(tasks: list[asyncio.Task]) -> None:
    """Cancel ``tasks`` and return once every one has ended; a cancellation of the caller meanwhile
    is re-raised only then."""
    for task in tasks:
        task.cancel()
    cancelled = False
    while not all(task.done() for task in tasks):
        try:
            await asyncio.wait(tasks)
        except asyncio.CancelledError:
            cancelled = True
    for task in tasks:
        if not task.cancelled():
            task.exception()  # retrieved: a stream's own failure is already the reason we are here
    if cancelled:
        raise asyncio.CancelledError


def check_stream_count(streams) -> int:
    """``streams`` when it is an int in [1, max_streams]; ConfigError otherwise."""
    if isinstance(streams, bool) or not isinstance(streams, int) or not 1 <= streams <= DEFAULT_LIMITS.max_streams:
        raise ConfigError(f"streams must be an int in [1, {DEFAULT_LIMITS.max_streams}], got {streams!r}")
    return streams


async def open_link(host: str, port: int, *, streams: int, secret: bytes | str, meta: dict | None = None,
                    timeout: float = DEFAULT_TIMEOUT, chunk_size: int | None = None, congestion: str | None = None,
                    sock_buffer: int | None = None, compress: bool = False, checksum: bool = False,
                    limits: Limits = DEFAULT_LIMITS, unix_name: str | None = None, secure: bool = False,
                    reopen: bool = True, chunk_order: str = "edf") -> Link:
    """Open a Link of exactly ``streams`` TCP streams to a wanlink server and authenticate each one.

    Everything is resolved already (``wanlink.connect`` probes the path and reads the settings):
    ``chunk_size`` None is 4 MiB over loopback or Unix sockets, else the transport's default.
    ``timeout`` bounds the connection set-up (a stream the server refuses BUSY is retried with
    backoff meanwhile) and is the link's silence timeout afterwards.
    ``unix_name``: the server's abstract Unix socket (``Server.unix_name``, same host and network
    namespace only); the streams are then Unix sockets. ``secure``: every frame encrypted and
    authenticated (AES-256-GCM, keys from the secret and each stream's handshake). ``reopen``: a
    stream that dies while others live is re-opened in the background (``Link.reopen_stream``).
    ``chunk_order``: "edf" (deadline first) or "fcfs" (arrival order) for what this side sends.
    """
    count = check_stream_count(streams)
    check_chunk_order(chunk_order)
    chunk_size_from(chunk_size)  # a bad size fails before connecting
    key = normalize_secret(secret)
    if secure and not key:
        raise ConfigError("secure=True needs a shared secret (WANLINK_SECRET): keys derive from it")
    if not key:
        log.warning("connecting to %s:%s without authentication (empty secret)", host, port)
    dialer = Dialer(host, port, key=key, link_id=os.urandom(16), count=count, meta=meta, limits=limits,
                    congestion=congestion, sock_buffer=sock_buffer, unix_name=unix_name, secure=secure)
    opened = await dialer.open_streams(list(range(count)), timeout)
    return Link([sock for sock, _keys in opened], peer=dialer.peer, link_id=dialer.link_id, limits=limits,
                chunk_size=chunk_size, timeout=timeout, compress=compress, checksum=checksum,
                keys=[keys for _sock, keys in opened], dialer=dialer if reopen else None,
                chunk_order=chunk_order).start()
