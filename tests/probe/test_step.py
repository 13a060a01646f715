"""How a ramp step is measured: its timing and the bytes it keeps in flight (pure)."""
from wanlink.probe.step import MIN_INFLIGHT_BYTES, STREAM_INFLIGHT_BYTES, StepTiming, inflight_bytes_for


def test_step_timing_scales_with_rtt_and_is_capped():
    short, long = StepTiming.for_rtt(0.0001), StepTiming.for_rtt(0.08)
    assert short.warmup_s == 0.25 and short.measure_s == 0.4
    assert long.warmup_s > short.warmup_s and long.measure_s > short.measure_s
    huge = StepTiming.for_rtt(10.0)
    assert huge.warmup_s == 2.0 and huge.measure_s == 2.0
    assert StepTiming.for_rtt(0.04, measure_s=0.1).measure_s == 0.1


def test_inflight_covers_every_stream_and_the_bandwidth_delay_product():
    assert inflight_bytes_for(1) == MIN_INFLIGHT_BYTES  # few streams: the floor
    assert inflight_bytes_for(16) == 16 * STREAM_INFLIGHT_BYTES > MIN_INFLIGHT_BYTES  # each stream kept busy
    fast = inflight_bytes_for(2, rate=250e6, rtt_s=0.2)  # 2 Gbit/s at 200 ms: twice the BDP
    assert fast == int(2 * 250e6 * 0.2)
    assert inflight_bytes_for(1, floor=1 << 20) == STREAM_INFLIGHT_BYTES
