"""msgpack control messages: encoding and bounded, typed decoding."""
from __future__ import annotations

import msgpack

from wanlink.errors import ProtocolError


def pack_message(message) -> bytes:
    return msgpack.packb(message, use_bin_type=True)


def unpack_message(payload: bytes, what: str = "control message"):
    """Decode one msgpack message whose length the caller already bounded; ProtocolError if malformed."""
    try:
        return msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise ProtocolError(f"malformed {what}: {exc}") from None
