"""Frame header encoding and the incremental decoder, fed bytes only."""
import random
import struct
import zlib

import lz4.block
import pytest

from wanlink.errors import LimitExceeded, LocalProtocolError, RemoteProtocolError
from wanlink.proto.frames import (
    CLOSE_FRAME, HEADER, HEADER_SIZE, PING_FRAME, READ_AHEAD_BYTES, AckReceived, ChunkReceived, CloseReceived,
    ControlReceived, Flags, FrameDecoder, FrameType, PingReceived, ack_header, control_header, data_header,
    parse_header,
)
from wanlink.proto.limits import Limits

LIMITS = Limits(max_frame_payload=1 << 16, max_transfer_size=1 << 20, max_control_size=1024)


class Sink:
    """Places each chunk into one message buffer per (tag, seq), like the reassembler does."""

    def __init__(self):
        self.buffers = {}

    def place(self, header):
        buf = self.buffers.setdefault((header.tag, header.seq), bytearray(header.total))
        return memoryview(buf)[header.offset:header.offset + header.raw_len]


def decoder():
    sink = Sink()
    return FrameDecoder(sink.place, LIMITS), sink


def data_frame(tag, seq, total, offset, payload, **kw):
    return data_header(tag, seq, total, offset, len(payload), **kw) + payload


def test_header_round_trip():
    raw = data_header(-5, 7, 1000, 200, 300, flags=Flags.CHECKSUM, checksum=0xDEADBEEF)
    assert len(raw) == HEADER_SIZE == 44
    header = parse_header(raw, LIMITS)
    assert (header.type, header.tag, header.seq, header.total, header.offset, header.wire_len, header.raw_len,
            header.checksum) == (FrameType.DATA, -5, 7, 1000, 200, 300, 300, 0xDEADBEEF)


@pytest.mark.parametrize("split", [1, 3, 43, 44, 45, 1000])
def test_fragmented_stream_decodes_identically(split):
    payload_a = bytes(range(256)) * 4
    payload_b = b"xyz"
    wire = (data_frame(1, 0, 2048, 0, payload_a) + PING_FRAME + ack_header(2, 3, 10, 0, 10)
            + data_frame(1, 0, 2048, 1024, payload_a) + control_header(3) + b"\x93\x01\x02\x03"[:3]
            + data_frame(9, 1, 3, 0, payload_b) + CLOSE_FRAME)
    dec, sink = decoder()
    events = []
    for start in range(0, len(wire), split):
        events += dec.feed(wire[start:start + split])
    kinds = [type(e) for e in events]
    assert kinds == [ChunkReceived, PingReceived, AckReceived, ChunkReceived, ControlReceived, ChunkReceived,
                     CloseReceived]
    assert bytes(sink.buffers[(1, 0)]) == payload_a * 2
    assert bytes(sink.buffers[(9, 1)]) == payload_b
    assert events[2].header.tag == 2 and events[2].header.seq == 3


def test_recv_into_style_buffer_then_advance_writes_payload_in_place():
    dec, sink = decoder()
    wire = data_frame(4, 0, 5, 0, b"hello")
    target = dec.buffer()
    assert len(target) == HEADER_SIZE
    target[:] = wire[:HEADER_SIZE]
    assert dec.advance(HEADER_SIZE) == []
    target = dec.buffer()
    assert len(target) == 5
    assert target.obj is sink.buffers[(4, 0)]  # the payload goes straight to the destination
    target[:] = b"hello"
    [event] = dec.advance(5)
    assert isinstance(event, ChunkReceived) and bytes(sink.buffers[(4, 0)]) == b"hello"


def test_zero_length_message():
    dec, sink = decoder()
    [event] = dec.feed(data_header(3, 0, 0, 0, 0))
    assert isinstance(event, ChunkReceived) and event.header.total == 0


def test_lz4_and_checksum_payloads():
    raw = b"abcd" * 1000
    packed = lz4.block.compress(raw, store_size=False)
    dec, sink = decoder()
    wire = data_header(1, 0, len(raw), 0, len(packed), flags=Flags.LZ4 | Flags.CHECKSUM, raw_len=len(raw),
                       checksum=zlib.crc32(raw)) + packed
    [event] = dec.feed(wire)
    assert bytes(sink.buffers[(1, 0)]) == raw


def test_checksum_mismatch_is_a_protocol_error():
    dec, _ = decoder()
    with pytest.raises(RemoteProtocolError, match="checksum"):
        dec.feed(data_header(1, 0, 3, 0, 3, flags=Flags.CHECKSUM, checksum=zlib.crc32(b"abc") ^ 1) + b"abc")


