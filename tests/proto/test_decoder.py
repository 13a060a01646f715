"""The compiled frame decoder (wanlink._wire) against the pure-Python reference: the same bytes in,
split anywhere and read any way (feed, buffers()/advance with read-ahead, receive() from a socket),
give the same events, the same bytes where the placer put them, and the same errors."""
import functools
import itertools
import os
import random
import socket
import subprocess
import sys
import zlib

import lz4.block
import pytest

from wanlink.errors import LocalProtocolError, RemoteProtocolError
from wanlink.io.stream import receive_into
from wanlink.proto import decoder as decoding
from wanlink.proto.frames import (
    BULK_READ_AHEAD_BYTES, CLOSE_FRAME, HEADER, HEADER_SIZE, PING_FRAME, READ_AHEAD_BYTES, Flags, FrameType,
    ack_header, announce_frame, control_header, credit_frame, data_header, grant_frame,
)
from wanlink.proto.limits import Limits

LIMITS = Limits(max_frame_payload=1 << 17, max_transfer_size=1 << 20, max_control_size=1024)


@pytest.fixture(params=decoding.IMPLEMENTATIONS)
def implementation(request):
    if request.param not in decoding.available():
        pytest.skip(f"{request.param} frame decoder unavailable in this process")
    return decoding.load(request.param)


@pytest.fixture
def both():
    if "compiled" not in decoding.available():
        pytest.skip("compiled frame decoder unavailable in this process")
    return decoding.load("compiled"), decoding.load("reference")


class Sink:
    """Places each chunk into one buffer per (tag, seq) and records every placement."""

    def __init__(self):
        self.buffers = {}
        self.placed = []

    def place(self, header):
        self.placed.append(header)
        buf = self.buffers.setdefault((header.tag, header.seq), bytearray(header.total))
        return memoryview(buf)[header.offset:header.offset + header.raw_len]


def data_frame(tag, seq, total, offset, payload, **kw):
    return data_header(tag, seq, total, offset, len(payload), **kw) + payload


def _events(events):
    return [(type(e).__name__, getattr(e, "header", None), getattr(e, "payload", None)) for e in events]


def _outcome(cls, blob, read):
    """What decoding ``blob`` with ``read(decoder, blob)`` gives: (events, placements, bytes placed, error)."""
    sink = Sink()
    dec = cls(sink.place, LIMITS)
    events = []
    try:
        read(dec, blob, events)
        error = None
    except (RemoteProtocolError, LocalProtocolError) as exc:
        error = (type(exc), str(exc))
    return _events(events), sink.placed, {k: bytes(v) for k, v in sink.buffers.items()}, error


def feed_in(pieces):
    def read(dec, blob, events):
        start = 0
        for size in pieces:
            events += dec.feed(blob[start:start + size])
            start += size
        events += dec.feed(blob[start:])
    return read


def scatter_in(pieces):
    """As a stream reads: each read fills buffers() in order (at most what they offer), then advance()."""
    def read(dec, blob, events):
        start = 0
        for size in itertools.chain(pieces, itertools.repeat(len(blob))):
            if start >= len(blob):
                return
            buffers = dec.buffers()
            n = min(size, len(blob) - start, sum(len(b) for b in buffers))
            at = start
            for buf in buffers:
                take = min(len(buf), start + n - at)
                buf[:take] = blob[at:at + take]
                at += take
            start += n
            events += dec.advance(n)
    return read


def _lz4_frame(tag, seq, raw):
    packed = lz4.block.compress(raw, store_size=False)
    return data_header(tag, seq, len(raw), 0, len(packed), flags=Flags.LZ4 | Flags.CHECKSUM, raw_len=len(raw),
                       checksum=zlib.crc32(raw)) + packed


