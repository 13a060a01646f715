"""wanlink's environment variables, read once at the edges into one typed :class:`Settings`.

Only the edges read the environment (``wanlink.connect``/``serve``, the torch backend's
``init_process_group``, the CLIs, the kernel chooser at import): they call :func:`from_env` and
pass the object, or the values they need from it, down. ``proto/`` and ``sched/`` never read it.
A malformed value is a :class:`~wanlink.errors.ConfigError` naming the variable.
:data:`VARIABLES` is the one table of every variable; docs/configuration.md is checked against it.
"""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping
from typing import Literal

from wanlink.errors import ConfigError
from wanlink.proto.limits import DEFAULT_LIMITS, MiB, Limits
from wanlink.sched.chunking import MAX_CHUNK_SIZE, MIN_CHUNK_SIZE
from wanlink.sched.edf import CHUNK_ORDERS
from wanlink.sched.sites import check_site_name

MAX_CONGESTION_NAME = 15  # TCP_CA_NAME_MAX (16) less the terminating zero

StreamCount = int | Literal["auto"] | None
"""An explicit count, ``"auto"`` (probe even towards loopback) or None (probe remote paths, 4 locally)."""

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def _flag(name: str, raw: str) -> bool:
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ConfigError(f"{name} must be 0 or 1 (or true/false, yes/no, on/off), got {raw!r}")


def _integer(name: str, raw: str, minimum: int, maximum: int | None = None) -> int:
    try:
        value = int(raw.strip())
    except ValueError:
        raise ConfigError(f"{name} must be an integer, got {raw!r}") from None
    if value < minimum or (maximum is not None and value > maximum):
        bound = f"in [{minimum}, {maximum}]" if maximum is not None else f">= {minimum}"
        raise ConfigError(f"{name} must be {bound}, got {value}")
    return value


def _text(name: str, raw: str) -> str:
    return raw


def _optional_text(name: str, raw: str) -> str | None:
    return raw.strip() or None


def _chunk_order(name: str, raw: str) -> str:
    value = raw.strip().lower()
    if value not in CHUNK_ORDERS:
        raise ConfigError(f"{name} must be one of {', '.join(CHUNK_ORDERS)}, got {raw!r}")
    return value


def _streams(name: str, raw: str) -> StreamCount:
    value = raw.strip().lower()
    if value == "":
        return None
    if value == "auto":
        return "auto"
    return _integer(name, value, 1, DEFAULT_LIMITS.max_streams)


def _chunk_size(name: str, raw: str) -> int | None:
    if not raw.strip():
        return None
    return _integer(name, raw, MIN_CHUNK_SIZE, MAX_CHUNK_SIZE)


def _staging_bytes(name: str, raw: str) -> int:
    return _integer(name, raw, MiB)


def _congestion(name: str, raw: str) -> str | None:
    value = raw.strip().lower()
    if not value:
        return None
    if not value.isascii() or not value.replace("_", "").isalnum() or len(value) > MAX_CONGESTION_NAME:
        raise ConfigError(f"{name} must name a TCP congestion control (e.g. bbr, cubic), got {raw!r}")
    return value


def _site(name: str, raw: str) -> str | None:
    return check_site_name(raw, name) if raw.strip() else None


def _positive(name: str, raw: str) -> int:
    return _integer(name, raw, 1)


def _non_negative(name: str, raw: str) -> int:
    return _integer(name, raw, 0)


@dataclasses.dataclass(frozen=True)
class Variable:
    """One environment variable: its name, the Settings field it fills, its parser and its documentation."""

    name: str
    field: str
    parse: Callable[[str, str], object]
    default_text: str
    meaning: str


