"""DeliveryRateEstimator on simulated delivery traces (the clock is simulated)."""
import random

import pytest

from wanlink.errors import ConfigError
from wanlink.probe.rate import BurstRateMeter, DeliveryRateEstimator, KernelAcks, SendingTime, WireTime

MB = 1_000_000


def deliver(est, rate, start, end, *, chunk=64 * 1024, jitter=0.0, rng=None):
    """Deliveries of ``chunk`` bytes at ``rate`` bytes/s over [start, end); returns the end time."""
    t = start
    while True:
        gap = chunk / rate
        if jitter:
            gap *= rng.expovariate(1.0) if jitter == "exp" else 1 + rng.uniform(-jitter, jitter)
        t += gap
        if t >= end:
            return end
        est.on_delivery(chunk, t)


def test_none_before_a_full_window():
    est = DeliveryRateEstimator(window_s=0.5)
    assert est.estimate() is None
    deliver(est, 100 * MB, 0.0, 0.4)
    assert est.estimate() is None and est.age(1.0) is None


def test_steady_rate_is_measured():
    est = DeliveryRateEstimator()
    deliver(est, 100 * MB, 0.0, 5.0)
    assert est.estimate() == pytest.approx(100 * MB, rel=0.02)


def test_follows_a_drop_within_a_second():
    est = DeliveryRateEstimator(window_s=0.5, horizon_s=3.0, percentile=10)
    deliver(est, 100 * MB, 0.0, 5.0)
    deliver(est, 20 * MB, 5.0, 6.0)
    assert est.estimate() <= 20 * MB * 1.1


def test_follows_a_rise_within_the_horizon_and_errs_low_until_then():
    est = DeliveryRateEstimator(window_s=0.5, horizon_s=3.0, percentile=10)
    deliver(est, 20 * MB, 0.0, 5.0)
    deliver(est, 100 * MB, 5.0, 6.0)
    assert est.estimate() < 50 * MB  # one second of the higher rate is not yet believed
    deliver(est, 100 * MB, 6.0, 9.5)
    assert est.estimate() == pytest.approx(100 * MB, rel=0.05)


@pytest.mark.parametrize("seed", range(5))
def test_noisy_deliveries_err_low(seed):
    rng = random.Random(seed)
    est = DeliveryRateEstimator()
    deliver(est, 50 * MB, 0.0, 10.0, jitter="exp", rng=rng)
    measured = est.total_bytes / 10.0
    assert est.estimate() <= measured
    assert est.estimate() >= 0.5 * measured


def test_application_idle_time_is_not_counted():
    est = DeliveryRateEstimator(idle_gap_s=None)
    deliver(est, 100 * MB, 0.0, 2.0)
    est.on_idle(2.0)
    deliver(est, 100 * MB, 4.0, 6.0)  # two idle seconds in between
    assert est.estimate() == pytest.approx(100 * MB, rel=0.03)


def test_long_gaps_start_a_new_window_without_on_idle():
    est = DeliveryRateEstimator(idle_gap_s=1.0)
    deliver(est, 100 * MB, 0.0, 2.0)
    deliver(est, 100 * MB, 3.5, 6.0)
    assert est.estimate() == pytest.approx(100 * MB, rel=0.03)
    est2 = DeliveryRateEstimator(idle_gap_s=None)
    deliver(est2, 100 * MB, 0.0, 2.0)
    deliver(est2, 100 * MB, 3.5, 6.0)
    assert est2.estimate() < 60 * MB  # without the rule, the gap reads as a slow link


def test_memory_stays_bounded_with_tiny_deliveries():
    est = DeliveryRateEstimator(window_s=0.5, horizon_s=3.0)
    deliver(est, 100 * MB, 0.0, 5.0, chunk=1000)  # half a million deliveries
    assert len(est._run) <= 40 and est.samples <= 3.0 / (0.5 / 8) + 2
    assert est.estimate() == pytest.approx(100 * MB, rel=0.02)


