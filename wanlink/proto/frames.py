"""Data-frame wire format and a sans-I/O incremental decoder.

Every frame is a fixed 44-byte little-endian header, optionally followed by a payload::

    type u8 | flags u8 | reserved u16 | tag i64 | seq u32 | total u64 | offset u64
    | wire_len u32 | raw_len u32 | checksum u32

``(tag, seq)`` names one message (the seq-th message the sender sent on that tag), ``total`` is
its size, and a DATA frame carries bytes ``[offset, offset + raw_len)`` of it, ``wire_len`` bytes
on the wire (fewer when lz4-compressed). ACK frames echo a received chunk's coordinates with no
payload. CONTROL frames carry one msgpack message. Flow control (``wanlink.proto.flow``) adds
header-only frames: GRANT (tag, seq) from the receiver once that receive is posted, CREDIT
(``total`` = eager bytes returned) and ANNOUNCE (tag, seq, total) from a sender that has a message
but no credit to start it. ABORT carries a msgpack ``[code, text]``: why the sender is failing the
link. Everything is validated against Limits before a payload byte is accepted.
"""
from __future__ import annotations

import dataclasses
import enum
import struct
import zlib
from typing import Callable, NamedTuple

from wanlink.errors import LocalProtocolError, RemoteProtocolError
from wanlink.proto.limits import DEFAULT_LIMITS, Limits

HEADER = struct.Struct("<BBHqIQQIII")
HEADER_SIZE = HEADER.size  # 44


class FrameType(enum.IntEnum):
    DATA = 1
    ACK = 2
    CONTROL = 3
    PING = 4
    CLOSE = 5
    GRANT = 6
    CREDIT = 7
    ANNOUNCE = 8
    ABORT = 9


class Flags(enum.IntFlag):
    NONE = 0
    LZ4 = 1  # payload is an lz4 block of raw_len bytes
    CHECKSUM = 2  # checksum holds crc32 of the raw payload
    EAGER = 4  # sent on the link's eager credit, before the receiver granted the message


FLAG_LZ4, FLAG_CHECKSUM, FLAG_EAGER = int(Flags.LZ4), int(Flags.CHECKSUM), int(Flags.EAGER)  # plain ints, per chunk
KNOWN_FLAGS = FLAG_LZ4 | FLAG_CHECKSUM | FLAG_EAGER
_NO_PAYLOAD = frozenset({FrameType.ACK, FrameType.PING, FrameType.CLOSE, FrameType.GRANT, FrameType.CREDIT,
                         FrameType.ANNOUNCE})


class Header(NamedTuple):
    """One decoded header (a tuple: built in one step, as every frame is decoded)."""

    type: FrameType
    flags: int = 0
    tag: int = 0
    seq: int = 0
    total: int = 0
    offset: int = 0
    wire_len: int = 0
    raw_len: int = 0
    checksum: int = 0

    def pack(self) -> bytes:
        return HEADER.pack(self.type, self.flags, 0, self.tag, self.seq, self.total, self.offset,
                           self.wire_len, self.raw_len, self.checksum)


def data_header(tag: int, seq: int, total: int, offset: int, payload_len: int, *,
                flags: int = 0, raw_len: int | None = None, checksum: int = 0) -> bytes:
    """Pack a DATA header for ``payload_len`` wire bytes at ``offset`` of message (tag, seq)."""
    raw = payload_len if raw_len is None else raw_len
    return HEADER.pack(FrameType.DATA, flags, 0, tag, seq, total, offset, payload_len, raw, checksum)


def ack_header(tag: int, seq: int, total: int, offset: int, raw_len: int) -> bytes:
    """Pack an ACK for the chunk at ``offset`` (``raw_len`` bytes) of message (tag, seq)."""
    return HEADER.pack(FrameType.ACK, 0, 0, tag, seq, total, offset, 0, raw_len, 0)


def control_header(payload_len: int, frame_type: FrameType = FrameType.CONTROL) -> bytes:
    """Header of a CONTROL (or ABORT) frame whose msgpack payload has ``payload_len`` bytes."""
    return HEADER.pack(frame_type, 0, 0, 0, 0, 0, 0, payload_len, payload_len, 0)


