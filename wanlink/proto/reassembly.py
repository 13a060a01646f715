"""Receiver bookkeeping: matching messages to posted buffers, staging, duplicates, credit (sans-I/O).

Messages are named (tag, seq): the seq-th message the peer sent on ``tag``. Posted buffers on a
tag are matched to messages in order. A chunk of a message nobody posted a buffer for yet is
staged on its own (so a post that comes a moment late copies only the chunks that came early).

Every byte of a message is covered exactly once: a chunk that overlaps another chunk of its
message, or repeats its offset with another length, is a ProtocolError naming both ranges; a
message completes when its chunks cover it. A chunk seen before with the same range (re-sent after
a stream died) is routed to a scratch sink and not counted twice; one re-sent while its first copy
was cut off mid-chunk lands where the first copy was going.

Flow control (receiver side of ``wanlink.proto.flow``): a chunk the peer sent on eager credit
(``FLAG_EAGER``) is charged against ``Limits.max_unexpected_bytes`` until its bytes left staging;
then the credit is due back to the peer (``take_credit``). Posting a receive grants its message:
any other chunk of a message that was never granted is the peer ignoring flow control. Negative
tags are reserved: ``PROBE_DISCARD_TAG`` payloads are received, acknowledged and dropped (probe traffic).
"""
from __future__ import annotations

import bisect
import dataclasses
import heapq
import threading

import numpy as np

from wanlink.errors import LocalProtocolError, MessageSizeError, RemoteProtocolError
from wanlink.proto.frames import FLAG_EAGER, Header
from wanlink.proto.limits import DEFAULT_LIMITS, Limits

PROBE_DISCARD_TAG = -1  # data sent on this tag is received, acknowledged and dropped by the peer
SPARE_STAGING_BYTES = 64 * 1024 * 1024
"""Staging buffers kept for reuse, per process, once their chunk moved to a posted buffer: chunks
that arrive before their receive is posted (a peer entering a collective late) then cost a copy,
not fresh pages that fault. When full, buffers of other sizes make room (the chunk size can change)."""


