"""Which algorithm AlgorithmChoice runs, seen from the bytes each member sends (in-memory Comm)."""
import pytest
import torch

from tests.support.memory_comm import data, reference, run_members
from wanlink.collectives.reduce_ops import reducer_for
from wanlink.collectives.choice import AlgorithmChoice

PIECE_BYTES = 64  # run_members' pipelining unit: 16 float32 elements a piece


@pytest.mark.parametrize("numel,pieces", [(16, 1), (64, 4)])
def test_broadcast_chains_only_a_buffer_that_pipelines(numel, pieces):
    size, root = 4, 1
    choice = AlgorithmChoice(direct_max_bytes=0)  # a flat group; nothing counts as small
    sent = {}

    async def member(comm):
        tensor = data(root, numel) if comm.rank == root else torch.zeros(numel)
        await choice.broadcast(comm, tensor, root)
        sent[comm.rank] = comm.sent_bytes
        return tensor

    assert all(torch.equal(result, data(root, numel)) for result in run_members(size, member, PIECE_BYTES))
    nbytes = numel * 4
    if pieces == 1:  # direct: the root sends every member its copy, nobody forwards
        assert sent[root] == (size - 1) * nbytes and sum(sent.values()) == sent[root]
    else:  # the chain: every member but the last forwards the buffer once (plus one-byte READY words)
        assert sent[root] == nbytes and sum(sent.values()) == (size - 1) * nbytes + (size - 1)


@pytest.mark.parametrize("size,numel,rounds", [(4, 64, 4), (4, 256, 6), (3, 48, 4)])
def test_all_reduce_halves_where_the_ring_would_not_pipeline(size, numel, rounds):
    """Messages a member sends: halving 2 log2(n) where segments are one piece (4 x 16 floats);
    the ring 2(n-1) per piece otherwise (segments of 4 pieces: more, and a group of 3 cannot halve)."""
    messages = _all_reduce_messages(size, numel, "sum")
    pieces = -(-numel * 4 // size // PIECE_BYTES)
    assert set(messages.values()) == {rounds if pieces == 1 else rounds * pieces}


@pytest.mark.parametrize("op", ["sum", "max", "product"])
@pytest.mark.parametrize("numel,sent", [(16, 1), (64, 4)])
def test_a_two_member_all_reduce_goes_direct_where_the_buffer_is_one_piece(numel, sent, op):
    """16 floats (one piece): one message each way, the whole buffer (the ring's bytes: half of it
    twice); 64 floats (4 pieces, segments of 2): the ring's 2 messages per piece. Both members end
    with the same result (rank 1 folds rank 0's copy and its own straight into its tensor)."""
    assert set(_all_reduce_messages(2, numel, op).values()) == {sent}


def _all_reduce_messages(size: int, numel: int, op: str) -> dict[int, int]:
    """Runs an all_reduce of ``numel`` floats on ``size`` members (nothing counts as small), checks
    every member's result against the reference; returns the messages each member sent."""
    choice = AlgorithmChoice(direct_max_bytes=0)
    messages = {}

    async def member(comm):
        tensor = data(comm.rank, numel)
        send = comm.send

        async def counted(*args):
            messages[comm.rank] = messages.get(comm.rank, 0) + 1
            await send(*args)
        comm.send = counted
        await choice.allreduce(comm, tensor, reducer_for(op, tensor.dtype, "t"), op)
        return tensor

    expected = reference(op, [data(rank, numel) for rank in range(size)])
    assert all(torch.equal(result, expected) for result in run_members(size, member, PIECE_BYTES))
    return messages


@pytest.mark.parametrize("op", ["all_gather", "reduce_scatter"])
@pytest.mark.parametrize("size,block,direct_expected", [(4, 16, True), (4, 64, False), (2, 16, True)])
def test_all_gather_and_reduce_scatter_go_direct_where_the_ring_would_not_pipeline(
        monkeypatch, op, size, block, direct_expected):
    """A member's block of one piece (16 floats): one direct round; of 4 pieces: the pipelined ring."""
    from wanlink.collectives import direct
    choice, went_direct, real = AlgorithmChoice(direct_max_bytes=0), [], getattr(direct, op)

    async def spy(comm, *args):
        went_direct.append(comm.rank)
        await real(comm, *args)
    monkeypatch.setattr(direct, op, spy)

    async def member(comm):
        if op == "all_gather":
            targets = [torch.zeros(block) for _ in range(size)]
            await choice.all_gather(comm, data(comm.rank, block), targets)
            return torch.cat(targets)
        result = torch.zeros(block)
        blocks = list(data(comm.rank, block * size).split(block))
        await choice.reduce_scatter(comm, blocks, result, reducer_for("sum", result.dtype, "t"), "sum")
        return result

    results = run_members(size, member, PIECE_BYTES)
    if op == "all_gather":
        expected = [torch.cat([data(rank, block) for rank in range(size)])] * size
    else:
        total = reference("sum", [data(rank, block * size) for rank in range(size)])
        expected = list(total.split(block))
    assert all(torch.equal(result, want) for result, want in zip(results, expected))
    assert sorted(went_direct) == (list(range(size)) if direct_expected else [])
