"""bench/fidelity.py's learning-rate schedules: the same multiple of the rate for every arm at every step."""
import pytest
import torch

from bench.fidelity import LR_WARMUP, lr_factor


def test_constant_keeps_the_rate():
    assert {lr_factor("constant", step, 100) for step in range(100)} == {1.0}


@pytest.mark.parametrize("steps", [20, 1200, 4800])
def test_cosine_warms_up_linearly_then_decays_to_near_zero(steps):
    warmup = round(LR_WARMUP * steps)
    factors = [lr_factor("cosine", step, steps) for step in range(steps)]
    assert factors[:warmup] == pytest.approx([(step + 1) / warmup for step in range(warmup)])
    decay = factors[warmup - 1:]
    assert decay[0] == 1.0
    assert all(later < earlier for earlier, later in zip(decay, decay[1:]))
    assert 0.0 < factors[-1] < 0.03
    middle = warmup + (steps - warmup) // 2  # half-way through the decay: half the rate
    assert factors[middle] == pytest.approx(0.5, abs=0.05)


def test_lambda_lr_gives_the_optimizer_these_rates():
    """run_job steps a LambdaLR of lr_factor after every optimizer step: the rate of step i is lr x lr_factor(i)."""
    steps = 40
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda i: lr_factor("cosine", i, steps))
    seen = []
    for _ in range(steps):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert seen == pytest.approx([0.1 * lr_factor("cosine", i, steps) for i in range(steps)])
