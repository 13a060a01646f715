"""Link: one logical connection to a peer, striped over N TCP streams."""
from __future__ import annotations

import asyncio
import collections
import socket
import time

from wanlink.errors import ConfigError, LimitExceeded, PeerLost, RemoteProtocolError, WanlinkError
from wanlink.io import registry
from wanlink.io.sockets import (
    close_quietly, congestion_of, is_local_socket, log, tcp_bytes_acked, tcp_info, tcp_notsent_bytes, tcp_rtt_s,
    tcp_send_progress, tcp_send_room,
)
from wanlink.io.stream import Stream
from wanlink.proto.control import abort_frame, pack_message, unpack_abort, unpack_message
from wanlink.proto.flow import MIN_EAGER_WINDOW, SendFlow, credit_batch, eager_window
from wanlink.proto.frames import (
    PING_FRAME, FrameType, Header, announce_frame, control_header, credit_frame, grant_frame,
)
from wanlink.proto.limits import DEFAULT_LIMITS, Limits
from wanlink.proto.reassembly import PROBE_DISCARD_TAG, Incoming, Reassembler
from wanlink.probe.rate import DeliveryRateEstimator, KernelAcks, SendingTime, WireTime
from wanlink.sched.chunking import CopyPool, OutgoingTransfer, chunk_size_from
from wanlink.sched.edf import EDFQueue

