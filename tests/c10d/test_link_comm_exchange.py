"""LinkComm.exchange: several sends and receives from one task (no task per message), with
gather_all's outcome: every message arrives, the first failure ends it at once, a receive it gave
up is handed to the next receive on its tag, and a timeout names the peers it still waits for."""
import asyncio

import pytest
import pytest_asyncio
import torch

from wanlink.c10d.link_comm import LinkComm
from wanlink.collectives.base import Tasks
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


async def test_tasks_start_a_linkcomms_messages_at_once_without_a_task_each(peers):
    """``base.Tasks.send`` / ``recv`` on a LinkComm (the ring's and the chain's messages): the send is
    queued and the receive posted before the algorithm's first await, no task is made for either,
    waiting_for names the peer still owing, and both complete."""
    comm = comm_of(peers)
    mine, incoming = torch.arange(8, dtype=torch.uint8), torch.zeros(8, dtype=torch.uint8)
    started = []

    async def body(tasks: Tasks) -> None:
        tasks_before = len(asyncio.all_tasks())
        started.append(tasks.send(comm, 1, mine, 3))
        started.append(tasks.recv(comm, 1, incoming, 3))
        started.append(len(asyncio.all_tasks()) - tasks_before)  # counted before any await
        assert comm.waiting_for() == [1]
        got = bytearray(8)
        await peers[0].accepted.recv_into(got, tag=TAG | 3)
        assert bytes(got) == mine.numpy().tobytes()
        await peers[0].accepted.send(b"\x05" * 8, tag=TAG | 3)

    await asyncio.wait_for(Tasks().run(body), 10)
    assert started[2] == 0 and not any(isinstance(future, asyncio.Task) for future in started[:2])
    assert torch.equal(incoming, torch.full((8,), 5, dtype=torch.uint8)) and comm.waiting_for() == []


async def test_tasks_give_a_receive_posted_without_a_task_back_when_the_algorithm_fails(peers):
    comm = comm_of(peers)

    async def body(tasks: Tasks) -> None:
        tasks.recv(comm, 1, torch.zeros(3, dtype=torch.uint8), 0)
        raise KeyError("the algorithm failed")

    with pytest.raises(KeyError, match="the algorithm failed"):
        await Tasks().run(body)
    await peers[0].accepted.send(b"abc", tag=TAG)
    out = bytearray(3)
    await asyncio.wait_for(peers[0].client.recv_into(out, tag=TAG), 10)
    assert out == b"abc"  # not swallowed by the abandoned receive
