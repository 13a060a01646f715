"""One error tree for wanlink.

Every class also subclasses the matching built-in, so callers may catch either
``wanlink.PeerLost`` or ``ConnectionError``.
"""


class WanlinkError(Exception):
    """Base of every error wanlink raises on purpose."""


class ConfigError(WanlinkError, ValueError):
    """A bad argument, environment variable or configuration value."""


class ProtocolError(WanlinkError, ValueError):
    """The wire protocol was broken: by the peer (:class:`RemoteProtocolError`) or by this side
    (:class:`LocalProtocolError`)."""


class LocalProtocolError(ProtocolError):
    """This side misused the protocol: drove a protocol state machine in the wrong state or with
    the wrong input, or asked to send what the protocol cannot carry (an oversize control message,
    transfer or handshake metadata). A bug or bad input here, not the peer's fault."""


class RemoteProtocolError(ProtocolError):
    """The peer sent bytes that violate the wire protocol (malformed frame, message or handshake)."""


class ServerBusy(RemoteProtocolError):
    """The server refused a stream for now (too many connections authenticating, or half-open
    links); ``connect`` retries with backoff within its timeout."""


class LimitExceeded(RemoteProtocolError):
    """The peer exceeded a hard limit (frame size, transfer size, streams, pending transfers).

    ``limit`` names the limit, ``value`` is what was asked and ``maximum`` the bound. (When this
    side would exceed one, by sending, that is a :class:`LocalProtocolError` naming the limit.)
    """

    def __init__(self, limit: str, value: int, maximum: int, context: str = ""):
        self.limit, self.value, self.maximum = limit, value, maximum
        where = f" ({context})" if context else ""
        super().__init__(f"limit {limit} exceeded: {value} > {maximum}{where}")


class AuthenticationError(WanlinkError, PermissionError):
    """The peer failed the HMAC challenge-response (wrong secret, replay or wrong link)."""


class PeerLost(WanlinkError, ConnectionError):
    """Every stream to a peer died or the peer went silent; pending transfers cannot finish."""


class DeadlineExceeded(WanlinkError, TimeoutError):
    """An operation did not finish within its timeout."""


class MessageSizeError(WanlinkError, ValueError):
    """A received message does not have the size of the buffer posted for it."""


class UnsupportedError(WanlinkError, NotImplementedError):
    """The requested operation, dtype or option is not supported."""


class NonFiniteGradientError(WanlinkError, ValueError):
    """A gradient (or gradient plus residual) holds NaN or Inf, or a block's magnitude overflows float32."""


class DesyncError(WanlinkError, RuntimeError):
    """Ranks issued different collectives (op, dtype or size) at the same sequence number."""


class SparseFidelityWarning(UserWarning):
    """Block-sparse training at this density is expected to fall short of dense training (docs/sparse.md)."""
