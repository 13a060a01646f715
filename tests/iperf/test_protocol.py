"""The sans-I/O iperf3 control protocol, fed bytes only: conversations, malformed input, fuzz."""
import json
import random
import struct

import pytest

from tests.support.iperf import PARAMS, RESULTS
from wanlink.errors import LimitExceeded, LocalProtocolError, RemoteProtocolError
from wanlink.iperf.protocol import (
    COOKIE_SIZE, MAX_PARAMS_JSON, NEED_DATA, ConnectionClosed, ControlConnection, Cookie, Parameters, Results, Role,
    ServerError, State, StateChange, WanlinkAccept, check_cookie, encode_json, is_wanlink_prefix, make_cookie,
)

COOKIE = b"abcdefghijklmnopqrstuvwxyz2345672345\0"


def events(conn):
    out = []
    while (event := conn.next_event()) is not NEED_DATA:
        out.append(event)
        if isinstance(event, ConnectionClosed):
            break
    return out


def feed(conn, data: bytes, step: int = 1):
    """Feed ``data`` in pieces of ``step`` bytes, collecting events."""
    out = []
    for i in range(0, len(data), step):
        conn.receive_data(data[i:i + step])
        out += events(conn)
    return out


def test_cookie_shape_and_check():
    cookie = make_cookie()
    assert len(cookie) == COOKIE_SIZE and cookie[-1] == 0
    assert all(chr(b) in "abcdefghijklmnopqrstuvwxyz234567" for b in cookie[:-1])
    assert check_cookie(cookie) == cookie
    assert make_cookie() != cookie
    with pytest.raises(RemoteProtocolError):
        check_cookie(cookie[:-1])
    with pytest.raises(RemoteProtocolError):
        check_cookie(cookie[:-1] + b"x")
    with pytest.raises(RemoteProtocolError):
        check_cookie(b"\x01" + cookie[1:])


def test_wanlink_prefix_never_matches_an_iperf3_cookie():
    assert is_wanlink_prefix(b"WLK1")
    assert not any(is_wanlink_prefix(make_cookie()[:4]) for _ in range(200))
    assert not is_wanlink_prefix(b"WLK")


@pytest.mark.parametrize("step", [1, 3, 1000])
def test_full_conversation_between_client_and_server(step):
    client, server = ControlConnection(Role.CLIENT), ControlConnection(Role.SERVER)
    assert feed(server, client.send(Cookie(COOKIE)), step) == [Cookie(COOKIE)]
    assert feed(client, server.send(StateChange(State.PARAM_EXCHANGE)), step) == [StateChange(State.PARAM_EXCHANGE)]
    assert feed(server, client.send(Parameters(PARAMS)), step) == [Parameters(PARAMS)]
    wire = server.send(WanlinkAccept({"version": 1})) + server.send(StateChange(State.CREATE_STREAMS))
    assert feed(client, wire, step) == [StateChange(State.WANLINK_ACCEPT), WanlinkAccept({"version": 1}),
                                        StateChange(State.CREATE_STREAMS)]
    wire = server.send(StateChange(State.TEST_START)) + server.send(StateChange(State.TEST_RUNNING))
    assert feed(client, wire, step) == [StateChange(State.TEST_START), StateChange(State.TEST_RUNNING)]
    assert feed(server, client.send(StateChange(State.TEST_END)), step) == [StateChange(State.TEST_END)]
    assert feed(client, server.send(StateChange(State.EXCHANGE_RESULTS)), step) == [
        StateChange(State.EXCHANGE_RESULTS)]
    assert feed(server, client.send(Results(RESULTS)), step) == [Results(RESULTS)]
    wire = server.send(Results(RESULTS)) + server.send(StateChange(State.DISPLAY_RESULTS))
    assert feed(client, wire, step) == [Results(RESULTS), StateChange(State.DISPLAY_RESULTS)]
    assert feed(server, client.send(StateChange(State.IPERF_DONE)), step) == [StateChange(State.IPERF_DONE)]
    server.receive_data(b"")
    client.receive_data(b"")
    assert events(server) == [ConnectionClosed()]
    assert events(client) == [ConnectionClosed()]


def test_wire_format_matches_iperf3():
    """One signed byte per state; JSON behind a 4-byte big-endian length, compact."""
    client, server = ControlConnection(Role.CLIENT), ControlConnection(Role.SERVER)
    server.receive_data(client.send(Cookie(COOKIE)))
    events(server)
    assert server.send(StateChange(State.PARAM_EXCHANGE)) == b"\x09"
    events_client = feed(client, b"\x09")
    assert events_client == [StateChange(State.PARAM_EXCHANGE)]
    wire = client.send(Parameters({"tcp": True, "time": 1}))
    assert wire == struct.pack("!I", len(b'{"tcp":true,"time":1}')) + b'{"tcp":true,"time":1}'
    assert struct.pack("b", State.ACCESS_DENIED) == b"\xff"
    assert struct.pack("b", State.SERVER_ERROR) == b"\xfe"


