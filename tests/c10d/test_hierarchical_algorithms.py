"""Site-aware collectives on the in-memory Comm: results equal the flat reference for even,
uneven and interleaved site layouts, bit-identical on every rank, and every member's WAN link
carries its share."""
import pytest
import torch

from tests.support.memory_comm import data, reference, run_members
from wanlink.collectives import hierarchical
from wanlink.collectives.reduce_ops import reducer_for
from wanlink.errors import ConfigError
from wanlink.sched.sites import SiteMap

LAYOUTS = {
    "2x2": ["a", "a", "b", "b"],
    "2+1": ["a", "a", "b"],
    "3+1": ["a", "a", "a", "b"],
    "interleaved": ["a", "b", "a", "b"],
    "3 sites": ["a", "b", "c", "a", "b"],
    "one site": ["a", "a", "a"],
}


class WanTally:
    """A Comm wrapper counting the bytes each member sends to and receives from members of other sites."""

    def __init__(self, comm, sites: SiteMap):
        self.comm, self.sites = comm, sites
        self.rank, self.size, self.piece_bytes = comm.rank, comm.size, comm.piece_bytes
        self.wan_bytes = self.wan_received = 0
        self.wan_messages, self.wan_peers = 0, set()

    def _remote(self, peer):
        return self.sites.site(peer) != self.sites.site(self.rank)

    async def send(self, peer, tensor, piece=0):
        if self._remote(peer):
            self.wan_bytes += tensor.numel() * tensor.element_size()
            self.wan_messages += 1
            self.wan_peers.add(peer)
        await self.comm.send(peer, tensor, piece)

    async def recv(self, peer, tensor, piece=0):
        if self._remote(peer):
            self.wan_received += tensor.numel() * tensor.element_size()
        await self.comm.recv(peer, tensor, piece)

    async def compute(self, fn, *args):
        await self.comm.compute(fn, *args)

    def empty(self, numel, dtype):
        return self.comm.empty(numel, dtype)


def run_sites(layout, member, piece_bytes=64):
    sites = SiteMap(layout)
    return run_members(len(layout), lambda comm: member(WanTally(comm, sites), sites), piece_bytes)


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("numel", [0, 1, 7, 1000, 4099])
def test_allreduce_sum_matches_the_flat_reduction(layout, numel):
    async def member(comm, sites):
        tensor = data(comm.rank, numel)
        await hierarchical.allreduce(comm, sites, tensor, reducer_for("sum", tensor.dtype, "t"))
        return tensor
    expected = reference("sum", [data(rank, numel) for rank in range(len(LAYOUTS[layout]))])
    assert all(torch.equal(result, expected) for result in run_sites(LAYOUTS[layout], member))


@pytest.mark.parametrize("op,dtype", [("max", torch.int32), ("min", torch.float64), ("product", torch.int64),
                                      ("band", torch.uint8), ("bxor", torch.int8), ("bor", torch.bool),
                                      ("sum", torch.float16), ("sum", torch.bfloat16)])
@pytest.mark.parametrize("layout", ["2x2", "2+1", "3 sites"])
def test_allreduce_ops_and_dtypes(op, dtype, layout):
    async def member(comm, sites):
        tensor = data(comm.rank, 777, dtype)
        await hierarchical.allreduce(comm, sites, tensor, reducer_for(op, dtype, "t"))
        return tensor
    size = len(LAYOUTS[layout])
    results = run_sites(LAYOUTS[layout], member)
    if dtype in (torch.float16, torch.bfloat16):  # the sum's order differs from the flat fold's
        expected = reference(op, [data(rank, 777, torch.float64) for rank in range(size)]).to(dtype)
        assert all(torch.allclose(result.double(), expected.double(), rtol=1e-2) for result in results)
    else:
        expected = reference(op, [data(rank, 777, dtype) for rank in range(size)])
        assert all(torch.equal(result, expected) for result in results)


@pytest.mark.parametrize("layout", ["2x2", "3+1", "3 sites"])
def test_allreduce_of_arbitrary_floats_is_bit_identical_on_every_rank(layout):
    async def member(comm, sites):
        tensor = torch.randn(5000, generator=torch.Generator().manual_seed(comm.rank))
        await hierarchical.allreduce(comm, sites, tensor, reducer_for("sum", tensor.dtype, "t"))
        return tensor
    results = run_sites(LAYOUTS[layout], member)
    assert all(torch.equal(result, results[0]) for result in results)


