"""Link: one logical connection to a peer, striped over N TCP streams."""
from __future__ import annotations

import asyncio
import collections
import os
import socket

from wanlink.errors import ConfigError, DeadlineExceeded, LimitExceeded, PeerLost, RemoteProtocolError, WanlinkError
from wanlink.io import registry
from wanlink.io.sockets import (
    close_quietly, configure_stream_socket, congestion_of, is_local_socket, log, recv_exactly, tcp_bytes_acked,
    unix_address,
)
from wanlink.io.stream import Stream
from wanlink.proto.control import pack_message, unpack_message
from wanlink.proto.frames import PING_FRAME, Header, control_header
from wanlink.proto.handshake import ClientHandshake, normalize_secret
from wanlink.proto.limits import DEFAULT_LIMITS, Limits
from wanlink.proto.reassembly import PROBE_DISCARD_TAG, Incoming, Reassembler
from wanlink.probe.rate import DeliveryRateEstimator
from wanlink.sched.chunking import OutgoingTransfer, chunk_size_from
from wanlink.sched.edf import EDFQueue

DEFAULT_TIMEOUT = 30.0
LOOPBACK_CHUNK_SIZE = 4 * 1024 * 1024
"""Default chunk size of a link whose streams all run over loopback or Unix sockets.
There the per-chunk CPU (frames, acks, wakeups) is what limits collectives; elsewhere the probe
picks one by rate and RTT (smaller chunks pre-empt and re-send at a finer grain)."""
RATE_WINDOW_S = 2.0
_INT64 = (-(2**63), 2**63 - 1)
_LINK_FAILED = object()  # queued to wake control readers when the link fails


def byte_view(buffer, *, writable: bool = False) -> memoryview:
    """A flat unsigned-byte memoryview of any C-contiguous buffer, without copying."""
    try:
        view = memoryview(buffer)
    except TypeError:
        raise ConfigError(f"expected a buffer (bytes, bytearray, memoryview, numpy array), "
                          f"got {type(buffer).__name__}") from None
    if not view.c_contiguous:
        raise ConfigError("buffer must be C-contiguous")
    if writable and view.readonly:
        raise ConfigError("recv_into needs a writable buffer")
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    return view


def _check_tag(tag, *, allow_discard: bool = False) -> None:
    if isinstance(tag, bool) or not isinstance(tag, int):
        raise ConfigError(f"tag must be an int, got {type(tag).__name__}")
    if not _INT64[0] <= tag <= _INT64[1]:
        raise ConfigError(f"tag {tag} does not fit in 64 bits")
    if tag < 0 and not (allow_discard and tag == PROBE_DISCARD_TAG):
        raise ConfigError(f"tag {tag} is reserved: negative tags are wanlink-internal")


