"""Sans-I/O iperf3 control protocol (TCP tests), in the manner of h11.

The wire, as iperf3 speaks it on its control connection:

* the client opens with a 37-byte *cookie* (36 characters of ``[a-z2-7]`` and a NUL); every data
  stream opens with the same cookie;
* the server drives the test with one signed byte per state change (``State``);
* after the server sends ``PARAM_EXCHANGE`` the client sends its parameters, and after
  ``EXCHANGE_RESULTS`` each side sends its results (client first): a 4-byte big-endian length,
  then that many bytes of JSON;
* ``SERVER_ERROR`` is followed by two 4-byte big-endian ints (iperf3's ``i_errno`` and ``errno``;
  some servers send only the first and close).

``ControlConnection`` turns received bytes into events and events into bytes; it never touches a
socket. Every length is checked against a bound before anything is buffered. Whatever the peer
sent wrong raises ``RemoteProtocolError`` (``LimitExceeded`` for bounds); sending what the protocol
does not allow now, or a message over its bound, raises ``LocalProtocolError`` (a bug on this side).

wanlink extension (invisible to stock iperf3): a client that puts ``"wanlink": {...}`` in its
parameters may be answered with state ``WANLINK_ACCEPT`` (77) followed by a length-prefixed JSON
object; the data then flows over a wanlink Link instead of raw iperf3 streams. A stock server
ignores the unknown key and answers ``CREATE_STREAMS``; a stock client never sends the key.
"""
from __future__ import annotations

import enum
import json
import secrets
import struct
from dataclasses import dataclass
from typing import Union

from wanlink.errors import LimitExceeded, LocalProtocolError, RemoteProtocolError

COOKIE_SIZE = 37
COOKIE_ALPHABET = b"abcdefghijklmnopqrstuvwxyz234567"
WANLINK_MAGIC = b"WLK1"  # first bytes of a wanlink handshake; never the start of an iperf3 cookie
COOKIE_META_KEY = "iperf_cookie"  # a test Link's meta names its control connection's cookie under this key
MAX_PARAMS_JSON = 8 * 1024  # iperf3's MAX_PARAMS_JSON_STRING
MAX_RESULTS_JSON = 1024 * 1024  # iperf3 itself does not bound results; we do
MAX_STREAMS = 128  # iperf3's MAX_STREAMS (per direction)
MAX_TIME = 86400
MAX_OMIT = 600
MAX_BLOCKSIZE = 1024 * 1024
MAX_WINDOW = 512 * 1024 * 1024
DEFAULT_BLOCKSIZE = 128 * 1024
DEFAULT_PORT = 5201
_LEN = struct.Struct("!I")
_ERRNO = struct.Struct("!i")


class State(enum.IntEnum):
    """One-byte state changes of iperf3's control connection (iperf_api.h)."""

    TEST_START = 1
    TEST_RUNNING = 2
    TEST_END = 4
    PARAM_EXCHANGE = 9
    CREATE_STREAMS = 10
    SERVER_TERMINATE = 11
    CLIENT_TERMINATE = 12
    EXCHANGE_RESULTS = 13
    DISPLAY_RESULTS = 14
    IPERF_DONE = 16
    ACCESS_DENIED = -1
    SERVER_ERROR = -2
    WANLINK_ACCEPT = 77  # wanlink extension, sent only to clients that asked for it


class Role(enum.Enum):
    CLIENT = "client"
    SERVER = "server"


# ----------------------------------------------------------------------------- events
@dataclass(frozen=True)
class Cookie:
    value: bytes


@dataclass(frozen=True)
class StateChange:
    state: State


@dataclass(frozen=True)
class Parameters:
    params: dict


@dataclass(frozen=True)
class Results:
    results: dict


@dataclass(frozen=True)
class WanlinkAccept:
    info: dict


@dataclass(frozen=True)
class ServerError:
    i_errno: int
    errno: int | None = None


@dataclass(frozen=True)
class ConnectionClosed:
    pass


