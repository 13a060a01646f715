"""DistributedDataParallel over wanlink ends with the same parameters as over gloo, and as one
process that averages the ranks' gradients itself (so a broken all-reduce in both backends, or no
training at all, fails too)."""
from __future__ import annotations

import contextlib

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


def batches(rank: int):
    """Rank ``rank``'s endless stream of (x, y) micro-batches."""
    data = torch.Generator().manual_seed(100 + rank)
    while True:
        yield torch.randn(8, 16, generator=data), torch.randn(8, 4, generator=data)


def initial_model() -> TwoHeads:
    torch.manual_seed(0)
    return TwoHeads()


def make_optimiser(parameters):
    return torch.optim.SGD(parameters, lr=0.1, momentum=0.9)


def train(rank: int, group, accumulate: int) -> list[torch.Tensor]:
    """STEPS optimiser steps; every step accumulates ``accumulate`` micro-batches (no_sync on all but the last)."""
    model = DDP(initial_model(), process_group=group, bucket_cap_mb=0.01, find_unused_parameters=True)
    optimiser = make_optimiser(model.parameters())
    data = batches(rank)
    for step in range(STEPS):
        optimiser.zero_grad()
        for micro in range(accumulate):
            x, y = next(data)
            use_b = step % 2 == 1
            with model.no_sync() if micro < accumulate - 1 else contextlib.nullcontext():
                torch.nn.functional.mse_loss(model(x, use_b), y).backward()
        optimiser.step()
    return [parameter.detach().clone() for parameter in model.parameters()]


def train_in_one_process(size: int, accumulate: int) -> list[torch.Tensor]:
    """What DDP over ``size`` ranks must compute: every rank's gradients, averaged, then one step."""
    model = initial_model()
    optimiser = make_optimiser(model.parameters())
    data = [batches(rank) for rank in range(size)]
    for step in range(STEPS):
        optimiser.zero_grad()
        for _ in range(accumulate):
            for stream in data:
                x, y = next(stream)
                torch.nn.functional.mse_loss(model(x, step % 2 == 1), y).backward()
        for parameter in model.parameters():
            if parameter.grad is not None:
                parameter.grad /= size
        optimiser.step()
    return [parameter.detach().clone() for parameter in model.parameters()]


def wanlink_and_gloo(rank, size):
    gloo = dist.new_group(backend="gloo")
    return {accumulate: (train(rank, None, accumulate), train(rank, gloo, accumulate)) for accumulate in (1, 3)}


def test_ddp_matches_gloo_and_a_single_process():
    initial = list(initial_model().parameters())
    for rank, runs in enumerate(run_world(2, wanlink_and_gloo, timeout=180)):
        for accumulate, (ours, gloo) in runs.items():
            # two ranks: a + b is commutative, so wanlink and gloo must agree bit for bit
            assert all(torch.equal(a, b) for a, b in zip(ours, gloo)), (rank, accumulate)
            expected = train_in_one_process(2, accumulate)
            assert all(not torch.equal(p, q.detach()) for p, q in zip(expected, initial)), "did not train"
            for index, (a, b) in enumerate(zip(ours, expected)):
                assert torch.allclose(a, b, rtol=1e-4, atol=1e-6), (rank, accumulate, index, (a - b).abs().max())
