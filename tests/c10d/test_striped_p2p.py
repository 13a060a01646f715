"""Cell-striped point-to-point (docs/sites.md) on loopback worlds with ``WANLINK_SITE`` per rank.

Sends of at least ``WANLINK_STRIPE_MIN_BYTES`` from a site of several ranks to another site are
split over the source site's members and relayed by their loop threads; the bytes must arrive
exactly, in order with the other messages on the tag, through isend/irecv, batch_isend_irecv, a
receive from any source and torch.distributed.pipelining; a member that dies mid-transfer fails
the transfer on both ends with an error naming it, and later transfers go over the survivors.
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from tests.support.worlds import run_world

MiB = 1 << 20
ENV = {"WANLINK_STRIPE_MIN_BYTES": str(MiB), "WANLINK_PIECE_BYTES": str(256 * 1024)}
BIG = 3 * MiB + 12345  # bytes: three 1 MiB granules and an odd tail, split over the members

pytestmark = pytest.mark.slow


def payload(seed: int, nbytes: int = BIG) -> torch.Tensor:
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def service():
    from wanlink.c10d import mesh

    return mesh._world_mesh.striping


def target_of(rank: int, sites: list[str]) -> int:
    """Where ``rank`` sends in ``exchange``: the other sites' ranks, picked by its LocalDPRank."""
    remote = [r for r in range(len(sites)) if sites[r] != sites[rank]]
    local = [r for r in range(len(sites)) if sites[r] == sites[rank]].index(rank)
    return remote[local % len(remote)]


def exchange(rank: int, size: int, sites: list[str]) -> dict:
    """Every rank sends BIG bytes to a rank of another site and receives likewise, all at once."""
    received = {source: torch.empty(BIG, dtype=torch.uint8)
                for source in range(size) if target_of(source, sites) == rank}
    works = [dist.isend(payload(rank), target_of(rank, sites), tag=3)]
    works += [dist.irecv(buffer, source, tag=3) for source, buffer in received.items()]
    for work in works:
        work.wait()
    return {source: torch.equal(buffer, payload(source)) for source, buffer in received.items()}


def striped_world(rank: int, size: int, sites: list[str]) -> dict:
    result = {"exact": exchange(rank, size, sites)}
    dist.barrier()
    ours = service()
    result["relayed"] = ours.relayed_bytes
    # float64, odd length, in order with small messages on the same tag, from a rank that is not LocalDPRank 0
    source, destination = sites.index("a") + 1, sites.index("b")
    big = torch.arange(BIG // 8 + 3, dtype=torch.float64)
    if rank == source:
        for tensor in (torch.full((5,), 7.0), big, torch.full((5,), 9.0), big * 2):
            dist.send(tensor, destination, tag=8)
    elif rank == destination:
        got = [torch.empty(5), torch.empty_like(big), torch.empty(5), torch.empty_like(big)]
        for tensor in got:
            dist.recv(tensor, source, tag=8)
        result["ordered"] = [torch.equal(got[0], torch.full((5,), 7.0)), torch.equal(got[1], big),
                             torch.equal(got[2], torch.full((5,), 9.0)), torch.equal(got[3], big * 2)]
    # batch_isend_irecv and a receive from any source
    if rank == source:
        dist.batch_isend_irecv([dist.P2POp(dist.isend, payload(11), destination, tag=4)])[0].wait()
    elif rank == destination:
        landing = torch.empty(BIG, dtype=torch.uint8)
        work = dist.batch_isend_irecv([dist.P2POp(dist.irecv, landing, source, tag=4)])[0]
        work.wait()
        result["batch"] = torch.equal(landing, payload(11))
    if rank == source:
        dist.send(payload(12), destination, tag=6)
    elif rank == destination:
        landing = torch.empty(BIG, dtype=torch.uint8)
        work = dist.irecv(landing, tag=6)
        work.wait()
        result["any"] = (torch.equal(landing, payload(12)), work._source_rank())
    dist.barrier()
    result["turns"] = [(t.started, t.finished) for t in ours.finished]
    result["handed_over"] = ours.handed_over
    result["wan"] = ours.wan.log
    return result


def run(sites: list[str]) -> list[dict]:
    return run_world(len(sites), striped_world, sites, env=ENV, rank_env=[{"WANLINK_SITE": s} for s in sites],
                     timeout=180)


def check_exact(results: list[dict]) -> None:
    """Every rank's send arrived, byte for byte."""
    arrived = {(source, rank): exact
               for rank, result in enumerate(results) for source, exact in result["exact"].items()}
    assert len(arrived) == len(results) and all(arrived.values()), arrived


def check_turns(leader: dict, members: list[dict]) -> None:
    """The leader granted turns and passed each on when its last piece was dealt; on every member's WAN
    link the transfers' routes went one after another (each route's pieces queued only once the one
    ahead had written its last)."""
    assert leader["turns"], "the cell leader granted no turns: nothing was striped"
    assert leader["handed_over"] == len(leader["turns"]), leader
    for member in members:
        routes = sorted(member["wan"], key=lambda route: route[2])
        assert routes, "a member sent no striped route over its WAN link"
        for (*_ahead, end), (*_behind, start, _end) in zip(routes, routes[1:]):
            assert start >= end, f"two striped transfers shared a member's WAN link at once: {routes}"


def test_two_sites_of_two_stripe_exactly_and_relay_without_user_calls():
    results = run(["a", "a", "b", "b"])
    check_exact(results)
    assert all(result["relayed"] > 0 for result in results), [r["relayed"] for r in results]
    assert results[2]["ordered"] == [True] * 4
    assert results[2]["batch"] is True
    assert results[2]["any"] == (True, 1)
    check_turns(results[0], results[:2])  # rank 0 leads site a: its two pipelines took turns
    check_turns(results[2], results[2:])


def test_uneven_sites_stripe_over_the_larger_site_only():
    results = run(["a", "a", "b"])
    check_exact(results)
    assert results[1]["relayed"] > 0  # rank 1 carried shares of rank 0's sends to rank 2 over its own link
    assert results[2]["relayed"] == 0  # a site of one sends alone
    assert results[2]["ordered"] == [True] * 4 and results[2]["batch"] is True and results[2]["any"] == (True, 1)


def pipeline(rank: int, size: int) -> list | None:
    """torch.distributed.pipelining's GPipe over a site boundary: stage 0 at rank 0 (site a), stage 1
    at rank 2 (site b); activations and their gradients (2 MiB each) are striped."""
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    group = dist.new_group([0, 2])
    if rank not in (0, 2):
        dist.barrier()
        return [None, service().relayed_bytes]
    torch.manual_seed(0)
    layers = [torch.nn.Linear(1024, 1024) for _ in range(2)]
    reference = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(2)])
    for layer, twin in zip(layers, reference):
        twin.load_state_dict(layer.state_dict())
    inputs = torch.randn(2048, 1024, generator=torch.Generator().manual_seed(1))
    targets = torch.randn(2048, 1024, generator=torch.Generator().manual_seed(2))
    stage_index = 0 if rank == 0 else 1
    stage = PipelineStage(layers[stage_index], stage_index, 2, torch.device("cpu"), group=group)
    schedule = ScheduleGPipe(stage, n_microbatches=4, loss_fn=torch.nn.functional.mse_loss)
    if rank == 0:
        schedule.step(inputs)
    else:
        schedule.step(target=targets, losses=[])
    torch.nn.functional.mse_loss(reference(inputs), targets).backward()  # the same, in one process
    dist.barrier()
    grad, expected = layers[stage_index].weight.grad, reference[stage_index].weight.grad
    return [float((grad - expected).abs().max() / expected.abs().max()), service().relayed_bytes]


