"""start_server(): accept authenticated streams, assemble them into Links, hand each Link to on_link."""
from __future__ import annotations

import asyncio
import dataclasses
import inspect
import socket

from wanlink.errors import (
    AuthenticationError, ConfigError, LocalProtocolError, PeerLost, RemoteProtocolError, WanlinkError,
)
from wanlink.io import registry
from wanlink.io.admission import HandshakeTable, RejectionLog
from wanlink.io.link import DEFAULT_TIMEOUT, Link
from wanlink.io.sockets import close_quietly, configure_stream_socket, log, recv_exactly, unix_listener
from wanlink.proto.handshake import PROBE_META_KEY, ServerHandshake, Status, normalize_secret
from wanlink.proto.limits import DEFAULT_LIMITS, Limits
from wanlink.proto.seal import stream_keys
from wanlink.sched.chunking import chunk_size_from

AUTH_TIMEOUT = 5.0
"""Seconds an accepted connection has to authenticate (HELLO to PROOF) before it is dropped."""


@dataclasses.dataclass
class _PendingLink:
    """Streams of one link that authenticated before all of them arrived."""

    count: int
    meta: dict | None = None
    peer: str = ""
    socks: dict[int, socket.socket] = dataclasses.field(default_factory=dict)
    keys: dict[int, tuple[bytes, bytes] | None] = dataclasses.field(default_factory=dict)
    expiry: asyncio.TimerHandle | None = None


@dataclasses.dataclass(eq=False)
class _Attempt:
    """One accepted connection that has not authenticated yet (an entry of the handshake table)."""

    sock: socket.socket
    task: asyncio.Task
    handshake: ServerHandshake
    evicted: bool = False

    def evict(self) -> None:
        self.evicted = True
        self.task.cancel()