def test_estimate_holds_when_deliveries_stop():
    est = DeliveryRateEstimator()
    deliver(est, 100 * MB, 0.0, 5.0)
    assert est.age(15.0) == pytest.approx(10.0, abs=0.1)
    assert est.estimate() == pytest.approx(100 * MB, rel=0.02)


def test_bad_input():
    with pytest.raises(ConfigError):
        DeliveryRateEstimator(window_s=3.0, horizon_s=1.0)
    with pytest.raises(ConfigError):
        DeliveryRateEstimator(percentile=150)
    with pytest.raises(ConfigError):
        DeliveryRateEstimator(idle_gap_s=0)
    est = DeliveryRateEstimator()
    est.on_delivery(10, 5.0)
    with pytest.raises(ConfigError):
        est.on_delivery(10, 4.0)
    with pytest.raises(ConfigError):
        est.on_delivery(-1, 6.0)
    with pytest.raises(ConfigError):
        est.on_delivery(1, float("nan"))



# -- SendingTime and BurstRateMeter: a link's transfer rate from its busy periods, net of their round trips ----

def test_sending_time_counts_busy_periods_and_the_bytes_acked_by_their_end():
    sending = SendingTime()
    sending.on_send(1.0)
    sending.on_send(1.01)  # a second message while busy: the same period
    sending.on_ack(100)
    assert sending.reading() == (0, 0.0, 0)  # nothing complete yet
    sending.on_ack(50)
    sending.on_idle(1.2)
    sending.on_idle(5.0)  # idle again without a send: nothing
    assert sending.reading() == (150, pytest.approx(0.2), 1)


def test_burst_rate_meter_takes_one_round_trip_per_burst_off_the_busy_time():
    meter = BurstRateMeter(min_busy_s=0.05)
    assert meter.update([("a", 0, 0.0, 0)], rtt_s=0.04) is None  # a baseline only
    # 10 bursts of 1 MB at 100 MB/s with a 40 ms round trip: 50 ms busy each
    assert meter.update([("a", 10 * MB, 0.5, 10)], rtt_s=0.04) == pytest.approx(100 * MB)


def test_burst_rate_meter_never_claims_more_than_its_bursts_resolve():
    meter = BurstRateMeter(min_busy_s=0.05, resolution_s=0.005)
    meter.update([("a", 0, 0.0, 0)], rtt_s=0.04)
    # 4 bursts of 25 kB, each acked a round trip after it left: the rate is unseen; at most 25 kB per 5 ms
    assert meter.update([("a", 100_000, 0.16, 4)], rtt_s=0.04) == pytest.approx(100_000 / 0.02)


def test_burst_rate_meter_carries_short_busy_time_over_and_rebases_restarted_counters():
    meter = BurstRateMeter(min_busy_s=0.05)
    meter.update([("a", 5 * MB, 10.0, 100)], rtt_s=0.0)
    assert meter.update([("a", 5 * MB + 1000, 10.02, 101)], rtt_s=0.0) is None  # 20 ms busy: too little
    assert meter.update([("a", 6 * MB, 10.1, 102)], rtt_s=0.0) == pytest.approx(MB / 0.1)
    # a new link, and a's counters from zero (a new Link): baselines only
    assert meter.update([("a", 0, 0.0, 0), ("b", 9 * MB, 1.0, 5)], rtt_s=0.0) is None
    assert meter.update([("a", MB, 0.1, 1), ("b", 9 * MB, 1.0, 5)], rtt_s=0.0) == pytest.approx(MB / 0.1)


def test_burst_rate_meter_refuses_non_positive_settings():
    with pytest.raises(ConfigError, match="min_busy_s and resolution_s"):
        BurstRateMeter(min_busy_s=0)


# -- WireTime: each message from its send to its last ack, less the round trip, overlaps once ----

def test_wire_time_counts_each_message_from_its_send_to_its_last_ack_less_the_round_trip():
    wire = WireTime()
    wire.on_message(1.0, 1.06, 100)  # 20 ms on the wire after a 40 ms round trip
    assert wire.reading(rtt_s=0.04) == (100, pytest.approx(0.02), 1)
    assert wire.reading(rtt_s=0.04) == (100, pytest.approx(0.02), 1)  # nothing new: the same counters