def test_pipelining_schedules_run_unchanged_over_striped_sends():
    results = run_world(4, pipeline, env=ENV, rank_env=[{"WANLINK_SITE": s} for s in "aabb"], timeout=180)
    assert results[0][0] < 1e-4 and results[2][0] < 1e-4, results  # the gradients of the unsplit model
    assert results[0][1] + results[2][1] == 0 and results[1][1] > 0 and results[3][1] > 0, results  # site-mates relayed


def dead_relay(rank: int, size: int, when: str) -> object:
    """Rank 1 dies when asked to relay its share of rank 0's send to rank 2 (``when="asked"``), or
    holding the first piece it was dealt, not forwarded (``"holding"``); rank 0 then sends again and
    ranks 0 and 2 report both sends."""
    from wanlink.c10d.tags import relay_tag
    from wanlink.errors import PeerLost
    from wanlink.sched.stripes import HEADER_BYTES, read_piece_header

    store = dist.distributed_c10d._get_default_store()
    ours = service()

    async def take_and_die(peer, origin, serial, index, destination, next_hop):
        link = await ours.mesh.link(peer)
        tag = relay_tag(ours.slot, origin, serial, index)
        header = bytearray(HEADER_BYTES)
        await link.recv_into(header, tag=tag)
        await link.recv_into(bytearray(read_piece_header(header, BIG, "test")[1]), tag=tag)
        os._exit(19)

    if rank == 1:
        ours._relay = (lambda *args: os._exit(19)) if when == "asked" else take_and_die
    dist.barrier()
    if rank in (1, 3):
        store.wait(["finished"])
        return "idle"
    outcome = {}
    try:
        (dist.send if rank == 0 else dist.recv)(payload(5) if rank == 0 else torch.empty(BIG, dtype=torch.uint8),
                                                2 - rank, tag=1)
        outcome["first"] = "no error"
    except PeerLost as error:
        outcome["first"] = str(error)
    landing = payload(6) if rank == 0 else torch.empty(BIG, dtype=torch.uint8)
    (dist.send if rank == 0 else dist.recv)(landing, 2 - rank, tag=2)
    outcome["second"] = torch.equal(landing, payload(6))
    if rank == 2:
        store.set("finished", "1")
    return outcome


@pytest.mark.parametrize("when", ["asked", "holding"])
def test_a_relay_dying_mid_transfer_fails_it_on_both_ends_naming_it_and_later_sends_use_the_survivors(when):
    """Rank 1 dies asked to carry its share, or holding a piece of it; the cell's leader ends the broken
    transfer's turn itself, so the next send is granted (and goes over the survivors)."""
    outcomes = run_world(4, dead_relay, when, env=ENV, rank_env=[{"WANLINK_SITE": s} for s in "aabb"],
                         timeout=180, allow_errors=True)
    assert "exit code 19" in outcomes[1][1], outcomes[1]
    for rank in (0, 2):
        status, outcome = outcomes[rank]
        assert status == "ok", outcome
        assert "relay rank 1 (site 'a', LocalDPRank 1) was lost" in outcome["first"], outcome["first"]
        assert "striped" in outcome["first"]
        assert outcome["second"] is True
