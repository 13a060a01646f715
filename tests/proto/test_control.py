"""msgpack control messages: what this side cannot send is its own error, what the peer sent wrong is the peer's."""
import pytest

from wanlink.errors import LocalProtocolError, RemoteProtocolError
from wanlink.proto.control import pack_message, unpack_message


def test_round_trip():
    message = {"op": "hello", "n": [1, 2], "blob": b"\x00\xff"}
    assert unpack_message(pack_message(message)) == message


@pytest.mark.parametrize("message", [object(), {"n": 1 << 70}])
def test_a_message_msgpack_cannot_carry_is_local_misuse(message):
    with pytest.raises(LocalProtocolError, match="cannot encode"):
        pack_message(message)


@pytest.mark.parametrize("payload", [b"\xc1", b"\x91", b""])
def test_malformed_bytes_from_the_peer_are_a_remote_error(payload):
    with pytest.raises(RemoteProtocolError, match="malformed control message"):
        unpack_message(payload)