def test_allreduce_puts_every_members_wan_link_to_work():
    numel = 4096

    async def member(comm, sites):
        await hierarchical.allreduce(comm, sites, data(comm.rank, numel), reducer_for("sum", torch.float32, "t"))
        return comm.wan_bytes
    assert run_sites(LAYOUTS["2x2"], member) == [numel // 2 * 4] * 4
    # 2 + 1: the lone member exchanges everything, each of the pair half of it
    assert run_sites(LAYOUTS["2+1"], member) == [numel // 2 * 4, numel // 2 * 4, numel * 4]


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("even", [True, False])
def test_all_gather(layout, even):
    size = len(LAYOUTS[layout])
    sizes = [300] * size if even else [5 * rank + 1 for rank in range(size)]

    async def member(comm, sites):
        outputs = [torch.full((n,), -1.0) for n in sizes]
        outputs[comm.rank].copy_(data(comm.rank, sizes[comm.rank]))
        await hierarchical.all_gather(comm, sites, outputs)
        return outputs
    for outputs in run_sites(LAYOUTS[layout], member):
        assert all(torch.equal(outputs[k], data(k, sizes[k])) for k in range(size))


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("numel", [1, 3, 999])
def test_broadcast_from_every_root(layout, numel):
    size = len(LAYOUTS[layout])
    for root in range(size):
        async def member(comm, sites, root=root):
            tensor = data(root, numel) if comm.rank == root else torch.zeros(numel)
            await hierarchical.broadcast(comm, sites, tensor, root)
            return tensor
        assert all(torch.equal(result, data(root, numel)) for result in run_sites(LAYOUTS[layout], member))


def test_broadcast_and_all_gather_split_the_wan_bytes_over_the_members():
    numel = 4000

    async def broadcast(comm, sites):
        tensor = data(0, numel) if comm.rank == 0 else torch.zeros(numel)
        await hierarchical.broadcast(comm, sites, tensor, 0)
        return comm.wan_bytes, comm.wan_received
    half = numel // 2 * 4
    assert run_sites(LAYOUTS["2x2"], broadcast) == [(half, 0), (half, 0), (0, half), (0, half)]

    async def all_gather(comm, sites):
        outputs = [torch.empty(numel) for _ in range(4)]
        outputs[comm.rank].copy_(data(comm.rank, numel))
        await hierarchical.all_gather(comm, sites, outputs)
        return comm.wan_bytes, comm.wan_received
    # its own block out once per other site; half of each of the other site's two blocks in
    assert run_sites(LAYOUTS["2x2"], all_gather) == [(numel * 4, numel * 4)] * 4


@pytest.mark.parametrize("layout, partners", [("2x2", {0: {2}, 1: {3}, 2: {0}, 3: {1}}),
                                               ("interleaved", {0: {1}, 1: {0}, 2: {3}, 3: {2}})])
def test_all_gather_of_equal_sites_pairs_each_member_with_one_partner_across(layout, partners):
    """Equal cells: a block crosses whole to the holder's partner (same LocalDPRank), which passes it on:
    the same WAN bytes per member as one piece per remote member, half the WAN links and messages."""
    async def all_gather(comm, sites):
        outputs = [torch.empty(1000) for _ in range(4)]
        outputs[comm.rank].copy_(data(comm.rank, 1000))
        await hierarchical.all_gather(comm, sites, outputs)
        return comm.wan_peers, comm.wan_messages, comm.wan_bytes
    results = run_sites(LAYOUTS[layout], all_gather)
    assert {rank: peers for rank, (peers, _m, _b) in enumerate(results)} == partners
    assert [(messages, nbytes) for _p, messages, nbytes in results] == [(1, 4000)] * 4


def test_a_site_map_of_another_size_is_refused():
    async def member(comm, sites):
        with pytest.raises(ConfigError, match="site map of 3 ranks for a group of 2"):
            await hierarchical.allreduce(comm, SiteMap(["a", "a", "b"]), torch.zeros(4),
                                         reducer_for("sum", torch.float32, "t"))
    run_members(2, lambda comm: member(comm, None))


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("op", ["sum", "max"])
@pytest.mark.parametrize("block", [0, 1, 301])
def test_reduce_scatter_leaves_blocks_alone(layout, op, block):
    size = len(LAYOUTS[layout])

    async def member(comm, sites):
        blocks = [data(comm.rank * 10 + k, block) for k in range(size)]
        originals = [b.clone() for b in blocks]
        out = torch.full((block,), -99.0)
        await hierarchical.reduce_scatter(comm, sites, blocks, out, reducer_for(op, torch.float32, "t"))
        assert all(torch.equal(a, b) for a, b in zip(blocks, originals)), "input blocks were modified"
        return out
    for rank, result in enumerate(run_sites(LAYOUTS[layout], member)):
        assert torch.equal(result, reference(op, [data(k * 10 + rank, block) for k in range(size)]))


def test_reduce_scatter_spreads_the_wan_bytes():
    block = 1000

    async def member(comm, sites):
        blocks = [data(comm.rank * 10 + k, block) for k in range(4)]
        await hierarchical.reduce_scatter(comm, sites, blocks, torch.empty(block),
                                          reducer_for("sum", torch.float32, "t"))
        return comm.wan_bytes, comm.wan_received
    # each member's site partial of one remote block out, the other site's partial of its own block in
    assert run_sites(LAYOUTS["2x2"], member) == [(block * 4, block * 4)] * 4


@pytest.mark.parametrize("layout, expected", [
    (["a", "a", "b", "b"], True), (["a", "a", "b"], True), (["a", "b", "c", "a", "b", "c"], True),
    (["a", "a", "a"], False),  # one site: nothing changes
    (["a", "b"], False),  # a swap is what the ring does for two ranks
    (["a", "b", "c", "d"], False),  # every host its own site: the ring carries less per link
])
def test_site_aware_algorithms_are_chosen_only_where_they_pay_off(layout, expected):
    assert hierarchical.pays_off(SiteMap(layout)) is expected
