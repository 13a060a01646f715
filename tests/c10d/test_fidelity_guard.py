"""The fidelity guard: one warning when, at a low density, the gradient is still large after many sparse steps."""
import warnings

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from tests.support.worlds import run_world
from wanlink.c10d.fidelity_guard import FidelityGuard
from wanlink.errors import ConfigError, SparseFidelityWarning


def _feed(guard, energies, density=0.01, warmup=50):
    """Feeds one energy per step (in two bucket parts, as the hook does); the first verdict and its step."""
    for step, energy in enumerate(energies):
        guard.add(step, energy / 2)
        guard.add(step, energy / 2)
        verdict = guard.end_step(density, step + 1 - warmup)
        if verdict is not None:
            return step, verdict
    return None, None


def test_a_gradient_that_stays_large_warns_once_after_the_judging_step():
    guard = FidelityGuard()
    step, verdict = _feed(guard, [1.0] * 300 + [0.5] * 1000)
    assert step == 549 and verdict.sparse_steps == 500  # max(500, 5 / 0.01), at a window's end
    assert verdict.warned and verdict.ratio == pytest.approx(0.5 ** 0.5)
    for text in ("density 0.01", "500 sparse steps", "71% of its largest", "density='auto'", "fidelity_guard=False"):
        assert text in verdict.message
    assert guard.done and _feed(guard, [1.0] * 1000) == (None, None)  # judged once


def test_a_gradient_that_settles_does_not_warn():
    step, verdict = _feed(FidelityGuard(), [1.0] * 300 + [1e-3] * 1000)  # norm at 3 % of its peak
    assert step == 549 and not verdict.warned and verdict.message is None
    assert verdict.ratio == pytest.approx(1e-3 ** 0.5)
    # 15 % of its peak: below the 20 % threshold
    step, verdict = _feed(FidelityGuard(), [1.0] * 300 + [0.0225] * 1000)
    assert not verdict.warned and verdict.ratio == pytest.approx(0.15)


def test_the_judging_step_grows_as_the_density_falls_and_high_densities_are_not_judged():
    guard = FidelityGuard()
    assert guard.judge_after(0.01) == 500 and guard.judge_after(0.001) == 5000
    step, verdict = _feed(FidelityGuard(), [1.0] * 6000, density=0.001)
    assert step == 5049 and verdict.warned and "~1000 steps" in verdict.message
    assert _feed(FidelityGuard(), [1.0] * 1000, density=0.1) == (None, None)


def test_guard_options_are_validated():
    from wanlink.c10d.sparse_hook import BlockSparseState

    for bad in ({"window": 0}, {"min_steps": -1}, {"threshold": 0.0}, {"threshold": 1.5},
                {"block_waits": -1.0}, {"block_waits": float("nan")}, {"block_waits": "5"},
                {"applies_below": 0.0}, {"applies_below": 2.0}, {"applies_below": float("nan")}):
        with pytest.raises(ConfigError):
            FidelityGuard(**bad)
    with pytest.raises(ConfigError, match="fidelity_guard"):
        BlockSparseState(fidelity_guard="yes")
    assert BlockSparseState(fidelity_guard=False).fidelity_guard is None
    assert isinstance(BlockSparseState().fidelity_guard, FidelityGuard)


def _train_watched(rank, size):
    """40 steps at 5 % through the hook, the loss scaled constant (still learning) or shrinking (settling)."""
    from wanlink.c10d.sparse_hook import BlockSparseState, block_sparse_hook

    outcomes = []
    for decay in (1.0, 0.7):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
        ddp = DDP(model, bucket_cap_mb=0.005)
        state = BlockSparseState(density=0.05, warmup_steps=2, momentum=0.9,
                                 fidelity_guard=FidelityGuard(window=5, min_steps=20, block_waits=1.0))
        ddp.register_comm_hook(state, block_sparse_hook)
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)
        generator = torch.Generator().manual_seed(rank)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for step in range(40):
                x, y = torch.randn(16, 32, generator=generator), torch.randint(0, 10, (16,), generator=generator)
                optimizer.zero_grad()
                (decay ** step * torch.nn.functional.cross_entropy(ddp(x), y)).backward()
                optimizer.step()
        dist.barrier()
        outcomes.append((state.fidelity_guard.verdict,
                         [str(w.message) for w in caught if issubclass(w.category, SparseFidelityWarning)]))
    return outcomes


@pytest.mark.slow
def test_the_hook_warns_on_a_gradient_that_stays_large_and_not_on_one_that_settles():
    for (learning, learning_warnings), (settling, settling_warnings) in run_world(2, _train_watched):
        # judged at the first window end with 20 sparse steps: iteration 24 (steps 0-1 dense)
        assert learning.sparse_steps == settling.sparse_steps == 23
        assert learning.warned and learning.ratio > 0.5 and len(learning_warnings) == 1
        assert "density 0.05" in learning_warnings[0]
        assert not settling.warned and settling.ratio < 0.01 and settling_warnings == []
