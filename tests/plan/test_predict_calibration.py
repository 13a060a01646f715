"""bench/predict.py's link calibration: the fit recovers the efficiency and send overhead that
produced a set of lone all-reduce times (the model's own), and reads rows of either format."""
import pytest

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


@pytest.mark.parametrize("made_by", [0.6, 0.09])  # a window-limited long path fits well below 0.2
def test_fit_recovers_the_link_that_made_the_times(made_by):
    row = {**ROW, "lone_allreduce_s": _lone_times(made_by, 7.0)}
    efficiency, overhead_ms = calibrate_link(row, Choice())
    assert efficiency == made_by
    assert abs(overhead_ms - 7.0) < 0.05


def test_overhead_never_negative_and_old_rows_read():
    fast = {str(size): seconds * 0.5 for size, seconds in _lone_times(1.0, 0.0).items()}  # faster than any link
    efficiency, overhead_ms = calibrate_link({**ROW, "lone_allreduce_s": fast}, Choice())
    assert overhead_ms == 0.0 and efficiency == 1.0
    assert _lone_probes({"probe_allreduce_s": 0.2}) == {4 * 1024 * 1024: 0.2}


def test_fit_reads_the_exchanges_timed_beside_compute():
    # the training's own exchanges (two buckets at once) timed beside the busy profile: with lone
    # times from one link and those from a link with more overhead, the fitted link's lies in between
    from dataclasses import replace

    prof = Profile("p", 8, 0.01, 0.02, 0.003, (Bucket(1 << 20, 0.005, (1 << 18,)), Bucket(4 << 20, 0.02, (1 << 20,))))
    exchanges = replace(prof, forward_s=0.0, backward_s=0.0, step_s=0.0,
                        buckets=tuple(replace(b, ready_s=0.0) for b in prof.buckets))
    busy = simulate(_cluster(ROW, 500, 0.6, 7.0), exchanges, Choice(), iterations=2).iteration_s
    row = {**ROW, "lone_allreduce_s": _lone_times(0.6, 7.0), "busy_exchange_s": busy}
    assert calibrate_link(row, Choice(), prof) == (0.6, pytest.approx(7.0, abs=0.05))
    slower = {**row, "busy_exchange_s": simulate(_cluster(ROW, 500, 0.6, 30.0), exchanges, Choice(),
                                                  iterations=2).iteration_s}
    fitted = _cluster(ROW, 500, *calibrate_link(slower, Choice(), prof))
    assert busy < simulate(fitted, exchanges, Choice(), iterations=2).iteration_s < slower["busy_exchange_s"]
    assert calibrate_link(slower, Choice())[1] == pytest.approx(7.0, abs=0.05)  # without the profile: lone only


def test_exchanges_beside_compute_weigh_as_much_as_all_lone_all_reduces():
    # lone all-reduces from a link with 7 ms of overhead, the training's exchanges from one with 60 ms
    # (a lossy path: the lone ones burst into another loss regime): the fitted link's exchanges lie
    # nearer the measured ones than the lone all-reduces' link's (one probe among four: nearer those)
    from dataclasses import replace

    prof = Profile("p", 8, 0.01, 0.02, 0.003, (Bucket(1 << 20, 0.005, (1 << 18,)), Bucket(4 << 20, 0.02, (1 << 20,))))
    exchanges = replace(prof, forward_s=0.0, backward_s=0.0, step_s=0.0,
                        buckets=tuple(replace(b, ready_s=0.0) for b in prof.buckets))

    def seconds(cluster):
        return simulate(cluster, exchanges, Choice(), iterations=2).iteration_s

    busy, lone_link = seconds(_cluster(ROW, 500, 0.6, 60.0)), seconds(_cluster(ROW, 500, 0.6, 7.0))
    row = {**ROW, "lone_allreduce_s": _lone_times(0.6, 7.0), "busy_exchange_s": busy}
    assert (lone_link + busy) / 2 < seconds(_cluster(ROW, 500, *calibrate_link(row, Choice(), prof))) < busy


def test_the_exchanges_count_as_their_mean_over_steps():
    from bench.predict import _busy_exchange

    row = {"per_rank_busy_exchange_s": [1.0, 1.0], "per_rank_busy_exchange_steps_s": [[1.0, 1.0, 2.2], [0.8, 1.0, 1.2]]}
    assert _busy_exchange(row) == pytest.approx((1.4 + 1.0) / 2)
    assert _busy_exchange({"per_rank_busy_exchange_s": [1.0, 1.2]}) == pytest.approx(1.1)  # rows before: medians

