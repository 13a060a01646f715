"""DensityController on synthetic traces: step changes, noise, outliers, bounds, hysteresis."""
import random

import pytest

from wanlink.errors import ConfigError
from wanlink.sched.density import DensityController

MBIT = 1e6 / 8  # bytes/s per Mbit/s
FULL = 100e6  # bytes per step at density 1
COMPUTE = 0.5  # seconds per step
STEP_S = 0.5


def controller(**overrides) -> DensityController:
    options = dict(full_bytes=FULL, min_density=0.001, max_density=0.1, staleness=1, margin=0.8, hold_s=3.0,
                   window_s=8.0, raise_ratio=1.7)
    options.update(overrides)
    return DensityController(**options)


def run(ctrl: DensityController, rates_mbit, start: float = 0.0, compute=COMPUTE):
    """Feed one bandwidth sample and one compute sample per step; the decisions, one per step."""
    decisions = []
    for i, rate in enumerate(rates_mbit):
        now = start + i * STEP_S
        ctrl.observe_bandwidth(rate * MBIT, now)
        ctrl.observe_compute(compute, now)
        decisions.append(ctrl.decide(now))
    return decisions


def fits(density: float, rate_mbit: float, margin=0.8, window=COMPUTE) -> bool:
    return density * FULL / (rate_mbit * MBIT) <= margin * window + 1e-12


def test_settles_below_the_bound_of_eq6_and_within_one_grid_step_of_it():
    ctrl = controller()
    decisions = run(ctrl, [100] * 40)
    final = decisions[-1]
    exact = 0.8 * COMPUTE * 100 * MBIT / FULL  # 0.05
    assert final.density <= exact and final.density > exact / 2 ** 0.25 - 1e-12
    assert final.hidden and final.comm_s <= final.budget_s


def test_step_down_is_followed_within_the_percentile_share_of_the_window():
    ctrl = controller()
    run(ctrl, [500] * 40)
    assert ctrl.density == 0.1  # the cap
    decisions = run(ctrl, [100] * 20, start=40 * STEP_S)
    # 20th percentile of an 8 s window (16 samples): about 4 low samples move it
    first_fitting = next(i for i, d in enumerate(decisions) if fits(d.density, 100))
    assert first_fitting <= 5
    assert all(fits(d.density, 100) for d in decisions[first_fitting:])


def test_step_up_waits_for_most_of_the_window_and_the_hold():
    ctrl = controller()
    run(ctrl, [50] * 40)
    low = ctrl.density
    decisions = run(ctrl, [400] * 40, start=40 * STEP_S)
    raised = next(i for i, d in enumerate(decisions) if d.density > low)
    # needs 80 % of the 8 s window (about 13 samples) to be high, then 3 s (6 samples) of hold
    assert raised >= 12
    assert decisions[-1].density > 3 * low and fits(decisions[-1].density, 400)


def test_one_high_outlier_never_raises_and_one_low_outlier_does_not_lower():
    ctrl = controller()
    run(ctrl, [100] * 40)
    settled = ctrl.density
    trace = [100] * 10 + [10_000] + [100] * 10 + [5] + [100] * 10
    decisions = run(ctrl, trace, start=40 * STEP_S)
    assert {d.density for d in decisions} == {settled}


@pytest.mark.parametrize("seed", range(10))
def test_noise_does_not_make_it_oscillate(seed):
    rng = random.Random(seed)
    ctrl = controller()
    decisions = run(ctrl, [max(1.0, rng.gauss(200, 40)) for _ in range(400)])  # 20 % noise, 200 s
    moves = [d.density for d in decisions if d.changed]
    assert len(moves) <= 4  # the climb, then at most a few settling steps
    directions = [b > a for a, b in zip(moves, moves[1:])]
    assert sum(x != y for x, y in zip(directions, directions[1:])) <= 1  # no up-down-up
    assert all(fits(d.density, 200) for d in decisions[40:])  # never above what the mean rate allows


def test_asymmetric_errors_over_estimates_are_short_lived():
    """A sustained drop reaches the fitting density far sooner than a rise of the same size."""
    down = controller()
    run(down, [400] * 40)
    to_low = run(down, [50] * 40, start=40 * STEP_S)
    up = controller()
    run(up, [50] * 40)
    to_high = run(up, [400] * 40, start=40 * STEP_S)
    steps_down = next(i for i, d in enumerate(to_low) if d.density == to_low[-1].density)
    steps_up = next(i for i, d in enumerate(to_high) if d.density == to_high[-1].density)
    assert steps_down < steps_up


def test_bounds_are_never_left():
    ctrl = controller(min_density=0.01, max_density=0.02)
    decisions = run(ctrl, [1] * 20 + [100_000] * 40 + [1] * 20)
    assert {d.density for d in decisions} <= {0.01, 0.02}
    assert decisions[-1].density == 0.01 and not decisions[-1].hidden  # the floor, on a link too slow for it
    assert max(d.density for d in decisions) == 0.02


