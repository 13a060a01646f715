"""LinkComm.exchange: several sends and receives from one task (no task per message), with
gather_all's outcome: every message arrives, the first failure ends it at once, a receive it gave
up is handed to the next receive on its tag, and a timeout names the peers it still waits for."""
import asyncio

import pytest
import pytest_asyncio
import torch

from wanlink.c10d.link_comm import LinkComm
from wanlink.errors import PeerLost
from tests.support.links import open_pair

pytestmark = pytest.mark.asyncio
TAG = 7 << 16


class TwoPeers:
    """Rank 0's view of a group of three: a link to rank 1 and one to rank 2 (``pairs[k - 1]``)."""

    def __init__(self, pairs):
        self.pairs = pairs

    def cached(self, mesh_rank: int):
        return self.pairs[mesh_rank - 1].client

    def lost(self, _mesh_rank: int):
        return None


@pytest_asyncio.fixture
async def peers():
    pairs = [await open_pair(1), await open_pair(1)]
    yield pairs
    for pair in pairs:
        await pair.close()


def comm_of(pairs) -> LinkComm:
    return LinkComm(TwoPeers(pairs), [0, 1, 2], 0, 1 << 20, TAG)


async def test_every_message_arrives_and_waiting_for_names_the_peers_still_owing(peers):
    comm = comm_of(peers)
    mine = torch.arange(1000, dtype=torch.float32)
    incoming = {peer: torch.zeros(1000, dtype=torch.float32) for peer in (1, 2)}
    exchange = asyncio.ensure_future(comm.exchange([(1, mine, 0), (2, mine, 0)],
                                                   [(1, incoming[1], 0), (2, incoming[2], 0)]))
    got = {peer: bytearray(4000) for peer in (1, 2)}
    for peer in (1, 2):
        await peers[peer - 1].accepted.recv_into(got[peer], tag=TAG)
    assert all(bytes(got[peer]) == mine.numpy().tobytes() for peer in (1, 2))
    assert comm.waiting_for() == [1, 2]  # both receives are still open
    await peers[0].accepted.send((torch.ones(1000) * 1).numpy(), tag=TAG)
    for _ in range(100):
        if comm.waiting_for() == [2]:
            break
        await asyncio.sleep(0.01)
    assert comm.waiting_for() == [2]
    assert not exchange.done()
    await peers[1].accepted.send((torch.ones(1000) * 2).numpy(), tag=TAG)
    await asyncio.wait_for(exchange, 10)
    assert comm.waiting_for() == []
    assert torch.equal(incoming[1], torch.ones(1000)) and torch.equal(incoming[2], torch.ones(1000) * 2)


async def test_a_failed_link_ends_it_at_once_and_the_other_receive_goes_to_the_next_one(peers):
    comm = comm_of(peers)
    incoming = {peer: torch.zeros(4, dtype=torch.uint8) for peer in (1, 2)}
    exchange = asyncio.ensure_future(comm.exchange([], [(1, incoming[1], 0), (2, incoming[2], 0)]))
    await asyncio.sleep(0.05)
    assert not exchange.done()
    await peers[1].accepted.close()  # rank 2 leaves; rank 1 is alive and silent
    with pytest.raises(PeerLost):
        await asyncio.wait_for(exchange, 10)  # (awaiting rank 1's receive first would hang here)
    assert comm.waiting_for() == []
    await peers[0].accepted.send(b"late", tag=TAG)
    out = bytearray(4)
    await asyncio.wait_for(peers[0].client.recv_into(out, tag=TAG), 10)
    assert out == b"late"  # the given-up receive did not swallow it


async def test_a_cancelled_exchange_gives_its_receives_back(peers):
    comm = comm_of(peers)
    exchange = asyncio.ensure_future(comm.exchange([], [(1, torch.zeros(3, dtype=torch.uint8), 0)]))
    await asyncio.sleep(0.05)
    exchange.cancel()
    with pytest.raises(asyncio.CancelledError):
        await exchange
    await peers[0].accepted.send(b"abc", tag=TAG)
    out = bytearray(3)
    await asyncio.wait_for(peers[0].client.recv_into(out, tag=TAG), 10)
    assert out == b"abc"
