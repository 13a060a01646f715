"""bench/sites.py's bookkeeping of case (c) "alternating" and of its trace (no emulator, no ranks)."""
import pytest

from bench.sites import FAIR, TURNS, _tcp_line, alternation_order, alternation_summary, alternation_text


def test_the_modes_take_the_first_place_in_turn():
    orders = [alternation_order(i) for i in range(6)]
    assert orders[0] == (TURNS, FAIR) and orders[1] == (FAIR, TURNS)
    assert [order[0] for order in orders].count(TURNS) == 3
    assert all(sorted(order) == sorted((TURNS, FAIR)) for order in orders)


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