class _NeedData:
    def __repr__(self):
        return "NEED_DATA"


NEED_DATA = _NeedData()
Event = Union[Cookie, StateChange, Parameters, Results, WanlinkAccept, ServerError, ConnectionClosed]

# States the client may receive from the server, given the last state received (None = start).
_TERMINATING = {State.SERVER_ERROR, State.SERVER_TERMINATE}
_CLIENT_MAY_RECEIVE: dict[State | None, set[State]] = {
    None: {State.PARAM_EXCHANGE, State.ACCESS_DENIED, State.SERVER_ERROR},
    State.PARAM_EXCHANGE: {State.CREATE_STREAMS, State.WANLINK_ACCEPT} | _TERMINATING,
    State.WANLINK_ACCEPT: {State.CREATE_STREAMS} | _TERMINATING,
    State.CREATE_STREAMS: {State.TEST_START} | _TERMINATING,
    State.TEST_START: {State.TEST_RUNNING} | _TERMINATING,
    State.TEST_RUNNING: {State.EXCHANGE_RESULTS} | _TERMINATING,
    State.EXCHANGE_RESULTS: {State.DISPLAY_RESULTS} | _TERMINATING,
}
_SERVER_MAY_SEND = _CLIENT_MAY_RECEIVE  # the same order, seen from the sending side


def make_cookie() -> bytes:
    """A fresh iperf3 cookie: 36 random characters of ``[a-z2-7]`` and a NUL."""
    return bytes(COOKIE_ALPHABET[b % 32] for b in secrets.token_bytes(COOKIE_SIZE - 1)) + b"\0"


def check_cookie(cookie: bytes) -> bytes:
    """Validate a received cookie (37 bytes, printable ASCII, NUL-terminated); return it."""
    if len(cookie) != COOKIE_SIZE:
        raise RemoteProtocolError(f"iperf3 cookie must be {COOKIE_SIZE} bytes, got {len(cookie)}")
    body, end = cookie[:-1], cookie[-1]
    if end != 0 or any(not 0x21 <= b <= 0x7E for b in body):
        raise RemoteProtocolError("iperf3 cookie is not 36 printable characters and a NUL")
    return bytes(cookie)


def is_wanlink_prefix(prefix: bytes) -> bool:
    """True when the first bytes of a fresh connection are a wanlink handshake, not an iperf3 cookie."""
    return bytes(prefix[: len(WANLINK_MAGIC)]) == WANLINK_MAGIC


