"""LostMemberWatch: a collective's task is cancelled the moment the link to a member of its group fails."""
import asyncio

import pytest

from wanlink.c10d.process_group import LostMemberWatch
from wanlink.errors import PeerLost

pytestmark = pytest.mark.asyncio


class FakeMesh:
    """The two methods LostMemberWatch uses: links already lost, and a listener for later losses."""

    def __init__(self, lost: dict[int, BaseException] | None = None):
        self._lost = lost or {}
        self.listeners: set = set()

    def lost(self, peer):
        return self._lost.get(peer)

    def on_lost(self, listener):
        self.listeners.add(listener)
        return lambda: self.listeners.discard(listener)

    def fail(self, peer, reason):
        self._lost[peer] = reason
        for listener in list(self.listeners):
            listener(peer, reason)


async def _collective(mesh, ranks, started: asyncio.Event):
    watch = LostMemberWatch(mesh, ranks)
    try:
        started.set()
        await asyncio.Event().wait()  # waits on a survivor forever
    except asyncio.CancelledError:
        return watch.lost
    finally:
        watch.stop()


async def test_a_member_lost_while_waiting_cancels_at_once_and_stops_listening():
    mesh, started = FakeMesh(), asyncio.Event()
    task = asyncio.ensure_future(_collective(mesh, [0, 1, 2], started))
    await started.wait()
    mesh.fail(5, PeerLost("not a member"))  # another group's rank: ignored
    await asyncio.sleep(0)
    assert not task.done()
    reason = PeerLost("rank 2 went away")
    mesh.fail(2, reason)
    await asyncio.wait({task}, timeout=5)  # (not wait_for: its own cancel would end the wait too)
    assert task.done() and task.result() is reason
    assert not mesh.listeners  # stop() unsubscribed


async def test_a_member_lost_before_the_collective_began_cancels_its_first_wait():
    reason = PeerLost("rank 1 is long gone")
    mesh, started = FakeMesh({1: reason}), asyncio.Event()
    task = asyncio.ensure_future(_collective(mesh, [0, 1], started))
    await asyncio.wait({task}, timeout=5)
    assert task.done() and task.result() is reason
    assert not mesh.listeners
