"""The typed messages of an iperf3 TCP test: the client's parameters, each side's results, iperf3's error numbers.

``TestParameters.from_json`` and ``TestResults.from_json`` validate what a peer sent (every
number bounded, every field typed) and raise ``RemoteProtocolError``; the ``to_json`` methods build
what ``ControlConnection`` sends as ``Parameters`` and ``Results``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from wanlink.errors import RemoteProtocolError, UnsupportedError
from wanlink.iperf.protocol import DEFAULT_BLOCKSIZE, MAX_BLOCKSIZE, MAX_OMIT, MAX_STREAMS, MAX_TIME, MAX_WINDOW


def _get_int(obj: dict, key: str, default: int, lo: int, hi: int) -> int:
    value = obj.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        raise RemoteProtocolError(f"iperf3 field {key!r} must be a number, got {value!r}")
    if not lo <= value <= hi:
        raise RemoteProtocolError(f"iperf3 field {key!r}={value!r} is outside [{lo}, {hi}]")
    return int(value)


def _get_float(obj: dict, key: str, default: float = 0.0) -> float:
    value = obj.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        raise RemoteProtocolError(f"iperf3 field {key!r} must be a number, got {value!r}")
    return float(value)


def _get_str(obj: dict, key: str, limit: int = 256) -> str | None:
    value = obj.get(key)
    if value is None:
        return None
    if not isinstance(value, str) or len(value) > limit:
        raise RemoteProtocolError(f"iperf3 field {key!r} must be a string of at most {limit} characters")
    return value


@dataclass
class TestParameters:
    """The client's parameters of a TCP test (fields named after iperf3's JSON keys)."""

    __test__ = False  # not a pytest test class

    time: int = 10
    num: int = 0  # bytes to transfer (-n); 0 = time-limited
    blockcount: int = 0
    parallel: int = 1
    len: int = DEFAULT_BLOCKSIZE
    reverse: bool = False
    bidirectional: bool = False
    window: int = 0
    omit: int = 0
    congestion: str | None = None
    nodelay: bool = False
    mss: int = 0
    client_version: str | None = None
    wanlink: dict | None = None  # extension: present when the client speaks wanlink

    def to_json(self) -> dict:
        out: dict[str, Any] = {"tcp": True, "omit": self.omit, "time": self.time, "num": self.num,
                               "blockcount": self.blockcount, "parallel": self.parallel, "len": self.len}
        if self.reverse:
            out["reverse"] = True
        if self.bidirectional:
            out["bidirectional"] = True
        if self.window:
            out["window"] = self.window
        if self.congestion:
            out["congestion"] = self.congestion
        if self.nodelay:
            out["nodelay"] = True
        if self.mss:
            out["MSS"] = self.mss
        if self.wanlink is not None:
            out["wanlink"] = self.wanlink
        out["client_version"] = self.client_version or "wanlink-iperf"
        return out

    @classmethod
    def from_json(cls, obj: dict) -> "TestParameters":
        """Validate a parameters object; raise RemoteProtocolError (or UnsupportedError for UDP/SCTP)."""
        if "udp" in obj or "sctp" in obj:
            raise UnsupportedError("wanlink-iperf serves TCP tests only (the client asked for UDP/SCTP)")
        wl = obj.get("wanlink")
        if wl is not None and not isinstance(wl, dict):
            raise RemoteProtocolError("iperf3 field 'wanlink' must be an object")
        params = cls(
            time=_get_int(obj, "time", 10, 0, MAX_TIME),
            num=_get_int(obj, "num", 0, 0, 2**62),
            blockcount=_get_int(obj, "blockcount", 0, 0, 2**62),
            parallel=_get_int(obj, "parallel", 1, 1, MAX_STREAMS),
            len=_get_int(obj, "len", DEFAULT_BLOCKSIZE, 1, MAX_BLOCKSIZE) or DEFAULT_BLOCKSIZE,
            reverse="reverse" in obj,
            bidirectional="bidirectional" in obj,
            window=_get_int(obj, "window", 0, 0, MAX_WINDOW),
            omit=_get_int(obj, "omit", 0, 0, MAX_OMIT),
            congestion=_get_str(obj, "congestion", 16),
            nodelay="nodelay" in obj,
            mss=_get_int(obj, "MSS", 0, 0, 32 * 1024 - 1),
            client_version=_get_str(obj, "client_version", 64),
            wanlink=wl,
        )
        if params.time == 0 and params.num == 0 and params.blockcount == 0:
            raise RemoteProtocolError("iperf3 parameters set neither a duration nor a byte or block count")
        return params


def _unsigned_minus_one(value: int) -> int:
    """iperf3 3.x sends an unknown retransmit count as (uint64)-1; map it back to -1."""
    return -1 if value > 2**63 - 1 else value


@dataclass
class StreamResult:
    """One stream's entry in the results exchange."""

    id: int
    bytes: int
    retransmits: int = -1
    start_time: float = 0.0
    end_time: float = 0.0
    jitter: float = 0.0
    errors: int = 0
    packets: int = 0


