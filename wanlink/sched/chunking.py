"""Cutting an outgoing message into chunks and tracking their acknowledgements (sans-I/O)."""
from __future__ import annotations

import dataclasses

from wanlink.errors import ConfigError, RemoteProtocolError

MIN_CHUNK_SIZE = 256 * 1024
MAX_CHUNK_SIZE = 4 * 1024 * 1024
# Chosen with `bench/loopback_throughput.py --chunk-kib 256 1024 4096` (docs/transport.md): 1 MiB
# reaches the plateau; larger chunks only coarsen EDF pre-emption points and re-sends after a stream
# dies, smaller ones cost per-chunk Python overhead.
DEFAULT_CHUNK_SIZE = 1024 * 1024


def chunk_size_from(value: int | None) -> int:
    """Validate a chunk size, defaulting to DEFAULT_CHUNK_SIZE (WANLINK_CHUNK_SIZE is the edges' business)."""
    if value is None:
        return DEFAULT_CHUNK_SIZE
    if isinstance(value, bool) or not isinstance(value, int) or not MIN_CHUNK_SIZE <= value <= MAX_CHUNK_SIZE:
        raise ConfigError(f"chunk size must be an int in [{MIN_CHUNK_SIZE}, {MAX_CHUNK_SIZE}], got {value!r}")
    return value


@dataclasses.dataclass(eq=False, slots=True)
class Chunk:
    """Bytes [offset, offset+len(view)) of message (tag, seq) of ``total`` bytes."""

    transfer: "OutgoingTransfer"
    offset: int
    view: memoryview
    acked: bool = False
    order: tuple | None = None  # EDF position, fixed when first queued
    eager: bool = False  # sent on the link's eager credit (flow control), before the peer granted it
    written: bool = False  # all of it is in a stream's kernel buffer (not re-queued since)

    @property
    def tag(self) -> int:
        return self.transfer.tag

    @property
    def seq(self) -> int:
        return self.transfer.seq

    @property
    def total(self) -> int:
        return self.transfer.total


class CopyPool:
    """Buffers of ``size`` bytes for the copies that sends finishing before their acks keep
    (``OutgoingTransfer.keep_unacked``), reused: a fresh MiB page-faults as it is first written,
    0.5-1.2 ms measured on a loaded host (more than the ack it saves), a reused one takes 25 us.
    Keeps at most ``keep`` buffers."""

    def __init__(self, size: int, keep: int):
        self.size, self.keep = size, keep
        self._free: list[bytearray] = []

    def take(self) -> bytearray:
        return self._free.pop() if self._free else bytearray(self.size)

    def give(self, buffer: bytearray) -> None:
        if len(self._free) < self.keep:
            self._free.append(buffer)


class OutgoingTransfer:
    """One message being sent: its chunks and which of them the peer acknowledged."""

    def __init__(self, tag: int, seq: int, payload: memoryview, chunk_size: int, deadline=0):
        self.tag = tag
        self.seq = seq
        self.total = len(payload)
        self.deadline = deadline_key(deadline)
        if self.total <= chunk_size:  # one chunk (the common case: no comprehensions)
            chunk = Chunk(self, 0, payload)
            self.chunks = [chunk]
            self._by_offset = {0: chunk}
        else:
            self.chunks = [Chunk(self, offset, payload[offset:offset + chunk_size])
                           for offset in range(0, self.total, chunk_size)]
            self._by_offset = {chunk.offset: chunk for chunk in self.chunks}
        self.acked_bytes = 0
        self.unacked = len(self.chunks)
        self.unwritten = len(self.chunks)  # chunks waiting for flow control, queued or being written
        self.settle_written = False  # the sender is released once every chunk is written (Link.send)
        self.settled = False  # ... and was: its unacknowledged chunks have their own copy (keep_unacked)
        self.started = 0.0  # when Link.send took it (time.monotonic), for the link's wire time
        self._copy: bytearray | None = None  # the pool buffer keep_unacked copied into

    def written(self, chunk: Chunk) -> None:
        """``chunk`` went into a stream's kernel buffer in full."""
        if not chunk.written:
            chunk.written = True
            self.unwritten -= 1

    def requeued(self, chunk: Chunk) -> None:
        """``chunk`` must be written again (its stream died before the peer acknowledged it)."""
        if chunk.written:
            chunk.written = False
            self.unwritten += 1

    def keep_unacked(self, pool: CopyPool) -> int:
        """Give every unacknowledged chunk a private copy of its bytes, so the sender's buffer is free
        while re-sends stay possible; returns the bytes copied. The copy goes into one of ``pool``'s
        buffers when it fits (``release_copy`` gives that back)."""
        unacked = [chunk for chunk in self.chunks if not chunk.acked]
        copied = sum(len(chunk.view) for chunk in unacked)
        if copied > pool.size:
            for chunk in unacked:
                chunk.view = memoryview(bytes(chunk.view))
            return copied
        self._copy = pool.take()
        copy, at = memoryview(self._copy), 0
        for chunk in unacked:
            size = len(chunk.view)
            copy[at:at + size] = chunk.view
            chunk.view = copy[at:at + size]
            at += size
        return copied

    def release_copy(self, pool: CopyPool) -> None:
        """Once complete: give the copy back to ``pool``, unless a chunk is being re-sent from it
        (a stream may still be writing those bytes)."""
        if self._copy is None or not self.complete:
            return
        if not self.unwritten:
            pool.give(self._copy)
        self._copy = None

    @property
    def complete(self) -> bool:
        return self.unacked == 0

    def ack(self, offset: int, length: int) -> bool:
        """Record the peer's ack of the chunk at ``offset``; True when it was new."""
        chunk = self._by_offset.get(offset)
        if chunk is None or len(chunk.view) != length:
            raise RemoteProtocolError(f"ack for [{offset}, {offset + length}) matches no chunk "
                                      f"of tag={self.tag} seq={self.seq}")
        if chunk.acked:
            return False
        chunk.acked = True
        self.acked_bytes += length
        self.unacked -= 1
        return True


def deadline_key(deadline) -> tuple:
    """EDF deadlines are numbers or tuples of numbers (e.g. (iteration, layer)); compared as tuples."""
    if isinstance(deadline, tuple):
        items = deadline
    else:
        items = (deadline,)
    for item in items:
        if isinstance(item, bool) or not isinstance(item, (int, float)):
            raise ConfigError(f"deadline must be a number or a tuple of numbers, got {deadline!r}")
    return tuple(items)
