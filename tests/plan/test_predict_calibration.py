"""bench/predict.py's link calibration: the fit recovers the efficiency and send overhead that
produced a set of lone all-reduce times (the model's own), and reads rows of either format."""
from bench.predict import PROBE_SIZES, _cluster, _lone_probes, calibrate_link
from wanlink.plan import Bucket, Choice, Profile, simulate

ROW = {"ranks": 2, "rtt_ms": 40, "rate_mbit": 500, "streams": 8}


def _lone_times(efficiency: float, overhead_ms: float) -> dict[str, float]:
    times = {}
    for size in PROBE_SIZES:
        lone = Profile("probe", 1, 0.0, 0.0, 0.0, (Bucket(size, 0.0, (size // 4,)),))
        cluster = _cluster(ROW, 500, efficiency, overhead_ms)
        times[str(size)] = simulate(cluster, lone, Choice(), iterations=2).iteration_s
    return times


def test_fit_recovers_the_link_that_made_the_times():
    row = {**ROW, "lone_allreduce_s": _lone_times(0.6, 7.0)}
    efficiency, overhead_ms = calibrate_link(row, Choice())
    assert efficiency == 0.6
    assert abs(overhead_ms - 7.0) < 0.05


def test_overhead_never_negative_and_old_rows_read():
    fast = {str(size): seconds * 0.5 for size, seconds in _lone_times(1.0, 0.0).items()}  # faster than any link
    efficiency, overhead_ms = calibrate_link({**ROW, "lone_allreduce_s": fast}, Choice())
    assert overhead_ms == 0.0 and efficiency == 1.0
    assert _lone_probes({"probe_allreduce_s": 0.2}) == {4 * 1024 * 1024: 0.2}
