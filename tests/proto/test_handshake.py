"""Stream handshake: mutual HMAC auth, replay resistance, malformed input (bytes only)."""
import os
import random

import pytest

from wanlink.errors import (
    AuthenticationError, ConfigError, LimitExceeded, LocalProtocolError, ProtocolError, RemoteProtocolError,
)
from wanlink.proto.handshake import (
    CHALLENGE, HELLO, MAGIC, ClientHandshake, ServerHandshake, Status, normalize_secret,
)
from wanlink.proto.limits import Limits

LINK_ID = bytes(range(16))


def run(client: ClientHandshake, server: ServerHandshake):
    """Shuttle messages between the two sides exactly as the I/O layer does."""
    to_server = client.hello()
    while True:
        while server.bytes_wanted() and to_server:
            wanted = server.bytes_wanted()
            chunk, to_server = to_server[:wanted], to_server[wanted:]
            reply = server.receive(chunk)
            if reply:
                break
        else:
            raise AssertionError("server wants more than the client sent")
        answer = client.receive(reply)
        if not client.bytes_wanted():
            return
        to_server = answer


def test_successful_handshake_carries_stream_and_meta():
    client = ClientHandshake(b"k", LINK_ID, 0, 4, {"rank": 3, "name": "a"})
    server = ServerHandshake(b"k")
    run(client, server)
    assert client.accepted and server.done
    assert server.stream.link_id == LINK_ID and server.stream.index == 0 and server.stream.count == 4
    assert server.stream.meta == {"rank": 3, "name": "a"}


def test_only_stream_zero_carries_meta():
    client = ClientHandshake(b"k", LINK_ID, 2, 4, {"rank": 3})
    server = ServerHandshake(b"k")
    run(client, server)
    assert server.stream.index == 2 and server.stream.meta == {}


def test_client_detects_server_with_wrong_secret():
    client = ClientHandshake(b"right", LINK_ID, 0, 1)
    server = ServerHandshake(b"wrong")
    challenge = server.receive(client.hello())
    with pytest.raises(AuthenticationError, match="wrong secret"):
        client.receive(challenge)


def test_server_rejects_client_with_wrong_secret():
    client = ClientHandshake(b"right", LINK_ID, 1, 2)
    server = ServerHandshake(b"right")
    challenge = server.receive(client.hello())
    proof = client.receive(challenge)
    forged = bytes(b ^ 1 for b in proof)
    with pytest.raises(AuthenticationError):
        server.receive(forged)
    assert server.reject_bytes == bytes([Status.REJECTED])


def test_recorded_proof_cannot_be_replayed_to_a_new_server_nonce():
    client = ClientHandshake(b"k", LINK_ID, 1, 2, nonce=b"c" * 32)
    first = ServerHandshake(b"k", nonce=b"1" * 32)
    proof = client.receive(first.receive(client.hello()))
    first.receive(proof)
    assert first.done
    replayed = ServerHandshake(b"k", nonce=b"2" * 32)  # attacker replays hello and proof
    replayed.receive(client.hello())
    with pytest.raises(AuthenticationError):
        replayed.receive(proof)


def test_recorded_challenge_cannot_be_replayed_to_a_new_client_nonce():
    server = ServerHandshake(b"k", nonce=b"s" * 32)
    old_client = ClientHandshake(b"k", LINK_ID, 1, 2, nonce=b"a" * 32)
    recorded = server.receive(old_client.hello())
    new_client = ClientHandshake(b"k", LINK_ID, 1, 2, nonce=b"b" * 32)
    with pytest.raises(AuthenticationError):
        new_client.receive(recorded)


def test_proof_binds_stream_index():
    client = ClientHandshake(b"k", LINK_ID, 1, 4)
    hello = bytearray(client.hello())
    hello[4 + 2 + 2 + 16:4 + 2 + 2 + 16 + 2] = (2).to_bytes(2, "little")  # attacker re-labels the stream
    server = ServerHandshake(b"k")
    challenge = server.receive(bytes(hello))
    with pytest.raises(AuthenticationError):
        client.receive(challenge)


def _hello(**changes):
    fields = dict(magic=MAGIC, version=1, flags=0, link_id=LINK_ID, index=0, count=2, nonce=os.urandom(32), meta_len=0)
    fields.update(changes)
    return HELLO.pack(*fields.values())


@pytest.mark.parametrize("raw, error, match", [
    (_hello(magic=b"HTTP"), RemoteProtocolError, "magic"),
    (_hello(version=2), RemoteProtocolError, "version"),
    (_hello(flags=2), RemoteProtocolError, "flags"),
    (_hello(count=65), LimitExceeded, "max_streams"),
    (_hello(index=2, count=2), RemoteProtocolError, "out of range"),
    (_hello(count=0), RemoteProtocolError, "out of range"),
    (_hello(meta_len=5000), LimitExceeded, "max_meta_size"),
    (_hello(index=1, meta_len=4), RemoteProtocolError, "only stream 0"),
])
def test_malformed_hello_is_rejected(raw, error, match):
    with pytest.raises(error, match=match):
        ServerHandshake(b"k").receive(raw)