def test_wire_time_leaves_out_the_gaps_between_messages_and_counts_overlap_once():
    """A step's buckets leave tens of ms apart, each waiting a round trip for its acks: one busy
    period of 0.1 s here for 36 ms of transmission. Messages overlapping on the wire (one queued
    behind another, or one overtaken by an earlier deadline) share their time."""
    wire = WireTime()
    rtt = 0.04
    wire.on_message(0.00, 0.05, 1000)  # on the wire 0.00-0.01
    wire.on_message(0.03, 0.08, 1000)  # 0.03-0.04: the 20 ms gap before it does not count
    wire.on_message(0.045, 0.10, 1000)  # 0.045-0.06
    wire.on_message(0.05, 0.09, 1000)  # 0.05-0.051 (1 ms resolution), inside the one above: it overtook it
    assert wire.reading(rtt) == (4000, pytest.approx(0.035), 4)
    wire.on_message(0.055, 0.12, 500)  # finished later, overlapping what was counted: 0.06-0.08 only
    assert wire.reading(rtt) == (4500, pytest.approx(0.055), 5)


def test_wire_time_holds_back_messages_overlapping_one_still_open():
    """Two 1 MB parts sent together on two streams, on the wire 50 and 60 ms: read while the second
    is open, the first waits for it, and both count over their union (33 MB/s); read apart, the
    second's bytes would count over only its 10 ms tail (100 MB/s, five times the path's share)."""
    held, apart = WireTime(), WireTime()
    for wire in (held, apart):
        wire.on_message(0.0, 0.09, 1_000_000)  # 50 ms past the 40 ms round trip
    assert held.reading(0.04, open_since=0.001) == (0, 0.0, 0)  # the second part is still open
    first = apart.reading(0.04)
    for wire in (held, apart):
        wire.on_message(0.001, 0.1, 1_000_000)
    acked, seconds, messages = held.reading(0.04)
    assert messages == 2 and acked / seconds == pytest.approx(2_000_000 / 0.06)
    acked, seconds, _ = apart.reading(0.04)
    assert (acked - first[0]) / (seconds - first[1]) == pytest.approx(1_000_000 / 0.01)
    later = WireTime()
    later.on_message(0.0, 0.09, 1_000_000)
    assert later.reading(0.04, open_since=0.2)[0] == 1_000_000  # it ended before the open one began


def test_wire_time_never_credits_a_message_with_less_than_its_resolution():
    wire = WireTime(resolution_s=0.005)
    wire.on_message(0.0, 0.03, 25_000)  # acknowledged within the round trip: the rate is unseen
    assert wire.reading(rtt_s=0.04) == (25_000, pytest.approx(0.005), 1)
    with pytest.raises(ConfigError, match="resolution_s"):
        WireTime(resolution_s=0)


# -- KernelAcks: when the peer's kernel acknowledged each message's last byte -------------------

def test_kernel_acks_end_a_message_at_the_first_poll_covering_every_stream_it_went_into():
    acks = KernelAcks()
    acks.written("m", 0, 1000)  # a chunk on stream 0 ends at kernel byte 1000, one on stream 1 at 500
    acks.written("m", 1, 500)
    acks.poll({0: 1000, 1: 500}, 1.0)  # covered, but not written in full yet: no end
    assert acks.awaited() == set()
    acks.all_written("m")
    assert acks.awaited() == {0, 1}
    acks.poll({0: 1000, 1: 499}, 2.0)  # stream 1 still owes a byte
    acks.poll({0: 1000}, 2.5)  # a stream missing from a poll acknowledged nothing more
    acks.poll({0: 1200, 1: None}, 2.6)  # nor one whose counters could not be read
    assert acks.awaited() == {0, 1}
    acks.poll({0: 1200, 1: 600}, 3.0)
    assert acks.awaited() == set()
    acks.poll({0: 1300, 1: 700}, 4.0)  # later polls keep the first end
    assert acks.finish("m", 9.0) == 3.0 and len(acks) == 0


