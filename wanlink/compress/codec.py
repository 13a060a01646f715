"""Block-COO wire format: one contiguous buffer with a fixed header, block ids and 64-byte-aligned values.

Layout (little endian)::

    0   magic b"WLBK" | version u8 | flags u8 (bit 0: lz4) | block u16
    8   count u32 | reserved u32 (0)
    16  numel u64
    24  payload u64: bytes after the header (the lz4 block when compressed)
    32  count int32 block ids, strictly increasing, each < ceil(numel / block)
        zero padding up to the next multiple of 64
        count x block float32 values (the tail block's padding is zero)

With lz4, everything from offset 32 on is one lz4 block; its decompressed size follows from the
header, so a frame can never make the decoder allocate more than the header allows. Decoding an
uncompressed frame returns NumPy views into the caller's buffer (no copy of the values).
"""
import struct
from typing import NamedTuple

import lz4.block
import numpy as np

from wanlink import kernels
from wanlink.errors import ConfigError, LimitExceeded, ProtocolError
from wanlink.kernels.arrays import block_count, block_values_view, check_block_size, flat_view

MAGIC = b"WLBK"
VERSION = 1
FLAG_LZ4 = 0x01
HEADER = struct.Struct("<4sBBHIIQQ")
ALIGNMENT = 64
MAX_BLOCK_ID = np.iinfo(np.int32).max
LZ4_MAX_RATIO = 256  # lz4 cannot expand a block more than ~255x: bounds what a header can make us allocate
DEFAULT_MAX_NUMEL = 1 << 36  # 256 GiB of float32: far above any tensor, far below u64 nonsense


class BlockFrame(NamedTuple):
    """A decoded frame: ``values[i]`` holds the ``block`` floats of block ``indices[i]``."""

    numel: int
    block: int
    indices: np.ndarray  # int32 [count]
    values: np.ndarray  # float32 [count, block]


def _values_offset(count: int) -> int:
    end_of_indices = HEADER.size + 4 * count
    return -(-end_of_indices // ALIGNMENT) * ALIGNMENT


def encoded_size(count: int, block: int = 16) -> int:
    """Bytes of an uncompressed frame holding ``count`` blocks (an upper bound for out= buffers)."""
    return _values_offset(count) + 4 * count * block


def _aligned_bytes(size: int) -> np.ndarray:
    raw = np.empty(size + ALIGNMENT, dtype=np.uint8)
    skip = (-raw.ctypes.data) % ALIGNMENT
    return raw[skip: skip + size]


def encode_blocks(indices, values, numel: int, *, block: int = 16, compress: bool = False,
                  out=None) -> memoryview:
    """Encode sorted block ids and their values into one frame; returns a memoryview of it.

    ``out`` (a writable uint8 array or bytearray of at least ``encoded_size`` bytes; with lz4,
    up to the lz4 bound) is reused instead of allocating; the frame starts at its first byte.
    """
    block = check_block_size(block)
    if isinstance(numel, bool) or not isinstance(numel, (int, np.integer)) or numel < 0:
        raise ConfigError(f"numel must be an int >= 0, got {numel!r}")
    nblocks = block_count(int(numel), block)
    if nblocks > MAX_BLOCK_ID:
        raise ConfigError(f"{nblocks} blocks do not fit int32 block ids")
    ids = flat_view(indices, np.int32, "indices")
    count = ids.shape[0]
    flat_values = block_values_view(values, count, block)
    bad = kernels.active().first_invalid_block_index(ids, nblocks)
    if bad >= 0:
        raise ConfigError(f"indices[{bad}] = {int(ids[bad])} is out of [0, {nblocks}) or not increasing")
    body_offset, values_offset = HEADER.size, _values_offset(count)
    size = encoded_size(count, block)
    if compress:
        body = np.zeros(size - body_offset, dtype=np.uint8)
        body[: 4 * count] = ids.view(np.uint8)
        body[values_offset - body_offset:] = flat_values.view(np.uint8)
        payload = lz4.block.compress(body, store_size=False)
        size = body_offset + len(payload)
    frame = _output_buffer(out, size)
    HEADER.pack_into(frame, 0, MAGIC, VERSION, FLAG_LZ4 if compress else 0, block, count, 0, int(numel),
                     size - body_offset)
    if compress:
        frame[body_offset:size] = np.frombuffer(payload, dtype=np.uint8)
    else:
        frame[body_offset: body_offset + 4 * count] = ids.view(np.uint8)
        frame[body_offset + 4 * count: values_offset] = 0
        frame[values_offset:size] = flat_values.view(np.uint8)
    return memoryview(frame)[:size]


def _output_buffer(out, size: int) -> np.ndarray:
    if out is None:
        return _aligned_bytes(size)
    try:
        frame = np.frombuffer(out, dtype=np.uint8) if not isinstance(out, np.ndarray) else out.reshape(-1)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"out must be a writable byte buffer: {exc}") from exc
    if frame.dtype != np.uint8 or not frame.flags.writeable or not frame.flags.c_contiguous:
        raise ConfigError("out must be a writable, contiguous uint8 buffer")
    if frame.shape[0] < size:
        raise ConfigError(f"out holds {frame.shape[0]} bytes; this frame needs {size}")
    return frame[:size]


