"""msgpack control messages: encoding and bounded, typed decoding; the ABORT frame's reason."""
from __future__ import annotations

import msgpack

from wanlink.errors import LimitExceeded, LocalProtocolError, ProtocolError, RemoteProtocolError
from wanlink.proto.frames import FrameType, control_header

ABORT_TEXT_MAX = 2000  # characters of the error's text an ABORT carries


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


def abort_reason(exc: BaseException) -> str:
    """The reason code an ABORT gives for failing a link because of ``exc``."""
    if isinstance(exc, LimitExceeded):
        return "limit"
    if isinstance(exc, ProtocolError):
        return "protocol"
    return "error"


def abort_frame(exc: BaseException) -> bytes:
    """An ABORT frame: ``[code, text]`` saying why this side fails the link."""
    payload = pack_message([abort_reason(exc), f"{type(exc).__name__}: {exc}"[:ABORT_TEXT_MAX]])
    return control_header(len(payload), FrameType.ABORT) + payload


def unpack_abort(payload: bytes) -> tuple[str, str]:
    """(code, text) of an ABORT payload; ProtocolError if it is not two strings."""
    message = unpack_message(payload, "ABORT reason")
    if not (isinstance(message, list) and len(message) == 2 and all(isinstance(part, str) for part in message)):
        raise RemoteProtocolError(f"malformed ABORT reason {message!r:.100}")
    return message[0], message[1]