def grant_frame(tag: int, seq: int) -> bytes:
    """The receive for message (tag, seq) is posted: send all of it."""
    return HEADER.pack(FrameType.GRANT, 0, 0, tag, seq, 0, 0, 0, 0, 0)


def credit_frame(nbytes: int) -> bytes:
    """``nbytes`` more bytes of eager credit."""
    return HEADER.pack(FrameType.CREDIT, 0, 0, 0, 0, nbytes, 0, 0, 0, 0)


def announce_frame(tag: int, seq: int, total: int) -> bytes:
    """Message (tag, seq) of ``total`` bytes waits for its grant (no credit to start it eagerly)."""
    return HEADER.pack(FrameType.ANNOUNCE, 0, 0, tag, seq, total, 0, 0, 0, 0)


_FRAME_TYPES = {int(frame_type): frame_type for frame_type in FrameType}
PING_FRAME = HEADER.pack(FrameType.PING, 0, 0, 0, 0, 0, 0, 0, 0, 0)
CLOSE_FRAME = HEADER.pack(FrameType.CLOSE, 0, 0, 0, 0, 0, 0, 0, 0, 0)


def parse_header(raw: bytes | memoryview, limits: Limits = DEFAULT_LIMITS) -> Header:
    """Decode and validate one header; raises RemoteProtocolError (LimitExceeded among them) on any bad field.
    (Each limit is compared first and its message only built to raise: this runs for every frame.)"""
    ftype, flags, reserved, tag, seq, total, offset, wire_len, raw_len, checksum = HEADER.unpack(raw)
    frame_type = _FRAME_TYPES.get(ftype)
    if frame_type is None:
        raise RemoteProtocolError(f"unknown frame type {ftype}")
    if reserved:
        raise RemoteProtocolError(f"reserved header field is {reserved}, must be 0")
    if flags & ~KNOWN_FLAGS:
        raise RemoteProtocolError(f"unknown frame flags 0x{flags:02x}")
    if (frame_type is FrameType.DATA or frame_type is FrameType.ANNOUNCE) and total > limits.max_transfer_size:
        limits.check("max_transfer_size", total, f"message tag={tag} seq={seq}")
    if frame_type is FrameType.DATA:
        if max(raw_len, wire_len) > limits.max_frame_payload:
            limits.check("max_frame_payload", raw_len, f"chunk of tag={tag} seq={seq}")
            limits.check("max_frame_payload", wire_len, f"chunk of tag={tag} seq={seq}")
        if offset + raw_len > total:
            raise RemoteProtocolError(f"chunk [{offset}, {offset + raw_len}) lies outside message of {total} bytes")
        if not flags & FLAG_LZ4 and wire_len != raw_len:
            raise RemoteProtocolError(f"uncompressed chunk has wire_len {wire_len} != raw_len {raw_len}")
        if not flags & FLAG_CHECKSUM and checksum:
            raise RemoteProtocolError("checksum set without the CHECKSUM flag")
    else:
        if flags:
            raise RemoteProtocolError(f"flags 0x{flags:02x} on a {frame_type.name} frame")
        if frame_type in _NO_PAYLOAD and wire_len:
            raise RemoteProtocolError(f"{frame_type.name} frame with a {wire_len}-byte payload")
        if frame_type in (FrameType.CONTROL, FrameType.ABORT):
            limits.check("max_control_size", wire_len, f"{frame_type.name} message")
        if frame_type is FrameType.ACK and offset + raw_len > total:
            raise RemoteProtocolError(f"ack of [{offset}, {offset + raw_len}) outside a {total}-byte message")
    return Header(frame_type, flags, tag, seq, total, offset, wire_len, raw_len, checksum)


@dataclasses.dataclass(frozen=True, slots=True)
class ChunkReceived:
    """A DATA chunk's raw bytes now lie in the destination its header was placed at."""

    header: Header


@dataclasses.dataclass(frozen=True, slots=True)
class AckReceived:
    header: Header


@dataclasses.dataclass(frozen=True, slots=True)
class ControlReceived:
    payload: bytes


@dataclasses.dataclass(frozen=True, slots=True)
class AbortReceived:
    """The peer is failing the link; ``payload`` is its msgpack ``[code, text]``."""

    payload: bytes


