"""A late rank slows the others instead of failing the world (flow control), with bounded staging.

CI-sized versions of the two programs of issue 14 (a 1.5 GiB send to a rank that receives 5 s
later; a 2.25 GiB all_reduce with one rank 6 s late, both against a 1 GiB staging limit): tensors
1.5x a 16 MiB staging limit (WANLINK_STAGING_BYTES). The late rank is made late by an event, not
a sleep: it waits until the others' data has reached it as far as flow control lets it (its links
hold the eager window, half the limit), so the others are blocked on it for sure when it joins.
bench/late_receiver.py runs the full sizes with 5, 30 and 120 s of lateness next to gloo.
"""
import time

import pytest
import torch
import torch.distributed as dist

from tests.support.worlds import run_world

LIMIT = 16 << 20
NUMEL = LIMIT * 3 // 2 // 4  # float32 elements: 1.5x the limit
ENV = {"WANLINK_STAGING_BYTES": str(LIMIT)}


def staged_now() -> int:
    import wanlink

    return sum(link["unexpected_bytes_held"] for link in wanlink.stats().values())


def peak_staged() -> int:
    import wanlink

    return max((link["peak_unexpected_bytes"] for link in wanlink.stats().values()), default=0)


def wait_until_blocked_on_me(at_least: int, patience: float = 60.0) -> int:
    """Be late: return once ``at_least`` bytes wait here for receives not posted (the senders are
    then stalled on this rank), or after ``patience`` s when nothing can come before this rank joins."""
    deadline = time.monotonic() + patience
    while staged_now() < at_least and time.monotonic() < deadline:
        time.sleep(0.01)
    return staged_now()


def pattern(rank: int) -> torch.Tensor:
    return (torch.arange(NUMEL, dtype=torch.int64) % 1013 + 5 * rank).to(torch.float32)


def late_recv(rank, size):
    if rank == 0:
        dist.send(pattern(0), dst=1)
        return None
    held = wait_until_blocked_on_me(LIMIT // 2)
    out = torch.empty(NUMEL)
    dist.recv(out, src=0)
    return held, peak_staged(), bool(torch.equal(out, pattern(0)))


def test_a_send_larger_than_the_staging_limit_waits_for_a_late_receiver():
    _, (held, peak, exact) = run_world(2, late_recv, env=ENV, timeout=180)
    assert held >= LIMIT // 2  # the sender had sent its eager window and was waiting
    assert peak <= LIMIT and exact


def late_collectives(rank, size):
    late = rank == size - 1
    results = {}
    for op in ("all_reduce", "broadcast", "all_gather"):
        dist.barrier()
        held = wait_until_blocked_on_me(1, patience=10.0) if late else None
        tensor = pattern(rank)
        if op == "all_reduce":
            dist.all_reduce(tensor)
            exact = torch.equal(tensor, sum(pattern(r) for r in range(size)))
        elif op == "broadcast":
            dist.broadcast(tensor, src=0)
            exact = torch.equal(tensor, pattern(0))
        else:
            gathered = [torch.empty(NUMEL) for _ in range(size)]
            dist.all_gather(gathered, tensor)
            exact = all(torch.equal(g, pattern(r)) for r, g in enumerate(gathered))
        results[op] = (held, bool(exact))
    return results, peak_staged()


@pytest.mark.parametrize("size", [2, 3])
def test_collectives_with_one_rank_late_are_exact_and_stage_at_most_the_limit(size):
    outcomes = run_world(size, late_collectives, env=ENV, timeout=300)
    for rank, (results, peak) in enumerate(outcomes):
        assert all(exact for _held, exact in results.values()), f"rank {rank}: {results}"
        assert peak <= LIMIT, f"rank {rank} staged {peak} bytes"
    late_results, _ = outcomes[-1]
    assert late_results["all_reduce"][0] > 0  # the late rank was waited for
