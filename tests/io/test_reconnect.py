"""Streams come back: a dead stream is re-opened under the same link id; a peer really gone still fails."""
import asyncio
import logging
import random

import numpy as np
import pytest

import wanlink
from wanlink.errors import PeerLost
from wanlink.io import dial
from tests.support.links import proxied_pair

pytestmark = pytest.mark.asyncio
MiB = 1024 * 1024


async def _until(condition, timeout: float = 60.0) -> None:
    async with asyncio.timeout(timeout):
        while not condition():
            await asyncio.sleep(0.02)


def _live_pipes(proxy, cut: set) -> list[int]:
    return [i for i in range(len(proxy.pipes)) if i not in cut]


@pytest.mark.parametrize("secure", [False, True])
async def test_streams_killed_repeatedly_during_a_long_transfer_come_back(secure):
    kills = 6 if secure else 10
    async with proxied_pair(4, timeout=20, secure=secure) as (proxy, client, accepted):
        rng = random.Random(7)
        cut: set[int] = set()
        done = asyncio.Event()

        async def killer():
            for _ in range(kills):
                await _until(lambda: client.streams_alive == 4 == accepted.streams_alive)
                await asyncio.sleep(0.05)
                victim = rng.choice(_live_pipes(proxy, cut))
                cut.add(victim)
                proxy.cut(victim)
            done.set()

        async def transfers():
            round_ = 0
            while not done.is_set() or round_ < 2:
                data = np.random.default_rng(round_).integers(0, 256, 8 * MiB, dtype=np.uint8).tobytes()
                out = bytearray(len(data))
                await asyncio.gather(client.send(data, tag=1), accepted.recv_into(out, tag=1))
                assert out == data, f"round {round_} differs"
                round_ += 1
            return round_

        rounds, _ = await asyncio.wait_for(asyncio.gather(transfers(), killer()), 240)
        await _until(lambda: client.streams_alive == 4 == accepted.streams_alive)
        assert client.reconnects == kills == accepted.reconnects and rounds >= 2
        assert wanlink.stats()[client.name]["reconnects"] == kills
        assert client.secure == secure == accepted.secure


async def test_a_peer_that_is_gone_still_fails_the_link(monkeypatch):
    monkeypatch.setattr(dial, "REOPEN_BACKOFF_S", (0.01, 0.05))
    async with proxied_pair(2, timeout=10) as (proxy, client, accepted):
        proxy.target_port = 1  # the server is unreachable from now on: every re-open fails
        proxy.cut(0)
        await asyncio.sleep(0.3)  # a few re-open attempts fail meanwhile
        assert client.error is None and client.streams_alive == 1
        await asyncio.wait_for(client.send(b"still works", tag=3), 10)
        proxy.cut(1)
        with pytest.raises(PeerLost):
            await asyncio.wait_for(client.send(b"x" * MiB, tag=4), 20)
        await _until(lambda: not client._reopening)  # the background re-open ended with the link


async def test_re_opening_gives_up_after_bounded_attempts(monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="wanlink.io")
    monkeypatch.setattr(dial, "REOPEN_BACKOFF_S", (0.01, 0.02))
    monkeypatch.setattr(dial, "REOPEN_ATTEMPTS", 3)
    async with proxied_pair(2, timeout=10) as (proxy, client, accepted):
        proxy.target_port = 1
        proxy.cut(0)
        await _until(lambda: "not re-opened after 3 attempts" in caplog.text)
        assert client.streams_alive == 1 and client.reconnects == 0
        transfer = asyncio.gather(client.send(b"y" * MiB, tag=5), accepted.recv_into(bytearray(MiB), tag=5))
        await asyncio.wait_for(transfer, 20)
