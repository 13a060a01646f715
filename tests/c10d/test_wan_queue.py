"""The per-link hand-over of striped routes (``WanQueue``): a rank's routes over its WAN link go one
after another in the order they joined, whatever order their pieces arrive in."""
import asyncio

import pytest

from wanlink.c10d.striped_p2p import WanQueue


@pytest.mark.asyncio
async def test_a_route_waits_for_every_route_ahead_to_queue_its_last_piece():
    wan = WanQueue()
    first, second, third = wan.join(0, 1), wan.join(1, 1), wan.join(0, 2)
    await first.turn()  # nobody ahead
    waiting = asyncio.ensure_future(third.turn())
    await asyncio.sleep(0.01)
    assert not waiting.done()
    second.leave()  # out of order: the third still waits for the first
    await asyncio.sleep(0.01)
    assert not waiting.done()
    first.leave()
    await asyncio.wait_for(waiting, 1)
    await second.turn()  # (left already: its own turn is no wait)
    third.leave()
    assert [key for *key, _start, _end in wan.log] == [[0, 1], [0, 2]]  # (the second never started)
    await asyncio.wait_for(wan.join(2, 3).turn(), 1)  # all left: a new route goes at once


@pytest.mark.asyncio
async def test_a_cancelled_waiter_leaves_the_routes_ahead_in_place():
    wan = WanQueue()
    first, second, third = wan.join(0, 1), wan.join(0, 2), wan.join(0, 3)
    waiting = asyncio.ensure_future(second.turn())
    await asyncio.sleep(0.01)
    waiting.cancel()
    second.leave()  # (a route that fails leaves)
    await asyncio.gather(waiting, return_exceptions=True)
    behind = asyncio.ensure_future(third.turn())
    await asyncio.sleep(0.01)
    assert not behind.done()  # still behind the first, whose place the cancel did not touch
    first.leave()
    await asyncio.wait_for(behind, 1)