def small_stream():
    """Every frame type, a zero-length message, lz4 and checksum, a control and an abort."""
    payload = bytes(range(256)) * 2
    return (data_frame(1, 0, 1024, 0, payload) + PING_FRAME + ack_header(2, 3, 10, 0, 10) + grant_frame(5, 1)
            + data_frame(1, 0, 1024, 512, payload, flags=Flags.CHECKSUM | Flags.EAGER,
                         checksum=zlib.crc32(payload))
            + credit_frame(1 << 20) + announce_frame(7, 2, 4096) + control_header(3) + b"\x93\x01\x02"
            + data_header(3, 0, 0, 0, 0) + _lz4_frame(9, 1, b"wanlink " * 40)
            + control_header(5, FrameType.ABORT) + b"\x92\xa1x\xa1y" + CLOSE_FRAME)


def test_the_small_stream_split_at_every_byte_boundary_decodes_alike(both):
    blob = small_stream()
    reference = _outcome(both[1], blob, feed_in([]))
    assert reference[3] is None and len(reference[0]) == 12
    for split in range(1, len(blob)):
        for read in (feed_in([split]), scatter_in([split])):
            for cls in both:
                assert _outcome(cls, blob, read) == reference, f"{cls.__module__} split at {split}"


def test_byte_by_byte_and_whole_reads_decode_alike(implementation):
    blob = small_stream()
    expected = _outcome(decoding.load("reference"), blob, feed_in([]))
    assert _outcome(implementation, blob, feed_in([1] * len(blob))) == expected
    assert _outcome(implementation, blob, scatter_in([1])) == expected
    assert _outcome(implementation, blob, scatter_in([len(blob)])) == expected


def test_payloads_larger_than_the_read_ahead_decode_alike(both):
    """Payloads around READ_AHEAD_BYTES: part found in the read-ahead is copied, the rest read in place."""
    rng = random.Random(5)
    frames = b""
    for seq, size in enumerate([READ_AHEAD_BYTES - HEADER_SIZE, READ_AHEAD_BYTES, READ_AHEAD_BYTES + 1, 100_000,
                                 3, 65536]):
        payload = rng.randbytes(size)
        frames += data_frame(4, seq, size, 0, payload) + ack_header(1, seq, 8, 0, 8)
    reference = _outcome(both[1], frames, feed_in([]))
    assert reference[3] is None and len(reference[0]) == 12
    for trial in range(40):
        pieces = [rng.choice([1, 43, 44, 45, 1000, READ_AHEAD_BYTES, 200_000, rng.randint(1, 150_000)])
                  for _ in range(30)]
        for cls in both:
            assert _outcome(cls, frames, scatter_in(pieces)) == reference, f"{cls.__module__} trial {trial}"


def test_the_read_ahead_shrinks_after_a_frame_larger_than_it_and_grows_back(implementation):
    """A large payload's successor is large too, most likely: less of it is read ahead (then copied)."""
    dec = implementation(Sink().place, LIMITS)
    offered = []
    for frame in (PING_FRAME, data_frame(1, 0, 100_000, 0, bytes(100_000)), PING_FRAME,
                  data_frame(1, 1, 10, 0, bytes(10)), PING_FRAME):
        dec.feed(frame)
        offered.append(len(dec.buffers()[1]))
    assert offered == [READ_AHEAD_BYTES, BULK_READ_AHEAD_BYTES, BULK_READ_AHEAD_BYTES, READ_AHEAD_BYTES,
                       READ_AHEAD_BYTES]
    with pytest.raises(LocalProtocolError, match="beyond"):  # what advance() takes follows what was offered
        dec.feed(data_frame(1, 2, 100_000, 0, bytes(100_000)))
        dec.advance(HEADER_SIZE + BULK_READ_AHEAD_BYTES + 1)


def _fields(**changes):
    base = dict(type=FrameType.DATA, flags=0, reserved=0, tag=1, seq=0, total=100, offset=0, wire_len=10,
                raw_len=10, checksum=0)
    base.update(changes)
    return HEADER.pack(*base.values())


