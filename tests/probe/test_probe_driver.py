"""choose_streams over real loopback Links (outcomes only: never timing)."""
import asyncio

import pytest

import wanlink
from wanlink.errors import AuthenticationError, ConfigError, PeerLost
from wanlink.probe.chunk import MAX_CHUNK, MIN_CHUNK
from wanlink.io.link import DEFAULT_STREAMS, PROBE_META_KEY
from tests.support.ports import refused_port
from wanlink.probe.driver import (
    MIN_INFLIGHT_BYTES, STREAM_INFLIGHT_BYTES, StepTiming, choose_streams, inflight_bytes_for,
)

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


def test_step_timing_scales_with_rtt_and_is_capped():
    short, long = StepTiming.for_rtt(0.0001), StepTiming.for_rtt(0.08)
    assert short.warmup_s == 0.25 and short.measure_s == 0.4
    assert long.warmup_s > short.warmup_s and long.measure_s > short.measure_s
    huge = StepTiming.for_rtt(10.0)
    assert huge.warmup_s == 2.0 and huge.measure_s == 2.0
    assert StepTiming.for_rtt(0.04, measure_s=0.1).measure_s == 0.1


def test_inflight_covers_every_stream_and_the_bandwidth_delay_product():
    assert inflight_bytes_for(1) == MIN_INFLIGHT_BYTES  # few streams: the floor
    assert inflight_bytes_for(16) == 16 * STREAM_INFLIGHT_BYTES > MIN_INFLIGHT_BYTES  # each stream kept busy
    fast = inflight_bytes_for(2, rate=250e6, rtt_s=0.2)  # 2 Gbit/s at 200 ms: twice the BDP
    assert fast == int(2 * 250e6 * 0.2)
    assert inflight_bytes_for(1, floor=1 << 20) == STREAM_INFLIGHT_BYTES
