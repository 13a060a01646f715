"""When a stream counts as stalled (sans-I/O)."""
from pytest import approx

from wanlink.sched.hedging import HEDGE_FLOOR_S, HEDGE_ROUNDS, HEDGE_RTTS, StallWatch, behind, stall_after


def test_stall_time_is_a_multiple_of_the_round_trip_with_a_floor():
    assert stall_after(0.05) == HEDGE_RTTS * 0.05
    assert stall_after(0.0001) == HEDGE_FLOOR_S == stall_after(None)


def test_a_stream_stalls_only_while_it_holds_bytes_and_its_acks_stand_still():
    watch = StallWatch()
    assert watch.stalled_for(0, acked=100, outstanding=50, now=10.0) == 0.0  # first look
    assert watch.stalled_for(0, acked=100, outstanding=50, now=10.3) == approx(0.3)
    assert watch.stalled_for(0, acked=120, outstanding=30, now=10.4) == 0.0  # progress
    assert watch.stalled_for(0, acked=120, outstanding=30, now=10.6) == approx(0.2)
    assert watch.stalled_for(0, acked=120, outstanding=0, now=11.0) == 0.0  # holds nothing: not stalled
    assert watch.stalled_for(0, acked=120, outstanding=10, now=11.5) == approx(0.5)  # (since it last held nothing)
    assert watch.stalled_for(1, acked=0, outstanding=10, now=11.5) == 0.0  # streams apart
    watch.forget(0)
    assert watch.stalled_for(0, acked=120, outstanding=10, now=12.0) == 0.0
    watch.clear()
    assert watch.stalled_for(1, acked=0, outstanding=10, now=13.0) == 0.0


def test_a_stream_is_behind_when_its_bytes_need_more_round_trips_than_hedge_rounds_at_its_window():
    assert not behind(HEDGE_ROUNDS * 1000, 1000)
    assert behind(HEDGE_ROUNDS * 1000 + 1, 1000)
    assert not behind(0, 0)
