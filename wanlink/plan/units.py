"""Quantities with units in cluster descriptions: rates, sizes and times (pure).

``parse_rate("500 Mbit/s")`` is bytes per second, ``parse_size("1.5 MB")`` bytes and
``parse_time("40 ms")`` seconds. A bare number is refused (is 500 bits or bytes? ms or s?), and
every error names the field it came from.
"""
from __future__ import annotations

import math
import re

from wanlink.errors import ConfigError

_NUMBER = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([A-Za-z/]*)\s*$")

SIZE_UNITS = {"B": 1, "kB": 1e3, "KB": 1e3, "KiB": 1024, "MB": 1e6, "MiB": 1024 ** 2, "GB": 1e9, "GiB": 1024 ** 3}
RATE_UNITS = {  # bytes per second
    "bit/s": 1 / 8, "kbit/s": 1e3 / 8, "Mbit/s": 1e6 / 8, "Gbit/s": 1e9 / 8,
    "bps": 1 / 8, "kbps": 1e3 / 8, "Mbps": 1e6 / 8, "Gbps": 1e9 / 8,
    "B/s": 1, "kB/s": 1e3, "MB/s": 1e6, "GB/s": 1e9, "MiB/s": 1024 ** 2, "GiB/s": 1024 ** 3,
}
TIME_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6}


def _parse(value, units: dict, field: str, kind: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise ConfigError(f"{field}: expected a {kind} such as '{next(iter(units))}' with a unit, got {value!r}")
    if not isinstance(value, str):
        raise ConfigError(f"{field}: {value!r} has no unit; write it as a string with one of {', '.join(units)}")
    match = _NUMBER.match(value)
    if not match:
        raise ConfigError(f"{field}: cannot read {value!r} as a {kind} (a number and a unit, e.g. '40 ms')")
    number, unit = float(match.group(1)), match.group(2)
    if not unit:
        raise ConfigError(f"{field}: {value!r} has no unit; use one of {', '.join(units)}")
    if unit not in units:
        raise ConfigError(f"{field}: unknown unit {unit!r} in {value!r}; use one of {', '.join(units)}")
    result = number * units[unit]
    if not math.isfinite(result):
        raise ConfigError(f"{field}: {value!r} is not a finite {kind}")
    return result


def parse_rate(value, field: str = "rate") -> float:
    """Bytes per second from e.g. '500 Mbit/s', '1 Gbps', '60 MB/s'."""
    return _parse(value, RATE_UNITS, field, "rate")


def parse_size(value, field: str = "size") -> float:
    """Bytes from e.g. '1.5 MB', '1536 KiB'."""
    return _parse(value, SIZE_UNITS, field, "size")


def parse_time(value, field: str = "time") -> float:
    """Seconds from e.g. '40 ms', '0.5 s', '200 us'."""
    return _parse(value, TIME_UNITS, field, "time")


def format_rate(bytes_per_second: float) -> str:
    return f"{bytes_per_second * 8 / 1e6:g} Mbit/s"