class Link:
    """N TCP streams to one peer, carrying tagged messages in both directions.

    Outgoing messages are cut into chunks queued by deadline (EDF); each stream pulls the next
    chunk when its previous one drained. The receiver writes payload straight into the buffer
    posted with ``recv_into`` and acknowledges each chunk, so a dead stream's unacknowledged
    chunks are re-sent on the survivors.
    """

    def __init__(self, socks: list[socket.socket], *, peer: str, link_id: bytes, peer_meta: dict | None = None,
                 limits: Limits = DEFAULT_LIMITS, chunk_size: int | None = None, timeout: float = DEFAULT_TIMEOUT,
                 compress: bool = False, checksum: bool = False):
        if not socks:
            raise ConfigError("a link needs at least one stream")
        if timeout <= 0:
            raise ConfigError(f"timeout must be positive, got {timeout}")
        self.peer = peer
        self.link_id = link_id
        self.peer_meta = peer_meta or {}
        self.labels: dict = {}  # what the layers above say about this link (rank, site), shown by stats()
        self.limits = limits
        if chunk_size is None and all(is_local_socket(sock) for sock in socks):
            chunk_size = LOOPBACK_CHUNK_SIZE
        self.chunk_size = chunk_size_from(chunk_size)
        self.timeout = timeout
        self.compress = compress
        self.checksum = checksum
        self.name = f"{peer}/{link_id.hex()[:8]}"
        self.reassembler = Reassembler(limits)
        self.queue = EDFQueue()
        self.peer_closed = False
        self.error: BaseException | None = None
        self.requeued_chunks = 0
        self.duplicate_acks = 0
        self.loop = asyncio.get_running_loop()
        self._streams = [Stream(self, sock, index) for index, sock in enumerate(socks)]
        self._outgoing: dict[tuple[int, int], tuple[OutgoingTransfer, asyncio.Future]] = {}
        self._next_send_seq: dict[int, int] = {}
        self._recv_waiters: dict[Incoming, asyncio.Future] = {}
        self._start_waiters: dict[int, list[asyncio.Future]] = {}  # tag -> wait_message_started callers
        self._controls: asyncio.Queue = asyncio.Queue(limits.max_pending_control)
        self._closing = False
        self._wake_start = 0
        self._rate_samples: collections.deque = collections.deque()
        self._watchdog: asyncio.Task | None = None
        self.send_log: collections.deque | None = None  # (tag, seq, offset) per chunk handed to a stream
        self.delivery = DeliveryRateEstimator()  # acknowledged bytes/s, a low percentile: errs low

    def record_send_order(self, maxlen: int = 100_000) -> collections.deque:
        """Start logging the order in which chunks leave (for tests and tracing); returns the log."""
        self.send_log = collections.deque(maxlen=maxlen)
        return self.send_log

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self) -> "Link":
        for stream in self._streams:
            stream.start()
        self._watchdog = self.loop.create_task(self._watch(), name=f"wanlink-watchdog-{self.name}")
        registry.register(self)
        return self

    async def close(self, grace: float = 1.0) -> None:
        """Close every stream; pending sends and receives fail with PeerLost."""
        if self._closing:
            return
        self._closing = True
        if self.error is None:
            self.error = PeerLost(f"link to {self.peer} closed locally")
            self._fail_waiters(self.error)
        self._stop_watchdog()
        await asyncio.gather(*(stream.close(grace) for stream in self._streams))
        registry.unregister(self)

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc_info):
        await self.close()

    @property
    def streams(self) -> int:
        return len(self._streams)

    @property
    def streams_alive(self) -> int:
        return sum(stream.alive for stream in self._streams)

    @property
    def closed(self) -> bool:
        return self._closing or self.error is not None

    # -- messages -------------------------------------------------------------------------------
    async def send(self, buffer, *, tag: int, deadline=0) -> None:
        """Send ``buffer`` as one message on ``tag``; returns once the peer acknowledged every byte.

        The buffer is not copied: keep it unchanged until this returns. Cancelling the caller does
        not withdraw the message (it is already promised to the peer); it still goes out.
        """
        view = byte_view(buffer)
        _check_tag(tag, allow_discard=True)
        self._raise_if_failed()
        self.limits.check_outgoing("max_transfer_size", len(view), f"send on tag {tag}")
        seq = self._next_send_seq.get(tag, 0)
        self._next_send_seq[tag] = seq + 1
        transfer = OutgoingTransfer(tag, seq, view, self.chunk_size, deadline)
        done = self.loop.create_future()
        self._outgoing[(tag, seq)] = (transfer, done)
        for chunk in transfer.chunks:
            self.queue.push(chunk)
        self._wake_writers()
        await asyncio.shield(done)

    async def recv_into(self, buffer, *, tag: int) -> int:
        """Receive the next message on ``tag`` into ``buffer`` (exactly its size); returns its size."""
        view = byte_view(buffer, writable=True)
        _check_tag(tag)
        self._raise_if_failed()
        entry = self.reassembler.post(tag, view)
        if entry.done:
            if entry.error is not None:
                raise entry.error
            return entry.total
        waiter = self.loop.create_future()
        self._recv_waiters[entry] = waiter
        try:
            return await waiter
        except asyncio.CancelledError:
            self._recv_waiters.pop(entry, None)
            if self.error is None:
                self.reassembler.unpost(entry)
            raise

    def message_started(self, tag: int) -> bool:
        """Whether the message the next ``recv_into`` on ``tag`` would receive has started arriving."""
        return self.reassembler.next_started(tag)

    async def wait_message_started(self, tag: int) -> None:
        """Return once the next message on ``tag`` has started arriving; receives nothing, so another
        receiver may claim it first (check ``message_started`` again before ``recv_into``)."""
        _check_tag(tag)
        while not self.reassembler.next_started(tag):
            self._raise_if_failed()
            waiter = self.loop.create_future()
            waiters = self._start_waiters.setdefault(tag, [])
            waiters.append(waiter)
            try:
                await waiter
            except asyncio.CancelledError:
                if self._start_waiters.get(tag) is waiters:  # still registered: nothing on this tag arrived
                    waiters.remove(waiter)
                    if not waiters:
                        del self._start_waiters[tag]
                raise

    async def send_control(self, message) -> None:
        """Send one small msgpack-able control message (ordered per stream, not across)."""
        self._raise_if_failed()
        payload = pack_message(message)
        self.limits.check_outgoing("max_control_size", len(payload), "outgoing control message")
        stream = min((s for s in self._streams if s.alive), key=lambda s: len(s.control))
        stream.queue_control(control_header(len(payload)) + payload)

    async def recv_control(self):
        """The next control message the peer sent."""
        message = await self._controls.get()
        if message is _LINK_FAILED:
            self._controls.put_nowait(_LINK_FAILED)  # wake the next reader too
            raise self._lost(self.error, "control message receive")
        return message

    # -- called by streams ------------------------------------------------------------------------
    def place(self, header: Header) -> memoryview:
        """Where a DATA chunk's payload goes; once closing, nowhere (the caller's buffers are released)."""
        if self._closing:
            return self.reassembler.scratch_view(header.raw_len)
        view = self.reassembler.place(header)
        if self._start_waiters:
            for waiter in self._start_waiters.pop(header.tag, ()):
                if not waiter.done():
                    waiter.set_result(None)
        return view

    def chunk_received(self, header: Header) -> None:
        entry = self.reassembler.chunk_done(header)
        if entry is None:
            return
        waiter = self._recv_waiters.pop(entry, None)
        if waiter is None or waiter.done():
            return
        if entry.error is not None:
            waiter.set_exception(entry.error)
        else:
            waiter.set_result(entry.total)

    def ack_received(self, stream: Stream, header: Header) -> None:
        key = (header.tag, header.seq)
        pending = self._outgoing.get(key)
        if pending is None:
            if header.seq < self._next_send_seq.get(header.tag, 0):
                self.duplicate_acks += 1
                return
            raise RemoteProtocolError(f"ack for tag={header.tag} seq={header.seq}, a message never sent")
        transfer, done = pending
        if transfer.ack(header.offset, header.raw_len):
            stream.in_flight.pop((header.tag, header.seq, header.offset), None)
            now = self.loop.time()
            self.delivery.on_delivery(header.raw_len, now)
            if transfer.complete:
                del self._outgoing[key]
                if not self._outgoing:  # nothing left to send: the coming gap is the application's
                    self.delivery.on_idle(now)
                if not done.done():
                    done.set_result(None)
        else:
            self.duplicate_acks += 1

    def control_received(self, payload: bytes) -> None:
        message = unpack_message(payload)
        try:
            self._controls.put_nowait(message)
        except asyncio.QueueFull:
            raise LimitExceeded("max_pending_control", self._controls.qsize() + 1,
                                self.limits.max_pending_control, "control messages nobody read") from None

    def stream_failed(self, stream: Stream, exc: BaseException) -> None:
        """A stream died: re-queue its unacknowledged chunks on the survivors, or fail the link."""
        if not stream.alive:
            return
        stream.abort()
        if self._closing or self.error is not None:
            return
        if self.peer_closed:  # each stream ends after its last acks and CLOSE: fail only after all of them
            if self.streams_alive == 0:
                self.fail(PeerLost(f"{self.peer} closed the link"))
            return
        unacked = stream.take_unacked()
        for chunk in unacked:
            self.queue.push(chunk)
        self.requeued_chunks += len(unacked)
        alive = self.streams_alive
        log.warning("wanlink: stream %d of %s died (%s); %d chunks re-queued on %d surviving streams",
                    stream.index, self.name, exc, len(unacked), alive)
        if alive == 0:
            reason = exc if isinstance(exc, PeerLost) else PeerLost(f"all {self.streams} streams died; last: {exc}")
            self.fail(reason)
        else:
            self._wake_writers()

    def fail(self, exc: BaseException) -> None:
        """Fail the link: close every stream and fail every pending operation with PeerLost."""
        if self.error is not None:
            return
        self.error = exc
        if not self._closing and not self.peer_closed:
            log.warning("wanlink: link %s failed: %s", self.name, exc)
        for stream in self._streams:
            stream.abort()
        self._stop_watchdog()
        self._fail_waiters(exc)
        registry.unregister(self)

    # -- internals --------------------------------------------------------------------------------
    def _raise_if_failed(self) -> None:
        if self.error is not None:
            raise self._lost(self.error, "new operation")

    def _lost(self, cause: BaseException, what: str) -> PeerLost:
        error = PeerLost(f"link to {self.peer} failed ({type(cause).__name__}: {cause}); {what}")
        error.__cause__ = cause
        return error

    def _fail_waiters(self, cause: BaseException) -> None:
        self.queue.drain()
        for (tag, _seq), (transfer, done) in self._outgoing.items():
            if not done.done():
                done.set_exception(self._lost(
                    cause, f"send on tag {tag}: {transfer.acked_bytes} of {transfer.total} bytes acknowledged"))
                done.exception()  # a cancelled sender never retrieves it; don't log it as lost
        self._outgoing.clear()
        for entry, waiter in self._recv_waiters.items():
            if not waiter.done():
                waiter.set_exception(self._lost(
                    cause, f"recv on tag {entry.tag}: {entry.received} of {len(entry.buffer)} bytes received"))
        self._recv_waiters.clear()
        for tag, waiters in self._start_waiters.items():
            for waiter in waiters:
                if not waiter.done():
                    waiter.set_exception(self._lost(cause, f"waiting for a message on tag {tag}"))
        self._start_waiters.clear()
        if not self._controls.full():
            self._controls.put_nowait(_LINK_FAILED)

    def _wake_writers(self) -> None:
        """Wake every idle writer, starting one further each time so small messages spread over streams."""
        count = len(self._streams)
        self._wake_start = (self._wake_start + 1) % count
        for i in range(count):
            stream = self._streams[(self._wake_start + i) % count]
            if stream.alive:
                stream.wake.set()

    def _stop_watchdog(self) -> None:
        if self._watchdog is not None and self._watchdog is not asyncio.current_task():
            self._watchdog.cancel()

    async def _watch(self) -> None:
        """Ping idle streams, drop silent ones, sample delivery rates."""
        interval = min(1.0, self.timeout / 4)
        while True:
            await asyncio.sleep(interval)
            now = self.loop.time()
            for stream in self._streams:
                if not stream.alive:
                    continue
                if now - stream.last_rx > self.timeout:
                    self.stream_failed(stream, PeerLost(
                        f"stream {stream.index} to {self.peer}: peer silent for more than {self.timeout:g} s"))
                elif now - stream.last_tx >= interval and not stream.control:
                    stream.queue_control(PING_FRAME)
            if self.error is not None:
                return
            self._sample_rates(now)

    def _sample_rates(self, now: float) -> None:
        samples = self._rate_samples
        samples.append((now, self._bytes("bytes_sent"), self._bytes("bytes_received")))
        while len(samples) > 2 and now - samples[1][0] >= RATE_WINDOW_S:
            samples.popleft()

    def _bytes(self, counter: str) -> int:
        return sum(getattr(stream, counter) for stream in self._streams)

    def _recent_rate_bps(self, column: int) -> float:
        if len(self._rate_samples) < 2:
            return 0.0
        first, last = self._rate_samples[0], self._rate_samples[-1]
        elapsed = last[0] - first[0]
        return 8 * (last[column] - first[column]) / elapsed if elapsed > 0 else 0.0

    def kernel_bytes_acked(self) -> int | None:
        """Bytes the peer's kernel acknowledged over all live streams (TCP_INFO); None where unknown.

        Unlike wanlink's own acks this does not lag when the peer's application is slow to read,
        so probes measure the path, not the peer's event loop.
        """
        total = 0
        for stream in self._streams:
            if stream.alive:
                acked = tcp_bytes_acked(stream.sock)
                if acked is None:
                    return None
                total += acked
        return total

    def stream_sockets(self) -> list[socket.socket | None]:
        """Each stream's socket by stream index (None once that stream died), for TCP_INFO readers."""
        return [stream.sock if stream.alive else None for stream in self._streams]

    def stats(self) -> dict:
        """Counters for this link (safe to read from any thread)."""
        streams = self._streams
        congestion = []
        for stream in streams:
            try:
                congestion.append(congestion_of(stream.sock) if stream.alive else None)
            except OSError:
                congestion.append(None)
        return {
            "peer": self.peer,
            "streams": len(streams),
            "streams_alive": self.streams_alive,
            "bytes_sent": self._bytes("bytes_sent"),
            "bytes_received": self._bytes("bytes_received"),
            "chunks_sent_per_stream": [s.chunks_sent for s in streams],
            "chunks_received_per_stream": [s.chunks_received for s in streams],
            "requeued_chunks": self.requeued_chunks,
            "duplicate_chunks": self.reassembler.duplicate_chunks,
            "duplicate_acks": self.duplicate_acks,
            "unexpected_bytes_held": self.reassembler.unexpected_bytes,
            "recent_send_bps": self._recent_rate_bps(1),
            "recent_recv_bps": self._recent_rate_bps(2),
            "estimated_bps": 8 * (self.delivery.estimate() or 0.0),
            "chunk_size": self.chunk_size,
            "congestion": congestion,
            **self.labels,
            "error": None if self.error is None else str(self.error),
        }


