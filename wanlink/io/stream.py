"""One TCP stream of a Link: a reader that receives payloads in place, a writer that pulls chunks."""
from __future__ import annotations

import asyncio
import functools
import os
import socket
import zlib

from wanlink.errors import PeerLost
from wanlink.io.sockets import close_quietly, is_local_socket, log
from wanlink.proto.frames import (
    CLOSE_FRAME, FLAG_CHECKSUM, FLAG_EAGER, FLAG_LZ4, AbortReceived, AckReceived, ChunkReceived, CloseReceived,
    ControlReceived, FlowReceived, PingReceived, ack_header, compress_chunk, data_header,
)
from wanlink.proto import decoder as decoding
from wanlink.proto.seal import FrameOpener, FrameSealer
from wanlink.sched.chunking import Chunk

MAX_FRAMES_PER_SEND = 256  # bounded by IOV_MAX (1024) with room to spare
READ_BUDGET_BYTES = 16 * 1024 * 1024
"""Most bytes one readable callback takes before letting other callbacks run (fairness between streams)."""


def receive_into(decoder, fd: int, budget: int) -> tuple[int, list, bool]:
    """Scatter-read the non-blocking ``fd`` into ``decoder.buffers()`` (``os.readv``) and decode,
    until a read comes back short (the socket is drained: no read that would only say so) or
    ``budget`` bytes were read. Returns (bytes read, events, whether the peer closed its side).
    A read error raises OSError, unless bytes were read before it (the next call meets it again)."""
    events: list = []
    total = 0
    while total < budget:
        buffers = decoder.buffers()
        try:
            n = os.readv(fd, buffers)
        except BlockingIOError:
            break
        except OSError:
            if total:
                break
            raise
        if n == 0:
            return total, events, True
        total += n
        events += decoder.advance(n)
        if n < sum(map(len, buffers)):
            break
    return total, events, False


