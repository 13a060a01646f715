"""density="auto": every rank switches at the same step, and error feedback stays exact across switches."""
import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from tests.support.worlds import run_world
from wanlink.errors import ConfigError

STEPS = 14
# bytes/s per step: extremes, so the controller's choice does not depend on measured compute times
SCHEDULE = [1e15] * 4 + [1.0] * 4 + [1e15] * 6
OPTIONS = {"window_s": 1e-3, "hold_s": 0.0}  # each decision from the latest sample alone


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 96), torch.nn.ReLU(), torch.nn.Linear(96, 64), torch.nn.ReLU(),
                               torch.nn.Linear(64, 10))


def _train_auto(rank, size, staleness, sparse_optimizer, schedule=SCHEDULE):
    """SGD with lr 1 and no momentum: the parameters move by exactly the sum of applied updates."""
    from wanlink.c10d.sparse_hook import BlockSparseState, block_sparse_hook
    from wanlink.optim import SparseSGD

    model = _model()
    start = [p.detach().clone() for p in model.parameters()]
    ddp = DDP(model, bucket_cap_mb=0.005)
    state = BlockSparseState(density="auto", min_density=0.01, max_density=0.5, staleness=staleness,
                             sparse_optimizer=sparse_optimizer, controller_options=OPTIONS,
                             bandwidth=lambda _now: schedule[min(state.iteration, STEPS - 1)])
    local_sums = {p: torch.zeros_like(p) for p in model.parameters()}
    layout = {}
    densities = []

    def hook(state, bucket):
        for param, grad in zip(bucket.parameters(), bucket.gradients()):
            local_sums[param] += grad.detach().view_as(param)  # this rank's own gradient, before the hook
        layout[bucket.index()] = list(bucket.parameters())
        return block_sparse_hook(state, bucket)

    ddp.register_comm_hook(state, hook)
    optimizer = SparseSGD(ddp.parameters(), lr=1.0) if sparse_optimizer else torch.optim.SGD(ddp.parameters(), lr=1.0)
    g = torch.Generator().manual_seed(100 + rank)
    for _ in range(STEPS):
        x, y = torch.randn(16, 32, generator=g), torch.randint(0, 10, (16,), generator=g)
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        densities.append(state.density)
        if sparse_optimizer:
            optimizer.step(sparse_grads=state.sparse_grads())
        else:
            optimizer.step()
    if state.flush():
        if sparse_optimizer:
            optimizer.step(sparse_grads=state.sparse_grads())
        else:
            optimizer.step()
    residuals = {}
    for index, params in layout.items():
        for param, sparsifier in zip(params, state._codecs[index].sparsifiers):
            residuals[param] = sparsifier.residual.view_as(param).clone()
    flat = lambda tensors: torch.cat([t.reshape(-1) for t in tensors])  # noqa: E731
    params = list(model.parameters())
    applied = flat([s - p.detach() for s, p in zip(start, params)])
    return (applied, flat([local_sums[p] for p in params]), flat([residuals[p] for p in params]), densities,
            state.density_stats())


@pytest.mark.parametrize("staleness, sparse_optimizer", [(0, False), (1, False), (1, True)])
def test_density_changes_keep_error_feedback_exact_and_ranks_in_step(staleness, sparse_optimizer):
    (applied0, sums0, res0, dens0, stats0), (applied1, sums1, res1, dens1, stats1) = run_world(
        2, _train_auto, staleness, sparse_optimizer)
    assert dens0 == dens1 and stats0["changes"] == stats1["changes"]  # one decision for every rank
    assert len(set(dens0)) >= 2 and len(stats0["changes"]) >= 2  # it went down and up again
    assert min(dens0) == 0.01 and max(dens0) == 0.5  # within the bounds, reaching both
    torch.testing.assert_close(applied0, applied1)  # ranks stay identical
    # nothing lost, nothing applied twice: applied + mean residual == mean of the local gradients
    torch.testing.assert_close(applied0 + (res0 + res1) / 2, (sums0 + sums1) / 2, rtol=1e-4, atol=1e-5)