def test_no_estimate_keeps_the_initial_density():
    ctrl = controller(initial=0.08)
    assert ctrl.decide(0.0).density == 0.08
    ctrl.observe_compute(COMPUTE, 0.1)
    decision = ctrl.decide(0.2)
    assert decision.density == 0.08 and decision.bandwidth_Bps is None and not decision.changed
    ctrl.observe_bandwidth(100 * MBIT, 0.3)
    assert ctrl.decide(0.3).density < 0.08  # 0.08 does not fit 100 Mbit/s in 0.4 s


def test_old_samples_leave_the_window():
    ctrl = controller(window_s=2.0)
    ctrl.observe_bandwidth(10 * MBIT, 0.0)
    ctrl.observe_bandwidth(1000 * MBIT, 5.0)
    assert ctrl.bandwidth_estimate(5.0) == 1000 * MBIT


def test_one_slow_step_does_not_move_the_compute_estimate():
    ctrl = controller()
    decisions = run(ctrl, [100] * 30)
    settled = decisions[-1].density
    ctrl.observe_compute(0.05, 100.0)  # one step measured far faster: a smaller budget
    assert ctrl.decide(100.0).density == settled


def test_staleness_zero_overlaps_only_the_backward_share_and_says_when_staleness_1_is_needed():
    stale = run(controller(staleness=1), [100] * 40)[-1]
    fresh = run(controller(staleness=0, backward_share=0.5), [100] * 40)[-1]
    assert fresh.density < stale.density
    assert not fresh.staleness_needed
    assert stale.staleness_needed  # its density fits the whole step, not the backward pass alone


def test_latency_is_charged_before_bandwidth():
    plain = run(controller(), [100] * 40)[-1]
    slow_rtt = run(controller(latency_s=0.2), [100] * 40)[-1]
    assert slow_rtt.density < plain.density
    assert slow_rtt.comm_s <= slow_rtt.budget_s


@pytest.mark.parametrize("bad", [
    dict(min_density=0.2, max_density=0.1), dict(max_density=1.5), dict(min_density=0.0),
    dict(full_bytes=0), dict(staleness=2), dict(margin=0.0), dict(levels_per_octave=0),
    dict(raise_ratio=0.5), dict(percentile=101.0),
])
def test_bad_configuration_is_refused(bad):
    with pytest.raises(ConfigError):
        controller(**bad)


def test_bad_samples_are_refused():
    ctrl = controller()
    ctrl.observe_bandwidth(1.0, 5.0)
    with pytest.raises(ConfigError, match="backwards"):
        ctrl.observe_compute(0.1, 4.0)
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ConfigError):
            ctrl.observe_bandwidth(bad, 6.0)


def test_a_sustained_drop_shows_once_the_last_second_saw_it_and_a_short_dip_does_not():
    """Samples every 0.1 s: the 20th percentile of 8 s needs 1.6 s of lower samples; a whole second
    of them is enough, and half a second (a dip) is not."""
    def feed(ctrl, rates_mbit, start):
        for i, rate in enumerate(rates_mbit):
            ctrl.observe_bandwidth(rate * MBIT, start + i * 0.1)
        return ctrl.bandwidth_estimate(start + (len(rates_mbit) - 1) * 0.1)

    fast, percentile_only = controller(drop_s=1.0, drop_samples=3), controller(drop_samples=10**6)
    for ctrl in (fast, percentile_only):
        feed(ctrl, [500] * 80, start=0.0)
    assert feed(fast, [100] * 5 + [500], start=8.0) == 500 * MBIT  # a dip of 0.5 s
    assert feed(fast, [120] * 11, start=8.6) == 120 * MBIT  # 1.1 s of lower samples
    assert feed(percentile_only, [100] * 5 + [500] + [120] * 11, start=8.0) == 500 * MBIT


def test_steps_that_wait_for_their_exchange_drop_the_samples_of_the_path_before():
    """Two of three steps waiting more than half the compute time for their exchange: the samples
    so far described a faster path, and the next one stands alone. One late step, or two with two
    fitting ones between them, move nothing."""
    ctrl = controller(overrun_share=0.5, overrun_steps=2)
    run(ctrl, [500] * 16)  # 8 s at 500 Mbit/s, compute 0.5 s
    assert fits(ctrl.density, 500) and not fits(ctrl.density, 100)
    for wait, now in ((0.3, 8.0), (0.0, 8.5), (0.0, 8.6), (0.3, 9.0), (0.25, 9.1)):  # 0.25: half the compute
        assert not ctrl.observe_wait(wait, now)
    ctrl.observe_bandwidth(100 * MBIT, 9.1)
    assert ctrl.decide(9.1).bandwidth_Bps == 500 * MBIT and ctrl.overruns == 0
    assert ctrl.observe_wait(0.4, 9.2)  # late, fitting, late: they alternate with staleness 1
    ctrl.observe_bandwidth(100 * MBIT, 9.2)
    decision = ctrl.decide(9.2)
    assert decision.bandwidth_Bps == 100 * MBIT and fits(decision.density, 100) and ctrl.overruns == 1
    assert not ctrl.observe_wait(0.4, 9.3)  # counting starts again
    with pytest.raises(ConfigError):
        ctrl.observe_wait(-1.0, 9.4)
