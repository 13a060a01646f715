"""Sans-I/O stream handshake: version, link id, stream index/count, mutual HMAC-SHA256 auth.

Client -> server  HELLO     magic "WLK1" | version u16 | flags u16 | link_id 16B | index u16 | count u16
                            | client_nonce 32B | meta_len u16 | meta (msgpack, stream 0 only)
Server -> client  CHALLENGE magic | version u16 | status u8 | server_nonce 32B | server_proof 32B
Client -> server  PROOF     client_proof 32B
Server -> client  RESULT    status u8 (0 = accepted)

HELLO flag 1 (FLAG_SECURE) asks for encryption with integrity (``wanlink.proto.seal``): after
RESULT every frame on the stream is sealed with keys derived from the secret, HELLO and nonces.

Proofs are HMAC(secret, role || HELLO || server_nonce): both nonces are fresh per stream, so a
recorded handshake cannot be replayed to either side, and the proof binds link id, stream index
and count. The server proves first so a client never sends its proof to an impostor it could
detect. An empty secret disables authentication (the proofs still detect corruption).
"""
from __future__ import annotations

import dataclasses
import enum
import hashlib
import hmac
import os
import struct

from wanlink.errors import AuthenticationError, ConfigError, LocalProtocolError, RemoteProtocolError, ServerBusy
from wanlink.proto.control import pack_message, unpack_message
from wanlink.proto.limits import DEFAULT_LIMITS, Limits

MAGIC = b"WLK1"
VERSION = 1
HELLO = struct.Struct("<4sHH16sHH32sH")
CHALLENGE = struct.Struct("<4sHB32s32s")
PROOF_SIZE = 32
RESULT_SIZE = 1
NONCE_SIZE = 32
FLAG_SECURE = 1
PROBE_META_KEY = "wanlink_probe"
"""In stream 0's metadata: the link carries only probe traffic; a server keeps it from its application."""


class Status(enum.IntEnum):
    OK = 0
    VERSION_MISMATCH = 1
    REJECTED = 2  # bad proof
    BUSY = 3  # too many connections authenticating or half-open links: retry later
    BAD_STREAM = 4  # stream index/count inconsistent with the link
    INSECURE = 5  # the server requires secure=True


_STATUS_TEXT = {
    Status.VERSION_MISMATCH: "protocol version mismatch",
    Status.REJECTED: "authentication failed (wrong secret?)",
    Status.BUSY: "server busy: too many connections authenticating or half-open links",
    Status.BAD_STREAM: "stream index/count inconsistent with the link",
    Status.INSECURE: "the server requires encryption: connect with secure=True (WANLINK_SECURE=1)",
}


def normalize_secret(secret: bytes | str) -> bytes:
    """A secret given as bytes or str, as bytes (the edges resolve an omitted one from WANLINK_SECRET)."""
    if isinstance(secret, str):
        return secret.encode()
    if isinstance(secret, (bytes, bytearray, memoryview)):
        return bytes(secret)
    raise ConfigError(f"secret must be bytes or str, not {type(secret).__name__}")


def _proof(secret: bytes, role: bytes, hello: bytes, server_nonce: bytes) -> bytes:
    return hmac.new(secret, role + hello + server_nonce, hashlib.sha256).digest()


@dataclasses.dataclass(frozen=True)
class StreamHello:
    """What the client declared for one stream."""

    link_id: bytes
    index: int
    count: int
    meta: dict
    secure: bool = False


class ClientHandshake:
    """Client side of one stream's handshake. Drive with ``bytes_wanted()`` / ``receive()``."""

    def __init__(self, secret: bytes, link_id: bytes, index: int, count: int, meta: dict | None = None,
                 *, nonce: bytes | None = None, limits: Limits = DEFAULT_LIMITS, secure: bool = False):
        if not 0 <= index < count <= limits.max_streams:
            raise ConfigError(f"stream index {index} / count {count} invalid (max {limits.max_streams} streams)")
        meta_bytes = pack_message(meta) if index == 0 and meta else b""
        limits.check_outgoing("max_meta_size", len(meta_bytes), "handshake metadata")
        if secure and not secret:
            raise ConfigError("secure=True needs a shared secret (WANLINK_SECRET): keys derive from it")
        self._secret = secret
        self.secure = secure
        self._hello = HELLO.pack(MAGIC, VERSION, FLAG_SECURE if secure else 0, link_id, index, count,
                                 nonce or os.urandom(NONCE_SIZE), len(meta_bytes)) + meta_bytes
        self._server_nonce = b""
        self._state = "challenge"
        self.accepted = False

    def hello(self) -> bytes:
        return self._hello

    def bytes_wanted(self) -> int:
        return {"challenge": CHALLENGE.size, "result": RESULT_SIZE}.get(self._state, 0)

    def receive(self, data: bytes) -> bytes:
        """Feed exactly ``bytes_wanted()`` bytes; returns the bytes to send next (maybe empty)."""
        if len(data) != self.bytes_wanted():
            raise LocalProtocolError(f"handshake expected {self.bytes_wanted()} bytes, got {len(data)}")
        if self._state == "challenge":
            magic, version, status, server_nonce, server_proof = CHALLENGE.unpack(data)
            if magic != MAGIC:
                raise RemoteProtocolError(f"peer is not a wanlink server (magic {magic!r})")
            _raise_for_status(status)
            if version != VERSION:
                raise RemoteProtocolError(f"server speaks protocol version {version}, we speak {VERSION}")
            if not hmac.compare_digest(server_proof, _proof(self._secret, b"server", self._hello, server_nonce)):
                raise AuthenticationError("server failed to prove it knows the shared secret (wrong secret?)")
            self._state = "result"
            self._server_nonce = server_nonce
            return _proof(self._secret, b"client", self._hello, server_nonce)
        if self._state == "result":
            _raise_for_status(data[0])
            self._state = "done"
            self.accepted = True
            return b""
        raise LocalProtocolError("handshake already finished")

    def transcript(self) -> tuple[bytes, bytes]:
        """(HELLO, server nonce) of the accepted handshake: what stream keys derive from."""
        if not self.accepted:
            raise LocalProtocolError("handshake not finished")
        return self._hello, self._server_nonce


