"""Block-COO codec: round trips, zero-copy decoding, and malformed frames (including a bounded fuzz)."""
import struct

import numpy as np
import pytest

from wanlink.compress import BlockFrame, decode_blocks, encode_blocks, encoded_size
from wanlink.compress.codec import HEADER
from wanlink.errors import ConfigError, LimitExceeded, ProtocolError, UnsupportedError


def random_blocks(rng, numel, count, block=16):
    nblocks = -(-numel // block)
    indices = np.sort(rng.choice(nblocks, size=count, replace=False)).astype(np.int32)
    values = rng.standard_normal((count, block)).astype(np.float32)
    tail = numel - (nblocks - 1) * block
    if count and indices[-1] == nblocks - 1:
        values[-1, tail:] = 0.0
    return indices, values


@pytest.mark.parametrize("numel, count, block", [
    (0, 0, 16), (1, 0, 16), (1, 1, 16), (17, 2, 16), (1000, 10, 16), (1000, 63, 16), (4097, 7, 1), (999, 5, 64),
])
@pytest.mark.parametrize("compress", [False, True])
def test_round_trip(implementation, rng, numel, count, block, compress):
    indices, values = random_blocks(rng, numel, count, block)
    frame = encode_blocks(indices, values, numel, block=block, compress=compress)
    decoded = decode_blocks(frame)
    assert isinstance(decoded, BlockFrame)
    assert (decoded.numel, decoded.block) == (numel, block)
    np.testing.assert_array_equal(decoded.indices, indices)
    np.testing.assert_array_equal(decoded.values, values)
    assert decoded.values.shape == (count, block) and decoded.values.dtype == np.float32
    if not compress:
        assert len(frame) == encoded_size(count, block)
    decoded_from_bytes = decode_blocks(bytes(frame))
    np.testing.assert_array_equal(decoded_from_bytes.values, values)


def test_decode_does_not_copy_values_and_aligns_them(implementation, rng):
    indices, values = random_blocks(rng, 10_000, 37)
    frame = np.frombuffer(encode_blocks(indices, values, 10_000), dtype=np.uint8)
    assert frame.ctypes.data % 64 == 0
    decoded = decode_blocks(frame)
    assert np.shares_memory(decoded.values, frame) and np.shares_memory(decoded.indices, frame)
    assert (decoded.values.ctypes.data - frame.ctypes.data) % 64 == 0


def test_encode_into_reused_buffer(implementation, rng):
    out = np.zeros(encoded_size(50) + 100, dtype=np.uint8)
    for count in (50, 3, 0):
        indices, values = random_blocks(rng, 5000, count)
        frame = encode_blocks(indices, values, 5000, out=out)
        assert np.shares_memory(np.frombuffer(frame, np.uint8), out)
        np.testing.assert_array_equal(decode_blocks(frame).values, values)
    with pytest.raises(ConfigError, match="needs"):
        encode_blocks(*random_blocks(rng, 5000, 60), 5000, out=out)
    with pytest.raises(ConfigError):
        encode_blocks(*random_blocks(rng, 5000, 2), 5000, out=bytes(10_000))


def test_lz4_shrinks_compressible_frames(implementation):
    values = np.zeros((1000, 16), dtype=np.float32)
    indices = np.arange(1000, dtype=np.int32)
    assert len(encode_blocks(indices, values, 16_000, compress=True)) < len(encode_blocks(indices, values, 16_000)) / 10


@pytest.mark.parametrize("indices, values, numel, block", [
    (np.array([3, 1], np.int32), np.zeros((2, 16), np.float32), 100, 16),  # not sorted
    (np.array([1, 1], np.int32), np.zeros((2, 16), np.float32), 100, 16),  # duplicate
    (np.array([7], np.int32), np.zeros((1, 16), np.float32), 100, 16),  # past the last block
    (np.array([-1], np.int32), np.zeros((1, 16), np.float32), 100, 16),
    (np.array([1], np.int64), np.zeros((1, 16), np.float32), 100, 16),  # wrong index dtype
    (np.array([1], np.int32), np.zeros((1, 16), np.float64), 100, 16),  # wrong value dtype
    (np.array([1], np.int32), np.zeros((1, 8), np.float32), 100, 16),  # wrong block width
    (np.array([1], np.int32), np.zeros((1, 16), np.float32), 100, 12),  # block not a power of two
    (np.array([1], np.int32), np.zeros((1, 16), np.float32), -1, 16),
])
def test_encode_rejects_bad_input(implementation, indices, values, numel, block):
    with pytest.raises((ConfigError, UnsupportedError)):
        encode_blocks(indices, values, numel, block=block)


def frame_with(**fields):
    """A valid 2-block frame (numel 40) with header fields overridden."""
    indices, values = np.array([0, 2], np.int32), np.ones((2, 16), np.float32)
    values[1, 8:] = 0.0  # block 2 covers elements 32..39 only
    frame = bytearray(encode_blocks(indices, values, 40))
    names = ("magic", "version", "flags", "block", "count", "reserved", "numel", "payload")
    header = dict(zip(names, HEADER.unpack_from(frame, 0)))
    header.update(fields)
    HEADER.pack_into(frame, 0, *(header[name] for name in names))
    return frame


@pytest.mark.parametrize("frame, message", [
    (b"", "truncated"),
    (frame_with()[:20], "truncated"),
    (frame_with(magic=b"XXXX"), "magic"),
    (frame_with(version=9), "version"),
    (frame_with(flags=0x80), "flags"),
    (frame_with(reserved=1), "reserved"),
    (frame_with(block=12), "power of two"),
    (frame_with(block=0), "power of two"),
    (frame_with(count=4), "claims"),
    (frame_with(count=1), "must be"),
    (frame_with(numel=33), "padding"),  # block 2 now holds 1 element: its other 15 floats must be zero
    (frame_with(numel=17), "out of"),  # only blocks 0 and 1 exist
    (frame_with(numel=15), "claims"),  # one block cannot carry two
    (frame_with(payload=10), "payload"),
    (frame_with()[:-4], "payload"),
    (frame_with() + b"\0", "payload"),
    (frame_with(flags=1), "lz4"),
])
def test_decode_rejects_malformed_frames(implementation, frame, message):
    with pytest.raises(ProtocolError, match=message):
        decode_blocks(frame)


def test_decode_rejects_bad_indices_and_padding(implementation):
    frame = frame_with()
    struct.pack_into("<ii", frame, HEADER.size, 2, 0)
    with pytest.raises(ProtocolError, match="not increasing"):
        decode_blocks(frame)
    frame = frame_with()
    struct.pack_into("<i", frame, HEADER.size + 4, 3)
    with pytest.raises(ProtocolError, match="out of"):
        decode_blocks(frame)
    frame = frame_with()
    frame[HEADER.size + 9] = 1
    with pytest.raises(ProtocolError, match="padding"):
        decode_blocks(frame)


def test_decode_limits(implementation):
    with pytest.raises(LimitExceeded):
        decode_blocks(frame_with(numel=1 << 40))
    with pytest.raises(LimitExceeded):
        decode_blocks(frame_with(), max_numel=39)
    # An lz4 frame whose header claims far more data than its payload could expand to.
    bomb = bytearray(HEADER.pack(b"WLBK", 1, 1, 16, 1 << 20, 0, 16 << 20, 8)) + bytes(8)
    with pytest.raises(ProtocolError, match="cannot expand"):
        decode_blocks(bomb)


def test_decode_rejects_non_buffers(implementation):
    with pytest.raises(ConfigError):
        decode_blocks(12345)


@pytest.mark.parametrize("compress", [False, True])
def test_fuzzed_frames_decode_or_raise_protocol_error(implementation, rng, compress):
    indices, values = random_blocks(rng, 3000, 20)
    original = bytes(encode_blocks(indices, values, 3000, compress=compress))
    outcomes = {"decoded": 0, "rejected": 0}
    for _ in range(400):
        frame = bytearray(original)
        mutation = rng.integers(4)
        if mutation == 0:  # flip bits
            for position in rng.integers(len(frame), size=rng.integers(1, 4)):
                frame[position] ^= 1 << int(rng.integers(8))
        elif mutation == 1:  # truncate
            frame = frame[: rng.integers(len(frame))]
        elif mutation == 2:  # overwrite a header field with random bytes
            start = int(rng.integers(HEADER.size - 4))
            frame[start: start + 4] = rng.bytes(4)
        else:  # random garbage after a valid header prefix
            frame = frame[:HEADER.size] + bytearray(rng.bytes(int(rng.integers(0, 2 * len(original)))))
        try:
            decoded = decode_blocks(bytes(frame))
        except ProtocolError:
            outcomes["rejected"] += 1
            continue
        outcomes["decoded"] += 1
        nblocks = -(-decoded.numel // decoded.block)
        assert decoded.values.shape == (decoded.indices.shape[0], decoded.block)
        assert np.all(np.diff(decoded.indices) > 0)
        assert decoded.indices.shape[0] == 0 or (decoded.indices[0] >= 0 and decoded.indices[-1] < nblocks)
    assert outcomes["rejected"] > 100