def test_auto_density_options_are_validated():
    from wanlink.c10d.sparse_hook import BlockSparseState

    with pytest.raises(ConfigError, match="min_density <= max_density"):
        BlockSparseState(density="auto", min_density=0.1, max_density=0.01)
    with pytest.raises(ConfigError, match="max_density in"):
        BlockSparseState(density="auto", max_density=2.0)
    with pytest.raises(ConfigError, match="'auto'"):
        BlockSparseState(density="fast")
    state = BlockSparseState(density="auto", min_density=0.002, max_density=0.05)
    assert state.density == 0.002 and state.density_stats()["changes"] == []


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_rank0s_proposal_applies_two_steps_later_and_each_change_is_logged(caplog):
    from wanlink.c10d.auto_density import LAG, AutoDensity

    clock = FakeClock()
    auto = AutoDensity(min_density=0.001, max_density=0.1, staleness=1, clock=clock)
    densities = []
    with caplog.at_level("INFO", logger="wanlink.c10d.auto_density"):
        for step in range(8):
            clock.now = step * 1.0
            densities.append(auto.begin_step(step, full_bytes=1e6))
            started = auto.exchange_started(step)
            clock.now += 0.1
            auto.exchange_done(step, started, 1000, rank0_proposal=0.05 if step >= 3 else 0.001)
    assert densities == [0.001] * (3 + LAG) + [0.05] * (8 - 3 - LAG)
    assert auto.stats()["changes"] == [(3 + LAG, 0.05)]
    assert [r.getMessage() for r in caplog.records] == [
        "density 0.001 -> 0.05 from step 5 (bandwidth estimate 0.08 Mbit/s, compute 1.000 s per step)"]


def test_compute_time_excludes_the_exposed_wait_for_the_exchange():
    from wanlink.c10d.auto_density import AutoDensity

    clock = FakeClock()
    auto = AutoDensity(min_density=0.001, max_density=0.1, staleness=0, clock=clock,
                       bandwidth=lambda _now: 1e6)
    for step in range(5):  # 0.3 s of compute, then 0.2 s waiting for the exchange after the last bucket
        clock.now = step * 0.5
        auto.begin_step(step, full_bytes=1e6)
        started = auto.exchange_started(step)
        clock.now += 0.3
        auto.bucket_called(step)
        clock.now += 0.2
        auto.exchange_done(step, started, 1000, rank0_proposal=0.001)
    assert auto.last_decision.compute_s == pytest.approx(0.3)


def test_a_steps_bandwidth_sample_charges_one_latency_for_its_overlapping_exchanges():
    from wanlink.c10d.auto_density import AutoDensity

    clock = FakeClock()
    auto = AutoDensity(min_density=0.001, max_density=0.1, staleness=0, clock=clock)
    for step in range(2):
        clock.now = step * 10.0
        auto.begin_step(step, full_bytes=1e6)
        for duration in (0.1, 0.1, 0.3):  # 0.1 s of latency each, the last one also 0.2 s of transfer
            started = auto.exchange_started(step)
            clock.now += duration
            auto.exchange_done(step, started, 1000, rank0_proposal=0.001)
    clock.now = 20.0
    auto.begin_step(2, full_bytes=1e6)
    # 3000 bytes over 0.5 s of exchanges less two of the three 0.1 s latencies
    assert auto.controller.bandwidth_estimate(20.0) == pytest.approx(3000 / 0.3)


class _FakeLink:
    """What LinkDeliveryRate reads of a wanlink Link: its ``sending`` counters and the kernel's min RTT."""

    def __init__(self, rtt_s):
        from wanlink.probe.rate import SendingTime, WireTime

        self.sending, self.wire, self.probe_wire, self.rtt_s = SendingTime(), WireTime(), WireTime(), rtt_s
        self.loop, self.closed, self.probes_sent, self.streams_alive = self, False, [], 4

    def call_soon_threadsafe(self, _send, link, parts):  # LinkDeliveryRate.probe's way onto the loop
        assert link is self
        self.probes_sent.append(sum(map(len, parts)))
        self.parts = [len(part) for part in parts]

    def min_rtt_s(self):
        return self.rtt_s

    def open_since(self, probes):  # every message sent so far was acknowledged
        return None

    def burst(self, t: float, nbytes: int, seconds: float) -> None:
        """One message alone in its busy period."""
        self.sending.on_send(t)
        self.sending.on_ack(nbytes)
        self.sending.on_idle(t + seconds)
        self.wire.on_message(t, t + seconds, nbytes)

    def spread(self, t: float, nbytes: int, transfer_s: float, messages: int, apart_s: float) -> None:
        """``messages`` messages ``apart_s`` apart (a step's buckets), each alone on the wire for
        ``transfer_s`` and acked a round trip later: one busy period spanning them all."""
        for i in range(messages):
            self.sending.on_send(t + i * apart_s)
            self.sending.on_ack(nbytes)
            self.wire.on_message(t + i * apart_s, t + i * apart_s + transfer_s + self.rtt_s, nbytes)
        self.sending.on_idle(t + (messages - 1) * apart_s + transfer_s + self.rtt_s)


