"""msgpack control messages: encoding and bounded, typed decoding."""
from __future__ import annotations

import msgpack

from wanlink.errors import LocalProtocolError, RemoteProtocolError


def pack_message(message) -> bytes:
    """Encode one message; LocalProtocolError when msgpack cannot carry it."""
    try:
        return msgpack.packb(message, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as exc:
        raise LocalProtocolError(f"cannot encode {type(message).__name__} as a msgpack message: {exc}") from None


def unpack_message(payload: bytes, what: str = "control message"):
    """Decode one msgpack message whose length the caller already bounded; RemoteProtocolError if malformed."""
    try:
        return msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise RemoteProtocolError(f"malformed {what}: {exc}") from None
