"""Large tensors (messages of many transport chunks, several pipeline pieces) arrive intact.

Small-tensor cases in test_c10d_ops.py fit in one chunk; this world uses the default thresholds
with buffers of several MiB, so every message spans several chunks and stripes.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from tests.support.worlds import run_world

NUMEL = 3 << 20  # 12 MiB of float32 per rank
ROUNDS = 3


def pattern(rank: int, round_: int) -> torch.Tensor:
    return (torch.arange(NUMEL, dtype=torch.int64) % 1009 + 7 * rank + round_).to(torch.float32)


def large_collectives(rank, size):
    problems = []
    for round_ in range(ROUNDS):
        tensor = pattern(rank, round_)
        dist.all_reduce(tensor)
        expected = sum(pattern(r, round_) for r in range(size))
        if not torch.equal(tensor, expected):
            problems.append(f"all_reduce round {round_}: {(tensor != expected).sum().item()} wrong elements")
        root = round_ % size
        tensor = pattern(rank, round_)
        dist.broadcast(tensor, src=root)
        if not torch.equal(tensor, pattern(root, round_)):
            problems.append(f"broadcast round {round_}: {(tensor != pattern(root, round_)).sum().item()} wrong")
        gathered = torch.empty(size * NUMEL // 4)
        dist.all_gather_into_tensor(gathered, pattern(rank, round_)[: NUMEL // 4])
        expected = torch.cat([pattern(r, round_)[: NUMEL // 4] for r in range(size)])
        if not torch.equal(gathered, expected):
            problems.append(f"all_gather round {round_}: {(gathered != expected).sum().item()} wrong")
    return problems


def test_large_collectives_are_exact():
    for rank, problems in enumerate(run_world(3, large_collectives, timeout=240)):
        assert not problems, f"rank {rank}: {problems}"