@dataclasses.dataclass(frozen=True, slots=True)
class FlowReceived:
    """A GRANT, CREDIT or ANNOUNCE frame (``header.type`` says which)."""

    header: Header


@dataclasses.dataclass(frozen=True, slots=True)
class PingReceived:
    pass


@dataclasses.dataclass(frozen=True, slots=True)
class CloseReceived:
    pass


_FLOW_FRAMES = frozenset({FrameType.GRANT, FrameType.CREDIT, FrameType.ANNOUNCE})
PayloadPlacer = Callable[[Header], memoryview]


READ_AHEAD_BYTES = 64 * 1024 + 1024
"""Room after the bytes the decoder expects (``buffers()``): one read takes the next frames' headers
with the current one, and a payload of up to 64 KiB with its header (then copied once, about as
long as the read it saves takes), so the reader stops on a short read instead of reading until a
read finds nothing."""
BULK_READ_AHEAD_BYTES = 4 * 1024 + HEADER_SIZE
"""The read-ahead offered after a frame of more than READ_AHEAD_BYTES: such frames come in a row (a
stream carrying a large message's chunks), and the part of the next payload a full read-ahead took
would only be copied (bench/frame_decoder.py, 1 MiB frames: about 8 % more time per frame than
reading payloads in place; about 4 % with this). This still takes the headers between chunks
(acks, grants)."""