@pytest.mark.parametrize("meta", [b"\xc1", b"\x91\x01", b"\x81"])
def test_malformed_meta_is_rejected(meta):
    server = ServerHandshake(b"k")
    server.receive(_hello(meta_len=len(meta)))
    with pytest.raises(RemoteProtocolError, match="metadata"):
        server.receive(meta)


def test_feeding_the_wrong_number_of_bytes_is_local_misuse():
    with pytest.raises(LocalProtocolError, match=f"expected {HELLO.size} bytes, got 5"):
        ServerHandshake(b"k").receive(b"short")
    client = ClientHandshake(b"k", LINK_ID, 0, 1)
    with pytest.raises(LocalProtocolError, match="got 5"):
        client.receive(b"x" * 5)


def test_driving_a_finished_handshake_is_local_misuse():
    client, server = ClientHandshake(b"k", LINK_ID, 0, 1), ServerHandshake(b"k")
    run(client, server)
    for side in (client, server):
        with pytest.raises(LocalProtocolError, match="already finished"):
            side.receive(b"")


def test_local_and_remote_protocol_errors_are_distinct_protocol_errors():
    assert issubclass(LocalProtocolError, ProtocolError) and issubclass(RemoteProtocolError, ProtocolError)
    assert issubclass(LimitExceeded, RemoteProtocolError) and issubclass(ProtocolError, ValueError)
    assert not issubclass(LocalProtocolError, RemoteProtocolError)
    assert not issubclass(RemoteProtocolError, LocalProtocolError)


@pytest.mark.parametrize("status, error", [(Status.REJECTED, AuthenticationError), (Status.BUSY, RemoteProtocolError),
                                            (Status.BAD_STREAM, RemoteProtocolError),
                                            (Status.VERSION_MISMATCH, RemoteProtocolError)])
def test_client_reports_server_refusal(status, error):
    client = ClientHandshake(b"k", LINK_ID, 0, 1)
    server = ServerHandshake(b"k")
    server.receive(client.hello())
    with pytest.raises(error, match="rejected"):
        client.receive(server.reject(status))


def test_client_reports_refusal_in_result_byte():
    client = ClientHandshake(b"k", LINK_ID, 0, 1)
    server = ServerHandshake(b"k")
    client.receive(server.receive(client.hello()))
    with pytest.raises(RemoteProtocolError, match="inconsistent"):
        client.receive(bytes([Status.BAD_STREAM]))


def test_client_rejects_non_wanlink_server():
    client = ClientHandshake(b"k", LINK_ID, 0, 1)
    with pytest.raises(RemoteProtocolError, match="not a wanlink server"):
        client.receive(b"SSH-" + bytes(CHALLENGE.size - 4))


def test_fuzzed_hello_only_raises_typed_errors_and_never_authenticates():
    """A corrupted hello is refused while parsing, or parsed and then fails the proofs; never accepted."""
    rng = random.Random(7)
    outcomes = set()
    for _ in range(2000):
        client = ClientHandshake(b"k", LINK_ID, 0, 3, {"a": 1})
        good = client.hello()
        blob = bytearray(good)
        for _ in range(rng.randint(1, 4)):
            blob[rng.randrange(len(blob))] = rng.getrandbits(8)
        server = ServerHandshake(b"k")
        try:
            data, reply = bytes(blob), b""
            while server.bytes_wanted() and data and server.stream is None:
                wanted = server.bytes_wanted()
                reply = server.receive(data[:wanted].ljust(wanted, b"\0"))
                data = data[wanted:]
            if server.stream is None:
                outcomes.add("truncated")
                continue
            proof = client.receive(reply)  # the honest client checks the server's proof of the hello it got
            server.receive(proof)
        except (RemoteProtocolError, AuthenticationError) as exc:  # LimitExceeded is a RemoteProtocolError too
            outcomes.add(type(exc).__name__)
            continue
        assert bytes(blob) == good, f"a corrupted hello authenticated: {bytes(blob).hex()}"
        assert server.done
    assert {"RemoteProtocolError", "AuthenticationError"} <= outcomes


def test_secret_normalisation(monkeypatch):
    assert normalize_secret("abc") == b"abc"
    assert normalize_secret(b"abc") == b"abc"
    monkeypatch.setenv("WANLINK_SECRET", "fromenv")  # the protocol never reads it (the edges do)
    for bad in (None, 123):
        with pytest.raises(ConfigError, match="secret must be bytes or str"):
            normalize_secret(bad)


def test_client_validates_its_own_arguments():
    with pytest.raises(ConfigError):
        ClientHandshake(b"k", LINK_ID, 4, 4)
    with pytest.raises(LocalProtocolError, match="handshake metadata: 50.. > 4096.*max_meta_size"):
        ClientHandshake(b"k", LINK_ID, 0, 1, {"x": "y" * 5000})


def test_limits_validate_themselves():
    with pytest.raises(ConfigError):
        Limits(max_streams=0)
    with pytest.raises(ConfigError):
        Limits(max_streams=70000)
