"""Sans-I/O encryption with integrity for one stream (``secure=True``): AES-256-GCM over every frame.

Keys: HKDF-SHA256 over the shared secret, salted with both handshake nonces and bound to the
whole HELLO (link id, stream index and count, flags), gives each stream two fresh keys, one per
direction. A stream re-opened later runs a new handshake, so it gets new keys.

Wire: each frame's 44-byte header is one sealed record (44 + 16 tag bytes) and its payload,
if any, the next (wire_len + 16). The GCM nonce is a per-key record counter, so a frame
replayed, dropped, reordered, moved to another stream or changed in one bit fails
authentication: the link fails with a RemoteProtocolError naming the stream.

Receiving keeps the payload's single pass: ciphertext lands in a per-stream staging buffer and
is decrypted straight into the destination the frame decoder chose (the posted receive buffer).
Bytes there are not trusted until the record's tag verified; on a failure the receive fails.
"""
from __future__ import annotations

import hashlib

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from wanlink.errors import ConfigError, RemoteProtocolError
from wanlink.proto.frames import HEADER_SIZE

TAG_SIZE = 16
KEY_SIZE = 32
_INFO = b"wanlink secure v1"


def stream_keys(secret: bytes, hello: bytes, server_nonce: bytes, *, client: bool) -> tuple[bytes, bytes]:
    """(send key, receive key) of one stream, for the client or the server side of its handshake."""
    if not secret:
        raise ConfigError("secure=True needs a shared secret (WANLINK_SECRET): keys derive from it")
    material = HKDF(algorithm=hashes.SHA256(), length=2 * KEY_SIZE, salt=server_nonce,
                    info=_INFO + hashlib.sha256(hello).digest()).derive(secret)
    to_server, to_client = material[:KEY_SIZE], material[KEY_SIZE:]
    return (to_server, to_client) if client else (to_client, to_server)


def _nonce(counter: int) -> bytes:
    return counter.to_bytes(12, "little")


class FrameSealer:
    """Seals the frames one stream sends, in the order they go out."""

    def __init__(self, key: bytes):
        self._aead = AESGCM(key)
        self._counter = 0
        self._staging = bytearray()

    def _next_nonce(self) -> bytes:
        nonce = _nonce(self._counter)
        self._counter += 1
        return nonce

    def seal_frame(self, frame: bytes) -> bytes:
        """A whole small frame (header, then its payload if any), sealed."""
        header, payload = frame[:HEADER_SIZE], frame[HEADER_SIZE:]
        sealed = self._aead.encrypt(self._next_nonce(), header, None)
        if payload:
            sealed += self._aead.encrypt(self._next_nonce(), payload, None)
        return sealed

    def seal_data(self, header: bytes, payload) -> list:
        """A DATA frame's parts, sealed; the payload's record is valid until the next call."""
        sealed_header = self._aead.encrypt(self._next_nonce(), header, None)
        if not len(payload):
            return [sealed_header]
        size = len(payload) + TAG_SIZE
        if len(self._staging) < size:
            self._staging = bytearray(size)
        record = memoryview(self._staging)[:size]
        self._aead.encrypt_into(self._next_nonce(), payload, None, record)
        return [sealed_header, record]


class FrameOpener:
    """Opens a stream's sealed records into a frame decoder; offers the decoder's own interface
    (``buffer()`` / ``advance(n)``), so the reader does not know whether the stream is sealed."""

    def __init__(self, decoder, key: bytes, name: str = "stream"):
        self._decoder = decoder
        self._aead = AESGCM(key)
        self._name = name
        self._counter = 0
        self._staging = bytearray(HEADER_SIZE + TAG_SIZE)
        self._record = HEADER_SIZE + TAG_SIZE
        self._filled = 0

    def buffer(self) -> memoryview:
        return memoryview(self._staging)[self._filled:self._record]

    def buffers(self) -> list[memoryview]:
        """``buffer()`` alone: a record is opened whole, so there is no reading ahead of it."""
        return [self.buffer()]

    def landing(self) -> tuple[int, int, int] | None:
        return self._decoder.landing()

    def redirect(self, destination: memoryview) -> None:
        """(A record is opened into the decoder's target when complete: nothing of it is there yet.)"""
        self._decoder.redirect(destination)

    def advance(self, nbytes: int) -> list:
        self._filled += nbytes
        if self._filled < self._record:
            return []
        target = self._decoder.buffer()  # the header's buffer, or where the payload belongs
        try:
            self._aead.decrypt_into(_nonce(self._counter), memoryview(self._staging)[:self._record], None, target)
        except InvalidTag:
            raise RemoteProtocolError(f"{self._name}: record {self._counter} failed authentication "
                                      "(tampered, replayed, reordered or a different key)") from None
        self._counter += 1
        events = self._decoder.advance(len(target))
        self._filled = 0
        self._record = len(self._decoder.buffer()) + TAG_SIZE  # bounded: the decoder checked the header's limits
        if len(self._staging) < self._record:
            self._staging = bytearray(self._record)
        return events
