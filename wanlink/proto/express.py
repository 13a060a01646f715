"""Express messages: the framing and matching of a same-host group's round-based collectives (sans I/O).

A group whose members all share this host and network namespace runs its one-round and halving
collectives over one Unix stream socket per pair of members, on a thread of its own instead of the
I/O loop (wanlink/c10d/express.py). On such a socket each message is a header (the collective's
sequence number, its piece, its length in bytes) and then its bytes. :class:`Outgoing` queues one
peer's messages and says which bytes to write next; :class:`Incoming` matches what a peer wrote to
the receives posted for it and says where the next bytes read should land. Neither touches a socket.

A collective that fails on one member (its timeout, a lost peer) leaves bytes in flight: a message
half written is finished (the peer's framing depends on it), the peer's messages for it are read
and dropped when a later collective reads that socket, and a receive it had posted is withdrawn, so
no late byte lands in a tensor the caller has taken back.
"""
from __future__ import annotations

import collections
import hmac
import struct

from wanlink.errors import ProtocolError

HEADER = struct.Struct("<QIQ")
"""sequence (the collective's number in its group), piece, payload length in bytes."""
DISCARD_BYTES = 1 << 16
"""Size of the scratch buffer a dropped payload is read into, a slice at a time."""


class Message:
    """One message queued for a peer; ``done`` once its last byte was handed to the socket."""

    __slots__ = ("sequence", "buffers", "done")

    def __init__(self, sequence: int, piece: int, payload: memoryview):
        self.sequence = sequence
        self.buffers = [memoryview(HEADER.pack(sequence, piece, payload.nbytes)), payload]  # (the view
        self.done = False  # holds the payload's memory until the message is written)


class Outgoing:
    """The messages waiting to be written to one peer, in order."""

    def __init__(self) -> None:
        self.queue: collections.deque[Message] = collections.deque()  # (empty: nothing to write)
        self._started = False  # some bytes of the head message were written

    def push(self, sequence: int, piece: int, payload: memoryview) -> Message:
        message = Message(sequence, piece, payload.cast("B"))
        self.queue.append(message)
        return message

    def buffers(self, most: int = 8) -> list[memoryview]:
        """The bytes to write next, as buffers for one gathering write (up to ``most`` messages)."""
        out: list[memoryview] = []
        for message in self.queue:
            out.extend(buffer for buffer in message.buffers if buffer.nbytes)
            most -= 1
            if not most:
                break
        return out

    def advance(self, written: int) -> None:
        """``written`` bytes of ``buffers()`` left: trim them, completing the messages they end."""
        while self.queue:
            message = self.queue[0]
            for index, buffer in enumerate(message.buffers):
                taken = min(written, buffer.nbytes)
                if taken:
                    message.buffers[index], written, self._started = buffer[taken:], written - taken, True
            if any(buffer.nbytes for buffer in message.buffers):
                return
            message.done, message.buffers = True, []
            self.queue.popleft()
            self._started = False

    def abandon(self, sequence: int) -> None:
        """Drop collective ``sequence``'s messages that have not begun (one half written goes on)."""
        head = self.queue.popleft() if self._started and self.queue else None
        self.queue = collections.deque(message for message in self.queue if message.sequence != sequence)
        if head is not None:
            self.queue.appendleft(head)


class Receive:
    """A receive posted for one message; ``done`` once its bytes all landed in ``target``."""

    __slots__ = ("sequence", "target", "done")

    def __init__(self, sequence: int, target: memoryview):
        self.sequence, self.target, self.done = sequence, target, False