VARIABLES: tuple[Variable, ...] = (
    Variable("WANLINK_SECRET", "secret", _text, "unset (torch backend: made by rank 0, shared via the Store)",
             "shared HMAC secret authenticating every stream; the same on both sides; \"\" means unauthenticated"),
    Variable("WANLINK_STREAMS", "streams", _streams, "unset: probed per remote path, 4 towards loopback/Unix",
             "TCP streams per link (1-64), or `auto` to probe even towards loopback"),
    Variable("WANLINK_CHUNK_SIZE", "chunk_size", _chunk_size, "unset: the probe's choice, 4 MiB on local links",
             "bytes per chunk (262144-4194304)"),
    Variable("WANLINK_CONGESTION", "congestion", _congestion,
             "unset: bbr towards remote peers where the kernel has it, the system default on loopback",
             "TCP congestion control of every TCP stream (a name from "
             "/proc/sys/net/ipv4/tcp_available_congestion_control, e.g. `cubic`); a name the kernel "
             "lacks fails when the first link opens"),
    Variable("WANLINK_CHUNK_ORDER", "chunk_order", _chunk_order, "edf",
             "order in which a link sends queued chunks: `edf` (earliest deadline: iteration, then layer) "
             "or `fcfs` (arrival order)"),
    Variable("WANLINK_UNIX", "unix", _flag, "1",
             "0: ranks of one host link over TCP loopback instead of abstract Unix sockets"),
    Variable("WANLINK_EXPRESS", "express", _flag, "1",
             "0: collectives of a group whose ranks all share this host run on the I/O loop like any other, "
             "instead of on the group's own thread over dedicated Unix sockets (docs/c10d.md, the express path)"),
    Variable("WANLINK_ADDR", "addr", _optional_text, "derived from the Store",
             "address this rank advertises to its peers"),
    Variable("WANLINK_BIND", "bind", _optional_text, "derived from the Store (0.0.0.0 or 127.0.0.1)",
             "address this rank's server binds"),
    Variable("WANLINK_SITE", "site", _site, "unset: `host:` + this machine's boot id and network namespace",
             "this rank's site (any name, up to 128 bytes): ranks of one site share a fast local network, "
             "sites are joined by the WAN; set the same name on every rank of a data centre or cloud region"),
    Variable("WANLINK_SECURE", "secure", _flag, "0",
             "1: every frame encrypted and authenticated (AES-256-GCM, keys from the secret); "
             "a secure server refuses plaintext clients"),
    Variable("WANLINK_COMPRESS", "compress", _flag, "0",
             "1: lz4 per chunk, sent compressed only where that shrinks it"),
    Variable("WANLINK_DIRECT_MAX_BYTES", "direct_max_bytes", _non_negative, "262144",
             "collectives up to this many bytes per rank use direct exchange instead of ring/chain"),
    Variable("WANLINK_STRIPE_MIN_BYTES", "stripe_min_bytes", _non_negative, "16777216 (16 MiB)",
             "point-to-point sends of at least this many bytes from a site of several ranks to another site "
             "are striped over every member's WAN link (docs/sites.md); 0: never"),
    Variable("WANLINK_STAGING_BYTES", "staging_bytes", _staging_bytes, "134217728 (128 MiB)",
             "per link: bytes staged for receives not posted yet (the eager credit; a sender waits for "
             "the receive beyond it); at least 1048576"),
    Variable("WANLINK_PIECE_BYTES", "piece_bytes", _positive, "4194304", "ring/chain pipelining unit in bytes"),
    Variable("WANLINK_GC_FREEZE", "gc_freeze", _flag, "1",
             "0: leave Python's garbage collector alone (1 freezes it once at the first group)"),
    Variable("WANLINK_PUREPYTHON", "pure_python", _flag, "0",
             "1: use the NumPy reference kernels and the pure-Python frame decoder even where the compiled ones load"),
)
"""Every variable wanlink reads at run time (``WANLINK_NO_EXT=1`` is read by the build alone: setup.py)."""


@dataclasses.dataclass(frozen=True)
class Settings:
    """Every run-time setting; the defaults are what an empty environment gives."""

    secret: str | None = None
    streams: StreamCount = None
    chunk_size: int | None = None
    chunk_order: str = "edf"
    congestion: str | None = None
    unix: bool = True
    express: bool = True
    addr: str | None = None
    bind: str | None = None
    site: str | None = None
    secure: bool = False
    compress: bool = False
    direct_max_bytes: int = 256 * 1024
    stripe_min_bytes: int = 16 * 1024 * 1024
    piece_bytes: int = 4 * 1024 * 1024
    staging_bytes: int = DEFAULT_LIMITS.max_unexpected_bytes
    gc_freeze: bool = True
    pure_python: bool = False


def limits_from(settings: Settings) -> Limits:
    """The protocol limits ``settings`` ask for (the defaults, with WANLINK_STAGING_BYTES)."""
    return dataclasses.replace(DEFAULT_LIMITS, max_unexpected_bytes=settings.staging_bytes)


def from_env(environ: Mapping[str, str] | None = None) -> Settings:
    """Settings from ``environ`` (default ``os.environ``); ConfigError naming the first malformed variable."""
    environ = os.environ if environ is None else environ
    values = {}
    for variable in VARIABLES:
        raw = environ.get(variable.name)
        if raw is not None:
            values[variable.field] = variable.parse(variable.name, raw)
    return Settings(**values)


def markdown_table() -> str:
    """The documentation table of :data:`VARIABLES` (docs/configuration.md holds it verbatim)."""
    rows = ["| variable | default | meaning |", "|---|---|---|"]
    rows += [f"| `{v.name}` | {v.default_text} | {v.meaning} |" for v in VARIABLES]
    return "\n".join(rows)
