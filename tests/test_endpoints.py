"""wanlink.connect/serve at the edge: settings filled in, and choose_streams over real loopback Links.

Outcomes only, never timing.
"""
import asyncio

import pytest

import wanlink
from wanlink.endpoints import DEFAULT_STREAMS, choose_streams
from wanlink.errors import AuthenticationError, ConfigError, PeerLost
from wanlink.probe.chunk import MAX_CHUNK, MIN_CHUNK
from wanlink.proto.handshake import PROBE_META_KEY
from wanlink.settings import Settings
from tests.support.ports import refused_port

SECRET = b"probe-test-secret"
LIMIT = 60.0


class Peer:
    """A wanlink server that records the links it is handed."""

    def __init__(self):
        self.links = []

    async def __aenter__(self):
        self.server = await wanlink.serve("127.0.0.1", 0, secret=SECRET, on_link=self.links.append)
        return self

    async def __aexit__(self, *exc):
        self.server.close()
        await self.server.wait_closed()
        for link in self.links:
            await link.close()


async def _until(condition) -> None:
    while not condition():
        await asyncio.sleep(0.01)


@pytest.mark.asyncio
async def test_probe_ramps_and_chooses_within_bounds():
    async with Peer() as peer:
        result = await asyncio.wait_for(
            choose_streams("127.0.0.1", peer.server.port, secret=SECRET, max_streams=4, measure_s=0.2,
                           meta={"rank": 3}), LIMIT)
    counts = [s.streams for s in result.samples]
    assert counts[0] == 1 and counts == sorted(counts) and set(counts) <= {1, 2, 4}
    assert all(s.rate > 0 for s in result.samples)
    assert result.streams in counts
    assert result.rate == dict((s.streams, s.rate) for s in result.samples)[result.streams]
    assert 0 < result.rtt_s < 1.0
    assert MIN_CHUNK <= result.chunk_size <= MAX_CHUNK
    assert result.reason
    # the peer's transport took one probe link per step and kept them from the application
    assert peer.links == []


@pytest.mark.asyncio
async def test_connect_probes_when_streams_is_auto(monkeypatch):
    monkeypatch.setenv("WANLINK_STREAMS", "auto")
    async with Peer() as peer:
        link = await asyncio.wait_for(wanlink.connect("127.0.0.1", peer.server.port, secret=SECRET), LIMIT)
        try:
            assert 1 <= link.streams <= 64 and MIN_CHUNK <= link.chunk_size <= MAX_CHUNK
            for _ in range(50):  # the application link arrives after the probe links, which it never sees
                if peer.links:
                    break
                await asyncio.sleep(0.05)
            assert [accepted.streams for accepted in peer.links] == [link.streams]
            assert not peer.links[0].peer_meta.get(PROBE_META_KEY)
        finally:
            await link.close()


@pytest.mark.asyncio
async def test_connect_to_loopback_without_setting_streams_skips_the_probe(monkeypatch):
    monkeypatch.delenv("WANLINK_STREAMS", raising=False)
    async with Peer() as peer:
        link = await asyncio.wait_for(wanlink.connect("127.0.0.1", peer.server.port, secret=SECRET), LIMIT)
        assert link.streams == DEFAULT_STREAMS
        await link.close()


@pytest.mark.asyncio
async def test_probe_with_wrong_secret_fails_with_authentication_error():
    async with Peer() as peer:
        with pytest.raises(AuthenticationError):
            await asyncio.wait_for(
                choose_streams("127.0.0.1", peer.server.port, secret=b"wrong", max_streams=2, measure_s=0.1,
                               timeout=5.0), LIMIT)


@pytest.mark.asyncio
async def test_probe_of_a_closed_port_fails_with_peer_lost():
    with refused_port() as port, pytest.raises(PeerLost):
        await asyncio.wait_for(choose_streams("127.0.0.1", port, secret=SECRET, max_streams=2, timeout=5.0), LIMIT)