def test_kernel_acks_fall_back_to_the_applications_ack_and_never_end_after_it():
    acks = KernelAcks()
    assert acks.finish("never written", 5.0) == 5.0  # a Unix socket, or a message not tracked
    acks.written("m", 0, 100)
    acks.all_written("m")
    assert acks.finish("m", 6.0) == 6.0  # no poll saw it: a stream died, or the ack beat the poll
    acks.written("n", 0, 100)
    acks.written("n", 0, 50)  # positions only grow (a re-sent chunk written earlier on the stream)
    acks.all_written("n")
    acks.poll({0: 100}, 8.0)
    assert acks.finish("n", 7.5) == 7.5  # the caller's time if it is the earlier


# -- ProbeSchedule: probe bursts that grow with the rate they show -------------------------------

def test_probe_schedule_sizes_each_probe_for_a_round_trip_at_twice_the_rate_seen_at_most_every_so_often():
    from wanlink.probe.rate import ProbeSchedule

    probes = ProbeSchedule(every_s=1.0, growth=2.0, min_bytes=64_000, max_bytes=4_000_000)
    assert probes.due(0.0, None, 0.04) == 64_000  # nothing measured: the smallest
    assert probes.due(0.9, 10e6, 0.04) is None  # under every_s since the last
    assert probes.due(1.0, 10e6, 0.04) == 800_000  # a 40 ms round trip at 2 x 10 MB/s
    assert probes.due(2.0, 10e6, None) == 64_000  # no round trip known
    assert probes.due(3.0, 0.5e6, 0.04) == 64_000 and probes.due(4.5, 1e9, 0.04) == 4_000_000  # clamped
    assert ProbeSchedule.parts(800_002, 4) == [200_001, 200_001, 200_000, 200_000]
    assert ProbeSchedule.parts(3, 8) == [1, 1, 1] and ProbeSchedule.parts(5, 0) == [5]
    with pytest.raises(ConfigError, match="growth >= 1"):
        ProbeSchedule(growth=0.5)


def _window_limited_crossing(parts: list[int], windows: list[float], rtt_s: float, path_Bps: float) -> float:
    """A toy of slow start: each round trip every stream sends what its window allows of its part,
    serialised at the path's rate; a window that limited its stream doubles. Seconds to the last ack."""
    left, seconds = list(parts), 0.0
    while any(left):
        sent = [min(window, rest) for window, rest in zip(windows, left)]
        for i, (window, rest) in enumerate(zip(windows, left)):
            if rest > window:
                windows[i] = 2 * window
            left[i] = rest - sent[i]
        seconds += rtt_s + sum(sent) / path_Bps
    return seconds


def test_probes_asking_for_more_than_the_windows_allow_grow_them_until_they_read_the_path():
    """Four streams whose windows shrank to 100 kB each after a drop (10 MB/s over 40 ms) on a path
    that carries 125 MB/s again: each probe, sized by ProbeSchedule and spread over the streams,
    asks every window for more than it allows; the rate it reads (a lower bound: one round trip
    off) grows a probe until it meets the path's, and every window grows, as a step's messages go
    to any stream. Sent on one stream, the other windows stay as they were."""
    from wanlink.probe.rate import ProbeSchedule

    rtt, path = 0.04, 125e6
    readings, windows = {}, {}
    for spread in (True, False):
        probes, windows[spread], rate = ProbeSchedule(max_bytes=4 * 2**20), [100e3] * 4, 10e6
        readings[spread] = []
        for second in range(6):
            size = probes.due(float(second), rate, rtt)
            parts = ProbeSchedule.parts(size, 4 if spread else 1) + [0] * (0 if spread else 3)
            rate = size / (_window_limited_crossing(parts, windows[spread], rtt, path) - rtt)
            readings[spread].append(rate)
    assert readings[True][0] > 1.5 * 10e6 and readings[True][3] > 0.8 * path
    assert all(later > earlier for earlier, later in zip(readings[True], readings[True][1:4]))
    assert min(windows[True]) >= 2**20 and windows[False][1:] == [100e3] * 3