class Incoming:
    """Matches one peer's messages to the receives posted for them, in each piece's posting order.

    Bytes are read only while a receive is posted (``unfilled``): a peer that runs ahead waits
    in its socket's buffer, which bounds memory. The peer ``name`` (e.g. "rank 2") is for errors.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self._posted: dict[tuple[int, int], collections.deque[Receive]] = {}
        self.unfilled = 0  # receives posted and not complete (0: nothing to read)
        self._current = -1  # the latest collective that posted a receive here
        self._header = bytearray(HEADER.size)
        self._header_got = 0
        self._parsed: tuple[int, int, int] | None = None  # a header read but not matched yet
        self._receive: Receive | None = None  # the receive the payload being read lands in
        self._offset = 0
        self._remaining = 0  # payload bytes still to read (into ``_receive``, or dropped without one)
        self._scratch = memoryview(bytearray(DISCARD_BYTES))

    def post(self, sequence: int, piece: int, target: memoryview) -> Receive:
        receive = Receive(sequence, target.cast("B"))
        self._posted.setdefault((sequence, piece), collections.deque()).append(receive)
        self.unfilled += 1
        self._current = max(self._current, sequence)
        if self._parsed is not None:
            self._match()
        return receive

    def view(self) -> memoryview:
        """Where the next bytes read from the peer go."""
        if self._remaining:
            if self._receive is None:
                return self._scratch[:min(self._remaining, DISCARD_BYTES)]
            return self._receive.target[self._offset:]
        return memoryview(self._header)[self._header_got:]

    def advance(self, count: int) -> None:
        """``count`` bytes were read into ``view()``; ProtocolError if they break the protocol."""
        if self._remaining:
            self._offset += count
            self._remaining -= count
            if not self._remaining:
                self._land()
            return
        self._header_got += count
        if self._header_got == HEADER.size:
            self._header_got = 0
            self._parsed = HEADER.unpack(self._header)
            self._match()

    def abandon(self, sequence: int) -> None:
        """Collective ``sequence`` failed here: withdraw its receives (a payload being read is dropped)."""
        for key in [key for key in self._posted if key[0] == sequence]:
            self.unfilled -= len(self._posted.pop(key))
        if self._receive is not None and self._receive.sequence == sequence:
            self._receive, self.unfilled = None, self.unfilled - 1

    def _match(self) -> None:
        sequence, piece, nbytes = self._parsed
        waiting = self._posted.get((sequence, piece))
        if waiting:
            receive = waiting[0]
            if nbytes != receive.target.nbytes:
                raise ProtocolError(f"{self.name} sent {nbytes} bytes as piece {piece} of collective "
                                    f"#{sequence}, where this rank expects {receive.target.nbytes}: the ranks "
                                    f"passed tensors of different sizes")
            waiting.popleft()
            if not waiting:
                del self._posted[sequence, piece]
            self._receive = receive
        elif sequence >= self._current:  # (a failed collective's messages, older, are dropped below)
            expected = sorted({key[0] for key in self._posted}) or [self._current]
            raise ProtocolError(f"{self.name} sent piece {piece} of collective #{sequence} while this rank "
                                f"waits for its part of collective #{expected[0]}: the ranks issued different "
                                f"collectives, or {self.name} gave up on #{expected[0]}")
        self._parsed, self._offset, self._remaining = None, 0, nbytes
        if not nbytes:
            self._land()

    def _land(self) -> None:
        if self._receive is not None:
            self._receive.done = True
            self._receive = None
            self.unfilled -= 1


HELLO = struct.Struct("<4s16sII32s")
"""What a member writes first on a new express socket: magic, world token, group slot, its world rank,
and an HMAC-SHA256 of the rest under the world's secret."""
HELLO_MAGIC = b"WLX1"


def hello(secret: bytes, world: str, slot: int, rank: int) -> bytes:
    """The hello of world rank ``rank`` opening group ``slot``'s express socket in world ``world``."""
    fields = (HELLO_MAGIC, world.encode()[:16].ljust(16, b"\0"), slot, rank)
    return HELLO.pack(*fields, hmac.digest(secret, HELLO.pack(*fields, b""), "sha256"))


def read_hello(data: bytes, secret: bytes, world: str) -> tuple[int, int]:
    """(group slot, world rank) of a valid hello of ``world``; ProtocolError for anything else."""
    if len(data) != HELLO.size:
        raise ProtocolError(f"express hello of {len(data)} bytes, expected {HELLO.size}")
    magic, token, slot, rank, digest = HELLO.unpack(data)
    if magic != HELLO_MAGIC or token != world.encode()[:16].ljust(16, b"\0"):
        raise ProtocolError("express hello from another world or protocol")
    if not hmac.compare_digest(digest, hmac.digest(secret, HELLO.pack(magic, token, slot, rank, b""), "sha256")):
        raise ProtocolError(f"express hello claiming rank {rank} failed authentication (another WANLINK_SECRET?)")
    return slot, rank