@pytest.mark.asyncio
async def test_probe_rejects_bad_bounds():
    with pytest.raises(ConfigError):
        await choose_streams("127.0.0.1", 1, secret=SECRET, max_streams=0)


@pytest.mark.asyncio
async def test_streams_and_chunk_size_come_from_the_environment_at_the_edge(monkeypatch):
    monkeypatch.setenv("WANLINK_STREAMS", "3")
    monkeypatch.setenv("WANLINK_CHUNK_SIZE", str(2 * 1024 * 1024))
    async with Peer() as peer:
        link = await asyncio.wait_for(wanlink.connect("127.0.0.1", peer.server.port, secret=SECRET), LIMIT)
        try:
            assert link.streams == 3
            assert link.chunk_size == 2 * 1024 * 1024  # the variable wins over the 4 MiB loopback default
            await asyncio.wait_for(_until(lambda: peer.links), LIMIT)
            assert peer.links[0].chunk_size == 2 * 1024 * 1024  # and so on the server's side
        finally:
            await link.close()


@pytest.mark.asyncio
async def test_explicit_arguments_and_settings_override_the_environment(monkeypatch):
    chosen = Settings(streams=2, secret=SECRET.decode())
    async with Peer() as peer:
        monkeypatch.setenv("WANLINK_STREAMS", "many")  # never read: settings= replaces the environment
        monkeypatch.setenv("WANLINK_SECRET", "not-this-one")
        link = await asyncio.wait_for(wanlink.connect("127.0.0.1", peer.server.port, settings=chosen), LIMIT)
        assert link.streams == 2
        await link.close()
        link = await asyncio.wait_for(
            wanlink.connect("127.0.0.1", peer.server.port, streams=1, secret=SECRET, settings=chosen), LIMIT)
        assert link.streams == 1
        await link.close()


@pytest.mark.asyncio
async def test_the_secret_comes_from_wanlink_secret_else_a_clear_error(monkeypatch):
    monkeypatch.delenv("WANLINK_SECRET", raising=False)
    with pytest.raises(ConfigError, match="WANLINK_SECRET"):
        await wanlink.serve("127.0.0.1", 0, on_link=lambda link: None)
    async with Peer() as peer:
        with pytest.raises(ConfigError, match="WANLINK_SECRET"):
            await wanlink.connect("127.0.0.1", peer.server.port, streams=1)
        monkeypatch.setenv("WANLINK_SECRET", SECRET.decode())
        link = await asyncio.wait_for(wanlink.connect("127.0.0.1", peer.server.port, streams=1), LIMIT)
        await link.close()


@pytest.mark.asyncio
@pytest.mark.parametrize("variable, value", [("WANLINK_STREAMS", "many"), ("WANLINK_CHUNK_SIZE", "big")])
async def test_a_malformed_variable_fails_before_connecting(monkeypatch, variable, value):
    monkeypatch.setenv(variable, value)
    with pytest.raises(ConfigError, match=variable):
        await wanlink.connect("127.0.0.1", 1, secret=SECRET)


@pytest.mark.asyncio
async def test_wanlink_congestion_chooses_every_streams_congestion_control_on_both_sides(monkeypatch):
    monkeypatch.setenv("WANLINK_CONGESTION", "reno")  # built into every Linux kernel; not the loopback default here
    async with Peer() as peer:
        link = await asyncio.wait_for(wanlink.connect("127.0.0.1", peer.server.port, streams=2, secret=SECRET), LIMIT)
        try:
            assert link.stats()["congestion"] == ["reno", "reno"]
            await asyncio.wait_for(_until(lambda: peer.links), LIMIT)
            assert peer.links[0].stats()["congestion"] == ["reno", "reno"]
        finally:
            await link.close()
    monkeypatch.setenv("WANLINK_CONGESTION", "nosuchcc")
    async with Peer() as peer:
        with pytest.raises(ConfigError, match="nosuchcc"):
            await asyncio.wait_for(wanlink.connect("127.0.0.1", peer.server.port, streams=1, secret=SECRET), LIMIT)