def test_by_default_the_links_busy_periods_feed_the_bandwidth_and_their_rtt_the_latency():
    from wanlink.c10d.auto_density import AutoDensity, LinkDeliveryRate

    clock, link = FakeClock(), _FakeLink(rtt_s=0.04)
    auto = AutoDensity(min_density=0.001, max_density=0.1, staleness=1, clock=clock,
                       link_rate=LinkDeliveryRate(lambda: [link]))
    for step in range(4):
        clock.now = step * 1.0
        auto.begin_step(step, full_bytes=1e6)
        started = auto.exchange_started(step)
        link.burst(clock.now, 1_000_000, 0.04 + 0.1)  # 1 MB at 10 MB/s after a 40 ms round trip
        clock.now += 0.9  # the exchange completes late (a slow peer): not the link's doing
        auto.exchange_done(step, started, 1_000_000, rank0_proposal=0.001)
    assert auto.controller.bandwidth_estimate(clock.now) == pytest.approx(10e6)
    assert auto.controller.latency_s == pytest.approx(0.04)
    assert auto.stats()["bandwidth_source"] == "link"


def test_messages_spread_over_a_backward_pass_read_as_their_wire_time_not_the_busy_period():
    """Three buckets 50 ms apart, 5 ms each on a 40 ms path: the busy period (0.145 s, one RTT off)
    reads 3 x 100 kB over 0.105 s; each message's own time on the wire reads the link (20 MB/s)."""
    from wanlink.c10d.auto_density import LinkDeliveryRate

    link = _FakeLink(rtt_s=0.04)
    rate = LinkDeliveryRate(lambda: [link])
    assert rate(0.0) is None  # baselines
    for step in range(10):
        link.spread(step * 1.0, 100_000, 0.005, messages=3, apart_s=0.05)
    assert rate(10.0) == pytest.approx(300_000 * 10 / (10 * 0.015))


def test_the_busy_periods_stand_in_while_the_messages_wire_time_is_short():
    from wanlink.c10d.auto_density import WIRE_MIN_S, LinkDeliveryRate

    link = _FakeLink(rtt_s=0.04)
    rate = LinkDeliveryRate(lambda: [link])
    rate(0.0)
    link.burst(0.0, 50_000, 0.04 + 0.01)  # 10 ms on the wire: too little for that meter
    assert WIRE_MIN_S > 0.01 and rate(1.0) == pytest.approx(50_000 / 0.01)  # the busy period's sample
    link.burst(2.0, 100_000, 0.04 + 0.03)  # busy: 100 kB / 30 ms; wire (10 ms carried over): 150 kB / 40 ms
    assert rate(3.0) == pytest.approx(150_000 / 0.04)  # the higher of the two latest samples


def test_without_links_the_exchange_times_stand_in():
    from wanlink.c10d.auto_density import AutoDensity, LinkDeliveryRate

    clock = FakeClock()
    auto = AutoDensity(min_density=0.001, max_density=0.1, staleness=0, clock=clock,
                       link_rate=LinkDeliveryRate(lambda: []))  # e.g. a gloo group
    for step in range(3):
        clock.now = step * 10.0
        auto.begin_step(step, full_bytes=1e6)
        started = auto.exchange_started(step)
        clock.now += 0.5
        auto.exchange_done(step, started, 1000, rank0_proposal=0.001)
    assert auto.controller.bandwidth_estimate(clock.now) == pytest.approx(1000 / 0.5)
    assert auto.stats()["bandwidth_source"] == "exchanges"


def _auto_on_links(rank, size):
    from wanlink.c10d.auto_density import group_links
    from wanlink.c10d.sparse_hook import BlockSparseState, block_sparse_hook

    ddp = DDP(_model(), bucket_cap_mb=0.005)
    state = BlockSparseState(density="auto", min_density=0.01, max_density=0.5)
    ddp.register_comm_hook(state, block_sparse_hook)
    g = torch.Generator().manual_seed(rank)
    for _ in range(6):
        torch.nn.functional.cross_entropy(ddp(torch.randn(16, 32, generator=g)), torch.randint(0, 10, (16,))).backward()
    return state.density_stats()["bandwidth_source"], [link.sending.reading() for link in group_links(None)]


def test_without_a_bandwidth_source_the_hook_reads_its_groups_links():
    # (the links carry the hook's all-gathers on the loop path; a one-host group's go express, off the links)
    for source, readings in run_world(2, _auto_on_links, env={"WANLINK_EXPRESS": "0"}):
        assert source == "link"
        [(acked, busy, periods)] = readings  # one link, to the other rank
        assert acked > 0 and busy > 0 and periods >= 5