class Server:
    """A listening wanlink server; ``close()`` stops accepting (links already handed out stay open)."""

    def __init__(self, listener: socket.socket, *, secret: bytes, on_link, limits: Limits, timeout: float,
                 link_options: dict, unix: tuple[socket.socket, str] | None = None,
                 auth_timeout: float = AUTH_TIMEOUT, secure: bool = False):
        self._listener = listener
        self._unix_listener, self.unix_name = unix if unix is not None else (None, None)
        self._secret = secret
        self._on_link = on_link
        self._limits = limits
        self._timeout = timeout
        self._require_secure = secure  # refuse clients that do not ask for sealed streams
        self._auth_timeout = min(auth_timeout, timeout)
        self._link_options = link_options
        self.loop = asyncio.get_running_loop()
        self._pending: dict[bytes, _PendingLink] = {}
        self._handlers: set[asyncio.Task] = set()
        self._callbacks: set[asyncio.Task] = set()  # async on_link calls: they hold no handshake slot
        self._probe_links: set[Link] = set()  # probe traffic only: kept here, never shown to on_link
        self._accept_tasks: dict[socket.socket, asyncio.Task] = {}  # listener -> its accept loop
        self.host, self.port = listener.getsockname()[:2]
        self.handshakes = HandshakeTable(limits.max_handshakes, limits.max_handshakes_per_host)
        self.rejections = RejectionLog(self.port)

    @property
    def rejected_streams(self) -> int:
        """Connections refused so far (evicted, timed out, failed the handshake, or refused BUSY)."""
        return self.rejections.total

    def start(self) -> "Server":
        for listener in self._listeners():
            self._accept_tasks[listener] = self.loop.create_task(self._accept_loop(listener),
                                                                 name=f"wanlink-accept-{self.port}")
        registry.register_server(self)
        return self

    async def _accept_loop(self, listener: socket.socket) -> None:
        while True:
            try:
                sock, _address = await self.loop.sock_accept(listener)
            except OSError as exc:  # e.g. EMFILE: keep serving once descriptors free up
                log.error("accept on port %d failed: %s", self.port, exc)
                await asyncio.sleep(0.1)
                continue
            self._spawn(self.accept_socket(sock), self._handlers)

    def _spawn(self, coro, tasks: set) -> None:
        task = self.loop.create_task(coro)
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    async def accept_socket(self, sock: socket.socket, prefix: bytes = b"") -> None:
        """Run the handshake on an accepted socket of which ``prefix`` bytes were already read.

        The connection takes a slot of the handshake table until it authenticated (within
        ``auth_timeout`` s), evicting the oldest one when the table is full; an evicted connection
        is told BUSY. ``on_link`` runs after the slot is free.
        """
        peer = _peer_name(sock)
        host = peer.rsplit(":", 1)[0]
        attempt = _Attempt(sock, asyncio.current_task(), ServerHandshake(self._secret, limits=self._limits))
        for victim in self.handshakes.add(attempt, host):
            victim.evict()
        try:
            configure_stream_socket(sock, congestion=self._link_options.get("congestion"),
                                    buffer_bytes=self._link_options.get("sock_buffer"), peer_host=host)
            async with asyncio.timeout(self._auth_timeout):
                accepted = await self._handshake(attempt, prefix, peer)
        except asyncio.CancelledError:
            if not attempt.evicted:
                close_quietly(sock)
                raise
            asyncio.current_task().uncancel()
            _send_quietly(sock, attempt.handshake.busy_reply())
            close_quietly(sock)
            self.rejections.record(f"evicted: handshake table full (max_handshakes={self._limits.max_handshakes}, "
                                   f"max_handshakes_per_host={self._limits.max_handshakes_per_host})", host)
            return
        except (WanlinkError, OSError, TimeoutError) as exc:
            self.rejections.record(_describe(exc, self._auth_timeout), host, example=str(exc))
            close_quietly(sock)
            return
        except BaseException:
            close_quietly(sock)
            raise
        finally:
            self.handshakes.remove(attempt)
        if accepted is not None:
            self._deliver(accepted)

    async def _handshake(self, attempt: _Attempt, prefix: bytes, peer: str):
        loop, sock, handshake = self.loop, attempt.sock, attempt.handshake
        data = prefix
        reply = b""
        while handshake.stream is None:
            wanted = handshake.bytes_wanted()
            if len(data) > wanted:
                raise LocalProtocolError(f"{len(data)} prefix bytes exceed the {wanted}-byte handshake message")
            data += await recv_exactly(loop, sock, wanted - len(data))
            reply, data = handshake.receive(data), b""
        self.handshakes.spoke(attempt)
        hello = handshake.stream
        pending = self._pending.get(hello.link_id)
        status = Status.INSECURE if self._require_secure and not hello.secure else self._admission(hello, pending)
        if status is not Status.OK:
            await loop.sock_sendall(sock, handshake.reject(status))
            raise RemoteProtocolError(f"stream {hello.index}/{hello.count} refused: {status.name}")
        await loop.sock_sendall(sock, reply)
        try:
            result = handshake.receive(await recv_exactly(loop, sock, handshake.bytes_wanted()))
        except AuthenticationError:
            await loop.sock_sendall(sock, handshake.reject_bytes)
            raise
        pending = self._pending.get(hello.link_id)
        status = self._admission(hello, pending)
        if status is not Status.OK:
            await loop.sock_sendall(sock, bytes([status]))
            raise RemoteProtocolError(f"stream {hello.index}/{hello.count} refused: {status.name}")
        self.handshakes.remove(attempt)  # authenticated: no longer evictable
        await loop.sock_sendall(sock, result)
        if pending is None:
            pending = _PendingLink(hello.count)
            pending.expiry = loop.call_later(self._timeout, self._expire, hello.link_id)
            self._pending[hello.link_id] = pending
        pending.socks[hello.index] = sock
        pending.keys[hello.index] = (stream_keys(self._secret, *handshake.transcript(), client=False)
                                     if hello.secure else None)
        if hello.index == 0:
            pending.meta, pending.peer = hello.meta, peer
        if len(pending.socks) < pending.count:
            return None
        del self._pending[hello.link_id]
        pending.expiry.cancel()
        return hello.link_id, pending

    def _admission(self, hello, pending: _PendingLink | None) -> Status:
        if pending is None:
            return Status.BUSY if len(self._pending) >= self._limits.max_pending_links else Status.OK
        if pending.count != hello.count or hello.index in pending.socks:
            return Status.BAD_STREAM
        return Status.OK

    def _expire(self, link_id: bytes) -> None:
        pending = self._pending.pop(link_id, None)
        if pending is None:
            return
        log.warning("dropped a link from %s: %d of %d streams arrived within %g s",
                    pending.peer or "?", len(pending.socks), pending.count, self._timeout)
        for sock in pending.socks.values():
            close_quietly(sock)

    def _deliver(self, accepted) -> None:
        link_id, pending = accepted
        socks = [pending.socks[i] for i in range(pending.count)]
        link = Link(socks, peer=pending.peer, link_id=link_id, peer_meta=pending.meta, limits=self._limits,
                    keys=[pending.keys[i] for i in range(pending.count)],
                    timeout=self._timeout, **{k: v for k, v in self._link_options.items()
                                              if k in ("chunk_size", "compress", "checksum")}).start()
        self._probe_links = {probe for probe in self._probe_links if not probe.closed}
        if link.peer_meta.get(PROBE_META_KEY):  # the transport drops probe data; the prober closes the link
            self._probe_links.add(link)
            return
        try:
            result = self._on_link(link)
        except Exception as exc:  # noqa: BLE001 - a failing callback must not take the server down
            self._callback_failed(link, exc)
            return
        if inspect.isawaitable(result):
            self._spawn(self._await_callback(link, result), self._callbacks)

    async def _await_callback(self, link: Link, result) -> None:
        try:
            await result
        except Exception as exc:  # noqa: BLE001 - as above
            self._callback_failed(link, exc)

    def _callback_failed(self, link: Link, exc: Exception) -> None:
        log.error("on_link callback failed for %s: %r; closing that link", link.name, exc)
        self._spawn(link.close(), self._callbacks)

    def _listeners(self) -> list[socket.socket]:
        return [listener for listener in (self._listener, self._unix_listener) if listener is not None]

    def close(self) -> None:
        """Stop accepting and drop half-open links and handshakes in progress."""
        for listener in self._listeners():
            task = self._accept_tasks.get(listener)
            if task is None or task.done():
                close_quietly(listener)
            else:  # closed once its pending accept ended: a descriptor closed under it breaks the loop's bookkeeping
                task.cancel()
                task.add_done_callback(lambda _task, listener=listener: close_quietly(listener))
        for task in [*self._handlers, *self._callbacks]:
            task.cancel()  # each handler closes its own socket once it has ended
        self.rejections.close()
        for probe in self._probe_links:
            probe.fail(PeerLost("server closed"))
        self._probe_links.clear()
        for link_id in list(self._pending):
            pending = self._pending.pop(link_id)
            pending.expiry.cancel()
            for sock in pending.socks.values():
                close_quietly(sock)
        registry.unregister_server(self)

    async def wait_closed(self) -> None:
        tasks = [*self._accept_tasks.values(), *self._handlers, *self._callbacks]
        await asyncio.gather(*tasks, return_exceptions=True)

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc_info):
        self.close()
        await self.wait_closed()