def _decode_json(payload: bytes, what: str) -> dict:
    try:
        value = json.loads(payload.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise RemoteProtocolError(f"malformed iperf3 {what} JSON: {exc}") from None
    if not isinstance(value, dict):
        raise RemoteProtocolError(f"iperf3 {what} JSON must be an object, got {type(value).__name__}")
    return value


def encode_json(obj: dict, limit: int = MAX_RESULTS_JSON, what: str = "message") -> bytes:
    """Length-prefixed compact JSON, as iperf3's ``JSON_write``."""
    body = json.dumps(obj, separators=(",", ":"), allow_nan=False).encode("utf-8")
    if len(body) > limit:
        raise LocalProtocolError(f"iperf3 {what} JSON: {len(body)} bytes > {limit}, the most the protocol carries")
    return _LEN.pack(len(body)) + body


class ControlConnection:
    """One side of an iperf3 control connection.

    Feed received bytes with ``receive_data`` (``b""`` for end of stream), pull events with
    ``next_event`` until it returns ``NEED_DATA``; turn events into bytes with ``send``.
    """

    def __init__(self, role: Role, *, max_params: int = MAX_PARAMS_JSON, max_results: int = MAX_RESULTS_JSON):
        self.role = role
        self.max_params, self.max_results = max_params, max_results
        self._buf = bytearray()
        self._eof = False
        self._closed_reported = False
        self.cookie: bytes | None = None
        self.last_received: State | None = None  # last state byte read from the peer
        self.last_sent: State | None = None  # last state byte this side sent
        # what the next bytes from the peer are: "cookie", "state", "json:<kind>", "errno", "errno2", "done"
        self._expect = "cookie" if role is Role.SERVER else "state"
        self._pending_errno: int | None = None
        self.finished = False

    # ------------------------------------------------------------------ receiving
    def receive_data(self, data: bytes) -> None:
        if self._eof and data:
            raise LocalProtocolError("receive_data after end of stream")
        if not data:
            self._eof = True
            return
        self._buf += data
        limit = self._buffer_limit()
        if len(self._buf) > limit:
            raise LimitExceeded("iperf3 control bytes buffered", len(self._buf), limit)

    def _buffer_limit(self) -> int:
        # a state byte may be followed by a JSON message already on the wire
        return 16 + _LEN.size + max(self.max_params, self.max_results)

    def _take(self, n: int) -> bytes | None:
        if len(self._buf) < n:
            return None
        out = bytes(self._buf[:n])
        del self._buf[:n]
        return out

    def next_event(self) -> Event | _NeedData:
        """The next complete event, ``NEED_DATA``, or ``ConnectionClosed`` once after end of stream."""
        if self._closed_reported:
            return ConnectionClosed()
        event = self._parse()
        if event is not NEED_DATA:
            return event
        if self._eof:
            if self._expect == "errno2":  # some servers send one int after SERVER_ERROR, then close
                self._expect = "done"
                return ServerError(self._pending_errno)
            if self._buf:
                raise RemoteProtocolError(f"iperf3 peer closed in the middle of a message "
                                          f"({len(self._buf)} bytes left)")
            self._closed_reported = True
            return ConnectionClosed()
        return NEED_DATA

    def _parse(self):
        expect = self._expect
        if expect == "cookie":
            raw = self._take(COOKIE_SIZE)
            if raw is None:
                return NEED_DATA
            self.cookie = check_cookie(raw)
            self._expect = "state"
            return Cookie(self.cookie)
        if expect.startswith("json:"):
            kind = expect[5:]
            if len(self._buf) < _LEN.size:
                return NEED_DATA
            (size,) = _LEN.unpack_from(self._buf)
            limit = self.max_params if kind == "params" else self.max_results
            if size == 0:
                raise RemoteProtocolError(f"iperf3 {kind} JSON has length 0")
            if size > limit:
                raise LimitExceeded(f"iperf3 {kind} JSON bytes", size, limit)
            if len(self._buf) < _LEN.size + size:
                return NEED_DATA
            payload = bytes(self._buf[_LEN.size:_LEN.size + size])
            del self._buf[:_LEN.size + size]
            obj = _decode_json(payload, kind)
            self._expect = "state"
            if kind == "params":
                return Parameters(obj)
            if kind == "wanlink":
                return WanlinkAccept(obj)
            return Results(obj)
        if expect in ("errno", "errno2"):
            raw = self._take(_ERRNO.size)
            if raw is None:
                return NEED_DATA
            (value,) = _ERRNO.unpack(raw)
            if expect == "errno":
                self._pending_errno, self._expect = value, "errno2"
                return NEED_DATA if not self._buf else self._parse()
            self._expect = "done"
            return ServerError(self._pending_errno, value)
        if expect == "done":
            if self._buf:
                raise RemoteProtocolError(f"iperf3 peer sent {len(self._buf)} bytes after the end of the test")
            return NEED_DATA
        raw = self._take(1)
        if raw is None:
            return NEED_DATA
        return self._on_state_byte(struct.unpack("b", raw)[0])

    def _on_state_byte(self, value: int):
        try:
            state = State(value)
        except ValueError:
            raise RemoteProtocolError(f"unknown iperf3 state {value}") from None
        if self.role is Role.CLIENT:
            allowed = _CLIENT_MAY_RECEIVE.get(self.last_received, set())
            if state not in allowed:
                prev = self.last_received.name if self.last_received is not None else "start"
                raise RemoteProtocolError(f"iperf3 server sent {state.name} after {prev}")
            self.last_received = state
            if state is State.SERVER_ERROR:
                self._expect = "errno"
                return self._parse()
            if state is State.EXCHANGE_RESULTS:
                self._expect = "json:results"
            elif state is State.WANLINK_ACCEPT:
                self._expect = "json:wanlink"
            elif state in (State.ACCESS_DENIED, State.SERVER_TERMINATE, State.DISPLAY_RESULTS):
                self._expect = "done"
            return StateChange(state)
        # server side: states from the client
        if self.last_sent is None or self.last_sent is State.SERVER_ERROR:
            raise RemoteProtocolError(f"iperf3 client sent {state.name} before the parameter exchange")
        if state is State.TEST_END and self.last_sent in (State.TEST_START, State.TEST_RUNNING):
            pass
        elif state is State.IPERF_DONE or state is State.CLIENT_TERMINATE:
            self._expect = "done"
        else:
            raise RemoteProtocolError(f"iperf3 client sent {state.name} after server state {self.last_sent.name}")
        self.last_received = state
        return StateChange(state)

    # ------------------------------------------------------------------ sending
    def send(self, event: Event) -> bytes:
        """Bytes to put on the wire for ``event`` (checked against the protocol)."""
        if isinstance(event, Cookie):
            if self.role is not Role.CLIENT or self.cookie is not None:
                raise LocalProtocolError("only the client sends the cookie, once")
            try:
                self.cookie = check_cookie(event.value)
            except RemoteProtocolError as exc:
                raise LocalProtocolError(f"cannot send this cookie: {exc}") from None
            return self.cookie
        if isinstance(event, StateChange):
            return self._send_state(State(event.state))
        if isinstance(event, Parameters):
            if self.role is not Role.CLIENT or self.last_received is not State.PARAM_EXCHANGE:
                raise LocalProtocolError("parameters are sent by the client after PARAM_EXCHANGE")
            return encode_json(event.params, self.max_params, "params")
        if isinstance(event, Results):
            state = self.last_received if self.role is Role.CLIENT else self.last_sent
            if state is not State.EXCHANGE_RESULTS:
                raise LocalProtocolError("results are sent after EXCHANGE_RESULTS")
            return encode_json(event.results, self.max_results, "results")
        if isinstance(event, WanlinkAccept):
            head = self._send_state(State.WANLINK_ACCEPT)
            return head + encode_json(event.info, self.max_params, "wanlink")
        if isinstance(event, ServerError):
            head = self._send_state(State.SERVER_ERROR)
            tail = _ERRNO.pack(event.i_errno) + (_ERRNO.pack(event.errno) if event.errno is not None else b"")
            return head + tail
        raise LocalProtocolError(f"cannot send {event!r}")

    def _send_state(self, state: State) -> bytes:
        if self.role is Role.SERVER:
            if self.cookie is None:
                raise LocalProtocolError("the server sends states only after reading the cookie")
            allowed = _SERVER_MAY_SEND.get(self.last_sent, set())
            if state not in allowed:
                prev = self.last_sent.name if self.last_sent is not None else "start"
                raise LocalProtocolError(f"server may not send {state.name} after {prev}")
            self.last_sent = state
            if state is State.PARAM_EXCHANGE:
                self._expect = "json:params"
            elif state is State.EXCHANGE_RESULTS:
                self._expect = "json:results"
            return struct.pack("b", state)
        if state not in (State.TEST_END, State.IPERF_DONE, State.CLIENT_TERMINATE):
            raise LocalProtocolError(f"client may not send {state.name}")
        if self.cookie is None:
            raise LocalProtocolError("the client sends the cookie first")
        if state is State.TEST_END and self.last_received is not State.TEST_RUNNING:
            raise LocalProtocolError("TEST_END is sent while the test is running")
        self.last_sent = state
        return struct.pack("b", state)