def test_access_denied_ends_the_client_side():
    client = ControlConnection(Role.CLIENT)
    client.send(Cookie(COOKIE))
    assert feed(client, b"\xff") == [StateChange(State.ACCESS_DENIED)]
    with pytest.raises(RemoteProtocolError, match="after the end"):
        feed(client, b"\x09")


@pytest.mark.parametrize("tail,expected", [
    (struct.pack("!ii", 142, 13), ServerError(142, 13)),
    (struct.pack("!i", 142), ServerError(142, None)),  # iperf3's authorization failure sends one int
])
def test_server_error_with_one_or_two_ints(tail, expected):
    client = ControlConnection(Role.CLIENT)
    client.send(Cookie(COOKIE))
    got = feed(client, b"\x09" + b"\xfe" + tail)
    client.receive_data(b"")
    got += events(client)
    assert got[0] == StateChange(State.PARAM_EXCHANGE)
    assert expected in got


def test_server_error_encoding_round_trips():
    server, client = ControlConnection(Role.SERVER), ControlConnection(Role.CLIENT)
    server.receive_data(client.send(Cookie(COOKIE)))
    events(server)
    wire = server.send(StateChange(State.PARAM_EXCHANGE)) + server.send(ServerError(131, 0))
    assert feed(client, wire) == [StateChange(State.PARAM_EXCHANGE), ServerError(131, 0)]


@pytest.mark.parametrize("state", [State.TEST_START, State.EXCHANGE_RESULTS, State.DISPLAY_RESULTS,
                                   State.CREATE_STREAMS])
def test_client_rejects_states_out_of_order(state):
    client = ControlConnection(Role.CLIENT)
    client.send(Cookie(COOKIE))
    with pytest.raises(RemoteProtocolError, match=state.name):
        feed(client, struct.pack("b", state))


@pytest.mark.parametrize("value", [0, 3, 5, 17, 100, -3, -128])
def test_unknown_state_byte_is_a_protocol_error(value):
    client = ControlConnection(Role.CLIENT)
    client.send(Cookie(COOKIE))
    with pytest.raises(RemoteProtocolError, match="unknown iperf3 state"):
        feed(client, struct.pack("b", value))


def server_after_params():
    client, server = ControlConnection(Role.CLIENT), ControlConnection(Role.SERVER)
    server.receive_data(client.send(Cookie(COOKIE)))
    events(server)
    client.receive_data(server.send(StateChange(State.PARAM_EXCHANGE)))
    events(client)
    return client, server


def test_server_rejects_client_states_out_of_order():
    client, server = server_after_params()
    server.receive_data(client.send(Parameters(PARAMS)))
    events(server)
    server.send(StateChange(State.CREATE_STREAMS))
    with pytest.raises(RemoteProtocolError, match="TEST_END"):
        feed(server, struct.pack("b", State.TEST_END))  # before TEST_RUNNING
    server2 = ControlConnection(Role.SERVER)
    server2.receive_data(COOKIE)
    events(server2)
    with pytest.raises(RemoteProtocolError, match="before the parameter exchange"):
        feed(server2, b"\x04")


def test_client_terminate_is_accepted_any_time_after_params():
    client, server = server_after_params()
    server.receive_data(client.send(Parameters(PARAMS)))
    events(server)
    server.send(StateChange(State.CREATE_STREAMS))
    assert feed(server, b"\x0c") == [StateChange(State.CLIENT_TERMINATE)]


@pytest.mark.parametrize("size", [0, MAX_PARAMS_JSON + 1, 2**32 - 1])
def test_json_length_is_bounded_before_buffering(size):
    _client, server = server_after_params()
    with pytest.raises(RemoteProtocolError) as info:
        feed(server, struct.pack("!I", size))
    if size:
        assert isinstance(info.value, LimitExceeded)


@pytest.mark.parametrize("payload", [b"{", b"[1, 2]", b'"text"', b"\xff\xfe{}", b"[" * 3000 + b"]" * 3000, b"nul"])
def test_malformed_json_is_a_protocol_error(payload):
    _client, server = server_after_params()
    with pytest.raises(RemoteProtocolError):
        feed(server, struct.pack("!I", len(payload)) + payload, step=len(payload) + 4)


