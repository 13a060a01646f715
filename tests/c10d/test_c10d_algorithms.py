"""The collective algorithms on an in-memory Comm (no sockets): every member is a coroutine."""
import asyncio

import pytest
import torch

from tests.support.memory_comm import data, reference, run_members
from wanlink.collectives import direct, halving, ring
from wanlink.collectives.base import piece_bounds, piece_count
from wanlink.collectives.reduce_ops import reducer_for


@pytest.mark.parametrize("size", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("numel", [0, 1, 7, 1000, 4099])
@pytest.mark.parametrize("algorithm", [direct.allreduce, ring.allreduce])
def test_allreduce_sum(size, numel, algorithm):
    async def member(comm):
        tensor = data(comm.rank, numel)
        await algorithm(comm, tensor, reducer_for("sum", tensor.dtype, "t"))
        return tensor
    expected = reference("sum", [data(rank, numel) for rank in range(size)])
    for result in run_members(size, member):
        assert torch.equal(result, expected)


@pytest.mark.parametrize("op,dtype", [("max", torch.int32), ("min", torch.float64), ("product", torch.int64),
                                      ("band", torch.uint8), ("bxor", torch.int8), ("bor", torch.bool)])
def test_ring_allreduce_ops(op, dtype):
    async def member(comm):
        tensor = data(comm.rank, 777, dtype)
        await ring.allreduce(comm, tensor, reducer_for(op, dtype, "t"))
        return tensor
    expected = reference(op, [data(rank, 777, dtype) for rank in range(4)])
    assert all(torch.equal(result, expected) for result in run_members(4, member))


@pytest.mark.parametrize("op,dtype", [("sum", torch.float32), ("sum", torch.bool), ("product", torch.int64),
                                      ("min", torch.float64), ("max", torch.int32), ("band", torch.uint8),
                                      ("bor", torch.int16), ("bxor", torch.int8)])
def test_reducer_with_out_leaves_the_accumulator_alone(op, dtype):
    reducer = reducer_for(op, dtype, "t")
    acc, incoming = data(0, 99, dtype), data(1, 99, dtype)
    in_place = acc.clone()
    reducer(in_place, incoming)
    separate, aliased = torch.empty_like(acc), incoming.clone()
    reducer(acc, incoming, separate)
    reducer(acc, aliased, aliased)  # out may be the incoming tensor itself
    assert torch.equal(separate, in_place) and torch.equal(aliased, in_place)
    assert torch.equal(acc, data(0, 99, dtype))


def test_ring_allreduce_bytes_per_member():
    """Each member sends 2(n-1)/n of the buffer, not (n-1) times it."""
    numel, size = 4000, 4
    counters = {}

    async def member(comm):
        await ring.allreduce(comm, data(comm.rank, numel), reducer_for("sum", torch.float32, "t"))
        counters[comm.rank] = comm.sent_bytes
    run_members(size, member)
    assert all(sent == 2 * (size - 1) * numel * 4 // size for sent in counters.values())


@pytest.mark.parametrize("size", [2, 3, 4])
@pytest.mark.parametrize("algorithm", [direct.reduce_scatter, ring.reduce_scatter_into])
def test_reduce_scatter(size, algorithm):
    block = 301

    async def member(comm):
        blocks = [data(comm.rank * 10 + k, block) for k in range(size)]
        out = torch.empty(block)
        await algorithm(comm, blocks, out, reducer_for("sum", torch.float32, "t"))
        return out
    for rank, result in enumerate(run_members(size, member)):
        assert torch.equal(result, reference("sum", [data(k * 10 + rank, block) for k in range(size)]))


@pytest.mark.parametrize("size", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("op", ["sum", "max"])
def test_ring_reduce_scatter_into_leaves_blocks_untouched(size, op):
    sizes = [(37 * k) % 101 for k in range(size)]  # uneven, some empty

    async def member(comm):
        blocks = [data(comm.rank * 10 + k, sizes[k]) for k in range(size)]
        originals = [b.clone() for b in blocks]
        out = torch.full((sizes[comm.rank],), -99.0)
        await ring.reduce_scatter_into(comm, blocks, out, reducer_for(op, torch.float32, "t"))
        assert all(torch.equal(a, b) for a, b in zip(blocks, originals)), "input blocks were modified"
        return out
    for rank, result in enumerate(run_members(size, member, piece_bytes=40)):
        assert torch.equal(result, reference(op, [data(k * 10 + rank, sizes[rank]) for k in range(size)]))


@pytest.mark.parametrize("size,root", [(2, 1), (3, 0), (4, 2)])
@pytest.mark.parametrize("algorithm", [direct.reduce, ring.reduce])
def test_reduce(size, root, algorithm):
    async def member(comm):
        tensor = data(comm.rank, 1001)
        await algorithm(comm, tensor, root, reducer_for("sum", torch.float32, "t"))
        return tensor
    results = run_members(size, member)
    assert torch.equal(results[root], reference("sum", [data(rank, 1001) for rank in range(size)]))
    for rank in range(size):
        if rank != root:
            assert torch.equal(results[rank], data(rank, 1001)), "a non-root's tensor was modified"


@pytest.mark.parametrize("size,root", [(2, 0), (3, 2), (5, 1)])
@pytest.mark.parametrize("algorithm", [direct.broadcast, ring.broadcast])
def test_broadcast(size, root, algorithm):
    async def member(comm):
        tensor = data(root, 999) if comm.rank == root else torch.zeros(999)
        await algorithm(comm, tensor, root)
        return tensor
    assert all(torch.equal(result, data(root, 999)) for result in run_members(size, member))


@pytest.mark.parametrize("size", [2, 3, 4])
@pytest.mark.parametrize("use_ring", [False, True])
def test_all_gather_uneven(size, use_ring):
    sizes = [5 * rank + 1 for rank in range(size)]

    async def member(comm):
        mine = data(comm.rank, sizes[comm.rank])
        outputs = [torch.empty(n) for n in sizes]
        if use_ring:
            outputs[comm.rank].copy_(mine)
            await ring.all_gather(comm, outputs)
        else:
            await direct.all_gather(comm, mine, outputs)
        return outputs
    for outputs in run_members(size, member):
        assert all(torch.equal(outputs[k], data(k, sizes[k])) for k in range(size))


def test_rooted_and_all_to_all():
    size = 3

    async def member(comm):
        mine = data(comm.rank, 4)
        gathered = [torch.empty(4) for _ in range(size)] if comm.rank == 1 else None
        await direct.gather(comm, mine, 1, gathered)
        scattered = torch.empty(4)
        sources = [data(100 + k, 4) for k in range(size)] if comm.rank == 2 else None
        await direct.scatter(comm, sources, 2, scattered)
        inputs = [data(comm.rank * 10 + k, k + 1) for k in range(size)]
        outputs = [torch.empty(comm.rank + 1) for _ in range(size)]
        await direct.all_to_all(comm, inputs, outputs)
        await direct.barrier(comm)
        return gathered, scattered, outputs
    results = run_members(size, member)
    assert all(torch.equal(results[1][0][k], data(k, 4)) for k in range(size))
    for rank, (_, scattered, outputs) in enumerate(results):
        assert torch.equal(scattered, data(100 + rank, 4))
        assert all(torch.equal(outputs[k], data(k * 10 + rank, rank + 1)) for k in range(size))


def test_piece_helpers():
    assert piece_bounds(10, 3) == [(0, 4), (4, 7), (7, 10)]
    assert piece_bounds(2, 4) == [(0, 1), (1, 2), (2, 2), (2, 2)]
    assert piece_count(0, 4, 64) == 1
    assert piece_count(1000, 4, 64) == 63
    assert piece_count(10, 4, 1) == 10


def test_chain_broadcast_sends_one_piece_before_the_successor_is_ready():
    """A member that enters late receives only the first piece before it has posted its receives
    (the rest would be staged and copied); the broadcast still completes."""
    numel, sent_early = 999, []

    def root_sends(comm):
        return sum(1 for key in comm.world if key[0] == "sent" and key[1][:2] == (0, 1))

    async def member(comm):
        tensor = data(0, numel) if comm.rank == 0 else torch.zeros(numel)
        if comm.rank == 1:
            for _ in range(50):  # let the root run ahead
                await asyncio.sleep(0)
            sent_early.append(root_sends(comm))
        await ring.broadcast(comm, tensor, 0)
        return tensor
    results = run_members(3, member)
    assert piece_count(numel, 4, 64) > 2 and sent_early == [1]
    assert all(torch.equal(result, data(0, numel)) for result in results)


class RankZeroComm:
    """Member 0 of three for the monitored barrier: member 1 reports, member 2 behaves as ``two``
    says ("fails": its link is lost; "silent": never reports)."""

    rank, size, piece_bytes = 0, 3, 1 << 20

    def __init__(self, two: str):
        self.two = two

    async def send(self, peer, tensor, piece=0):
        pass

    async def recv(self, peer, tensor, piece=0):
        if peer == 2 and self.two == "fails":
            from wanlink.errors import PeerLost
            raise PeerLost("wanlink: the link to rank 2 closed")
        if peer == 2:
            await asyncio.Event().wait()
        tensor.fill_(1)


@pytest.mark.parametrize("wait_all_ranks", [False, True])
def test_monitored_barrier_tells_a_lost_link_from_a_rank_that_did_not_arrive(wait_all_ranks):
    from wanlink.errors import DeadlineExceeded, PeerLost

    with pytest.raises(PeerLost, match=r"link to rank\(s\) \[2\] failed") as lost:
        asyncio.run(direct.monitored_barrier(RankZeroComm("fails"), 30, wait_all_ranks))
    assert "did not reach" not in str(lost.value)
    with pytest.raises(DeadlineExceeded, match=r"timed out after 0.05 s: rank\(s\) \[2\] did not reach the barrier"):
        asyncio.run(direct.monitored_barrier(RankZeroComm("silent"), 0.05, wait_all_ranks))


def random_coo(rank, shape, density, dtype=torch.float32, sparse_dim=None):
    """A coalesced random sparse tensor (integer-valued, so sums are exact in any order)."""
    generator = torch.Generator().manual_seed(1000 + rank)
    sparse_dim = len(shape) if sparse_dim is None else sparse_dim
    dense = torch.randint(-5, 6, shape, generator=generator).to(dtype)
    keep = torch.rand(shape[:sparse_dim], generator=generator) < density
    dense[~keep] = 0
    return dense.to_sparse(sparse_dim)


@pytest.mark.parametrize("size", [1, 2, 3])
@pytest.mark.parametrize("shape,sparse_dim", [((40,), 1), ((12, 9), 2), ((10, 3, 2), 1)])
@pytest.mark.parametrize("density", [0.0, 0.1, 1.0])
def test_sparse_allreduce_sums_every_members_nonzeros(size, shape, sparse_dim, density):
    from wanlink.collectives import sparse

    inputs = [random_coo(rank, shape, density, sparse_dim=sparse_dim) for rank in range(size)]
    results = run_members(size, lambda comm: sparse.allreduce_coo(comm, inputs[comm.rank]))
    expected = sum(tensor.to_dense() for tensor in inputs)
    for result in results:
        assert result.is_coalesced() and result.sparse_dim() == sparse_dim
        assert torch.equal(result.to_dense(), expected)
        assert torch.equal(result.indices(), results[0].indices()) and torch.equal(result.values(), results[0].values())


@pytest.mark.parametrize("size", [2, 3, 4])
@pytest.mark.parametrize("sets", [1, 2, 5])
def test_ring_reduce_scatter_receive_buffers_are_bounded_and_recycled(monkeypatch, size, sets):
    """Whatever the tensor's size, a ring holds at most RECEIVE_BUFFER_BYTES of receive buffers
    (at least one set), reused from piece to piece in piece order, without deadlock."""
    numel, piece_bytes = 4099, 64  # 16 elements a piece: dozens of pieces per segment
    block = -(-numel // size)  # the largest segment (both collectives)
    largest_piece = piece_bounds(block, piece_count(block, 4, piece_bytes))[0][1]
    set_bytes = largest_piece * 4 * min(ring.ROTATING_BUFFERS, size - 1)
    monkeypatch.setattr(ring, "RECEIVE_BUFFER_BYTES", sets * set_bytes)
    allocated = {}

    async def member(comm):
        empty = comm.empty

        def counted(count, dtype):
            allocated[comm.rank] = allocated.get(comm.rank, 0) + count * 4
            return empty(count, dtype)
        comm.empty = counted
        tensor = data(comm.rank, numel)
        await ring.allreduce(comm, tensor, reducer_for("sum", torch.float32, "t"))
        out = torch.empty(block)
        blocks = list(torch.cat([tensor, torch.zeros(size * block - numel)]).chunk(size))
        await ring.reduce_scatter_into(comm, blocks, out, reducer_for("max", torch.float32, "t"))
        return tensor, out
    expected = reference("sum", [data(rank, numel) for rank in range(size)])
    for rank, (tensor, out) in enumerate(run_members(size, member, piece_bytes=piece_bytes)):
        assert torch.equal(tensor, expected)
        assert torch.equal(out, torch.cat([expected, torch.zeros(size * block - numel)]).chunk(size)[rank])
    assert all(nbytes <= 2 * sets * set_bytes for nbytes in allocated.values()), (allocated, set_bytes)  # 2 collectives


@pytest.mark.parametrize("size", [2, 4, 8])
@pytest.mark.parametrize("numel", [0, 1, 7, 1000, 4099])
@pytest.mark.parametrize("op,dtype", [("sum", torch.float32), ("max", torch.int32), ("bxor", torch.int8)])
def test_halving_allreduce_matches_the_reference_and_sends_what_the_ring_sends(size, numel, op, dtype):
    sent = {}

    async def member(comm):
        tensor = data(comm.rank, numel, dtype)
        await halving.allreduce(comm, tensor, reducer_for(op, dtype, "t"))
        sent[comm.rank] = comm.sent_bytes
        return tensor
    expected = reference(op, [data(rank, numel, dtype) for rank in range(size)])
    assert all(torch.equal(result, expected) for result in run_members(size, member))
    if numel % size == 0:
        assert all(count == 2 * (size - 1) * numel * expected.element_size() // size for count in sent.values())


@pytest.mark.parametrize("size", [2, 4, 8])
def test_halving_posts_every_receive_before_it_sends_a_second_message(size):
    """A partner's message that comes before this member is ready for it lands in place, not in staging."""
    events = {}

    async def member(comm):
        log = events.setdefault(comm.rank, [])
        send, recv = comm.send, comm.recv

        async def logged_send(peer, tensor, piece=0):
            log.append("send")
            await send(peer, tensor, piece)

        async def logged_recv(peer, tensor, piece=0):
            log.append("recv")
            await recv(peer, tensor, piece)
        comm.send, comm.recv = logged_send, logged_recv
        tensor = data(comm.rank, 64)
        await halving.allreduce(comm, tensor, reducer_for("sum", tensor.dtype, "t"))
        return tensor
    expected = reference("sum", [data(rank, 64) for rank in range(size)])
    assert all(torch.equal(result, expected) for result in run_members(size, member))
    steps = 2 * (size.bit_length() - 1)
    for log in events.values():
        assert log.count("recv") == steps and "recv" not in log[log.index("send", 1):], log


@pytest.mark.parametrize("size", [2, 4, 8])
def test_a_halving_step_waits_for_its_receive_not_its_send(size):
    """Every send is held unfinished (its bytes delivered) until this member's last receive has
    landed: steps that waited for their own sends would never get there (each partner stuck on its
    first send), as halving's did before."""
    last = halving.GATHER + size.bit_length() - 2  # the last doubling step's piece

    async def member(comm):
        landed = asyncio.Event()
        send, recv = comm.send, comm.recv

        async def held_send(peer, tensor, piece=0):
            await send(peer, tensor, piece)
            await landed.wait()

        async def noting_recv(peer, tensor, piece=0):
            await recv(peer, tensor, piece)
            if piece == last:
                landed.set()
        comm.send, comm.recv = held_send, noting_recv
        tensor = data(comm.rank, 64)
        await halving.allreduce(comm, tensor, reducer_for("sum", tensor.dtype, "t"))
        return tensor
    expected = reference("sum", [data(rank, 64) for rank in range(size)])
    assert all(torch.equal(result, expected) for result in run_members(size, member))


def test_halving_is_for_powers_of_two():
    assert [n for n in range(1, 17) if halving.usable(n)] == [2, 4, 8, 16]