def check_stream_count(streams) -> int:
    """``streams`` when it is an int in [1, max_streams]; ConfigError otherwise."""
    if isinstance(streams, bool) or not isinstance(streams, int) or not 1 <= streams <= DEFAULT_LIMITS.max_streams:
        raise ConfigError(f"streams must be an int in [1, {DEFAULT_LIMITS.max_streams}], got {streams!r}")
    return streams


async def open_link(host: str, port: int, *, streams: int, secret: bytes | str, meta: dict | None = None,
                    timeout: float = DEFAULT_TIMEOUT, chunk_size: int | None = None, congestion: str | None = None,
                    sock_buffer: int | None = None, compress: bool = False, checksum: bool = False,
                    limits: Limits = DEFAULT_LIMITS, unix_name: str | None = None) -> Link:
    """Open a Link of exactly ``streams`` TCP streams to a wanlink server and authenticate each one.

    Everything is resolved already (``wanlink.connect`` probes the path and reads the settings):
    ``chunk_size`` None is 4 MiB over loopback or Unix sockets, else the transport's default.
    ``timeout`` bounds the connection set-up and is the link's silence timeout afterwards.
    ``unix_name``: the server's abstract Unix socket (``Server.unix_name``, same host and network
    namespace only); the streams are then Unix sockets.
    """
    count = check_stream_count(streams)
    chunk_size_from(chunk_size)  # a bad size fails before connecting
    key = normalize_secret(secret)
    if not key:
        log.warning("wanlink: connecting to %s:%s without authentication (empty secret)", host, port)
    loop = asyncio.get_running_loop()
    link_id = os.urandom(16)
    socks: list[socket.socket | None] = [None] * count

    async def open_stream(index: int) -> None:
        if unix_name is not None:
            family, proto, address, peer_host = socket.AF_UNIX, 0, unix_address(unix_name), None
        else:
            infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
            family, _type, proto, _name, address = infos[0]
            peer_host = address[0]
        sock = socket.socket(family, socket.SOCK_STREAM, proto)
        socks[index] = sock
        configure_stream_socket(sock, congestion=congestion, buffer_bytes=sock_buffer, peer_host=peer_host)
        await loop.sock_connect(sock, address)
        handshake = ClientHandshake(key, link_id, index, count, meta, limits=limits)
        await loop.sock_sendall(sock, handshake.hello())
        while handshake.bytes_wanted():
            reply = handshake.receive(await recv_exactly(loop, sock, handshake.bytes_wanted()))
            if reply:
                await loop.sock_sendall(sock, reply)

    try:
        async with asyncio.timeout(timeout):
            await asyncio.gather(*(open_stream(i) for i in range(count)))
    except BaseException as exc:
        for sock in socks:
            if sock is not None:
                close_quietly(sock)
        if isinstance(exc, TimeoutError) and not isinstance(exc, DeadlineExceeded):
            raise DeadlineExceeded(f"connecting to {host}:{port} took more than {timeout:g} s") from None
        if isinstance(exc, OSError) and not isinstance(exc, WanlinkError):
            raise PeerLost(f"cannot connect to {host}:{port}: {exc}") from exc
        raise
    peer = f"{host}:{port}" if unix_name is None else f"unix:{unix_name}"
    return Link(socks, peer=peer, link_id=link_id, limits=limits, chunk_size=chunk_size,
                timeout=timeout, compress=compress, checksum=checksum).start()