def decode_blocks(buffer, *, max_numel: int = DEFAULT_MAX_NUMEL) -> BlockFrame:
    """Parse and validate a frame; values are views into ``buffer`` unless the frame is lz4-compressed.

    Raises ProtocolError for anything malformed (LimitExceeded when numel exceeds ``max_numel``).
    """
    try:
        data = np.frombuffer(buffer, dtype=np.uint8)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"cannot read a contiguous byte buffer from {type(buffer).__name__}: {exc}") from exc
    if data.shape[0] < HEADER.size:
        raise ProtocolError(f"block frame truncated: {data.shape[0]} bytes, header needs {HEADER.size}")
    magic, version, flags, block, count, reserved, numel, payload = HEADER.unpack_from(data, 0)
    if magic != MAGIC:
        raise ProtocolError(f"not a block frame (magic {magic!r})")
    if version != VERSION:
        raise ProtocolError(f"unsupported block frame version {version}")
    if flags & ~FLAG_LZ4 or reserved:
        raise ProtocolError(f"unknown flags 0x{flags:02x} or reserved field 0x{reserved:x} in block frame")
    try:
        block = check_block_size(block)
    except ConfigError as exc:
        raise ProtocolError(f"block frame: {exc}") from None
    if numel > max_numel:
        raise LimitExceeded("block frame numel", numel, max_numel)
    nblocks = block_count(numel, block)
    if count > nblocks:
        raise ProtocolError(f"block frame claims {count} blocks of a {nblocks}-block tensor")
    if payload != data.shape[0] - HEADER.size:
        raise ProtocolError(f"block frame payload is {payload} bytes but {data.shape[0] - HEADER.size} follow "
                            "the header (truncated or trailing bytes)")
    size = encoded_size(count, block)
    if flags & FLAG_LZ4:
        if size - HEADER.size > LZ4_MAX_RATIO * payload + ALIGNMENT:
            raise ProtocolError(f"block frame lz4 payload of {payload} bytes cannot expand to {size - HEADER.size}")
        try:
            body = lz4.block.decompress(data[HEADER.size:], uncompressed_size=size - HEADER.size)
        except lz4.block.LZ4BlockError as exc:
            raise ProtocolError(f"block frame lz4 payload is corrupt: {exc}") from None
        if len(body) != size - HEADER.size:
            raise ProtocolError(f"block frame lz4 payload decompressed to {len(body)} bytes, "
                                f"expected {size - HEADER.size}")
        base, data = HEADER.size, np.frombuffer(body, dtype=np.uint8)
    elif payload != size - HEADER.size:
        raise ProtocolError(f"block frame of {count} blocks must be {size} bytes, got {HEADER.size + payload}")
    else:
        base = 0
    values_offset = _values_offset(count) - base
    indices = data[HEADER.size - base: HEADER.size - base + 4 * count].view(np.int32)
    if data[HEADER.size - base + 4 * count: values_offset].any():
        raise ProtocolError("block frame padding before the values is not zero")
    bad = kernels.active().first_invalid_block_index(indices, nblocks)
    if bad >= 0:
        raise ProtocolError(f"block frame index {bad} ({int(indices[bad])}) is out of [0, {nblocks}) "
                            "or not increasing")
    values = data[values_offset: values_offset + 4 * count * block].view(np.float32).reshape(count, block)
    tail = numel - (nblocks - 1) * block
    if count and tail < block and indices[-1] == nblocks - 1 and values[-1, tail:].view(np.uint32).any():
        raise ProtocolError("block frame tail block has non-zero padding")
    return BlockFrame(int(numel), block, indices, values)
