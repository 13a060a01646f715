"""DistributedDataParallel over wanlink ends with the same parameters as over gloo."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from tests.support.worlds import run_world

STEPS = 6


class TwoHeads(torch.nn.Module):
    """A trunk and two heads; ``head_b`` is used on odd steps only (an unused parameter on even ones)."""

    def __init__(self):
        super().__init__()
        self.trunk = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64))
        self.head_a = torch.nn.Linear(64, 4)
        self.head_b = torch.nn.Linear(64, 4)

    def forward(self, x, use_b: bool):
        hidden = self.trunk(x)
        return self.head_a(hidden) + (self.head_b(hidden) if use_b else 0)


def train(rank: int, group, accumulate: int) -> list[torch.Tensor]:
    """STEPS optimiser steps; every step accumulates ``accumulate`` micro-batches (no_sync on all but the last)."""
    torch.manual_seed(0)
    model = DDP(TwoHeads(), process_group=group, bucket_cap_mb=0.01, find_unused_parameters=True)
    optimiser = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    data = torch.Generator().manual_seed(100 + rank)
    for step in range(STEPS):
        optimiser.zero_grad()
        for micro in range(accumulate):
            x, y = torch.randn(8, 16, generator=data), torch.randn(8, 4, generator=data)
            use_b = step % 2 == 1
            if micro < accumulate - 1:
                with model.no_sync():
                    torch.nn.functional.mse_loss(model(x, use_b), y).backward()
            else:
                torch.nn.functional.mse_loss(model(x, use_b), y).backward()
        optimiser.step()
    return [parameter.detach().clone() for parameter in model.parameters()]


def compare_with_gloo(rank, size):
    gloo = dist.new_group(backend="gloo")
    results = {}
    for accumulate in (1, 3):
        ours = train(rank, None, accumulate)
        reference = train(rank, gloo, accumulate)
        results[accumulate] = max((a - b).abs().max().item() for a, b in zip(ours, reference))
        untouched = TwoHeads()
        assert any(not torch.equal(p, q.detach()) for p, q in zip(ours, untouched.parameters())), "did not train"
    return results


def test_ddp_matches_gloo():
    for rank, differences in enumerate(run_world(2, compare_with_gloo, timeout=180)):
        # two ranks: a + b is commutative, so wanlink and gloo must agree bit for bit
        assert differences == {1: 0.0, 3: 0.0}, (rank, differences)