def test_a_probe_burst_reads_the_path_where_small_messages_read_their_ack_delays():
    """Messages of 30 kB, each acknowledged 5 ms after its round trip (polls, loops): 6 MB/s. A
    probe of 2 MB is on the wire 20 ms: 100 MB/s, the highest lower bound, which stands until
    HOLD_S passes without another probe."""
    from wanlink.c10d.auto_density import HOLD_S, LinkDeliveryRate

    link = _FakeLink(rtt_s=0.04)
    rate = LinkDeliveryRate(lambda: [link])
    rate(0.0)
    for step in range(10):
        link.wire.on_message(step * 0.1, step * 0.1 + 0.045, 30_000)
    assert rate(1.0) == pytest.approx(6e6)
    link.probe_wire.on_message(1.0, 1.06, 2_000_000)
    assert rate(1.1) == pytest.approx(100e6)
    readings = []
    for t in (1.1 + HOLD_S, 1.2 + HOLD_S):  # each with a new sample of the messages' meter
        for i in range(5):
            link.wire.on_message(t - 0.06 + i * 0.01, t - 0.06 + i * 0.01 + 0.045, 30_000)
        readings.append(rate(t))
    # within the hold; then no probe since: the messages' meter alone
    assert readings == [pytest.approx(100e6), pytest.approx(6e6)]


def test_probes_go_out_at_most_every_so_often_sized_by_the_rate_seen_and_spread_over_the_streams():
    from wanlink.c10d.auto_density import LinkDeliveryRate
    from wanlink.probe.rate import ProbeSchedule

    link = _FakeLink(rtt_s=0.04)
    rate = LinkDeliveryRate(lambda: [link], probes=ProbeSchedule(every_s=1.0, growth=2.0, min_bytes=10_000,
                                                                   max_bytes=1_000_000))
    rate.probe(0.0)  # nothing measured yet: the smallest
    rate.probe(0.5)  # too soon
    rate.latest["wire"], rate.rtt_s = 2e6, 0.04
    rate.probe(1.0)  # a round trip at 2 x 2 MB/s
    assert link.parts == [40_000] * 4  # one part per stream
    rate.latest["probe"] = 100e6
    rate.probe(2.0)  # capped
    assert link.probes_sent == [10_000, 160_000, 1_000_000]
    assert LinkDeliveryRate(lambda: []).probe(0.0) is None  # no links (another backend): nothing to probe


def test_the_hook_probes_once_nothing_it_launched_is_in_flight():
    from wanlink.c10d.auto_density import AutoDensity, LinkDeliveryRate

    clock, link = FakeClock(), _FakeLink(rtt_s=0.04)
    auto = AutoDensity(min_density=0.001, max_density=0.1, staleness=1, clock=clock,
                       link_rate=LinkDeliveryRate(lambda: [link]))
    auto.begin_step(0, full_bytes=1e6)
    first, second = auto.exchange_started(0), auto.exchange_started(0)
    auto.exchange_done(0, first, 1000, rank0_proposal=0.001)
    assert link.probes_sent == []  # the step's second bucket is still on the wire
    auto.exchange_done(0, second, 1000, rank0_proposal=0.001)
    assert len(link.probes_sent) == 1


def test_steps_waiting_for_their_exchange_drop_the_held_samples_and_hold_back_the_probes():
    """0.1 s steps: while each exchange completes within its step, the probe's 100 MB/s stands and
    probes go out (once a second); once two steps in a row wait 60 ms for theirs (the path slowed
    down), the held sample goes, the messages' 4 MB/s stands alone, and no probe goes out until a
    step fits again."""
    from wanlink.c10d.auto_density import AutoDensity, LinkDeliveryRate

    clock, link = FakeClock(), _FakeLink(rtt_s=0.04)
    rate = LinkDeliveryRate(lambda: [link])
    auto = AutoDensity(min_density=0.001, max_density=0.1, staleness=0, clock=clock, link_rate=rate)

    def steps(first: int, last: int, late_s: float) -> None:
        for n in range(first, last):
            auto.begin_step(n, full_bytes=1e6)
            started = auto.exchange_started(n)
            link.wire.on_message(clock.now, clock.now + 0.065, 100_000)  # 25 ms past the RTT: 4 MB/s
            clock.now += 0.09
            auto.bucket_called(n)  # its last bucket; then DDP waits for the exchange
            clock.now += late_s
            auto.exchange_done(n, started, 100_000, rank0_proposal=0.001)
            clock.now += 0.01
            if n == 2:
                link.probe_wire.on_message(clock.now, clock.now + 0.06, 2_000_000)  # 100 MB/s

    steps(0, 5, late_s=0.0)
    assert rate.latest["probe"] == pytest.approx(100e6)
    probes = len(link.probes_sent)
    steps(5, 7, late_s=0.06)  # the second late step shows at the next step's start
    steps(7, 8, late_s=0.06)
    assert auto.controller.overruns == 1 and "probe" not in rate.latest
    assert auto.controller.bandwidth_estimate(clock.now) == pytest.approx(4e6)
    assert auto.stats()["exposed_s"] == pytest.approx(0.06)
    steps(8, 30, late_s=0.06)  # 3.5 s of late steps: no probe
    assert len(link.probes_sent) == probes
    steps(30, 50, late_s=0.0)
    assert len(link.probes_sent) > probes  # steps fit again: probing again
