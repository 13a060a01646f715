"""Link.wait_message_started / message_started: waiting for a message without receiving it."""
import asyncio

import pytest

from wanlink.errors import PeerLost
from tests.support.links import open_pair

pytestmark = pytest.mark.asyncio


async def test_waits_for_the_first_chunk_and_claims_nothing(pair):
    waiting = asyncio.ensure_future(pair.accepted.wait_message_started(5))
    await asyncio.sleep(0.05)
    assert not waiting.done() and not pair.accepted.message_started(5)
    await pair.client.send(b"first", tag=6)  # another tag does not count
    await asyncio.sleep(0.05)
    assert not waiting.done()
    await pair.client.send(b"hello", tag=5)
    await asyncio.wait_for(waiting, 5)
    assert pair.accepted.message_started(5) and pair.accepted.message_started(5)
    out = bytearray(5)
    assert await pair.accepted.recv_into(out, tag=5) == 5 and out == b"hello"
    assert not pair.accepted.message_started(5)
    await asyncio.wait_for(pair.accepted.wait_message_started(6), 5)  # already there: returns at once


async def test_several_waiters_all_wake_and_only_one_receive_gets_the_message(pair):
    waiters = [asyncio.ensure_future(pair.accepted.wait_message_started(3)) for _ in range(3)]
    await pair.client.send(b"x", tag=3)
    await asyncio.wait_for(asyncio.gather(*waiters), 5)
    out = bytearray(1)
    await pair.accepted.recv_into(out, tag=3)
    assert out == b"x" and not pair.accepted.message_started(3)


async def test_a_cancelled_waiter_leaves_nothing_behind(pair):
    waiting = asyncio.ensure_future(pair.accepted.wait_message_started(9))
    await asyncio.sleep(0.02)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert pair.accepted._start_waiters == {}
    await pair.client.send(b"later", tag=9)
    out = bytearray(5)
    assert await asyncio.wait_for(pair.accepted.recv_into(out, tag=9), 5) == 5 and out == b"later"


async def test_a_failed_link_fails_the_waiter():
    p = await open_pair(2)
    try:
        waiting = asyncio.ensure_future(p.accepted.wait_message_started(4))
        await asyncio.sleep(0.02)
        await p.client.close()
        with pytest.raises(PeerLost):
            await asyncio.wait_for(waiting, 10)
        with pytest.raises(PeerLost):
            await p.accepted.wait_message_started(4)
    finally:
        await p.close()
