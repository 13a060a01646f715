"""bench/sites.py's bookkeeping of case (c) "alternating" and of its trace (no emulator, no ranks)."""
import pytest

from bench.sites import FAIR, TURNS, _tcp_line, alternation_order, alternation_summary, alternation_text, window_dips


def test_every_iteration_times_both_modes_in_the_thue_morse_order():
    runs = [mode for i in range(8) for mode in alternation_order(i)]
    assert "".join("TF"[mode == FAIR] for mode in runs) == "TFFTFTTFFTTFTFFT"


@pytest.mark.parametrize("every", [1, 2, 4, 8])
def test_an_event_every_few_runs_falls_on_both_modes_alike(every):
    """ProbeRTT's 10 s is about 2 runs at 250 Mbit/s and 4 at 500: whatever run it first falls in, over the
    default 8 iterations it falls on turns as often as on fair sharing. (T F, F T, T F, ... would put an
    event every 4 runs on one mode only.)"""
    runs = [mode for i in range(8) for mode in alternation_order(i)]
    for first in range(every):
        hit = runs[first::every]
        assert hit.count(TURNS) == hit.count(FAIR), (every, first)


def rows(times: dict[str, list[tuple[float, float]]]) -> list[dict]:
    """Rows as bench/sites.py writes them: per mode, each iteration's (first, second) pipeline seconds."""
    out = []
    for iteration in range(len(times[TURNS])):
        for position, mode in enumerate(alternation_order(iteration)):
            first, second = times[mode][iteration]
            out.append({"mode": mode, "iteration": iteration, "position": position, "seconds": max(first, second),
                        "mean_s": (first + second) / 2})
    return out


def test_the_summary_compares_each_mode_over_all_iterations():
    summary = alternation_summary(rows({TURNS: [(1.0, 2.0), (1.5, 2.5)], FAIR: [(2.0, 2.0), (2.2, 2.6)]}))
    assert summary["iterations"] == 2
    assert summary["turns"] == {"mean_s": pytest.approx(1.75), "last_s": pytest.approx(2.25)}
    assert summary["fair sharing"] == {"mean_s": pytest.approx(2.2), "last_s": pytest.approx(2.3)}
    assert summary["mean_ratio"] == pytest.approx(2.2 / 1.75)  # the ratio of the means, not a mean of ratios
    assert summary["last_ratio"] == pytest.approx(2.3 / 2.25)
    assert summary["worst_last_ratio"] == pytest.approx(2.6 / 2.5)
    assert [(it["turns_first"], round(it["mean_ratio"], 3), round(it["last_ratio"], 3))
            for it in summary["per_iteration"]] == [(True, 1.333, 1.0), (False, 1.2, 1.04)]
    assert alternation_text(summary).endswith("per iteration T 1.33/1.00, F 1.20/1.04")


def test_an_iteration_that_timed_one_mode_only_is_left_out():
    both = rows({TURNS: [(1.0, 2.0)], FAIR: [(2.0, 2.0)]})
    extra = {"mode": TURNS, "iteration": 1, "position": 0, "seconds": 9.0, "mean_s": 9.0}
    assert alternation_summary(both + [extra])["iterations"] == 1
    assert alternation_summary([]) == {}


def sample(stamp: float, acked_mib: int, first_cwnd: int) -> tuple:
    """A WAN link's trace sample as bench/sites.py records it: two streams, the first's window given."""
    streams = [(acked_mib << 20, min(first_cwnd, 900), first_cwnd, 0), (acked_mib << 20, 800, 1000, 0)]
    return (stamp, "tcp", 2, streams, 3, 0, 1 << 27)


def test_the_trace_lists_where_a_window_falls_to_four_segments_and_where_it_opens_again():
    hosts, previous = ("a0", "a1", "b0", "b1"), {}
    lines = [_tcp_line(sample(10 + 0.05 * i, 4 * i, cwnd), previous, "a0", hosts)
             for i, cwnd in enumerate([1000, 1000, 4, 4, 4, 1000, 1000])]
    assert lines[0] is None  # the link's first sample
    assert lines[1] is None  # moving, nothing lost, windows open
    assert "cwnd [4, 1000]" in lines[2] and "-> b0" in lines[2]  # BBR's ProbeRTT begins
    assert lines[3] is None and lines[4] is None  # still there: listed once
    assert "cwnd [1000, 1000]" in lines[5]  # and ends
    assert lines[6] is None


def test_a_window_of_four_segments_is_counted_in_the_run_whose_link_carried_data():
    moving = [sample(10 + 0.05 * i, 4 * i, 4 if i == 3 else 1000) for i in range(6)]  # a0 -> b0: 20 MiB, one dip
    idle = [sample(10 + 0.05 * i, 0, 4) for i in range(6)]  # a1 -> b1: at 4 segments, but carrying nothing
    later = [sample(20.0, 0, 1000), sample(20.05, 4, 4), sample(20.1, 8, 1000)]
    per_rank = [moving + later, [(t, kind, 3, *rest) for t, kind, _peer, *rest in idle], [], []]
    windows = [{"wall": (9.9, 10.4)}, {"wall": (10.5, 19.0)}, {"wall": (19.9, 20.2)}]
    assert window_dips(per_rank, windows) == [["a0->b0"], [], ["a0->b0"]]


def test_the_summary_counts_the_runs_of_each_mode_that_met_a_dip():
    traced = rows({TURNS: [(1.0, 2.0), (1.5, 2.5)], FAIR: [(2.0, 2.0), (2.2, 2.6)]})
    for row, dips in zip(traced, [[], ["a0->b0"], ["a1->b1"], ["a0->b0", "a1->b1"]]):
        row["small_windows"] = dips
    assert alternation_summary(traced)["runs_with_small_windows"] == {"turns": 1, "fair sharing": 2}
    assert alternation_text(alternation_summary(traced)).endswith("data: turns 1, fair sharing 2")
    assert "runs_with_small_windows" not in alternation_summary(rows({TURNS: [(1.0, 2.0)], FAIR: [(2.0, 2.0)]}))
