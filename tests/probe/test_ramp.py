"""StreamRamp decisions on simulated rate curves (no sockets, no clock)."""
import math
import random

import pytest

from wanlink.errors import ConfigError
from wanlink.probe.ramp import ProbeResult, RampStep, StreamRamp

MB = 1e6 / 8  # bytes/s in one Mbit/s


def run(curve, **kwargs) -> StreamRamp:
    """Drive a ramp with ``curve(n) -> rate``; returns the finished ramp."""
    ramp = StreamRamp(**kwargs)
    guard = 0
    while (n := ramp.next_streams()) is not None:
        ramp.record(n, curve(n))
        guard += 1
        assert guard < 20
    return ramp


def window_limited(per_flow, bottleneck):
    """n flows of rate ``per_flow`` (window / RTT) sharing a bottleneck."""
    return lambda n: min(n * per_flow, bottleneck)


def test_sequence_is_powers_of_two_up_to_max():
    ramp = run(lambda n: n * 100.0, max_streams=64)
    assert [s.streams for s in ramp.steps] == [1, 2, 4, 8, 16, 32, 64]
    assert ramp.choice() == 64 and "maximum" in ramp.reason


def test_non_power_of_two_maximum_is_measured_last():
    ramp = run(lambda n: n * 100.0, max_streams=48)
    assert [s.streams for s in ramp.steps] == [1, 2, 4, 8, 16, 32, 48]


@pytest.mark.parametrize("rtt_ms,bottleneck_mbit,expected", [
    (40, 1000, 4),    # 300 Mbit/s per flow: 4 flows fill 1 Gbit/s
    (10, 1000, 1),    # 1.2 Gbit/s per flow: one flow already fills it
    (80, 1000, 8),    # 150 Mbit/s per flow
    (40, 20_000, 64),  # never saturates within 64 flows
])
def test_window_limited_flows_behind_a_bottleneck(rtt_ms, bottleneck_mbit, expected):
    per_flow = 1.5e6 / (rtt_ms / 1e3)  # ~1.5 MB effective window
    ramp = run(window_limited(per_flow, bottleneck_mbit * MB))
    assert ramp.choice() == expected
    chosen_rate = ramp.rate_of(ramp.choice())
    assert chosen_rate >= min(bottleneck_mbit * MB, 64 * per_flow) / 1.05


def test_stops_soon_after_saturation():
    ramp = run(window_limited(300 * MB, 1000 * MB))
    # 1, 2, 4 gain; 8 and 16 do not (patience 1): no 32 or 64
    assert [s.streams for s in ramp.steps] == [1, 2, 4, 8, 16]
    assert "gained" in ramp.reason


def test_patience_zero_stops_at_first_flat_step():
    ramp = run(window_limited(300 * MB, 1000 * MB), patience=0)
    assert [s.streams for s in ramp.steps] == [1, 2, 4, 8]


def test_one_noisy_dip_does_not_end_the_ramp():
    rates = {1: 100, 2: 200, 4: 190, 8: 700, 16: 720, 32: 725, 64: 726}  # a dip at 4
    ramp = run(lambda n: rates[n] * MB)
    assert 8 in [s.streams for s in ramp.steps]
    assert ramp.choice() == 8


def test_soft_knee_saturating_curve():
    capacity = 5000 * MB
    ramp = run(lambda n: capacity * (1 - math.exp(-n * 0.2)))
    # 16 flows reach 96% of capacity, 32 add 4% (< 5%), 64 nothing: the smallest within 5% is 16
    assert [s.streams for s in ramp.steps] == [1, 2, 4, 8, 16, 32, 64]
    assert ramp.choice() == 16


def test_loss_limited_flows_with_self_congestion():
    """Mathis-limited flows (rate ~ MSS / (RTT sqrt(p))) until the bottleneck; beyond it more
    flows raise the loss rate and the total falls: the choice stays at the knee."""
    mss, rtt, p = 1448, 0.04, 0.01
    per_flow = 1.22 * mss / (rtt * math.sqrt(p))  # ~442 KB/s
    bottleneck = 30 * per_flow

    def curve(n):
        if n * per_flow <= bottleneck:
            return n * per_flow
        return bottleneck * (1 - 0.02 * math.log2(n * per_flow / bottleneck))

    ramp = run(curve)
    assert ramp.rate_of(64) < ramp.rate_of(32)
    assert ramp.choice() == 32