def test_corrupt_lz4_is_a_protocol_error():
    dec, _ = decoder()
    with pytest.raises(RemoteProtocolError, match="lz4"):
        dec.feed(data_header(1, 0, 100, 0, 5, flags=Flags.LZ4, raw_len=100) + b"\xff\xff\xff\xff\xff")


def _fields(**changes):
    base = dict(type=FrameType.DATA, flags=0, reserved=0, tag=1, seq=0, total=100, offset=0, wire_len=10,
                raw_len=10, checksum=0)
    base.update(changes)
    return HEADER.pack(*base.values())


@pytest.mark.parametrize("raw, error, match", [
    (_fields(type=0), RemoteProtocolError, "unknown frame type"),
    (_fields(type=99), RemoteProtocolError, "unknown frame type"),
    (_fields(reserved=1), RemoteProtocolError, "reserved"),
    (_fields(flags=0x80), RemoteProtocolError, "unknown frame flags"),
    (_fields(total=(1 << 20) + 1), LimitExceeded, "max_transfer_size"),
    (_fields(wire_len=(1 << 16) + 1, raw_len=(1 << 16) + 1, total=1 << 20), LimitExceeded, "max_frame_payload"),
    (_fields(flags=Flags.LZ4, wire_len=(1 << 16) + 1, total=1 << 20), LimitExceeded, "max_frame_payload"),
    (_fields(offset=95), RemoteProtocolError, "outside message"),
    (_fields(wire_len=9), RemoteProtocolError, "wire_len"),
    (_fields(checksum=5), RemoteProtocolError, "checksum set without"),
    (_fields(type=FrameType.ACK, wire_len=4), RemoteProtocolError, "payload"),
    (_fields(type=FrameType.PING, wire_len=1, raw_len=0), RemoteProtocolError, "payload"),
    (_fields(type=FrameType.CLOSE, flags=1, wire_len=0), RemoteProtocolError, "flags"),
    (_fields(type=FrameType.CONTROL, wire_len=1025, raw_len=1025), LimitExceeded, "max_control_size"),
    (_fields(type=FrameType.ACK, wire_len=0, offset=95), RemoteProtocolError, "outside"),
])
def test_every_malformed_field_is_rejected_before_payload(raw, error, match):
    placed = []
    dec = FrameDecoder(lambda h: placed.append(h) or memoryview(bytearray(h.raw_len)), LIMITS)
    with pytest.raises(error, match=match) as info:
        dec.feed(raw)
    assert not placed  # nothing was allocated for a rejected frame
    if error is LimitExceeded:
        assert info.value.limit == match


def test_limit_error_names_the_limit():
    with pytest.raises(LimitExceeded) as info:
        parse_header(_fields(total=1 << 30), LIMITS)
    assert info.value.limit == "max_transfer_size" and info.value.maximum == 1 << 20
    assert "max_transfer_size" in str(info.value)


def test_advance_beyond_offered_buffer_is_local_misuse():
    dec, _ = decoder()
    with pytest.raises(LocalProtocolError, match="beyond"):
        dec.advance(HEADER_SIZE + READ_AHEAD_BYTES + 1)


def test_a_placer_returning_the_wrong_size_is_local_misuse():
    dec = FrameDecoder(lambda header: memoryview(bytearray(header.raw_len - 1)), LIMITS)
    with pytest.raises(LocalProtocolError, match="wrong size"):
        dec.feed(data_frame(1, 0, 64, 0, bytes(64)))


def _decode(blob, piece_sizes):
    """Feed ``blob`` in consecutive, non-overlapping pieces; returns (events as comparable tuples, error type)."""
    dec, _ = decoder()
    events, start = [], 0
    try:
        for size in piece_sizes:
            if start >= len(blob):
                break
            events += [(type(e).__name__, getattr(e, "header", None)) for e in dec.feed(blob[start:start + size])]
            start += size
    except RemoteProtocolError as exc:  # LimitExceeded is one too; local misuse or anything else fails the test
        return events, type(exc)
    assert start >= len(blob), "pieces did not cover the input"
    return events, None


