"""Cluster descriptions: units, TOML, and errors that name the field."""
import pytest

from wanlink.errors import ConfigError
from wanlink.plan import Cluster, cluster_from_toml, load_cluster
from wanlink.plan.units import parse_rate, parse_size, parse_time

GOOD = """
[defaults]
window = "1536 KiB"
streams = 4
efficiency = 1.0

[[site]]
name = "east"
ranks = 2
host_cap = "1 Gbit/s"

[[site]]
name = "west"
ranks = 3
speed = 2.0

[[path]]
sites = ["east", "west"]
rtt = "40 ms"
rate = "500 Mbit/s"
"""


def test_units():
    assert parse_rate("500 Mbit/s") == 500e6 / 8
    assert parse_rate("1Gbps") == 1e9 / 8
    assert parse_rate("60 MB/s") == 60e6
    assert parse_size("1.5 MB") == 1.5e6
    assert parse_size("1536 KiB") == 1536 * 1024
    assert parse_time("40 ms") == pytest.approx(0.04)
    assert parse_time("200 us") == pytest.approx(200e-6)


@pytest.mark.parametrize("value, message", [
    ("40 msec", "unknown unit 'msec'"), ("40", "has no unit"), (40, "has no unit"), ("fast", "cannot read"),
    (True, "expected a time"),
])
def test_unit_errors_name_the_field(value, message):
    with pytest.raises(ConfigError, match=message) as error:
        parse_time(value, "path[0].rtt")
    assert "path[0].rtt" in str(error.value)


def test_good_description():
    cluster = cluster_from_toml(GOOD)
    assert cluster.world_size == 5
    assert cluster.site_of_rank() == [0, 0, 1, 1, 1]
    assert cluster.streams == 4 and cluster.window == 1536 * 1024
    assert cluster.sites[0].host_cap == 1e9 / 8 and cluster.sites[1].speed == 2.0
    assert cluster.path("west", "east").rtt_s == pytest.approx(0.04)
    # 4 streams of a 1536 KiB window over 40 ms
    assert cluster.flow_cap("east", "west") == pytest.approx(4 * 1536 * 1024 / 0.04)


def test_load_cluster_file(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text(GOOD)
    assert load_cluster(path).world_size == 5
    with pytest.raises(ConfigError, match="cannot read cluster description"):
        load_cluster(tmp_path / "missing.toml")


@pytest.mark.parametrize("edit, field", [
    (('ranks = 2\n', ''), "site[0].ranks: missing"),
    (('rtt = "40 ms"', 'rtt = "40 parsecs"'), "path[0].rtt: unknown unit 'parsecs'"),
    (('rate = "500 Mbit/s"', 'rate = "0 Mbit/s"'), "path[0].rate must be a finite number > 0"),
    (('rtt = "40 ms"', 'rtt = "0 ms"'), "path[0].rtt must be > 0"),
    (('ranks = 2', 'ranks = 0'), "site[0].ranks must be an integer >= 1"),
    (('ranks = 2', 'ranks = 2.5'), "site[0].ranks: expected an integer"),
    (('efficiency = 1.0', 'efficiency = 1.5'), "defaults.efficiency must be in (0, 1]"),
    (('streams = 4', 'streams = 0'), "defaults.streams must be an integer >= 1"),
    (('speed = 2.0', 'speed = -1.0'), "site[1].speed must be a finite number > 0"),
    (('sites = ["east", "west"]', 'sites = ["east", "north"]'), "path[0].sites: unknown site 'north'"),
    (('sites = ["east", "west"]', 'sites = ["east", "east"]'), "path[0].sites: a path joins two different sites"),
    (('name = "west"', 'name = "east"'), "site[1].name: 'east' appears twice"),
    (('host_cap = "1 Gbit/s"', 'host_cap = "1 Gbit/s"\ncolour = "red"'), "site[0]: unknown field 'colour'"),
    (('window = "1536 KiB"', 'window = 1536'), "defaults.window: 1536 has no unit"),
    (('streams = 4', 'streams = 4\nsend_overhead = "-2 ms"'), "defaults.send_overhead: cannot read '-2 ms'"),
])
def test_bad_descriptions_name_the_field(edit, field):
    old, new = edit
    assert old in GOOD
    with pytest.raises(ConfigError) as error:
        cluster_from_toml(GOOD.replace(old, new, 1), source="c.toml")
    assert field in str(error.value)
    assert str(error.value).startswith("c.toml: ")


def test_missing_path_between_sites():
    text = GOOD.split("[[path]]")[0]
    with pytest.raises(ConfigError, match="need exactly one \\[\\[path\\]\\] between sites 'east' and 'west'"):
        cluster_from_toml(text)


def test_not_toml():
    with pytest.raises(ConfigError, match="not valid TOML"):
        cluster_from_toml("[[site]\nname=")


def test_from_probe():
    probe = {"streams": 4, "rtt_ms": 40.0, "bits_per_second": 800e6}
    cluster = Cluster.from_probe(probe, ranks_per_site=2)
    assert cluster.world_size == 4 and cluster.streams == 4 and cluster.efficiency == 1.0
    assert cluster.paths[0].rate == 100e6
    # the window the probe's streams achieved: 4 windows per RTT deliver the measured rate
    assert cluster.flow_cap("a", "b") == pytest.approx(100e6)
    with pytest.raises(ConfigError, match="probe result: missing field 'rtt_ms'"):
        Cluster.from_probe({"streams": 4, "bits_per_second": 1.0})


def test_from_probe_result_object():
    from wanlink.probe import ProbeResult

    result = ProbeResult(streams=2, rtt_s=0.01, rate=50e6, chunk_size=1 << 20)
    assert Cluster.from_probe(result).paths[0].rtt_s == 0.01