DEFAULT_TIMEOUT = 30.0
LOOPBACK_CHUNK_SIZE = 4 * 1024 * 1024
"""Default chunk size of a link whose streams all run over loopback or Unix sockets.
There the per-chunk CPU (frames, acks, wakeups) is what limits collectives; elsewhere the probe
picks one by rate and RTT (smaller chunks pre-empt and re-send at a finer grain)."""
RATE_WINDOW_S = 2.0
COPY_TO_SETTLE_BYTES = 1024 * 1024
"""A send with ``until="written"`` returns once all of it is in the kernel and at most this many of
its bytes are unacknowledged: those are copied (about 25 us for 1 MiB, into a reused buffer of the
link's ``CopyPool``) so that a stream dying later can still re-send them. Copying more would cost
more than the ack it saves on fast paths."""
COPIES_KEPT = 4
"""Copy buffers (of COPY_TO_SETTLE_BYTES) a link keeps for reuse: sends settled at once per link."""
ABORT_GRACE_S = 1.0  # how long a failing link tries to deliver its ABORT before closing
KERNEL_ACK_POLL_S = 0.002
"""While a message written in full awaits its acks, the link reads its streams' acknowledged bytes
this often (``KernelAcks``): about 5 us of getsockopt a stream, a few dozen times a message."""
SEND_ROOM_FLOOR = 64 * 1024
"""A stream whose congestion window lets less than this (or less than the next chunk, if smaller)
leave at once is written to only after the others (``Link._write_chunks``): traced on an 80 ms path,
one of 8 streams left at 6 to 10 segments by losses before training stalled every 4th step's
message of 38 segments for several round trips while the other streams had windows of hundreds."""
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
                 compress: bool = False, checksum: bool = False, keys: list | None = None, dialer=None,
                 chunk_order: str = "edf"):
        """``keys``: per stream, the (send, receive) keys its handshake derived (``secure=True``).
        ``dialer``: what opened the streams (``wanlink.io.dial.Dialer``), to re-open one that dies.
        ``chunk_order``: "edf" (deadline first) or "fcfs" (arrival order) for what this side sends."""
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
        self.queue = EDFQueue(chunk_order)  # "fcfs": arrival order, ignoring deadlines
        self.peer_closed = False
        self.error: BaseException | None = None
        self.requeued_chunks = 0
        self.duplicate_acks = 0
        self.reconnects = 0  # streams re-opened (by us) or re-attached (by the peer) under this link id
        self._dialer = dialer
        self._reopening: dict[int, asyncio.Task] = {}
        self.loop = asyncio.get_running_loop()
        keys = keys or [None] * len(socks)
        self.secure = all(key is not None for key in keys)
        self._streams = [Stream(self, sock, index, keys[index]) for index, sock in enumerate(socks)]
        self._outgoing: dict[tuple[int, int], tuple[OutgoingTransfer, asyncio.Future]] = {}
        self._copies = CopyPool(COPY_TO_SETTLE_BYTES, COPIES_KEPT)
        self._next_send_seq: dict[int, int] = {}
        self._recv_waiters: dict[Incoming, asyncio.Future] = {}
        self._start_waiters: dict[int, list[asyncio.Future]] = {}  # tag -> wait_message_started callers
        self._controls: asyncio.Queue = asyncio.Queue(limits.max_pending_control)
        self._closing = False
        self._wake_start = 0
        self._holding = 0  # > 0: control frames wait for release_frames (one write for all of them)
        self._chunks_due = False  # _write_chunks is scheduled
        self._frames_due = False  # _release_held_frames is scheduled (it holds one hold_frames)
        self._rate_samples: collections.deque = collections.deque()
        self._watchdog: asyncio.Task | None = None
        self._failure_callbacks: list = []
        self.flow = SendFlow(max_grants=limits.max_pending_transfers)  # what we may send (peer's credit, grants)
        self._credit_granted = limits.max_unexpected_bytes  # cumulative eager credit we gave the peer
        self._credit_batch = credit_batch(limits.max_unexpected_bytes)  # credit returned once this much is due
        self._rtt_s: float | None = None  # smallest kernel RTT over the streams (TCP only)
        self.send_log: collections.deque | None = None  # (tag, seq, offset) per chunk handed to a stream
        self.delivery = DeliveryRateEstimator()  # acknowledged bytes/s, a low percentile: errs low
        self.sending = SendingTime()  # busy periods of what we send (density="auto" reads it)
        self._wire = WireTime()  # each message's time on the wire (``wire``)
        self._probe_wire = WireTime()  # the same for what we send on PROBE_DISCARD_TAG (``probe_wire``)
        self.kernel_acks = KernelAcks()  # when the peer's kernel acknowledged each message (WAN TCP streams)
        self.timing_acks = False  # kernel acks tracked: from the first read of ``wire`` or ``probe_wire`` on
        self._ack_poll: asyncio.TimerHandle | None = None

    def record_send_order(self, maxlen: int = 100_000) -> collections.deque:
        """Start logging the order in which chunks leave (for tests and tracing); returns the log."""
        self.send_log = collections.deque(maxlen=maxlen)
        return self.send_log

    @property
    def wire(self) -> WireTime:
        """Each message's time on the wire, from its send to its last byte's ack (the peer's kernel's
        on WAN streams, see ``KernelAcks``). Reading it the first time turns the kernel-ack clock on
        (TCP_INFO read per chunk written and polled while a message awaits its acks; TCP_QUICKACK on
        this side's reads, for the peer's clock): only ``density="auto"`` reads it, and no other
        link pays for it. Until then a message ends at the peer's ack frame."""
        self._time_acks()
        return self._wire

    @property
    def probe_wire(self) -> WireTime:
        """``wire`` for what we send on PROBE_DISCARD_TAG (probe bursts); reading it turns the same clock on."""
        self._time_acks()
        return self._probe_wire

    def open_since(self, probes: bool = False) -> float | None:
        """When the earliest message still awaiting its acks was sent (``time.monotonic``; with
        ``probes``, of those on PROBE_DISCARD_TAG, else of the others); None when none is. For
        ``WireTime.reading`` (any thread)."""
        return min((transfer.started for transfer, _done in list(self._outgoing.values())
                    if (transfer.tag == PROBE_DISCARD_TAG) == probes), default=None)

    def _time_acks(self) -> None:
        if not self.timing_acks:
            self.timing_acks = True
            for stream in self._streams:
                stream.ack_quickly()

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self) -> "Link":
        self._queue_frame(credit_frame(self._credit_granted))  # advertise our staging budget
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
        self._stop_reopening()
        await asyncio.gather(*(stream.close(grace) for stream in self._streams))
        registry.unregister(self)
        self._release()

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

    def silent_s(self) -> float:
        """Seconds since any live stream received a byte (a live peer pings idle streams every second)."""
        last = max((stream.last_rx for stream in self._streams if stream.alive), default=None)
        return float("inf") if last is None else self.loop.time() - last

    @property
    def closed(self) -> bool:
        return self._closing or self.error is not None

    # -- messages -------------------------------------------------------------------------------
    async def send(self, buffer, *, tag: int, deadline=0, until: str = "acked") -> None:
        """Send ``buffer`` as one message on ``tag``; returns once the peer acknowledged every byte,
        or with ``until="written"`` once every byte is in the kernel's socket buffers and the link
        holds a copy of the unacknowledged ones (at most ``COPY_TO_SETTLE_BYTES``; more waits for acks).
        "written" saves the ack's round trip; a peer failing after it returns fails the next operation.

        The buffer is not copied: keep it unchanged until this returns. Cancelling the caller does
        not withdraw the message (it is already promised to the peer); it still goes out: ``done``
        only tells the caller, the transfer's state lives in ``_outgoing`` (awaited directly, not
        through ``asyncio.shield``: a shield costs the caller one more loop iteration per send).
        """
        await self.start_send(buffer, tag=tag, deadline=deadline, until=until)

    def start_send(self, buffer, *, tag: int, deadline=0, until: str = "acked") -> asyncio.Future:
        """``send`` without its wait: queues the message now and returns the future ``send`` awaits
        (done as ``until`` says; failed with PeerLost). For exchanges that start several messages
        from one task (``LinkComm.exchange``) instead of a task each. The message goes out whether
        or not anyone awaits the future."""
        if until not in ("acked", "written"):
            raise ConfigError(f"send until must be 'acked' or 'written', got {until!r}")
        view = byte_view(buffer)
        _check_tag(tag, allow_discard=True)
        total = len(view)
        if self.error is not None:  # (messages built only to raise: this runs for every message)
            self._raise_if_failed(f"send on tag {tag}: 0 of {total} bytes acknowledged")
        if total > self.limits.max_transfer_size:
            self.limits.check_outgoing("max_transfer_size", total, f"send on tag {tag}")
        seq = self._next_send_seq.get(tag, 0)
        self._next_send_seq[tag] = seq + 1
        transfer = OutgoingTransfer(tag, seq, view, self.chunk_size, deadline)
        transfer.settle_written = until == "written"
        done = self.loop.create_future()
        self._outgoing[(tag, seq)] = (transfer, done)
        transfer.started = time.monotonic()  # not loop.time(): uvloop's ticks are whole milliseconds
        self.sending.on_send(transfer.started)
        if tag == PROBE_DISCARD_TAG:  # dropped by the peer: no flow control
            self._queue_chunks([(chunk, False) for chunk in transfer.chunks])
        else:
            flow = self.flow
            # The window only matters for a message larger than the smallest one eager_window gives.
            window = total if total <= min(MIN_EAGER_WINDOW, flow.budget // 2) else self.eager_window()
            released, announce = flow.start(tag, seq, [(chunk, len(chunk.view)) for chunk in transfer.chunks], window)
            if announce:
                self._queue_frame(announce_frame(tag, seq, transfer.total))
            self._queue_chunks(released)
        return done

    async def recv_into(self, buffer, *, tag: int) -> int:
        """Receive the next message on ``tag`` into ``buffer`` (exactly its size); returns its size."""
        entry, waiter = self.start_recv(buffer, tag=tag)
        try:
            return await waiter
        except asyncio.CancelledError:
            self.cancel_recv(entry)
            raise

    def start_recv(self, buffer, *, tag: int) -> tuple[Incoming, asyncio.Future]:
        """``recv_into`` without its wait: posts the receive now; returns it and the future that
        ``recv_into`` awaits (done with the message's size, or failed). A receive nobody awaits
        any more must be given back with ``cancel_recv``."""
        view = byte_view(buffer, writable=True)
        _check_tag(tag)
        if self.error is not None:
            self._raise_if_failed(f"recv on tag {tag}: 0 of {len(view)} bytes received")
        entry = self.reassembler.post(tag, view)
        if entry.landing and not entry.done:
            self._land_directly(entry)
        waiter = self.loop.create_future()
        self.hold_frames()  # the credit and the grant leave in one write
        try:
            self._return_credit()
            if entry.done:
                if entry.error is not None:
                    raise entry.error
                waiter.set_result(entry.total)
                return entry, waiter
            self._queue_frame(grant_frame(tag, entry.seq))
        finally:
            self.release_frames()
        self._recv_waiters[entry] = waiter
        return entry, waiter

    def cancel_recv(self, entry: Incoming) -> None:
        """Give back a receive of ``start_recv`` whose caller stopped waiting: a message it had not
        finished goes to the next receive on its tag (nothing for a finished one or a failed link)."""
        self._recv_waiters.pop(entry, None)
        if self.error is None:
            self.reassembler.unpost(entry)

    def _land_directly(self, entry: Incoming) -> None:
        """Chunks of ``entry`` that were arriving into staging when its receive was posted go on
        into the posted buffer: only what arrived so far is copied (not the whole chunk at its end)."""
        reassembler = self.reassembler
        for offset in reassembler.staged_landing(entry):
            key = (entry.tag, entry.seq, offset)
            for stream in self._streams:
                decoder = stream.decoder
                if stream.alive and decoder is not None and decoder.landing() == key:
                    decoder.redirect(reassembler.land_directly(entry, offset))
                    reassembler.release_staging(entry, offset)
                    break

    def message_started(self, tag: int) -> bool:
        """Whether the message the next ``recv_into`` on ``tag`` would receive has started arriving."""
        return self.reassembler.next_started(tag)

    async def wait_message_started(self, tag: int) -> None:
        """Return once the next message on ``tag`` has started arriving; receives nothing, so another
        receiver may claim it first (check ``message_started`` again before ``recv_into``)."""
        _check_tag(tag)
        while not self.reassembler.next_started(tag):
            self._raise_if_failed(f"waiting for a message on tag {tag}")
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

    def send_control(self, message) -> None:
        """Queue one small msgpack-able control message (ordered per stream, not across); returns at once."""
        self._raise_if_failed("control message send")
        payload = pack_message(message)
        self.limits.check_outgoing("max_control_size", len(payload), "outgoing control message")
        self._queue_frame(control_header(len(payload)) + payload)

    async def recv_control(self):
        """The next control message the peer sent."""
        message = await self._controls.get()
        if message is _LINK_FAILED:
            self._controls.put_nowait(_LINK_FAILED)  # wake the next reader too
            raise self._lost(self.error, "control message receive")
        return message

    # -- called by streams ------------------------------------------------------------------------
    def hold_frames(self) -> None:
        """Queue control frames (acks, credits, grants) without writing them until the matching
        ``release_frames``, so that what one event produces leaves in one write (nests)."""
        self._holding += 1

    def release_frames(self, after_wakeups: bool = False) -> None:
        """``after_wakeups``: hold them on until the end of this loop iteration (a readable event's
        acks: the receives that event completed resume first, and the frames their tasks queue
        meanwhile join the same write)."""
        if after_wakeups and self._holding == 1 and not self._frames_due:
            self._frames_due = True
            self.loop.call_soon(self._release_held_frames)  # (the hold passes to it)
            return
        self._holding -= 1
        if not self._holding:
            for stream in self._streams:
                if stream.control:
                    stream.kick()

    def _release_held_frames(self) -> None:
        self._frames_due = False
        self.release_frames()

    def place(self, header: Header) -> memoryview:
        """Where a DATA chunk's payload goes; once closing, nowhere (the caller's buffers are released)."""
        if self._closing:
            return self.reassembler.scratch_view(header.raw_len)
        view = self.reassembler.place(header)
        if self._start_waiters:
            self._wake_start_waiters(header.tag)
        return view

    def chunk_received(self, header: Header) -> None:
        reassembler = self.reassembler
        entry = reassembler.chunk_done(header)
        if reassembler.credit_due >= self._credit_batch:  # (checked here: this runs for every chunk)
            self._return_credit()
        if entry is None:
            return
        waiter = self._recv_waiters.pop(entry, None)
        if waiter is None or waiter.done():
            return
        if entry.error is not None:
            waiter.set_exception(entry.error)
        else:
            waiter.set_result(entry.total)

    def chunk_written(self, chunk, stream: Stream) -> None:
        """``stream`` put all of ``chunk`` into its kernel buffer (or found it acknowledged already)."""
        transfer = chunk.transfer
        transfer.written(chunk)
        if self.timing_acks and not stream.is_local:
            self._note_kernel_position(transfer, stream)
        if transfer.settle_written and not transfer.unwritten:
            self._settle_written(transfer)

    def _settle_written(self, transfer: OutgoingTransfer) -> None:
        """Finish an ``until="written"`` send whose bytes are all in the kernel, once copying its
        unacknowledged ones is cheap (see ``COPY_TO_SETTLE_BYTES``)."""
        pending = self._outgoing.get((transfer.tag, transfer.seq))
        if pending is None or transfer.settled or transfer.total - transfer.acked_bytes > COPY_TO_SETTLE_BYTES:
            return
        transfer.settled = True
        transfer.keep_unacked(self._copies)  # (also when the caller was cancelled: the message still goes out)
        if not pending[1].done():
            pending[1].set_result(None)

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
            self.sending.on_ack(header.raw_len)
            if transfer.complete:
                del self._outgoing[key]
                finished = time.monotonic()
                wire = self._probe_wire if transfer.tag == PROBE_DISCARD_TAG else self._wire
                wire.on_message(transfer.started, self.kernel_acks.finish(key, finished), transfer.total)
                transfer.release_copy(self._copies)
                if not self._outgoing:  # nothing left to send: the coming gap is the application's
                    self.delivery.on_idle(now)
                    self.sending.on_idle(finished)
                if not done.done():
                    done.set_result(None)
            elif transfer.settle_written and not transfer.unwritten:
                self._settle_written(transfer)
        else:
            self.duplicate_acks += 1

    def _note_kernel_position(self, transfer: OutgoingTransfer, stream: Stream) -> None:
        """Where ``transfer``'s bytes end in ``stream``'s kernel byte count; once all of it is written,
        poll for the peer's kernel acks (see ``KernelAcks``)."""
        key = (transfer.tag, transfer.seq)
        progress = tcp_send_progress(stream.sock) if key in self._outgoing else None
        if progress is None:
            return
        self.kernel_acks.written(key, stream.index, progress[0])
        if not transfer.unwritten:
            self.kernel_acks.all_written(key)
            if self._ack_poll is None:  # nothing can be acknowledged before a round trip: the smoothed RTT / 2
                early = transfer.started + 0.5 * (self._rtt_s or 0.0) - time.monotonic()
                self._ack_poll = self.loop.call_later(max(KERNEL_ACK_POLL_S, early), self._poll_kernel_acks)

    def _poll_kernel_acks(self) -> None:
        self._ack_poll = None
        awaited = self.kernel_acks.awaited()
        if not awaited or self.error is not None:
            return
        acked = {}
        for index in awaited:
            stream = self._streams[index]
            progress = tcp_send_progress(stream.sock) if stream.alive else None
            acked[index] = None if progress is None else progress[1]
        self.kernel_acks.poll(acked, time.monotonic())
        if self.kernel_acks.awaited():
            self._ack_poll = self.loop.call_later(KERNEL_ACK_POLL_S, self._poll_kernel_acks)

    def flow_received(self, header: Header) -> None:
        """A GRANT or CREDIT for what we send, or an ANNOUNCE of a message waiting for our grant."""
        if header.type is FrameType.CREDIT:
            self._queue_chunks(self.flow.on_credit(header.total))
            return
        if header.tag < 0:
            raise RemoteProtocolError(f"{header.type.name} on reserved tag {header.tag}")
        if header.type is FrameType.GRANT:
            started = header.seq < self._next_send_seq.get(header.tag, 0)
            self._queue_chunks(self.flow.on_grant(header.tag, header.seq, started))
        else:
            self.reassembler.announce(header)
            self._wake_start_waiters(header.tag)

    def abort_received(self, payload: bytes) -> None:
        """The peer is failing the link and said why."""
        code, text = unpack_abort(payload)
        self.fail(PeerLost(f"{self.peer} failed the link ({code}): {text}"))

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
        unacked = self._salvage(stream)
        alive = self.streams_alive
        log.warning("stream %d of %s died (%s); %d chunks re-queued on %d surviving streams",
                    stream.index, self.name, exc, unacked, alive)
        if alive == 0:
            reason = exc if isinstance(exc, PeerLost) else PeerLost(f"all {self.streams} streams died; last: {exc}")
            self.fail(reason)
            return
        self._wake_writers()
        if self._dialer is not None and stream.index not in self._reopening:
            task = self.loop.create_task(self._dialer.reopen(self, stream.index),
                                         name=f"wanlink-reopen-{stream.index}-{self.name}")
            self._reopening[stream.index] = task
            task.add_done_callback(lambda _task, index=stream.index: self._reopening.pop(index, None))

    def replace_stream(self, index: int, sock: socket.socket, keys: tuple | None) -> None:
        """Stream ``index`` runs on ``sock`` from now on: re-opened by us, or by the peer (a server
        re-attaching an authenticated stream of this link id); one still alive here is replaced."""
        if self.closed:
            close_quietly(sock)
            return
        old = self._streams[index]
        self._streams[index] = Stream(self, sock, index, keys)
        if self.timing_acks:
            self._streams[index].ack_quickly()
        if old.alive:  # dead to the peer, which re-opened it
            old.abort()
            self._salvage(old)
        old.detach()
        self._streams[index].start()
        self.reconnects += 1
        self._repeat_flow_frames()
        self._wake_writers()

    def _salvage(self, stream: Stream) -> int:
        """Re-queue a dead stream's unacknowledged chunks (in deadline order, like any chunk) and repeat
        the flow frames it may have lost; returns how many chunks."""
        unacked = stream.take_unacked()
        for chunk in unacked:
            chunk.transfer.requeued(chunk)
            self.queue.push(chunk)
        self.requeued_chunks += len(unacked)
        self._repeat_flow_frames()
        return len(unacked)

    def fail(self, exc: BaseException) -> None:
        """Fail the link: close every stream and fail every pending operation with PeerLost.

        Unless the peer is gone already (PeerLost), it is told why first: an ABORT frame with a
        reason code and the error's text, so its error names what ours does (tag, bytes, limit).
        """
        if self.error is not None:
            return
        if not self._closing and not self.peer_closed:
            log.warning("link %s failed: %s", self.name, exc, exc_info=None if isinstance(exc, WanlinkError) else exc)
        self.error = exc.with_traceback(None)  # its frames would hold this link (and staged chunks) in a cycle
        if isinstance(exc, PeerLost):
            for stream in self._streams:
                stream.abort()
        else:
            frame = abort_frame(exc)
            for stream in self._streams:
                stream.abort_saying(frame, ABORT_GRACE_S)
        self._stop_watchdog()
        self._stop_reopening()
        self._fail_waiters(exc)
        registry.unregister(self)
        callbacks, self._failure_callbacks = self._failure_callbacks, []
        for callback in callbacks:
            callback(self)
        if not self._closing:  # (close() releases once its streams said goodbye)
            self._release()

    def add_failure_callback(self, callback) -> None:
        """Call ``callback(link)`` once if the link fails (not when closed locally); e.g. to drop it."""
        self._failure_callbacks.append(callback)

    # -- internals --------------------------------------------------------------------------------
    def _release(self) -> None:
        """The link is finished: free staged chunks at once and drop the references from its streams
        back to it, so that it is freed without waiting for Python's cycle collector."""
        self.reassembler.clear()
        self._failure_callbacks = []
        for stream in self._streams:
            stream.detach()

    def _raise_if_failed(self, operation: str) -> None:
        if self.error is not None:
            raise self._lost(self.error, operation)

    @property
    def peer_description(self) -> str:
        """The peer as the layers above know it: ``rank 2 at host:port (unix)`` where labels say so."""
        if "peer_rank" not in self.labels:
            return self.peer
        return f"rank {self.labels['peer_rank']} at {self.labels.get('peer_address', '?')} ({self.peer})"

    def _lost(self, cause: BaseException, what: str) -> PeerLost:
        error = PeerLost(f"link to {self.peer_description} failed ({type(cause).__name__}: {cause}); {what}")
        error.__cause__ = cause
        return error

    def _fail_waiters(self, cause: BaseException) -> None:
        self.queue.drain()
        self.flow.forget()
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

    def eager_window(self) -> int:
        """Bytes of a new message sent before the peer grants it: a bandwidth-delay product of the
        acknowledged rate and the kernel's RTT (see ``wanlink.proto.flow.eager_window``)."""
        return eager_window(self.delivery.estimate(), self._rtt_s, self.flow.budget)

    def _queue_chunks(self, released: list) -> None:
        """Queue the chunks flow control released, marking those sent on eager credit."""
        if not released:
            return
        for chunk, eager in released:
            chunk.eager = eager
            self.queue.push(chunk)
        self._kick_writers()

    def _queue_frame(self, frame: bytes) -> None:
        """Queue a control or flow frame on the live stream with the fewest waiting (none left: drop it),
        and write it now unless frames are held (``hold_frames``)."""
        streams = self._streams
        if len(streams) == 1:
            stream = streams[0]
            if not stream.alive:
                return
        else:
            alive = [s for s in streams if s.alive]
            if not alive:
                return
            stream = min(alive, key=lambda s: len(s.control))
        stream.control.append(frame)
        if not self._holding:
            stream.kick()

    def _return_credit(self) -> None:
        due = self.reassembler.take_credit(self._credit_batch)
        if due:
            self._credit_granted += due
            self._queue_frame(credit_frame(self._credit_granted))

    def _repeat_flow_frames(self) -> None:
        """A stream died, maybe with flow frames unsent: say again what the peer must know (idempotent)."""
        self._queue_frame(credit_frame(self._credit_granted))
        for entry in self.reassembler.pending():
            self._queue_frame(grant_frame(entry.tag, entry.seq))
        for tag, seq, total in self.flow.waiting_announced():
            self._queue_frame(announce_frame(tag, seq, total))

    def _wake_start_waiters(self, tag: int) -> None:
        for waiter in self._start_waiters.pop(tag, ()):
            if not waiter.done():
                waiter.set_result(None)

    def _kick_writers(self) -> None:
        """Have the streams write the queued chunks at the end of this loop iteration: the chunks of
        every send queued in it (by several tasks) then leave in deadline order, as from a writer task,
        but without waking one."""
        if not self._chunks_due:
            self._chunks_due = True
            self.loop.call_soon(self._write_chunks)

    def _write_chunks(self) -> None:
        """Streams write the queued chunks (``_streams_in_turn``); a stream whose kernel buffer fills
        leaves the rest to the next one. A stream whose congestion window cannot send the next chunk
        (or SEND_ROOM_FLOOR of it) at once waits until the others had their turn: its kernel would
        take the chunk and hold it for round trips while another stream could send it now."""
        self._chunks_due = False
        short = []
        for stream in self._streams_in_turn():
            if not self.queue:
                return
            if self._window_short(stream):
                short.append(stream)
            else:
                stream.kick(chunks=True)
        for stream in short:
            if not self.queue:
                return
            stream.kick(chunks=True)

    def _window_short(self, stream: Stream) -> bool:
        """Whether ``stream``'s congestion window lets less than the next chunk (at most
        SEND_ROOM_FLOOR) leave now; False for a lone stream, a local one (Unix or loopback: no window
        worth asking about, and no TCP_INFO to read per chunk) and where the kernel cannot say."""
        if len(self._streams) == 1 or stream.is_local:
            return False
        room = tcp_send_room(stream.sock)
        if room is None:
            return False
        chunk = self.queue.peek()
        return chunk is not None and room < min(len(chunk.view), SEND_ROOM_FLOOR)

    def _wake_writers(self) -> None:
        """Wake every idle writer (``_streams_in_turn``)."""
        for stream in self._streams_in_turn():
            stream.wake.set()

    def _streams_in_turn(self):
        """The live streams, starting one further each call, so that small messages spread over them."""
        streams = self._streams
        count = len(streams)
        if count == 1:  # (no generator: this runs for every message)
            return streams if streams[0].alive else ()
        return self._rotated(streams, count)

    def _rotated(self, streams: list, count: int):
        self._wake_start = (self._wake_start + 1) % count
        for i in range(count):
            stream = streams[(self._wake_start + i) % count]
            if stream.alive:
                yield stream

    def _stop_reopening(self) -> None:
        for task in list(self._reopening.values()):
            if task is not asyncio.current_task():
                task.cancel()

    def _stop_watchdog(self) -> None:
        if self._ack_poll is not None:
            self._ack_poll.cancel()
            self._ack_poll = None
        if self._watchdog is not None and self._watchdog is not asyncio.current_task():
            self._watchdog.cancel()
            self._watchdog = None  # its CancelledError's traceback holds this link

    async def _watch(self) -> None:
        """Ping idle streams, drop silent ones, sample delivery rates."""
        interval = min(1.0, self.timeout / 4)
        woke = self.loop.time()
        while True:
            await asyncio.sleep(interval)
            now = self.loop.time()
            # A loop that overslept (this process stalled: GIL, swap, a loaded host) has not read what
            # arrived meanwhile, nor sent its pings: judge silence from the next round on.
            judge, woke = now - woke < 2 * interval, now
            for stream in self._streams:
                if not stream.alive:
                    continue
                if judge and now - stream.last_rx > self.timeout:
                    self.stream_failed(stream, PeerLost(
                        f"stream {stream.index} to {self.peer}: peer silent for more than {self.timeout:g} s"))
                elif now - stream.last_tx >= interval and not stream.control:
                    stream.queue_control(PING_FRAME)
            if self.error is not None:
                return
            self._rtt_s = min(filter(None, (tcp_rtt_s(s.sock) for s in self._streams if s.alive)), default=None)
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

    def on_wire(self, tag: int) -> bool | None:
        """Whether every send started on ``tag`` has left this host: all its chunks written into the
        kernel and no live stream's kernel buffer holding bytes not sent yet (TCP_INFO
        ``notsent_bytes``, whatever their tag). None where a stream's kernel cannot say (not TCP)."""
        if any(transfer.tag == tag and transfer.unwritten for transfer, _done in self._outgoing.values()):
            return False
        notsent = [tcp_notsent_bytes(stream.sock) for stream in self._streams if stream.alive]
        return None if None in notsent else not any(notsent)

    def min_rtt_s(self) -> float | None:
        """The smallest minimum RTT the kernel saw on any live TCP stream (seconds); None where unknown."""
        infos = (tcp_info(stream.sock) for stream in self._streams if stream.alive)
        return min((info.min_rtt / 1e6 for info in infos if info is not None and info.min_rtt), default=None)

    def stream_sockets(self) -> list[socket.socket | None]:
        """Each stream's socket by stream index (None once that stream died), for TCP_INFO readers."""
        return [stream.sock if stream.alive else None for stream in self._streams]

    def pending(self, limit: int = 20) -> dict:
        """What this link still owes and awaits, to say where a stuck exchange stands (call on the
        link's loop): sends not finished (tag, seq, bytes acknowledged, total), posted receives not
        complete (tag, seq, bytes received, size), chunks queued and in flight per stream, messages
        flow control holds back and the peer's eager credit left. At most ``limit`` of each list."""
        sends = [(t.tag, t.seq, t.acked_bytes, t.total) for t, _done in self._outgoing.values()]
        receives = [(e.tag, e.seq, e.received, len(e.buffer)) for e in self.reassembler.pending()]
        return {"peer": self.peer_description, "sends": sends[:limit], "sends_pending": len(sends),
                "receives": receives[:limit], "receives_pending": len(receives),
                "queued_chunks": len(self.queue), "held_messages": self.flow.held_messages,
                "eager_credit": self.flow.credit, "unexpected_bytes_held": self.reassembler.unexpected_bytes,
                "in_flight_per_stream": [len(s.in_flight) if s.alive else None for s in self._streams],
                "silent_s": self.silent_s(), "error": None if self.error is None else str(self.error)}

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
            "reconnects": self.reconnects,
            "duplicate_chunks": self.reassembler.duplicate_chunks,
            "duplicate_acks": self.duplicate_acks,
            "unexpected_bytes_held": self.reassembler.unexpected_bytes,
            "peak_unexpected_bytes": self.reassembler.peak_unexpected_bytes,
            "eager_window": self.eager_window(),
            "recent_send_bps": self._recent_rate_bps(1),
            "recent_recv_bps": self._recent_rate_bps(2),
            "estimated_bps": 8 * (self.delivery.estimate() or 0.0),
            "chunk_size": self.chunk_size,
            "congestion": congestion,
            **self.labels,
            "error": None if self.error is None else str(self.error),
        }