class Stream:
    """A TCP connection carrying frames for one Link.

    The reader is a readiness callback registered once (``loop.add_reader``): each time the socket
    is readable it receives straight into the decoder's target, and into its read-ahead area the
    frames after it (one ``readv`` of both; the compiled decoder's reads run in C, without the GIL),
    until a read comes back short (the socket is drained) or ``READ_BUDGET_BYTES`` are read, and
    hands every decoded event to the link. (``sock_recv_into`` would register and unregister the
    socket with epoll and wake a task for every single read.)
    The writer sends queued control frames (acks, pings) first, then pulls the next chunk from the
    link's EDF queue whenever its previous send has drained into the kernel, so a faster stream
    carries more chunks. Whoever queues something calls ``kick()``, which writes it at once, in the
    caller's callback, while the kernel takes every byte: no task wakes for the common case (a small
    message, an ack). The writer task only finishes a frame the kernel took part of, as room appears.
    """

    def __init__(self, link, sock: socket.socket, index: int, keys: tuple[bytes, bytes] | None = None):
        """``keys``: (send, receive) keys of a sealed stream (``secure=True``), else None."""
        self.link = link
        self.sock = sock
        self._fd = sock.fileno()
        self.index = index
        self.alive = True
        self.closing = False
        self.in_flight: dict[tuple[int, int, int], Chunk] = {}
        self.control: list[bytes] = []
        self.wake = asyncio.Event()
        self.decoder = decoding.new(link.place, link.limits)  # (the link breaks these cycles: detach())
        self._sealer = None
        if keys is not None:  # same interface: the reader never knows
            self._sealer = FrameSealer(keys[0])
            self.decoder = FrameOpener(self.decoder, keys[1], f"stream {index} of link {link.name}")
        # the compiled decoder reads in C, without the GIL; the others through receive_into
        self._receive = getattr(self.decoder, "receive", None) or functools.partial(receive_into, self.decoder)
        loop = asyncio.get_running_loop()
        self.loop = loop
        self.last_rx = self.last_tx = loop.time()
        self.chunks_sent = self.chunks_received = 0
        self.bytes_sent = self.bytes_received = 0
        self._writer: asyncio.Task | None = None
        self._unsent: list | None = None  # the rest of a frame the kernel took part of (the writer sends it)
        self._unsent_chunk: Chunk | None = None  # the chunk that frame carries, reported written after it
        self._reading = False
        self._read_done: asyncio.Future = loop.create_future()  # set once the reader stopped
        self._writable: asyncio.Future | None = None  # awaited by the writer while the socket is full
        self._goodbye: asyncio.Task | None = None  # delivering an ABORT before the socket closes
        self.is_local = is_local_socket(sock)  # Unix or loopback: no WAN to time or to ack quickly for
        self._quickack = False  # see ack_quickly

    def ack_quickly(self) -> None:
        """Acknowledge every read at once from now on (``_ack_now``; WAN streams only): the peer times
        its messages by our kernel's acks (``Link.wire``)."""
        self._quickack = hasattr(socket, "TCP_QUICKACK") and not self.is_local

    def start(self) -> None:
        self.loop.add_reader(self.sock, self._on_readable)
        self._reading = True
        self._writer = self.loop.create_task(self._guard(self._write_loop), name=f"wanlink-write-{self.index}")

    def queue_control(self, frame: bytes) -> None:
        """Queue ``frame`` for the writer task (rare frames: pings, CLOSE; the hot path uses ``kick``)."""
        self.control.append(frame)
        self.wake.set()

    def kick(self, chunks: bool = False) -> None:
        """Write queued control frames now (with ``chunks``, then queued chunks too: the link's
        end-of-iteration call, so that sends queued together leave in deadline order) while the kernel
        takes all of each; a frame it takes part of is finished by the writer task (woken for it)."""
        if not self.alive or self._unsent is not None or self.closing or self._writer is None:
            if self.alive:
                self.wake.set()
            return
        try:
            if not self._write_ready(chunks):
                self.wake.set()
        except Exception as exc:  # noqa: BLE001 - see _failed
            self._failed(exc)

    async def _guard(self, run) -> None:
        try:
            await run()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - see _failed
            self._failed(exc)

    def _failed(self, exc: BaseException) -> None:
        """Socket errors lose this stream (its chunks are re-sent); anything else fails the link."""
        link = self.link
        if link is None:  # the link is finished already
            return
        if isinstance(exc, (ConnectionError, OSError)):
            link.stream_failed(self, exc)
        else:  # protocol errors and bugs fail the link, never the loop
            link.fail(exc)

    def detach(self) -> None:
        """Forget the (finished) link, so that nothing here keeps it alive (call once stopped)."""
        self.link = None
        self.decoder = self._receive = None

    def _on_readable(self) -> None:
        """Receive until the socket is drained or the read budget is spent; dispatch every frame."""
        if not self._reading:  # stopped earlier in this loop iteration
            return
        link = self.link
        nbytes = 0
        link.hold_frames()  # acks, credits and grants this read produces leave together, at the end
        try:
            # scatter reads into the decoder's target and its read-ahead area, until one comes back
            # short (the socket is drained) or the budget is spent (the reader is level-triggered:
            # bytes arriving meanwhile call it again)
            nbytes, events, ended = self._receive(self._fd, READ_BUDGET_BYTES)
            self.bytes_received += nbytes
            for event in events:
                self._dispatch(event)
                if not self._reading:  # the link failed or closed meanwhile
                    return
            if ended:
                reason = "peer closed the link" if link.peer_closed else "peer closed the connection"
                raise PeerLost(f"stream {self.index} to {link.peer}: {reason}")
        except Exception as exc:  # noqa: BLE001 - see _failed
            self._stop_reading()
            self._failed(exc)
        finally:
            if nbytes:
                self.last_rx = self.loop.time()
                if self._quickack:
                    self._ack_now(self.sock)
            link.release_frames(after_wakeups=True)

    def _ack_now(self, sock: socket.socket) -> None:
        """Acknowledge what was just read now. A link carries data both ways, so the kernel treats
        it as interactive and holds back the ack of a message's short last segment until this side
        sends something (its ack frame, after the event loop dispatched the message) or its delayed-ack
        timer fires: the sender's kernel would see each message end late by this side's loop
        (``Link.kernel_acks``). TCP_QUICKACK leaves that mode and sends a pending ack at once (the
        kernel re-enters the mode on its own, hence on every read)."""
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_QUICKACK, 1)
        except OSError:
            self._quickack = False

    def _dispatch(self, event) -> None:
        link = self.link
        if type(event) is ChunkReceived:
            if link.closed:  # draining after our CLOSE: the payload went to scratch
                return
            self.chunks_received += 1
            header = event.header
            link.chunk_received(header)
            self.control.append(ack_header(header.tag, header.seq, header.total, header.offset, header.raw_len))
        elif type(event) is AckReceived:
            link.ack_received(self, event.header)
        elif type(event) is FlowReceived:
            link.flow_received(event.header)
        elif type(event) is AbortReceived:
            link.abort_received(event.payload)
        elif type(event) is ControlReceived:
            link.control_received(event.payload)
        elif type(event) is CloseReceived:
            link.peer_closed = True
        elif type(event) is not PingReceived:
            raise AssertionError(f"unhandled frame event {event!r}")

    def _stop_reading(self) -> None:
        if self._reading:
            self._reading = False
            self.loop.remove_reader(self.sock)
        if not self._read_done.done():
            self._read_done.set_result(None)

    async def _write_loop(self) -> None:
        while True:
            if self._unsent is not None:
                await self._send_unsent()
                continue
            if not self._write_ready():
                continue
            if self.closing:
                return
            self.wake.clear()
            await self.wake.wait()

    def _write_ready(self, chunks: bool = True) -> bool:
        """Write control frames, then (``chunks``) chunks from the link's queue, while the kernel takes every byte.
        The last control frames and the next chunk leave in one sendmsg (a grant and the data that
        follows it: one system call here, one readable event at the peer).
        False when it stopped on a frame the kernel took part of (``_unsent`` holds the rest).
        (A closing stream sends its control frames, an ABORT among them, after the link let go of it.)"""
        while True:
            parts: list = []
            if self.control:
                frames, self.control = self.control[:MAX_FRAMES_PER_SEND], self.control[MAX_FRAMES_PER_SEND:]
                parts = frames if self._sealer is None else [self._sealer.seal_frame(frame) for frame in frames]
            chunk = None
            if chunks and not self.closing and not self.control:
                link = self.link
                chunk = None if link.peer_closed else link.queue.pop()  # a closing peer reads no more data
                if chunk is not None and not chunk.acked:
                    parts += self._chunk_parts(chunk)
            if parts and not self._write(parts, None if chunk is None or chunk.acked else chunk):
                return False
            if chunk is not None:
                link.chunk_written(chunk, self)
            elif not self.control:
                return True

    def _chunk_parts(self, chunk: Chunk) -> list:
        """The DATA frame of ``chunk`` (header and payload parts), recorded as in flight on this stream."""
        link = self.link
        transfer = chunk.transfer
        self.in_flight[(transfer.tag, transfer.seq, chunk.offset)] = chunk
        if link.send_log is not None:
            link.send_log.append((transfer.tag, transfer.seq, chunk.offset))
        payload = chunk.view
        flags = FLAG_EAGER if chunk.eager else 0
        checksum = 0
        raw_len = len(payload)
        if link.checksum:
            flags |= FLAG_CHECKSUM
            checksum = zlib.crc32(payload)
        if link.compress and raw_len:
            packed = compress_chunk(payload)
            if packed is not None:
                flags |= FLAG_LZ4
                payload = packed
        header = data_header(transfer.tag, transfer.seq, transfer.total, chunk.offset, len(payload),
                             flags=flags, raw_len=raw_len, checksum=checksum)
        return [header, payload] if self._sealer is None else self._sealer.seal_data(header, payload)

    def _write(self, parts: list, chunk: Chunk | None) -> bool:
        """One sendmsg of ``parts``; False when the kernel took only some (the rest goes to ``_unsent``)."""
        try:
            sent = self.sock.sendmsg(parts)
        except BlockingIOError:
            sent = 0
        self.bytes_sent += sent
        self.last_tx = self.loop.time()
        for index, part in enumerate(parts):
            size = len(part)
            if sent >= size:
                sent -= size
                continue
            self._unsent = [memoryview(part)[sent:], *parts[index + 1:]]
            self._unsent_chunk = chunk
            return False
        if chunk is not None:
            self.chunks_sent += 1
        return True

    async def _send_unsent(self) -> None:
        """Finish the frame the kernel took part of, then report its chunk written."""
        for part in self._unsent:
            await self._send_rest(memoryview(part))
        chunk, self._unsent, self._unsent_chunk = self._unsent_chunk, None, None
        self.last_tx = self.loop.time()
        if chunk is not None:
            self.chunks_sent += 1
            if self.link is not None:
                self.link.chunk_written(chunk, self)

    async def _send_rest(self, view: memoryview) -> None:
        """Send all of ``view`` as the kernel makes room, registered for writability meanwhile."""
        loop, sock = self.loop, self.sock
        loop.add_writer(sock, self._on_writable)
        try:
            while view:
                self._writable = loop.create_future()
                await self._writable
                try:
                    n = sock.send(view)
                except (BlockingIOError, InterruptedError):
                    continue
                view = view[n:]
                self.bytes_sent += n
        finally:
            self._writable = None
            loop.remove_writer(sock)

    def _on_writable(self) -> None:
        if self._writable is not None and not self._writable.done():
            self._writable.set_result(None)

    def take_unacked(self) -> list[Chunk]:
        """The chunks this stream sent whose acks never came (to re-queue on other streams)."""
        chunks = [c for c in self.in_flight.values() if not c.acked]
        self.in_flight.clear()
        return chunks

    def abort(self) -> None:
        """Stop reading and writing and close the socket (no goodbye) once the writer let go of it."""
        self.alive = False
        self._stop_reading()
        writer = self._writer
        if writer is not None and writer is not asyncio.current_task() and not writer.done():
            writer.cancel()  # closing the fd under a registered writer would break the loop's bookkeeping
            writer.add_done_callback(lambda _: close_quietly(self.sock))
        else:
            close_quietly(self.sock)

    def abort_saying(self, frame: bytes, grace: float) -> None:
        """Abort, but first send ``frame`` (after the frame in progress) within ``grace`` s.

        Frames are no longer decoded; what the peer still sends is read and dropped until it
        closes, so our close does not reset the connection before the peer read ``frame``.
        """
        if not self.alive or self._writer is None or self._writer.done():
            self.abort()
            return
        self.alive = False
        self.closing = True
        self._stop_reading()
        self.control = [frame]
        self.wake.set()
        self._goodbye = self.loop.create_task(self._say_goodbye(grace), name=f"wanlink-abort-{self.index}")

    async def _say_goodbye(self, grace: float) -> None:
        loop, sock = self.loop, self.sock
        try:
            async with asyncio.timeout(grace):
                await asyncio.wait({self._writer})
                sock.shutdown(socket.SHUT_WR)
                scratch = bytearray(64 * 1024)
                while await loop.sock_recv_into(sock, scratch):
                    pass
        except (TimeoutError, OSError):
            pass
        finally:
            self.abort()

    async def close(self, grace: float) -> None:
        """Say goodbye within ``grace`` s, then abort.

        The writer finishes its frame and sends CLOSE; then our side is shut (FIN) and the reader
        drains until the peer closes too, so neither side resets a connection with unread bytes.
        """
        if self._goodbye is not None:
            await asyncio.gather(self._goodbye, return_exceptions=True)
        if self.alive and self._writer is not None:
            self.closing = True
            self.queue_control(CLOSE_FRAME)
            loop = self.loop
            deadline = loop.time() + grace
            _done, late = await asyncio.wait({self._writer}, timeout=grace)
            if late:
                log.debug("stream %d: CLOSE not delivered within %.1f s", self.index, grace)
            else:
                try:
                    self.sock.shutdown(socket.SHUT_WR)
                except OSError:
                    pass
                await asyncio.wait({self._read_done}, timeout=max(0.0, deadline - loop.time()))
        self.abort()
        if self._writer is not None:
            await asyncio.gather(self._writer, return_exceptions=True)
        close_quietly(self.sock)