class StagingPool:
    """Spare staging buffers by size, shared by every Reassembler of the process (thread-safe)."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.bytes = 0
        self._spare: dict[int, list] = {}  # size -> buffers (bytearray or uint8 array) free for reuse
        self._lock = threading.Lock()

    def take(self, size: int):
        """A buffer of ``size`` bytes: a spare one, else a fresh one (not zeroed: a chunk overwrites it)."""
        with self._lock:
            buffers = self._spare.get(size)
            if buffers:
                self.bytes -= size
                staged = buffers.pop()
                if not buffers:
                    del self._spare[size]
                return staged
        return np.empty(size, dtype=np.uint8)

    def give(self, staged) -> None:
        """Keep ``staged`` for reuse if there is room (making room from buffers of other sizes)."""
        size = len(staged)
        with self._lock:
            while self.bytes + size > self.capacity:
                other = next((s for s in self._spare if s != size), None)
                if other is None:  # full of this size already
                    return
                self.bytes -= other * len(self._spare.pop(other))
            self._spare.setdefault(size, []).append(staged)
            self.bytes += size


STAGING_POOL = StagingPool(SPARE_STAGING_BYTES)


@dataclasses.dataclass(eq=False, slots=True)
class Incoming:
    """One message being received: its destination and which chunks have arrived."""

    tag: int
    seq: int
    buffer: memoryview | None  # the posted buffer, or None while unclaimed
    total: int | None = None  # known once a chunk arrived
    received: int = 0
    chunks: dict = dataclasses.field(default_factory=dict)  # offset -> length of every chunk received
    staged: dict = dataclasses.field(default_factory=dict)  # offset -> staging buffer, while unclaimed
    landing: dict = dataclasses.field(default_factory=dict)  # offset -> (view, staged?) of chunks in progress
    spans: dict = dataclasses.field(default_factory=dict)  # offset -> length of every chunk placed (landing or done)
    starts: list = dataclasses.field(default_factory=list)  # sorted keys of spans
    charged: set = dataclasses.field(default_factory=set)  # offsets of eager chunks whose credit is not yet due
    granted: bool = False  # a receive was posted for it (the peer may send all of it)
    error: Exception | None = None
    done: bool = False

    @property
    def complete(self) -> bool:
        return self.total is not None and self.received == self.total


@dataclasses.dataclass
class _TagState:
    next_post_seq: int = 0
    returned_seqs: list = dataclasses.field(default_factory=list)  # min-heap of un-posted seqs
    completed_below: int = 0  # every seq below this is finished
    completed_above: set = dataclasses.field(default_factory=set)

    def is_completed(self, seq: int) -> bool:
        return seq < self.completed_below or seq in self.completed_above

    def mark_completed(self, seq: int) -> None:
        self.completed_above.add(seq)
        while self.completed_below in self.completed_above:
            self.completed_above.remove(self.completed_below)
            self.completed_below += 1


class Reassembler:
    """Routes incoming chunks to destinations and reports finished messages."""

    def __init__(self, limits: Limits = DEFAULT_LIMITS):
        self._limits = limits
        self._tags: dict[int, _TagState] = {}
        self._incoming: dict[tuple[int, int], Incoming] = {}
        self._scratch = memoryview(bytearray(0))
        self.unexpected_bytes = 0  # bytes staged now (eager chunks plus chunks of cancelled receives)
        self.peak_unexpected_bytes = 0
        self.eager_bytes = 0  # bytes of eager chunks charged and not yet due back to the peer
        self.credit_due = 0  # eager bytes whose credit is due back to the peer (``take_credit``)
        self.duplicate_chunks = 0
        self._pool = STAGING_POOL

    # -- application side -------------------------------------------------------------------
    def post(self, tag: int, buffer: memoryview) -> Incoming:
        """Claim the next message on ``tag`` for ``buffer``; chunks that came early are copied in now."""
        if tag < 0:
            raise LocalProtocolError(f"tag {tag} is reserved (negative tags are wanlink-internal)")
        state = self._tags.setdefault(tag, _TagState())
        if state.returned_seqs:
            seq = heapq.heappop(state.returned_seqs)
        else:
            seq = state.next_post_seq
            state.next_post_seq += 1
        entry = self._incoming.get((tag, seq))
        if entry is None:
            entry = self._new_entry(tag, seq, buffer)
            entry.granted = True
            return entry
        entry.buffer = buffer
        entry.granted = True
        if entry.total is not None and entry.total != len(buffer):
            entry.error = _size_error(tag, entry.total, len(buffer))
        for offset in [o for o in entry.staged if o not in entry.landing]:  # chunks still arriving move later
            self._unstage(entry, offset)
        if entry.error is not None or entry.complete:
            self._finish(entry)
        return entry

    def staged_landing(self, entry: Incoming) -> list[int]:
        """Offsets of ``entry``'s chunks still arriving into staging although it is claimed now
        (``post`` came while they arrived): the I/O layer may ``land_directly`` each."""
        if entry.done or entry.buffer is None or entry.error is not None:
            return []
        return [offset for offset, (_view, staged) in entry.landing.items() if staged]

    def land_directly(self, entry: Incoming, offset: int) -> memoryview:
        """Chunk ``offset`` of ``entry`` (one of ``staged_landing``) lands in the posted buffer from now
        on: returns where. The caller moves what arrived of it so far there (the decoder's
        ``redirect``), then frees its staging with ``release_staging``."""
        length = entry.spans[offset]
        view = entry.buffer[offset:offset + length]
        entry.landing[offset] = (view, False)
        return view

    def release_staging(self, entry: Incoming, offset: int) -> None:
        """The staging buffer of a chunk redirected by ``land_directly`` is no longer read: free it."""
        staged = entry.staged.pop(offset)
        self.unexpected_bytes -= len(staged)
        self._pool.give(staged)

    def unpost(self, entry: Incoming) -> None:
        """Give a posted, unfinished message back (its receiver was cancelled): stage what arrived."""
        if entry.done or entry.buffer is None:
            return
        for offset, length in entry.chunks.items():  # chunks still arriving are re-staged when done
            self._stage(entry, offset, entry.buffer[offset:offset + length])
        entry.buffer = None
        entry.error = None
        heapq.heappush(self._tags[entry.tag].returned_seqs, entry.seq)

    def next_started(self, tag: int) -> bool:
        """Whether the message the next ``post`` on ``tag`` would claim has started arriving (claims nothing)."""
        state = self._tags.get(tag)
        if state is None:
            return False
        seq = state.returned_seqs[0] if state.returned_seqs else state.next_post_seq
        return (tag, seq) in self._incoming

    # -- wire side --------------------------------------------------------------------------
    def announce(self, header: Header) -> None:
        """The peer started message (tag, seq) of ``header.total`` bytes but waits for its grant.
        (An announcement overtaken by the message's chunks, on another stream, may come after it finished.)"""
        if header.tag < 0:
            raise RemoteProtocolError(f"announcement on reserved tag {header.tag}")
        if not self._tags.setdefault(header.tag, _TagState()).is_completed(header.seq):
            self._entry_for(header)

    def place(self, header: Header) -> memoryview:
        """Where the raw bytes of this DATA chunk go."""
        if header.tag < 0:
            if header.tag != PROBE_DISCARD_TAG:
                raise RemoteProtocolError(f"data on reserved tag {header.tag}")
            return self.scratch_view(header.raw_len)
        state = self._tags.setdefault(header.tag, _TagState())
        if state.is_completed(header.seq):
            return self.scratch_view(header.raw_len)
        entry = self._entry_for(header)
        offset = header.offset
        claim = _claim(entry, offset, header.raw_len)
        if claim is _DUPLICATE:
            return self.scratch_view(header.raw_len)
        if claim is _NEW:
            self._charge(entry, header)
        if entry.error is not None:
            self._release(entry, offset)
            return self.scratch_view(header.raw_len)
        if entry.buffer is not None:
            orphan = entry.staged.pop(offset, None)  # staged by a stream that died mid-chunk
            if orphan is not None:
                self.unexpected_bytes -= len(orphan)
            view = entry.buffer[offset:offset + header.raw_len]
            entry.landing[offset] = (view, False)
            return view
        staged = entry.staged.get(offset)
        if staged is None:  # (a chunk cut off by a dead stream and re-sent reuses its staging buffer)
            staged = self._stage(entry, offset, None, header.raw_len)
        view = memoryview(staged)
        entry.landing[offset] = (view, True)
        return view

    def chunk_done(self, header: Header) -> Incoming | None:
        """Record a placed chunk; returns the message when this chunk finished it (or failed it)."""
        if header.tag < 0:
            return None
        state = self._tags[header.tag]
        entry = self._incoming.get((header.tag, header.seq))
        if entry is None or state.is_completed(header.seq) or header.offset in entry.chunks:
            self.duplicate_chunks += 1
            return None
        self._settle(entry, header.offset)
        entry.chunks[header.offset] = header.raw_len
        entry.received += header.raw_len
        if entry.done:  # failed earlier: forget it once its remaining chunks are drained
            if entry.complete:
                self._retire(entry)
            return None
        if entry.buffer is not None and (entry.complete or entry.error is not None):
            return self._finish(entry)
        return None

    def take_credit(self, at_least: int = 0) -> int:
        """Eager bytes whose credit is due back to the peer since the last call that returned some;
        0 (and the credit kept for later) while fewer than ``at_least`` (at least 1) are due."""
        due = self.credit_due
        if due < max(at_least, 1):
            return 0
        self.credit_due = 0
        return due

    def clear(self) -> None:
        """Forget every message and free what is staged (the link is finished)."""
        self._incoming.clear()
        self._tags.clear()
        self.unexpected_bytes = self.eager_bytes = 0
        self._scratch = memoryview(bytearray(0))

    def pending(self) -> list[Incoming]:
        """Posted messages not finished yet."""
        return [e for e in self._incoming.values() if e.buffer is not None and not e.done]

    # -- internals ----------------------------------------------------------------------------
    def _entry_for(self, header: Header) -> Incoming:
        """The message a chunk or announcement belongs to (created on first sight), its size checked."""
        entry = self._incoming.get((header.tag, header.seq))
        if entry is None:
            entry = self._new_entry(header.tag, header.seq, None)
        if entry.total is None:
            entry.total = header.total
            if entry.buffer is not None and len(entry.buffer) != header.total:
                entry.error = _size_error(entry.tag, header.total, len(entry.buffer))
        elif entry.total != header.total:
            raise RemoteProtocolError(f"message tag={header.tag} seq={header.seq} changed size "
                                      f"{entry.total} -> {header.total}")
        return entry

    def _charge(self, entry: Incoming, header: Header) -> None:
        """Check a new chunk against flow control: eager credit, or the message's grant.
        (Messages are built only to raise: this runs for every chunk.)"""
        if header.flags & FLAG_EAGER:
            charged = self.eager_bytes + header.raw_len
            if charged > self._limits.max_unexpected_bytes:
                self._limits.check("max_unexpected_bytes", charged, f"eager {_chunk_name(entry, header)}: "
                                   "the peer sent more than the credit it was given")
            self.eager_bytes = charged
            entry.charged.add(header.offset)
        elif not entry.granted:
            raise RemoteProtocolError(f"the peer sent {_chunk_name(entry, header)} without eager credit before its "
                                      f"receive was posted (it ignored flow control)")

    def _release(self, entry: Incoming, offset: int) -> None:
        """An eager chunk's bytes left staging (or never used it): its credit is due back."""
        if offset in entry.charged:
            entry.charged.remove(offset)
            length = entry.spans[offset]
            self.eager_bytes -= length
            self.credit_due += length

    def _new_entry(self, tag: int, seq: int, buffer: memoryview | None) -> Incoming:
        if len(self._incoming) >= self._limits.max_pending_transfers:
            self._limits.check("max_pending_transfers", len(self._incoming) + 1, "partially received messages")
        entry = Incoming(tag, seq, buffer)
        self._incoming[(tag, seq)] = entry
        return entry

    def _stage(self, entry: Incoming, offset: int, data, size: int | None = None):
        """Hold a chunk of an unclaimed message (a copy of ``data``, or room for ``size`` bytes).

        Eager chunks are bounded by their credit (``_charge``); chunks of a cancelled receive are
        bounded by the size of the receives the application cancelled.
        """
        size = len(data) if data is not None else size
        if data is not None:
            staged = bytearray(data)
        else:
            staged = self._pool.take(size)
        entry.staged[offset] = staged
        self.unexpected_bytes += size
        self.peak_unexpected_bytes = max(self.peak_unexpected_bytes, self.unexpected_bytes)
        return staged

    def _unstage(self, entry: Incoming, offset: int) -> None:
        """Move a staged chunk into the claimed message's buffer (unless it failed) and free its staging."""
        data = entry.staged.pop(offset)
        if entry.error is None:
            entry.buffer[offset:offset + len(data)] = data
        self.unexpected_bytes -= len(data)
        self._release(entry, offset)
        self._pool.give(data)

    def _settle(self, entry: Incoming, offset: int) -> None:
        """A chunk finished landing: move it if the message was claimed or given back meanwhile."""
        view, was_staged = entry.landing.pop(offset, (None, None))
        if was_staged is None:  # went to the scratch sink (failed message)
            return
        if was_staged and entry.buffer is not None:  # claimed while this chunk was arriving
            self._unstage(entry, offset)
        elif not was_staged:
            self._release(entry, offset)
            if entry.buffer is None:  # given back while this chunk was arriving
                self._stage(entry, offset, view)

    def _finish(self, entry: Incoming) -> Incoming:
        entry.done = True
        if entry.complete:
            self._retire(entry)
        # a failed, incomplete entry stays so that its remaining chunks are recognised and dropped
        return entry

    def _retire(self, entry: Incoming) -> None:
        self._tags[entry.tag].mark_completed(entry.seq)
        del self._incoming[(entry.tag, entry.seq)]

    def scratch_view(self, nbytes: int) -> memoryview:
        """A reused sink for bytes that must be read off the wire and dropped (grown on demand)."""
        if nbytes > len(self._scratch):
            self._scratch = memoryview(bytearray(nbytes))
        return self._scratch[:nbytes]


_NEW, _RESENT, _DUPLICATE = "new", "resent", "duplicate"


def _claim(entry: Incoming, offset: int, length: int) -> str:
    """Record that [offset, offset + length) of ``entry`` is arriving; any overlap is a ProtocolError."""
    known = entry.spans.get(offset)
    if known is not None:
        if known != length:
            raise RemoteProtocolError(f"chunk [{offset}, {offset + length}) of tag={entry.tag} seq={entry.seq} "
                                      f"overlaps chunk [{offset}, {offset + known}) with another length")
        return _DUPLICATE if offset in entry.chunks else _RESENT
    if length == 0 and entry.total:
        raise RemoteProtocolError(f"empty chunk at offset {offset} of tag={entry.tag} seq={entry.seq} "
                                  f"({entry.total} bytes)")
    starts = entry.starts
    if starts:  # (the first chunk of a message overlaps nothing)
        i = bisect.bisect(starts, offset)
        for other in starts[max(i - 1, 0):i + 1]:
            end = other + entry.spans[other]
            if other < offset + length and offset < end:
                raise RemoteProtocolError(f"chunk [{offset}, {offset + length}) of tag={entry.tag} seq={entry.seq} "
                                          f"overlaps chunk [{other}, {end})")
        starts.insert(i, offset)
    else:
        starts.append(offset)
    entry.spans[offset] = length
    return _NEW


def _chunk_name(entry: Incoming, header: Header) -> str:
    return f"chunk [{header.offset}, {header.offset + header.raw_len}) of tag={entry.tag} seq={entry.seq}"


def _size_error(tag: int, total: int, posted: int) -> MessageSizeError:
    return MessageSizeError(f"message on tag {tag} has {total} bytes but the posted buffer has {posted}")