@pytest.mark.parametrize("seed", range(10))
def test_noisy_window_limited_curves_choose_near_the_best(seed):
    rng = random.Random(seed)
    for _ in range(40):
        per_flow, bottleneck = 10 ** rng.uniform(5, 9), 10 ** rng.uniform(6, 10)
        noise = rng.uniform(0, 0.03)
        curve = window_limited(per_flow, bottleneck)
        ramp = run(lambda n, curve=curve, noise=noise: curve(n) * (1 + rng.uniform(-noise, noise)))
        chosen = ramp.choice()
        assert 1 <= chosen <= 64
        # the chosen count is within the gain threshold of the best measured rate
        assert ramp.rate_of(chosen) >= ramp.best.rate / 1.05
        # and, the noise being small, it delivers most of what 64 flows could
        assert curve(chosen) >= curve(64) * (1 - noise) / (1 + noise) / 1.05


def test_zero_rates_end_with_one_stream():
    ramp = run(lambda n: 0.0)
    assert ramp.choice() == 1 and len(ramp.steps) == 3


def test_recording_errors():
    ramp = StreamRamp(max_streams=4)
    with pytest.raises(ConfigError):
        ramp.record(2, 1.0)  # it asked for 1
    for bad in (-1.0, float("nan"), float("inf"), True, "fast"):
        with pytest.raises(ConfigError):
            ramp.record(1, bad)
    ramp.record(1, 1.0)
    ramp.record(2, 2.0)
    ramp.record(4, 4.0)
    assert ramp.done and ramp.next_streams() is None
    with pytest.raises(ConfigError):
        ramp.record(8, 1.0)


@pytest.mark.parametrize("kwargs", [{"max_streams": 0}, {"start": 5, "max_streams": 4}, {"factor": 1},
                                    {"min_gain": -0.1}, {"patience": -1}])
def test_bad_configuration(kwargs):
    with pytest.raises(ConfigError):
        StreamRamp(**kwargs)


def test_choice_before_any_measurement_is_one():
    assert StreamRamp().choice() == 1 and StreamRamp().best is None


def test_probe_result_json():
    result = ProbeResult(streams=4, rtt_s=0.04, rate=1e8, chunk_size=1 << 20,
                         samples=(RampStep(1, 3e7), RampStep(4, 1e8)), reason="r")
    doc = result.to_json()
    assert doc["streams"] == 4 and doc["rtt_ms"] == pytest.approx(40.0)
    assert doc["bits_per_second"] == pytest.approx(8e8)
    assert [s["streams"] for s in doc["samples"]] == [1, 4]


@pytest.mark.parametrize("gbps, expected", [
    # bench/wan_throughput.py probe samples (Gbit/s per stream count) on the emulated 2 Gbit/s path
    ({1: 0.309, 2: 0.618, 4: 1.236, 8: 1.931, 16: 1.845, 32: 1.893}, 8),  # 40 ms, window-limited
    ({1: 0.23, 2: 0.38, 4: 0.783, 8: 1.578, 16: 1.767, 32: 1.931, 64: 1.364}, 32),  # 40 ms, 0.1 % loss
    ({1: 0.398, 2: 0.735, 4: 1.276, 8: 1.734, 16: 1.551, 32: 1.417}, 8),  # 40 ms, 1 % loss, -w 4M
    ({1: 0.553, 2: 1.101, 4: 1.93, 8: 1.786, 16: 1.484}, 4),  # 80 ms, -w 4M: past the knee it falls
])
def test_measured_wan_curves_choose_the_knee(gbps, expected):
    ramp = run(lambda n: gbps[n] * 1e9 / 8)
    assert [s.streams for s in ramp.steps] == sorted(gbps)  # stops after two steps without gain
    assert ramp.choice() == expected