class FrameDecoder:
    """Incremental frame decoder that lets the caller receive payloads in place.

    The I/O layer asks ``buffer()`` where the next bytes belong, receives into it (``recv_into``),
    then calls ``advance(n)``. When a DATA header is complete, ``place(header)`` returns the
    writable memoryview of exactly ``raw_len`` bytes that the payload goes to (the posted buffer,
    a staging buffer, or a scratch sink), so payload bytes are copied once, by the kernel.

    ``buffers()`` adds a read-ahead area after ``buffer()`` for one scatter read (``readv``, see
    ``wanlink.io.stream.receive_into``): bytes that overflow into it are decoded by the same
    ``advance(n)``, every frame they complete included (the part of a payload found there is
    copied to its place).
    The pure-Python reference of ``wanlink._wire.FrameDecoder`` (see ``wanlink.proto.decoder``).
    """

    def __init__(self, place: PayloadPlacer, limits: Limits = DEFAULT_LIMITS):
        self._place = place
        self._limits = limits
        self._header_buf = bytearray(HEADER_SIZE)
        self._header_view = memoryview(self._header_buf)
        self._target: memoryview = self._header_view
        self._filled = 0
        self._header: Header | None = None
        self._compressed: bytearray | None = None
        self._destination: memoryview | None = None
        self._ahead_full = memoryview(bytearray(READ_AHEAD_BYTES))
        self._ahead_bulk = self._ahead_full[:BULK_READ_AHEAD_BYTES]
        self._ahead = self._ahead_full  # the read-ahead area offered now (see BULK_READ_AHEAD_BYTES)

    def buffer(self) -> memoryview:
        """The writable region the next received bytes must be written to."""
        return self._target[self._filled:]

    def buffers(self) -> list[memoryview]:
        """``buffer()`` and then the read-ahead area, for one scatter read; ``advance`` takes what it got."""
        return [self._target[self._filled:], self._ahead]

    def advance(self, nbytes: int) -> list:
        """Account for ``nbytes`` just written into ``buffer()`` (beyond it: into the read-ahead area
        of ``buffers()``); returns completed events."""
        offered = len(self._target) - self._filled
        if nbytes < 0 or nbytes > offered + len(self._ahead):
            raise LocalProtocolError(f"advance({nbytes}) beyond the {offered} bytes offered "
                                     f"(and {len(self._ahead)} of read-ahead)")
        if nbytes <= offered:
            return self._advance(nbytes)
        events = self._advance(offered)
        ahead, start, end = self._ahead_full, 0, nbytes - offered
        while start < end:  # the bytes that overflowed go where the frames decoded so far say
            take = min(len(self._target) - self._filled, end - start)
            self._target[self._filled:self._filled + take] = ahead[start:start + take]
            start += take
            events += self._advance(take)
        return events

    def _advance(self, nbytes: int) -> list:
        self._filled += nbytes
        if self._filled < len(self._target):
            return []
        if self._header is None:
            return self._on_header_complete()
        return [self._on_payload_complete()]

    def landing(self) -> tuple[int, int, int] | None:
        """(tag, seq, offset) of the DATA chunk whose payload is being received now, else None."""
        header = self._header
        if header is None or header.type is not FrameType.DATA:
            return None
        return header.tag, header.seq, header.offset

    def redirect(self, destination: memoryview) -> None:
        """The chunk being received (``landing()``) goes to ``destination`` from now on (its receive
        was posted while it arrived into staging): the bytes received so far are copied over, the
        rest lands there directly."""
        header = self._header
        if header is None or header.type is not FrameType.DATA or len(destination) != header.raw_len:
            raise LocalProtocolError("redirect() needs a DATA payload in progress and a view of its size")
        if header.flags & FLAG_LZ4:  # the compressed bytes stay; they decompress to the new place
            self._destination = destination
            return
        destination[:self._filled] = self._target[:self._filled]
        self._target = destination

    def feed(self, data: bytes) -> list:
        """Copy ``data`` through buffer()/advance(); convenient for tests and small inputs."""
        events: list = []
        view = memoryview(data)
        while view:
            target = self.buffer()
            n = min(len(target), len(view))
            target[:n] = view[:n]
            view = view[n:]
            events += self.advance(n)
        return events

    def _on_header_complete(self) -> list:
        header = parse_header(self._header_buf, self._limits)
        if header.type is FrameType.ACK:
            return self._expect_header([AckReceived(header)])
        if header.type is FrameType.PING:
            return self._expect_header([PingReceived()])
        if header.type is FrameType.CLOSE:
            return self._expect_header([CloseReceived()])
        if header.type in _FLOW_FRAMES:
            return self._expect_header([FlowReceived(header)])
        self._header = header
        if header.type is not FrameType.DATA or header.flags & FLAG_LZ4:
            self._compressed = bytearray(header.wire_len)
            self._target = memoryview(self._compressed)
        if header.type is FrameType.DATA:
            destination = self._place(header)
            if len(destination) != header.raw_len:
                raise LocalProtocolError("payload placer returned a view of the wrong size")
            if header.flags & FLAG_LZ4:
                self._destination = destination
            else:
                self._target = destination
        self._filled = 0
        if header.wire_len == 0:
            return [self._on_payload_complete()]
        return []

    def _on_payload_complete(self):
        header = self._header
        if header.type is FrameType.CONTROL:
            event = ControlReceived(bytes(self._compressed))
        elif header.type is FrameType.ABORT:
            event = AbortReceived(bytes(self._compressed))
        else:
            if header.flags & FLAG_LZ4:
                _decompress_into(self._compressed, self._destination, header)
                raw = self._destination
            else:
                raw = self._target
            if header.flags & FLAG_CHECKSUM and zlib.crc32(raw) != header.checksum:
                raise RemoteProtocolError(f"checksum mismatch in chunk at offset {header.offset} "
                                          f"of tag={header.tag} seq={header.seq}")
            event = ChunkReceived(header)
        self._ahead = self._ahead_bulk if header.wire_len > READ_AHEAD_BYTES else self._ahead_full
        self._expect_header([])
        return event

    def _expect_header(self, events: list) -> list:
        self._header = None
        self._compressed = None
        self._destination = None
        self._target = self._header_view
        self._filled = 0
        return events


def _decompress_into(compressed: bytearray, destination: memoryview, header: Header) -> None:
    import lz4.block

    try:
        raw = lz4.block.decompress(bytes(compressed), uncompressed_size=header.raw_len)
    except lz4.block.LZ4BlockError as exc:
        raise RemoteProtocolError(f"corrupt lz4 chunk at offset {header.offset} of tag={header.tag}: {exc}") from None
    if len(raw) != header.raw_len:
        raise RemoteProtocolError(f"lz4 chunk decompressed to {len(raw)} bytes, header says {header.raw_len}")
    destination[:] = raw


def compress_chunk(payload: memoryview) -> bytes | None:
    """lz4-compress a chunk; None when compression does not shrink it."""
    import lz4.block

    packed = lz4.block.compress(payload, store_size=False)
    return packed if len(packed) < len(payload) else None
