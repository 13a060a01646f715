"""Cluster descriptions: sites of ranks and the WAN paths between them (pure, validated).

A description is TOML (or the same shape as a dict)::

    [defaults]
    window = "1536 KiB"     # effective window of one TCP flow (what a long path gives it)
    streams = 8             # TCP streams per link (wanlink stripes over them)
    chunk = "1 MiB"         # wanlink's chunk: one stream carries one chunk at a time
    send_overhead = "0 ms"  # measured: what a WAN send step takes beyond its one-way delay
    efficiency = 0.965      # goodput / line rate (TCP/IP headers: 1448 of every 1500 bytes)
    lan_rate = "10 Gbit/s"  # between ranks of one site, per host

    [[site]]
    name = "east"
    ranks = 2
    speed = 1.0             # compute speed relative to the profile (2.0 = twice as fast)
    host_cap = "1 Gbit/s"   # optional: WAN rate one host may use, each way
    cores = 16              # optional: CPU cores the site's ranks share (compute and transport)

    [[path]]
    sites = ["east", "west"]
    rtt = "40 ms"
    rate = "500 Mbit/s"     # bottleneck rate each way

Every error names the field (``site[1].ranks``, ``path[0].rtt``) and what was wrong with it.
``Cluster.from_probe`` builds a two-site cluster from what ``wanlink.probe`` measured.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from pathlib import Path

from wanlink.errors import ConfigError
from wanlink.plan.units import parse_rate, parse_size, parse_time

DEFAULT_WINDOW = 1536 * 1024
"""Effective window of one TCP flow on a long path (the emulator's cap; docs/wanem.md)."""
DEFAULT_EFFICIENCY = 1448 / 1500
DEFAULT_LAN_RATE = 10e9 / 8
DEFAULT_STREAMS = 8
DEFAULT_CHUNK = 1024 * 1024  # wanlink.sched.chunking.DEFAULT_CHUNK_SIZE: a stream carries one chunk at a time


@dataclass(frozen=True)
class Site:
    name: str
    ranks: int
    speed: float = 1.0
    host_cap: float | None = None  # bytes/s each way per host, None = no cap beyond the path
    lan_rate: float = DEFAULT_LAN_RATE  # bytes/s per host towards ranks of the same site
    cores: float | None = None  # CPU cores the site's ranks share (compute and transport), None = no limit


@dataclass(frozen=True)
class SitePath:
    sites: tuple[str, str]
    rtt_s: float
    rate: float  # line rate in bytes/s, each way


@dataclass(frozen=True)
class Cluster:
    sites: tuple[Site, ...]
    paths: tuple[SitePath, ...] = ()
    window: float = DEFAULT_WINDOW
    streams: int = DEFAULT_STREAMS
    efficiency: float = DEFAULT_EFFICIENCY
    lan_rtt_s: float = 0.0
    chunk: float = DEFAULT_CHUNK
    send_overhead_s: float = 0.0  # measured time a send step over the WAN takes beyond its one-way delay
    source: str = field(default="cluster", compare=False)

    def __post_init__(self):
        _check_cluster(self)

    @property
    def world_size(self) -> int:
        return sum(site.ranks for site in self.sites)

    def site_of_rank(self) -> list[int]:
        """Site index of every rank; ranks are numbered site by site in description order."""
        return [index for index, site in enumerate(self.sites) for _ in range(site.ranks)]

    def path(self, a: str, b: str) -> SitePath:
        for path in self.paths:
            if set(path.sites) == {a, b}:
                return path
        raise ConfigError(f"{self.source}: no [[path]] between sites {a!r} and {b!r}")

    def flow_cap(self, a: str, b: str, streams: int | None = None) -> float:
        """Most one striped link of ``streams`` flows carries from site a to b (bytes/s): window-limited."""
        count = self.streams if streams is None else streams
        rtt = self.lan_rtt_s if a == b else self.path(a, b).rtt_s
        return math.inf if rtt <= 0 else count * self.window / rtt

    def subset(self, names: list[str]) -> "Cluster":
        """The same cluster restricted to the named sites (in that order)."""
        chosen = tuple(next(s for s in self.sites if s.name == n) for n in names)
        paths = tuple(p for p in self.paths if set(p.sites) <= set(names))
        return replace(self, sites=chosen, paths=paths)

    def with_ranks(self, ranks: dict[str, int]) -> "Cluster":
        return replace(self, sites=tuple(replace(s, ranks=ranks.get(s.name, s.ranks)) for s in self.sites))

    @classmethod
    def from_probe(cls, probe, ranks_per_site: int = 1, names: tuple[str, str] = ("a", "b")) -> "Cluster":
        """Two sites joined by the path a ``wanlink.probe.ProbeResult`` (or its ``to_json()``) measured.

        The probe's rate is delivered goodput at its chosen stream count, so efficiency is 1 and the
        window is what that many streams achieved if the path was window-limited.
        """
        if isinstance(probe, dict):
            try:
                streams, rtt_s, rate = int(probe["streams"]), probe["rtt_ms"] / 1e3, probe["bits_per_second"] / 8
            except KeyError as missing:
                raise ConfigError(f"probe result: missing field {missing.args[0]!r}") from None
        else:
            streams, rtt_s, rate = probe.streams, probe.rtt_s, probe.rate
        window = max(rate * rtt_s / max(streams, 1), 1.0)
        sites = tuple(Site(name, ranks_per_site) for name in names)
        return cls(sites, (SitePath(names, rtt_s, rate),), window=window, streams=streams, efficiency=1.0,
                   source="probe result")


def _check_cluster(cluster: Cluster) -> None:
    where = cluster.source
    if not cluster.sites:
        raise ConfigError(f"{where}: needs at least one [[site]]")
    names = [site.name for site in cluster.sites]
    for i, site in enumerate(cluster.sites):
        if names.index(site.name) != i:
            raise ConfigError(f"{where}: site[{i}].name: {site.name!r} appears twice")
        if not isinstance(site.ranks, int) or site.ranks < 1:
            raise ConfigError(f"{where}: site[{i}].ranks must be an integer >= 1, got {site.ranks!r}")
        _positive(site.speed, f"{where}: site[{i}].speed")
        _positive(site.lan_rate, f"{where}: site[{i}].lan_rate")
        if site.host_cap is not None:
            _positive(site.host_cap, f"{where}: site[{i}].host_cap")
        if site.cores is not None:
            _positive(site.cores, f"{where}: site[{i}].cores")
    for i, path in enumerate(cluster.paths):
        a, b = path.sites
        for end in (a, b):
            if end not in names:
                raise ConfigError(f"{where}: path[{i}].sites: unknown site {end!r} (sites: {', '.join(names)})")
        if a == b:
            raise ConfigError(f"{where}: path[{i}].sites: a path joins two different sites, got {a!r} twice")
        if not (math.isfinite(path.rtt_s) and path.rtt_s > 0):
            raise ConfigError(f"{where}: path[{i}].rtt must be > 0, got {path.rtt_s} s")
        _positive(path.rate, f"{where}: path[{i}].rate")
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            if sum(set(p.sites) == {a, b} for p in cluster.paths) != 1:
                raise ConfigError(f"{where}: need exactly one [[path]] between sites {a!r} and {b!r}")
    _positive(cluster.window, f"{where}: defaults.window")
    _positive(cluster.chunk, f"{where}: defaults.chunk")
    if not isinstance(cluster.streams, int) or cluster.streams < 1:
        raise ConfigError(f"{where}: defaults.streams must be an integer >= 1, got {cluster.streams!r}")
    if not (0 < cluster.efficiency <= 1):
        raise ConfigError(f"{where}: defaults.efficiency must be in (0, 1], got {cluster.efficiency!r}")
    for name, value in (("lan_rtt", cluster.lan_rtt_s), ("send_overhead", cluster.send_overhead_s)):
        if not (math.isfinite(value) and value >= 0):
            raise ConfigError(f"{where}: defaults.{name} must be >= 0, got {value} s")


def _positive(value, field: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value > 0):
        raise ConfigError(f"{field} must be a finite number > 0, got {value!r}")


def _take(table: dict, key: str, where: str, parse=None, default=...):
    if key not in table:
        if default is ...:
            raise ConfigError(f"{where}.{key}: missing (required)")
        return default
    value = table[key]
    return parse(value, f"{where}.{key}") if parse else value


def _known(table, keys: set, where: str) -> dict:
    if not isinstance(table, dict):
        raise ConfigError(f"{where}: expected a table, got {type(table).__name__}")
    unknown = set(table) - keys
    if unknown:
        raise ConfigError(f"{where}: unknown field {sorted(unknown)[0]!r} (known: {', '.join(sorted(keys))})")
    return table


def _number(value, field: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{field}: expected a number, got {value!r}")
    return float(value)


def _integer(value, field: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{field}: expected an integer, got {value!r}")
    return value


def cluster_from_dict(doc: dict, source: str = "cluster") -> Cluster:
    """A validated Cluster from a parsed description; errors are prefixed with ``source``."""
    _known(doc, {"defaults", "site", "path"}, source)
    defaults = _known(doc.get("defaults", {}), {"window", "streams", "efficiency", "lan_rate", "lan_rtt", "chunk",
                                                         "send_overhead"},
                      f"{source}: defaults")
    lan_rate = _take(defaults, "lan_rate", f"{source}: defaults", parse_rate, DEFAULT_LAN_RATE)
    site_tables = doc.get("site")
    if not site_tables:
        raise ConfigError(f"{source}: site: missing (at least one [[site]] with name and ranks)")
    if not isinstance(site_tables, list):
        raise ConfigError(f"{source}: site: write sites as [[site]] tables")
    sites = []
    for i, table in enumerate(site_tables):
        where = f"{source}: site[{i}]"
        _known(table, {"name", "ranks", "speed", "host_cap", "lan_rate", "cores"}, where)
        name = _take(table, "name", where)
        if not isinstance(name, str) or not name:
            raise ConfigError(f"{where}.name: expected a non-empty string, got {name!r}")
        sites.append(Site(name=name, ranks=_take(table, "ranks", where, _integer),
                          speed=_take(table, "speed", where, _number, 1.0),
                          host_cap=_take(table, "host_cap", where, parse_rate, None),
                          lan_rate=_take(table, "lan_rate", where, parse_rate, lan_rate),
                          cores=_take(table, "cores", where, _number, None)))
    paths = []
    path_tables = doc.get("path", [])
    if not isinstance(path_tables, list):
        raise ConfigError(f"{source}: path: write paths as [[path]] tables")
    for i, table in enumerate(path_tables):
        where = f"{source}: path[{i}]"
        _known(table, {"sites", "rtt", "rate"}, where)
        ends = _take(table, "sites", where)
        if not (isinstance(ends, list) and len(ends) == 2 and all(isinstance(e, str) for e in ends)):
            raise ConfigError(f"{where}.sites: expected two site names, got {ends!r}")
        paths.append(SitePath(sites=(ends[0], ends[1]), rtt_s=_take(table, "rtt", where, parse_time),
                              rate=_take(table, "rate", where, parse_rate)))
    return Cluster(sites=tuple(sites), paths=tuple(paths),
                   window=_take(defaults, "window", f"{source}: defaults", parse_size, DEFAULT_WINDOW),
                   streams=_take(defaults, "streams", f"{source}: defaults", _integer, DEFAULT_STREAMS),
                   efficiency=_take(defaults, "efficiency", f"{source}: defaults", _number, DEFAULT_EFFICIENCY),
                   lan_rtt_s=_take(defaults, "lan_rtt", f"{source}: defaults", parse_time, 0.0),
                   chunk=_take(defaults, "chunk", f"{source}: defaults", parse_size, DEFAULT_CHUNK),
                   send_overhead_s=_take(defaults, "send_overhead", f"{source}: defaults", parse_time, 0.0),
                   source=source)


def cluster_from_toml(text: str, source: str = "cluster") -> Cluster:
    try:
        import tomllib
    except ImportError:  # Python 3.10
        try:
            import tomli as tomllib
        except ImportError:
            raise ConfigError("reading TOML needs Python 3.11 (tomllib) or the tomli package") from None
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"{source}: not valid TOML: {error}") from None
    return cluster_from_dict(doc, source)


def load_cluster(path: str | Path) -> Cluster:
    """Read and validate a cluster description file (TOML)."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as error:
        raise ConfigError(f"cannot read cluster description {path}: {error.strerror}") from None
    return cluster_from_toml(text, source=str(path))
