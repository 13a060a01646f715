"""all_reduce of sparse COO tensors and DDP with sparse gradients: wanlink against gloo in one world."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from tests.support.worlds import run_world

SHAPES = [((50,), 1), ((8, 7), 2), ((9, 4, 3), 1), ((0, 3), 2)]  # (shape, sparse dims); hybrid; empty
DTYPES = [torch.float32, torch.float64, torch.int64, torch.int32]  # gloo has no half-precision sparse sum
DENSITIES = [0.0, 0.05, 0.5, 1.0]


def random_coo(seed, shape, sparse_dim, density, dtype, coalesced=True):
    generator = torch.Generator().manual_seed(seed)
    dense = (torch.randn(shape, generator=generator) * 4).to(dtype)
    keep = torch.rand(shape[:sparse_dim], generator=generator) < density
    dense[~keep] = 0
    tensor = dense.to_sparse(sparse_dim)
    if coalesced:
        return tensor
    # the same values as an uncoalesced tensor: every nonzero split into two halves
    indices, values = tensor.indices(), tensor.values()
    return torch.sparse_coo_tensor(torch.cat([indices, indices], 1), torch.cat([values - values // 2, values // 2]),
                                   shape)


def compare_with_gloo(rank, size):
    gloo = dist.new_group(backend="gloo")
    checked = 0
    for shape, sparse_dim in SHAPES:
        for dtype in DTYPES:
            for density in DENSITIES:
                seed = 100 * rank + 7 * checked
                ours = random_coo(seed, shape, sparse_dim, density, dtype, coalesced=checked % 2 == 0)
                reference = random_coo(seed, shape, sparse_dim, density, dtype).clone()
                dist.all_reduce(ours)
                dist.all_reduce(reference, group=gloo)
                what = (shape, sparse_dim, dtype, density)
                assert ours.is_coalesced() and ours.sparse_dim() == sparse_dim, what
                reference = reference.coalesce()
                assert torch.equal(ours.indices(), reference.indices()), what
                torch.testing.assert_close(ours.values(), reference.values(), msg=str(what))
                checked += 1
    with pytest.raises(Exception, match="SUM"):
        dist.all_reduce(random_coo(rank, (5,), 1, 0.5, torch.float32), op=dist.ReduceOp.MAX)
    return checked


@pytest.mark.parametrize("size", [2, 3])
def test_sparse_all_reduce_matches_gloo(size):
    assert run_world(size, compare_with_gloo, timeout=240) == [len(SHAPES) * len(DTYPES) * len(DENSITIES)] * size


def bytes_of_one_sparse_all_reduce(rank, size):
    import wanlink

    tensor = random_coo(rank, (100_000, 16), 1, 0.01, torch.float32)  # ~1000 rows of 16 floats
    dist.all_reduce(tensor)  # warm-up: links and buffers

    def sent():
        return sum(link["bytes_sent"] for link in wanlink.stats().values())

    before = sent()
    dist.all_reduce(random_coo(rank, (100_000, 16), 1, 0.01, torch.float32))
    dist.barrier()  # 1 byte per peer
    nnz = random_coo(rank, (100_000, 16), 1, 0.01, torch.float32)._nnz()
    return sent() - before, nnz * (8 + 16 * 4) + 8 + 1


def test_sparse_all_reduce_moves_about_what_the_nonzeros_need():
    for moved, needed in run_world(2, bytes_of_one_sparse_all_reduce):
        # payload (indices + values + the 8-byte count) plus framing: nowhere near the dense 6.4 MB
        assert needed <= moved <= needed * 1.05 + 512, (moved, needed)


class Bag(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embedding = torch.nn.Embedding(1000, 16, sparse=True)
        self.bag = torch.nn.EmbeddingBag(500, 16, mode="sum", sparse=True)
        self.head = torch.nn.Linear(16, 1)

    def forward(self, ids, bag_ids):
        return self.head(self.embedding(ids).sum(1) + self.bag(bag_ids))


def train_sparse(rank, group):
    torch.manual_seed(0)
    model = DDP(Bag(), process_group=group)
    optimiser = torch.optim.SGD(model.parameters(), lr=0.05)
    data = torch.Generator().manual_seed(10 + rank)
    for _ in range(5):
        optimiser.zero_grad()
        ids, bag_ids = torch.randint(0, 1000, (8, 5), generator=data), torch.randint(0, 500, (8, 3), generator=data)
        torch.nn.functional.mse_loss(model(ids, bag_ids), torch.randn(8, 1, generator=data)).backward()
        optimiser.step()
    return [parameter.detach().clone() for parameter in model.parameters()]


def ddp_sparse(rank, size):
    return train_sparse(rank, None), train_sparse(rank, dist.new_group(backend="gloo"))


def test_ddp_with_sparse_embeddings_trains_like_gloo():
    torch.manual_seed(0)
    initial = [parameter.detach() for parameter in Bag().parameters()]
    for ours, gloo in run_world(2, ddp_sparse, timeout=180):
        for a, b, start in zip(ours, gloo, initial):
            torch.testing.assert_close(a, b)
            assert not torch.equal(a, start)  # it trained