def _raise_for_status(status: int) -> None:
    if status == Status.OK:
        return
    try:
        text = _STATUS_TEXT[Status(status)]
    except ValueError:
        raise RemoteProtocolError(f"unknown handshake status {status}") from None
    if status == Status.REJECTED:
        raise AuthenticationError(f"server rejected the stream: {text}")
    if status == Status.BUSY:
        raise ServerBusy(f"server rejected the stream: {text}")
    raise RemoteProtocolError(f"server rejected the stream: {text}")


class ServerHandshake:
    """Server side of one stream's handshake. Drive with ``bytes_wanted()`` / ``receive()``.

    After HELLO the caller may veto the stream with ``reject(status)`` (e.g. BUSY); otherwise
    ``receive()`` returns the CHALLENGE, and after the PROOF it returns the RESULT byte, raising
    AuthenticationError (after which ``reject_bytes`` holds the RESULT to send) on a bad proof.
    """

    def __init__(self, secret: bytes, *, nonce: bytes | None = None, limits: Limits = DEFAULT_LIMITS):
        self._secret = secret
        self._limits = limits
        self._nonce = nonce or os.urandom(NONCE_SIZE)
        self._state = "hello"
        self._hello_fixed = b""
        self._hello = b""
        self.stream: StreamHello | None = None
        self.reject_bytes = bytes([Status.REJECTED])

    def bytes_wanted(self) -> int:
        if self._state == "hello":
            return HELLO.size
        if self._state == "meta":
            return HELLO.unpack(self._hello_fixed)[-1]
        if self._state == "proof":
            return PROOF_SIZE
        return 0

    def receive(self, data: bytes) -> bytes:
        """Feed exactly ``bytes_wanted()`` bytes; returns the bytes to send (maybe empty)."""
        if len(data) != self.bytes_wanted():
            raise LocalProtocolError(f"handshake expected {self.bytes_wanted()} bytes, got {len(data)}")
        if self._state == "hello":
            return self._on_hello_fixed(bytes(data))
        if self._state == "meta":
            return self._on_meta(bytes(data))
        if self._state == "proof":
            if not hmac.compare_digest(bytes(data), _proof(self._secret, b"client", self._hello, self._nonce)):
                self._state = "failed"
                raise AuthenticationError("client failed to prove it knows the shared secret (wrong secret?)")
            self._state = "done"
            return bytes([Status.OK])
        raise LocalProtocolError("handshake already finished")

    @property
    def done(self) -> bool:
        return self._state == "done"

    def transcript(self) -> tuple[bytes, bytes]:
        """(HELLO, server nonce) of the accepted handshake: what stream keys derive from."""
        if not self.done:
            raise LocalProtocolError("handshake not finished")
        return self._hello, self._nonce

    def reject(self, status: Status) -> bytes:
        """A CHALLENGE carrying an error status, to send before closing the stream."""
        self._state = "failed"
        return CHALLENGE.pack(MAGIC, VERSION, status, bytes(NONCE_SIZE), bytes(32))

    def busy_reply(self) -> bytes:
        """What tells the client BUSY at this point: a CHALLENGE carrying it before the server sent
        its own CHALLENGE, the RESULT byte after."""
        if self._state in ("hello", "meta"):
            return self.reject(Status.BUSY)
        self._state = "failed"
        return bytes([Status.BUSY])

    def _on_hello_fixed(self, data: bytes) -> bytes:
        magic, version, flags, link_id, index, count, _nonce, meta_len = HELLO.unpack(data)
        if magic != MAGIC:
            raise RemoteProtocolError(f"not a wanlink handshake (magic {magic!r})")
        if version != VERSION:
            self._state = "failed"
            raise RemoteProtocolError(f"client speaks protocol version {version}, we speak {VERSION}")
        if flags & ~FLAG_SECURE:
            raise RemoteProtocolError(f"unknown handshake flags 0x{flags:04x}")
        self._limits.check("max_streams", count, "streams in one link")
        if not 0 <= index < count:
            raise RemoteProtocolError(f"stream index {index} out of range for {count} streams")
        self._limits.check("max_meta_size", meta_len, "handshake metadata")
        if meta_len and index != 0:
            raise RemoteProtocolError("only stream 0 carries handshake metadata")
        self._hello_fixed = data
        if meta_len:
            self._state = "meta"
            return b""
        return self._on_meta(b"")

    def _on_meta(self, meta_bytes: bytes) -> bytes:
        _m, _v, flags, link_id, index, count, _n, _l = HELLO.unpack(self._hello_fixed)
        meta = {}
        if meta_bytes:
            meta = unpack_message(meta_bytes, "handshake metadata")
            if not isinstance(meta, dict):
                raise RemoteProtocolError("handshake metadata must be a map")
        self._hello = self._hello_fixed + meta_bytes
        self.stream = StreamHello(link_id, index, count, meta, secure=bool(flags & FLAG_SECURE))
        self._state = "proof"
        server_proof = _proof(self._secret, b"server", self._hello, self._nonce)
        return CHALLENGE.pack(MAGIC, VERSION, Status.OK, self._nonce, server_proof)
