"""Hard limits of the wire protocol, checked before anything is allocated."""
from __future__ import annotations

import dataclasses

from wanlink.errors import ConfigError, LimitExceeded, LocalProtocolError

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB


@dataclasses.dataclass(frozen=True)
class Limits:
    """Bounds a peer may never exceed (a violation raises LimitExceeded and closes that link), and
    which this side never asks for (``check_outgoing``: LocalProtocolError)."""

    max_frame_payload: int = 16 * MiB  # one DATA frame's payload (chunks are at most 4 MiB)
    max_transfer_size: int = 64 * GiB  # one message (tag, seq)
    max_streams: int = 64  # TCP streams in one link
    max_pending_transfers: int = 4096  # partially received or unclaimed messages
    max_unexpected_bytes: int = 128 * MiB  # eager credit: bytes staged for receives not posted yet
    max_control_size: int = 64 * KiB  # one msgpack control message
    max_pending_control: int = 1024  # control messages not yet read by the application
    max_meta_size: int = 4 * KiB  # the metadata a client sends in its handshake
    max_pending_links: int = 64  # half-assembled links on a server
    max_handshakes: int = 256  # streams a server authenticates at once; when full, the oldest is evicted
    max_handshakes_per_host: int = 128  # of those, from one source address (above: its own oldest is evicted)

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"Limits.{field.name} must be a positive int, got {value!r}")
        if self.max_streams > 65535:
            raise ConfigError("Limits.max_streams must fit in 16 bits")
        if self.max_frame_payload >= 2**32:
            raise ConfigError("Limits.max_frame_payload must fit in 32 bits")

    def check(self, limit: str, value: int, context: str = "") -> None:
        """Raise LimitExceeded when ``value``, which the peer sent, is above the limit named ``limit``."""
        maximum = getattr(self, limit)
        if value > maximum:
            raise LimitExceeded(limit, value, maximum, context)

    def check_outgoing(self, limit: str, value: int, context: str = "") -> None:
        """Raise LocalProtocolError when ``value``, which this side is about to send, is above ``limit``."""
        maximum = getattr(self, limit)
        if value > maximum:
            raise LocalProtocolError(f"{context}: {value} > {maximum}, the most the protocol carries ({limit})")


DEFAULT_LIMITS = Limits()