@dataclass
class TestResults:
    """One side's results (iperf3's ``send_results``/``get_results``)."""

    __test__ = False

    streams: list[StreamResult] = field(default_factory=list)
    cpu_util_total: float = 0.0
    cpu_util_user: float = 0.0
    cpu_util_system: float = 0.0
    sender_has_retransmits: int = -1
    congestion_used: str | None = None
    extra: dict = field(default_factory=dict)  # e.g. the wanlink section

    def to_json(self) -> dict:
        out: dict[str, Any] = {
            "cpu_util_total": self.cpu_util_total, "cpu_util_user": self.cpu_util_user,
            "cpu_util_system": self.cpu_util_system, "sender_has_retransmits": self.sender_has_retransmits,
        }
        if self.congestion_used:
            out["congestion_used"] = self.congestion_used
        out["streams"] = [
            {"id": s.id, "bytes": s.bytes, "retransmits": s.retransmits, "jitter": s.jitter, "errors": s.errors,
             "packets": s.packets, "start_time": s.start_time, "end_time": s.end_time}
            for s in self.streams
        ]
        out.update(self.extra)
        return out

    @classmethod
    def from_json(cls, obj: dict) -> "TestResults":
        for key in ("cpu_util_total", "cpu_util_user", "cpu_util_system", "sender_has_retransmits", "streams"):
            if key not in obj:
                raise RemoteProtocolError(f"iperf3 results lack {key!r}")
        raw_streams = obj["streams"]
        if not isinstance(raw_streams, list) or len(raw_streams) > 2 * MAX_STREAMS:
            raise RemoteProtocolError(f"iperf3 results 'streams' must be a list of at most {2 * MAX_STREAMS}")
        streams = []
        for item in raw_streams:
            if not isinstance(item, dict):
                raise RemoteProtocolError("iperf3 results stream entry must be an object")
            for key in ("id", "bytes", "retransmits", "jitter", "errors", "packets"):
                if key not in item:
                    raise RemoteProtocolError(f"iperf3 results stream entry lacks {key!r}")
            streams.append(StreamResult(
                id=_get_int(item, "id", 0, 0, 2**31 - 1), bytes=_get_int(item, "bytes", 0, 0, 2**63 - 1),
                retransmits=_unsigned_minus_one(_get_int(item, "retransmits", -1, -1, 2**64 - 1)),
                jitter=_get_float(item, "jitter"),
                errors=_get_int(item, "errors", 0, -2**63, 2**63 - 1),
                packets=_get_int(item, "packets", 0, -2**63, 2**63 - 1),
                start_time=_get_float(item, "start_time"), end_time=_get_float(item, "end_time")))
        extra = {"wanlink": obj["wanlink"]} if isinstance(obj.get("wanlink"), dict) else {}
        return cls(streams=streams, cpu_util_total=_get_float(obj, "cpu_util_total"),
                   cpu_util_user=_get_float(obj, "cpu_util_user"),
                   cpu_util_system=_get_float(obj, "cpu_util_system"),
                   sender_has_retransmits=_unsigned_minus_one(
                       _get_int(obj, "sender_has_retransmits", -1, -1, 2**64 - 1)),
                   congestion_used=_get_str(obj, "congestion_used", 16), extra=extra)


# iperf3's i_errno values (iperf_api.h) used in SERVER_ERROR, with their messages.
IE_DURATION, IE_NUMSTREAMS, IE_BLOCKSIZE, IE_BUFSIZE = 5, 6, 7, 8
IE_INITTEST, IE_RECVPARAMS, IE_PROTOCOL, IE_SETCONGESTION, IE_STREAMACCEPT = 101, 114, 131, 134, 204
IPERF_ERRORS = {
    IE_DURATION: "test duration too long", IE_NUMSTREAMS: "number of parallel streams too large",
    IE_BLOCKSIZE: "block size too large", IE_BUFSIZE: "socket buffer size too large",
    IE_INITTEST: "test initialization failed", 102: "unable to start listener for connections",
    IE_RECVPARAMS: "unable to receive parameters from client", 117: "unable to receive results",
    120: "the server has terminated", 121: "the server is busy running a test",
    IE_PROTOCOL: "protocol does not exist", IE_SETCONGESTION: "unable to set TCP_CONGESTION",
    142: "test authorization failed", IE_STREAMACCEPT: "unable to accept stream connection",
}