def test_eof_inside_a_message_is_a_protocol_error():
    _client, server = server_after_params()
    server.receive_data(struct.pack("!I", 10) + b"{}")
    assert events(server) == []
    server.receive_data(b"")
    with pytest.raises(RemoteProtocolError, match="middle of a message"):
        events(server)


def test_short_or_bad_cookie_from_client():
    server = ControlConnection(Role.SERVER)
    server.receive_data(COOKIE[:10])
    server.receive_data(b"")
    with pytest.raises(RemoteProtocolError):
        events(server)
    server = ControlConnection(Role.SERVER)
    with pytest.raises(RemoteProtocolError, match="cookie"):
        feed(server, b"WLK1" + bytes(33), step=37)


def test_local_misuse_is_a_local_protocol_error():
    client = ControlConnection(Role.CLIENT)
    with pytest.raises(LocalProtocolError):
        client.send(StateChange(State.TEST_END))  # before the cookie
    client.send(Cookie(COOKIE))
    with pytest.raises(LocalProtocolError):
        client.send(Cookie(COOKIE))
    with pytest.raises(LocalProtocolError):
        client.send(Parameters(PARAMS))  # before PARAM_EXCHANGE
    with pytest.raises(LocalProtocolError):
        client.send(StateChange(State.CREATE_STREAMS))  # a server state
    server = ControlConnection(Role.SERVER)
    with pytest.raises(LocalProtocolError):
        server.send(StateChange(State.PARAM_EXCHANGE))  # before the cookie
    server.receive_data(COOKIE)
    events(server)
    with pytest.raises(LocalProtocolError):
        server.send(StateChange(State.TEST_RUNNING))
    with pytest.raises(LocalProtocolError, match="50"):
        encode_json({"x": "y" * 100}, limit=50)  # an outgoing message over its bound
    with pytest.raises(LocalProtocolError, match="cookie"):
        ControlConnection(Role.CLIENT).send(Cookie(b"short\0"))


def test_buffered_bytes_are_bounded():
    client = ControlConnection(Role.CLIENT, max_params=64, max_results=64)
    client.send(Cookie(COOKIE))
    with pytest.raises(LimitExceeded):
        client.receive_data(bytes(1000))


# ----------------------------------------------------------------------------- fuzz (bytes only)
def _drive(role: Role, chunks: list[bytes]) -> None:
    conn = ControlConnection(role, max_params=256, max_results=256)
    if role is Role.CLIENT:
        conn.send(Cookie(COOKIE))
    try:
        for chunk in chunks:
            if not chunk:
                continue  # b"" means end of stream; that comes last
            conn.receive_data(chunk)
            while (event := conn.next_event()) is not NEED_DATA:
                assert not isinstance(event, ConnectionClosed)
        conn.receive_data(b"")
        for _ in range(4):
            event = conn.next_event()
            assert event is not NEED_DATA  # after end of stream: events, then ConnectionClosed for good
    except RemoteProtocolError:
        pass


ROLES = [Role.CLIENT, Role.SERVER]
STATE_BYTES = [struct.pack("b", s) for s in State] + [b"\x00", b"\x7f"]
JSON_BODIES = [json.dumps(PARAMS).encode(), json.dumps(RESULTS).encode(), b"{}", b"[]", b"{"]


def random_cuts(rng: random.Random, data: bytes) -> list[bytes]:
    cuts = sorted(rng.randint(0, len(data)) for _ in range(rng.randint(0, 5)))
    return [data[a:b] for a, b in zip([0] + cuts, cuts + [len(data)])]


@pytest.mark.parametrize("seed", range(8))
def test_fuzz_random_bytes_only_raise_protocol_errors(seed):
    rng = random.Random(seed)
    for _ in range(150):
        chunks = [rng.randbytes(rng.randint(0, 64)) for _ in range(rng.randint(0, 12))]
        _drive(rng.choice(ROLES), chunks)


@pytest.mark.parametrize("seed", range(8))
def test_fuzz_plausible_streams_only_raise_protocol_errors(seed):
    """Valid-looking pieces (state bytes, length-prefixed JSON, ints, cookies) in random order and cuts."""
    rng = random.Random(1000 + seed)
    for _ in range(150):
        pieces = []
        for _ in range(rng.randint(0, 10)):
            kind = rng.randint(0, 3)
            if kind == 0:
                pieces.append(rng.choice(STATE_BYTES))
            elif kind == 1:
                body = rng.choice(JSON_BODIES)
                pieces.append(struct.pack("!I", len(body)) + body)
            elif kind == 2:
                pieces.append(struct.pack("!i", rng.randint(-2**31, 2**31 - 1)))
            else:
                pieces.append(COOKIE)
        _drive(rng.choice(ROLES), random_cuts(rng, b"".join(pieces)))
