"""bench/predict.py's drop accounting: the emulator's counters, sampled in time, split by the
phases a rank marked (which phase of a configuration lost segments)."""
from bench.predict import phase_counts


def test_drops_go_to_the_phase_that_was_running():
    samples = [(10.0, 0, 0), (10.1, 5, 0), (10.2, 5, 1), (10.3, 40, 3), (10.4, 40, 3), (10.5, 41, 3)]
    marks = [("start", 10.05), ("warm-up", 10.15), ("probes", 10.35), ("timed iterations", 10.45)]
    assert phase_counts(samples, marks) == {"before": [5, 0], "warm-up": [0, 1], "probes": [35, 2],
                                           "timed iterations": [1, 0], "after": [0, 0]}


def test_a_mark_after_the_last_sample_takes_the_last_counters():
    samples = [(1.0, 2, 2), (1.1, 3, 7)]
    assert phase_counts(samples, [("start", 1.0), ("probes", 5.0)]) == {"before": [0, 0], "probes": [1, 5],
                                                                       "after": [0, 0]}