def _peer_name(sock: socket.socket) -> str:
    if sock.family == socket.AF_UNIX:
        return "unix"  # a process of this host; its rank or name comes with the handshake
    try:
        host, port = sock.getpeername()[:2]
    except OSError:
        return "?"
    return f"{host}:{port}"


def _describe(exc: BaseException, auth_timeout: float) -> str:
    """A rejection reason to count: the kind of failure, without what varies per connection."""
    if isinstance(exc, TimeoutError) and not str(exc):
        return f"not authenticated within {auth_timeout:g} s (auth_timeout)"
    if isinstance(exc, OSError) and not isinstance(exc, WanlinkError):
        return f"connection lost during the handshake ({type(exc).__name__})"
    return type(exc).__name__


def _send_quietly(sock: socket.socket, data: bytes) -> None:
    """Best effort, never blocking: a few bytes a fresh socket's send buffer always takes."""
    try:
        sock.send(data)
    except OSError:
        pass


async def start_server(host: str, port: int, *, on_link, secret: bytes | str, timeout: float = DEFAULT_TIMEOUT,
                       limits: Limits = DEFAULT_LIMITS, backlog: int = 128, chunk_size: int | None = None,
                       congestion: str | None = None, sock_buffer: int | None = None, compress: bool = False,
                       checksum: bool = False, unix: bool = False, auth_timeout: float = AUTH_TIMEOUT,
                       secure: bool = False) -> Server:
    """Listen on host:port; call ``on_link(link)`` (plain or async) for each authenticated peer.

    Everything is resolved already (``wanlink.serve`` reads the settings for what it is not given).
    An accepted connection must authenticate within ``auth_timeout`` s (at most ``timeout``).
    ``secure=True`` refuses clients that do not ask for encrypted, authenticated streams (a client
    that asks always gets them).

    ``unix=True`` also listens on an abstract Unix socket (``server.unix_name``) for processes of
    the same host and network namespace: the same handshake; sending costs a third less CPU per
    byte than over TCP loopback (bench/loopback_throughput.py --paths tcp unix).
    """
    key = normalize_secret(secret)
    chunk_size_from(chunk_size)  # a bad size fails now, not at each link
    if secure and not key:
        raise ConfigError("secure=True needs a shared secret (WANLINK_SECRET): keys derive from it")
    if not key:
        log.warning("serving on %s:%s without authentication (empty secret)", host, port)
    try:
        listener = socket.create_server((host, port), backlog=backlog)
    except OSError as exc:
        raise OSError(exc.errno, f"cannot listen on {host}:{port}: {exc.strerror}") from None
    listener.setblocking(False)
    options = {"chunk_size": chunk_size, "congestion": congestion, "sock_buffer": sock_buffer,
               "compress": compress, "checksum": checksum}
    try:
        local = unix_listener(backlog) if unix else None
    except OSError:
        close_quietly(listener)
        raise
    return Server(listener, secret=key, on_link=on_link, limits=limits, timeout=timeout,
                  link_options=options, unix=local, auth_timeout=auth_timeout, secure=secure).start()