def test_fuzz_random_and_mutated_frames_only_raise_typed_errors():
    """Every byte is fed exactly once, and how the bytes are split never changes what is decoded."""
    rng = random.Random(1234)
    valid = [data_frame(1, 0, 64, 0, bytes(64)), PING_FRAME, ack_header(1, 0, 64, 0, 64),
             control_header(2) + b"\x91\x01",
             data_header(2, 0, 100, 0, 7, flags=Flags.LZ4, raw_len=100)
             + lz4.block.compress(bytes(100), store_size=False)[:7]]
    outcomes = set()
    for trial in range(3000):
        if trial % 3 == 0:
            blob = bytes(rng.getrandbits(8) for _ in range(rng.randint(0, 200)))
        else:
            blob = bytearray(rng.choice(valid) * rng.randint(1, 3))
            for _ in range(rng.randint(1, 6)):
                blob[rng.randrange(len(blob))] = rng.getrandbits(8)
            blob = bytes(blob)
        bytewise_events, bytewise_error = _decode(blob, [1] * len(blob))
        events, error = _decode(blob, [rng.randint(1, 50) for _ in range(len(blob))])
        assert error is bytewise_error, f"trial {trial}: {error} split randomly, {bytewise_error} byte by byte"
        if error is None:
            assert events == bytewise_events, f"trial {trial}"
        else:  # a feed() that raises drops the events completed earlier in the same piece
            assert events == bytewise_events[:len(events)], f"trial {trial}"
        outcomes.add(error)
        outcomes.update(name for name, _ in bytewise_events)
    # the fuzz reached both the decoding paths and the rejections
    assert {None, RemoteProtocolError, LimitExceeded, "ChunkReceived", "PingReceived"} <= outcomes


def test_fuzz_never_allocates_beyond_limits():
    rng = random.Random(99)
    sizes = []
    dec_limits = Limits(max_frame_payload=4096, max_transfer_size=8192)

    def place(header):
        sizes.append(header.raw_len)
        return memoryview(bytearray(header.raw_len))

    for _ in range(2000):
        length = rng.getrandbits(13)
        raw = struct.pack("<BBHqIQQIII", 1, 0, 0, rng.getrandbits(63), rng.getrandbits(32), rng.getrandbits(14),
                          rng.getrandbits(13), length, length, 0)
        try:
            FrameDecoder(place, dec_limits).feed(raw)
        except RemoteProtocolError:
            pass
    assert sizes and max(sizes) <= 4096


def staging_decoder():
    """A decoder whose chunks land in a staging buffer (as for a message nobody posted yet)."""
    staging = {}

    def place(header):
        return memoryview(staging.setdefault((header.tag, header.seq), bytearray(header.raw_len)))

    return FrameDecoder(place, LIMITS), staging


@pytest.mark.parametrize("flags", [0, Flags.CHECKSUM])
def test_a_chunk_redirected_mid_payload_lands_whole_in_its_new_place(flags):
    dec, staging = staging_decoder()
    payload = bytes(range(256)) * 4
    wire = data_frame(3, 0, len(payload), 0, payload, flags=flags, checksum=zlib.crc32(payload) if flags else 0)
    assert dec.landing() is None
    assert dec.feed(wire[:HEADER_SIZE + 300]) == []
    assert dec.landing() == (3, 0, 0)
    posted = bytearray(len(payload))
    dec.redirect(memoryview(posted))  # the receive was posted: 300 bytes move, the rest lands there
    assert posted[:300] == payload[:300] and not any(posted[300:])
    [event] = dec.feed(wire[HEADER_SIZE + 300:])
    assert isinstance(event, ChunkReceived) and posted == payload
    assert staging[(3, 0)][300:] == bytes(len(payload) - 300)  # none of the rest went to staging
    assert dec.landing() is None


def test_a_compressed_chunk_redirected_mid_payload_decompresses_into_its_new_place():
    dec, staging = staging_decoder()
    payload = b"wanlink " * 200
    packed = lz4.block.compress(payload, store_size=False)
    wire = data_header(1, 2, len(payload), 0, len(packed), flags=Flags.LZ4, raw_len=len(payload)) + packed
    dec.feed(wire[:HEADER_SIZE + 10])
    posted = bytearray(len(payload))
    dec.redirect(memoryview(posted))
    [event] = dec.feed(wire[HEADER_SIZE + 10:])
    assert event.header.seq == 2 and posted == payload and not any(staging[(1, 2)])


def test_redirect_without_a_payload_in_progress_or_of_another_size_is_local_misuse():
    dec, _ = staging_decoder()
    with pytest.raises(LocalProtocolError):
        dec.redirect(memoryview(bytearray(4)))
    dec.feed(data_frame(1, 0, 8, 0, b"abcdefgh")[:HEADER_SIZE + 2])
    with pytest.raises(LocalProtocolError):
        dec.redirect(memoryview(bytearray(4)))
