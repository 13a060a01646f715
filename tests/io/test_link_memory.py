"""Memory comes back: a failed link and what it staged are freed at once, with no garbage-collector pass."""
import asyncio
import gc
import tracemalloc
import weakref

import pytest

from tests.support.links import open_pair
from wanlink.errors import PeerLost, RemoteProtocolError
from wanlink.proto.limits import MiB, Limits

STAGING = 8 * MiB
pytestmark = pytest.mark.asyncio


@pytest.fixture
def no_gc():
    gc.collect()
    gc.disable()
    yield
    gc.enable()


async def _wait_for(predicate, timeout=10.0):
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(0.01)


async def test_a_failed_link_and_its_staged_chunks_are_freed_without_a_gc_pass(no_gc):
    p = await open_pair(2, server_options={"limits": Limits(max_unexpected_bytes=STAGING)}, chunk_size=256 * 1024)
    tracemalloc.start()
    try:
        payload = bytes(STAGING)  # beyond the eager window (half the budget): no send can complete
        sends = [asyncio.ensure_future(p.client.send(payload, tag=tag)) for tag in (1, 2)]  # nobody receives
        await _wait_for(lambda: p.accepted.reassembler.unexpected_bytes >= STAGING // 2)
        staged = tracemalloc.get_traced_memory()[0]
        accepted = weakref.ref(p.accepted)
        p.accepted.fail(RemoteProtocolError("test: this link is broken"))
        p.accepted = None
        for send in sends:  # the sender hears why (ABORT) and its sends fail
            with pytest.raises(PeerLost, match="test: this link is broken"):
                await asyncio.wait_for(send, 10)
        await _wait_for(lambda: accepted() is None)  # (its streams finish saying goodbye first)
        freed = staged - tracemalloc.get_traced_memory()[0]
        assert freed >= STAGING // 2, f"only {freed} bytes freed"
    finally:
        tracemalloc.stop()
        await p.client.close()
        p.server.close()
        await p.server.wait_closed()


async def test_a_closed_link_is_freed_without_a_gc_pass(no_gc):
    p = await open_pair(2)
    await p.client.send(b"x" * 1000, tag=1)
    out = bytearray(1000)
    await p.accepted.recv_into(out, tag=1)
    links = [weakref.ref(p.client), weakref.ref(p.accepted)]
    await p.close()
    p.client = p.accepted = None
    await _wait_for(lambda: all(link() is None for link in links))


async def test_an_idle_link_allocates_no_scratch_or_staging_up_front():
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        p = await open_pair(4)
        try:
            assert tracemalloc.get_traced_memory()[0] - before < 1 * MiB  # was 2 x 16 MiB of zeroed scratch
        finally:
            await p.close()
    finally:
        tracemalloc.stop()