MALFORMED = [
    _fields(type=0), _fields(type=10), _fields(type=255), _fields(reserved=1), _fields(reserved=256),
    _fields(flags=0x80), _fields(flags=8), _fields(total=(1 << 20) + 1), _fields(total=(1 << 64) - 1),
    _fields(wire_len=(1 << 17) + 1, raw_len=(1 << 17) + 1, total=1 << 20),
    _fields(flags=Flags.LZ4, wire_len=(1 << 17) + 1, total=1 << 20), _fields(offset=95), _fields(offset=1 << 63),
    _fields(offset=(1 << 64) - 5, total=100), _fields(wire_len=9), _fields(checksum=5),
    _fields(type=FrameType.ACK, wire_len=4), _fields(type=FrameType.ACK, wire_len=0, offset=95),
    _fields(type=FrameType.ACK, wire_len=0, total=(1 << 64) - 1, offset=(1 << 64) - 2, raw_len=10),
    _fields(type=FrameType.PING, wire_len=1, raw_len=0), _fields(type=FrameType.CLOSE, flags=1, wire_len=0),
    _fields(type=FrameType.GRANT, flags=4, wire_len=0), _fields(type=FrameType.CREDIT, wire_len=3),
    _fields(type=FrameType.ANNOUNCE, wire_len=0, total=(1 << 20) + 1),
    _fields(type=FrameType.CONTROL, wire_len=1025, raw_len=1025), _fields(type=FrameType.ABORT, wire_len=1025),
    _fields(type=FrameType.CONTROL, flags=2, wire_len=3),
    data_header(1, 0, 3, 0, 3, flags=Flags.CHECKSUM, checksum=zlib.crc32(b"abc") ^ 1) + b"abc",
    data_header(1, 0, 100, 0, 5, flags=Flags.LZ4, raw_len=100) + b"\xff\xff\xff\xff\xff",
]


@pytest.mark.parametrize("index", range(len(MALFORMED)))
def test_malformed_frames_raise_the_same_error_after_the_same_events(both, index):
    blob = PING_FRAME + data_frame(2, 0, 4, 0, b"good") + MALFORMED[index] + PING_FRAME
    reference = _outcome(both[1], blob, feed_in([]))
    assert reference[3] is not None and reference[3][0] is not LocalProtocolError
    for read in (feed_in([]), feed_in([1] * len(blob)), scatter_in([len(blob)]), scatter_in([45]),
                 scatter_in([HEADER_SIZE + 1])):
        # (a read that raises loses the events it completed before it, in both)
        assert _outcome(both[0], blob, read) == _outcome(both[1], blob, read)


def test_random_and_mutated_frames_decode_alike(both):
    rng = random.Random(77)
    valid = [data_frame(1, 0, 64, 0, bytes(64)), PING_FRAME, ack_header(1, 0, 64, 0, 64), grant_frame(3, 4),
             control_header(2) + b"\x91\x01", _lz4_frame(2, 0, bytes(100)), credit_frame(9)]
    for trial in range(1500):
        if trial % 3 == 0:
            blob = rng.randbytes(rng.randint(0, 200))
        else:
            blob = bytearray(b"".join(rng.choice(valid) for _ in range(rng.randint(1, 4))))
            for _ in range(rng.randint(1, 6)):
                blob[rng.randrange(len(blob))] = rng.getrandbits(8)
            blob = bytes(blob)
        pieces = [rng.randint(1, 60) for _ in range(len(blob))]
        bytewise = _outcome(both[1], blob, feed_in([1] * len(blob)))
        for read in (feed_in(pieces), scatter_in(pieces)):
            reference = _outcome(both[1], blob, read)
            assert _outcome(both[0], blob, read) == reference, f"trial {trial}"
            assert reference[3] == bytewise[3], f"trial {trial}: how the bytes were split changed the error"


def test_a_chunk_redirected_mid_payload_lands_whole_in_both(implementation):
    staging = {}

    def place(header):
        return memoryview(staging.setdefault((header.tag, header.seq), bytearray(header.raw_len)))

    dec = implementation(place, LIMITS)
    payload = bytes(range(256)) * 4
    wire = data_frame(3, 0, len(payload), 0, payload, flags=Flags.CHECKSUM, checksum=zlib.crc32(payload))
    buffers = dec.buffers()
    buffers[0][:] = wire[:HEADER_SIZE]
    buffers[1][:300] = wire[HEADER_SIZE:HEADER_SIZE + 300]
    assert dec.advance(HEADER_SIZE + 300) == [] and dec.landing() == (3, 0, 0)
    posted = bytearray(len(payload))
    dec.redirect(memoryview(posted))
    assert posted[:300] == payload[:300] and not any(posted[300:])
    [event] = dec.feed(wire[HEADER_SIZE + 300:])
    assert event.header.tag == 3 and posted == payload and dec.landing() is None
    with pytest.raises(LocalProtocolError, match="redirect"):
        dec.redirect(memoryview(bytearray(4)))


