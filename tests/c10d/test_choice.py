"""Which algorithm AlgorithmChoice runs, seen from the bytes each member sends (in-memory Comm)."""
import pytest
import torch

from tests.support.memory_comm import data, run_members
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