def test_advance_beyond_what_was_offered_is_local_misuse(implementation):
    dec = implementation(Sink().place, LIMITS)
    with pytest.raises(LocalProtocolError, match="beyond"):
        dec.advance(HEADER_SIZE + READ_AHEAD_BYTES + 1)
    with pytest.raises(LocalProtocolError, match="beyond"):
        dec.advance(-1)


def _receive(dec):
    """The compiled decoder's own read loop, or the reference's (``receive_into``): what a stream uses."""
    return getattr(dec, "receive", None) or functools.partial(receive_into, dec)


def _socket_pair():
    a, b = socket.socketpair()
    a.setblocking(False)
    return a, b


def test_receive_reads_until_a_short_read_and_reports_the_end(implementation):
    reader, writer = _socket_pair()
    try:
        sink = Sink()
        dec = implementation(sink.place, LIMITS)
        assert _receive(dec)(reader.fileno(), 1 << 20) == (0, [], False)  # nothing there: no error, no events
        blob = small_stream() + data_frame(6, 0, 100_000, 0, b"z" * 100_000)
        writer.sendall(blob[:5000])
        nbytes, events, ended = _receive(dec)(reader.fileno(), 1 << 20)
        assert (nbytes, ended) == (5000, False)
        writer.sendall(blob[5000:])
        writer.shutdown(socket.SHUT_WR)
        while not ended:
            n, more, ended = _receive(dec)(reader.fileno(), 1 << 20)
            nbytes, events = nbytes + n, events + more
        assert nbytes == len(blob)
        assert _events(events) == _outcome(decoding.load("reference"), blob, feed_in([]))[0]
        assert bytes(sink.buffers[(6, 0)]) == b"z" * 100_000
    finally:
        reader.close()
        writer.close()


def test_receive_stops_at_its_budget_and_raises_read_errors(implementation):
    reader, writer = _socket_pair()
    try:
        dec = implementation(Sink().place, LIMITS)
        writer.sendall(PING_FRAME * 1000)
        nbytes, events, ended = _receive(dec)(reader.fileno(), 1)  # one read, however much it takes
        assert 0 < nbytes <= len(PING_FRAME) + READ_AHEAD_BYTES and len(events) == nbytes // HEADER_SIZE
    finally:
        reader.close()
        writer.close()
    bad = os.open(os.devnull, os.O_WRONLY)
    try:
        with pytest.raises(OSError):
            _receive(implementation(Sink().place, LIMITS))(bad, 1 << 20)
    finally:
        os.close(bad)


# Makes `import wanlink._wire` fail as it does where the build skipped it (no compiler, another Python).
WITHOUT_EXTENSION = """
import importlib.abc, sys, warnings
class NoWire(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "wanlink._wire":
            raise ImportError("No module named 'wanlink._wire'")
sys.meta_path.insert(0, NoWire())
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    from wanlink.proto import decoder
    from wanlink.io.stream import Stream
print(decoder.NAME, decoder.available(), len([w for w in caught if "_wire" in str(w.message)]))
try:
    decoder.load("compiled")
except Exception as exc:
    print(type(exc).__name__, exc)
"""


def test_without_the_extension_the_reference_decodes_and_nothing_breaks():
    environment = {k: v for k, v in os.environ.items() if k != "WANLINK_PUREPYTHON"}
    done = subprocess.run([sys.executable, "-c", WITHOUT_EXTENSION], capture_output=True, text=True, timeout=120,
                          check=True, env=environment)
    chosen, refused = done.stdout.splitlines()
    assert chosen == "reference ['reference'] 0"  # no warning: the kernels' import says the build was skipped
    assert refused.startswith("UnsupportedError compiled frame decoder unavailable: wanlink._wire is not built")
