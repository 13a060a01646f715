"""The DP-cell scheduler on simulated timelines: members send their shares at true rates on a fake clock."""
import collections

import pytest

from wanlink.errors import ConfigError, PeerLost
from wanlink.sched.cells import CellScheduler, SendShare, TransferFailed, TransferFinished, split_by_rate

MiB = 1024 * 1024
MB_S = 1e6  # 1 MB/s


class SimulatedCell:
    """A cell whose members send their shares at ``true_rates`` while the simulated clock advances.

    Events happen at share completions, at scheduled submissions and at scheduled deaths; a member
    reports its delivered bytes when a share completes, and the partial bytes of its current share
    just before it dies (what the receiver acknowledged).
    """

    def __init__(self, true_rates, estimates=None, **kwargs):
        self.now = 0.0
        self.true_rates = dict(true_rates)
        ranks = list(true_rates)
        rates = estimates or [true_rates[r] for r in ranks]
        self.scheduler = CellScheduler(ranks, rates, clock=lambda: self.now, **kwargs)
        self.pending = {rank: collections.deque() for rank in ranks}  # [SendShare, bytes left, started]
        self.segments = []  # (key, rank, offset, length, start, end): bytes that crossed the WAN
        self.finished, self.failed, self.owners = {}, {}, []
        self.events = []  # (time, kind, args)
        self.dead = set()

    def at(self, time, kind, *args):
        self.events.append((time, kind, args))

    def apply(self, actions):
        for action in actions:
            if isinstance(action, SendShare):
                queue = self.pending[action.rank]
                queue.append([action, float(action.length), self.now])
                if action.key not in self.owners:
                    self.owners.append(action.key)
            elif isinstance(action, TransferFinished):
                self.finished[action.key] = action
            else:
                assert isinstance(action, TransferFailed)
                self.failed[action.key] = action.error
                for queue in self.pending.values():
                    for item in [i for i in queue if i[0].key == action.key]:
                        queue.remove(item)

    def _advance(self, dt):
        for rank, queue in self.pending.items():
            if queue:
                queue[0][1] -= dt * self.true_rates[rank]
        self.now += dt

    def _complete_heads(self):
        for rank, queue in self.pending.items():
            while queue and queue[0][1] <= 1e-6:
                share, _left, started = queue.popleft()
                self.segments.append((share.key, rank, share.offset, share.length, started, self.now))
                if queue:
                    queue[0][2] = self.now
                self.apply(self.scheduler.progress(rank, share.length))

    def run(self):
        self.events.sort(key=lambda e: e[0])
        while True:
            heads = [q[0][1] / self.true_rates[r] for r, q in self.pending.items() if q]
            next_share = self.now + min(heads) if heads else None
            next_event = self.events[0][0] if self.events else None
            if next_share is None and next_event is None:
                return self
            if next_event is not None and (next_share is None or next_event <= next_share):
                time, kind, args = self.events.pop(0)
                self._advance(time - self.now)
                self._complete_heads()
                getattr(self, "_" + kind)(*args)
            else:
                self._advance(next_share - self.now)
                self._complete_heads()

    def _submit(self, source, nbytes, key):
        self.apply(self.scheduler.submit(source, nbytes, key))

    def _die(self, rank):
        queue = self.pending[rank]
        if queue:
            share, left, started = queue[0]
            delivered = int(share.length - left)
            self.segments.append((share.key, rank, share.offset, delivered, started, self.now))
            self.apply(self.scheduler.progress(rank, delivered))
        queue.clear()
        self.dead.add(rank)
        self.apply(self.scheduler.member_lost(rank))

    # -- what the tests check ---------------------------------------------------------------

    def windows(self):
        """Each transfer's WAN phase: first byte sent to last byte delivered."""
        spans = collections.defaultdict(list)
        for key, _rank, _offset, _length, start, end in self.segments:
            spans[key] += [start, end]
        return {key: (min(times), max(times)) for key, times in spans.items()}

    def assert_exclusive_turns(self):
        windows = sorted(self.windows().values())
        for (_s1, end), (start, _e2) in zip(windows, windows[1:]):
            assert end <= start + 1e-9, f"WAN phases overlap: {windows}"

    def assert_delivered_once(self, key, nbytes):
        pieces = sorted((o, n) for k, _r, o, n, _s, _e in self.segments if k == key and n)
        position = 0
        for offset, length in pieces:
            assert offset == position, f"gap or overlap at byte {position} of {key}: {pieces}"
            position += length
        assert position == nbytes


def test_split_is_proportional_contiguous_and_whole_granules():
    shares = split_by_rate(10 * MiB, [(5, 1.0), (6, 3.0), (7, 1.0)], MiB)
    assert shares == [(5, 0, 2 * MiB), (6, 2 * MiB, 6 * MiB), (7, 8 * MiB, 2 * MiB)]
    ragged = split_by_rate(3 * MiB + 7, [(0, 1.0), (1, 1.0)], MiB)
    assert ragged == [(0, 0, 2 * MiB), (1, 2 * MiB, MiB + 7)]  # the tie goes to the earlier member


def test_split_leaves_out_members_with_nothing_to_send():
    assert split_by_rate(MiB, [(0, 1.0), (1, 1.0), (2, 1.0)], MiB) == [(0, 0, MiB)]
    assert split_by_rate(0, [(0, 1.0)], MiB) == []
    assert split_by_rate(5, [(0, 1.0), (1, 100.0)], 1) == [(1, 0, 5)]


def test_one_transfer_gets_the_cells_aggregate_rate():
    cell = SimulatedCell({0: MB_S, 1: MB_S, 2: MB_S, 3: MB_S})
    cell.at(0.0, "submit", 0, 64 * MiB, "t")
    cell.run()
    assert [(s[1], s[3]) for s in cell.segments] == [(r, 16 * MiB) for r in range(4)]
    assert cell.finished["t"].finished == pytest.approx(64 * MiB / (4 * MB_S))
    cell.assert_delivered_once("t", 64 * MiB)


def test_unequal_rates_get_proportional_shares_that_end_together():
    rates = {0: 1 * MB_S, 1: 2 * MB_S, 2: 5 * MB_S}
    cell = SimulatedCell(rates)
    cell.at(0.0, "submit", 1, 80 * MiB, "t")
    cell.run()
    lengths = {rank: length for _k, rank, _o, length, _s, _e in cell.segments}
    assert lengths == {0: 10 * MiB, 1: 20 * MiB, 2: 50 * MiB}
    ends = [end for *_rest, end in cell.segments]
    assert max(ends) == pytest.approx(min(ends)) == pytest.approx(80 * MiB / (8 * MB_S))
    assert [rank for _k, rank, offset, *_rest in cell.segments if offset == 0] == [1]  # the source's share first


def test_rates_are_measured_from_finished_shares():
    true = {0: 1 * MB_S, 1: 3 * MB_S}
    cell = SimulatedCell(true, estimates=[2 * MB_S, 2 * MB_S], smoothing=1.0)
    cell.at(0.0, "submit", 0, 40 * MiB, "first")
    cell.at(100.0, "submit", 0, 40 * MiB, "second")
    cell.run()
    assert cell.scheduler.rates() == pytest.approx(true)
    first, second = cell.finished["first"], cell.finished["second"]
    assert first.finished - first.started == pytest.approx(20 * MiB / MB_S)  # the slow member held the turn
    assert second.finished - second.started == pytest.approx(40 * MiB / (4 * MB_S))


class RelayingCell(SimulatedCell):
    """A SimulatedCell whose members start a share they carry for another member's transfer only
    ``local_phase`` seconds after the grant (the share first crosses the local network)."""

    def __init__(self, true_rates, local_phase, **kwargs):
        super().__init__(true_rates, **kwargs)
        self.local_phase, self.sources = local_phase, {}

    def _submit(self, source, nbytes, key):
        self.sources[key] = source
        super()._submit(source, nbytes, key)

    def apply(self, actions):
        super().apply(actions)
        for action in actions:
            if isinstance(action, SendShare) and action.rank != self.sources[action.key]:
                self.pending[action.rank][-1][1] += self.local_phase * self.true_rates[action.rank]

    def turn_ends(self, key):
        return [end for k, _rank, _offset, _length, _start, end in self.segments if k == key]


def test_relayed_shares_get_less_so_a_turns_shares_end_together_despite_the_local_phase():
    rate, local_phase = 50 * MB_S, 0.1
    cell = RelayingCell({0: rate, 1: rate}, local_phase, estimates=[100 * MB_S, 100 * MB_S])
    sizes = [16 * MiB] * 4 + [128 * MiB] * 4  # small transfers first (a warm-up), then large ones
    for turn, size in enumerate(sizes):  # two pipelines, queued at once: turns alternate
        cell.at(0.0, "submit", turn % 2, size, turn)
    cell.run()
    cell.assert_exclusive_turns()
    granule_time = MiB / rate
    for turn in range(2, len(sizes)):  # both members measured in both roles after the first two turns
        ends = cell.turn_ends(turn)
        assert max(ends) - min(ends) <= granule_time + 1e-9, (turn, ends)
        finished = cell.finished[turn]
        # both links busy to the end: the turn lasts its bytes at the cell's rate plus half the local phase
        assert finished.finished - finished.started == pytest.approx(sizes[turn] / (2 * rate) + local_phase / 2,
                                                                     abs=granule_time)
    assert cell.scheduler.rates() == pytest.approx({0: rate, 1: rate})
    assert cell.scheduler.lags() == pytest.approx({0: local_phase, 1: local_phase})


def test_a_member_whose_local_phase_outlasts_the_turn_gets_no_share():
    cell = RelayingCell({0: 50 * MB_S, 1: 50 * MB_S}, local_phase=1.0)
    for turn in range(4):  # measure both members' lags on 64 MiB transfers
        cell.at(0.0, "submit", turn % 2, 64 * MiB, turn)
    cell.at(100.0, "submit", 0, 20 * MiB, "small")  # 0.42 s alone: shorter than rank 1's local phase
    cell.run()
    assert [(rank, length) for key, rank, _o, length, _s, _e in cell.segments if key == "small"] == [(0, 20 * MiB)]


def test_pipelines_take_turns_by_local_dp_rank_without_overlap():
    cell = SimulatedCell({10: MB_S, 11: MB_S, 12: MB_S})
    for pipeline in (12, 10, 11):
        cell.at(0.0, "submit", pipeline, 6 * MiB, (pipeline, "a"))
        cell.at(0.0, "submit", pipeline, 6 * MiB, (pipeline, "b"))
    cell.run()
    # 12 submitted first and found the cell idle; then round the LocalDPRanks after it.
    assert cell.owners == [(12, "a"), (10, "a"), (11, "a"), (12, "b"), (10, "b"), (11, "b")]
    cell.assert_exclusive_turns()
    for key in cell.owners:
        cell.assert_delivered_once(key, 6 * MiB)
        assert cell.finished[key].finished - cell.finished[key].started == pytest.approx(6 * MiB / (3 * MB_S))


def test_turns_beat_fair_sharing_on_mean_completion_and_match_it_on_the_last():
    rates = {0: MB_S, 1: MB_S}
    cell = SimulatedCell(rates)
    for pipeline in rates:
        cell.at(0.0, "submit", pipeline, 128 * MiB, pipeline)
    cell.run()
    cell.assert_exclusive_turns()
    turns = sorted(f.finished for f in cell.finished.values())
    fair = 2 * 128 * MiB / (2 * MB_S)  # each pipeline on its own member's link: both end together
    assert turns[1] == pytest.approx(fair)
    assert sum(turns) / 2 == pytest.approx(0.75 * fair)


def test_a_member_dying_mid_turn_leaves_its_remainder_to_the_survivors():
    cell = SimulatedCell({0: MB_S, 1: MB_S, 2: 2 * MB_S})
    cell.at(0.0, "submit", 0, 40 * MiB, "t")
    cell.at(3.0, "die", 1)
    cell.at(30.0, "submit", 2, 30 * MiB, "after")
    cell.run()
    assert not cell.failed
    cell.assert_delivered_once("t", 40 * MiB)
    dead_share = [s for s in cell.segments if s[0] == "t" and s[1] == 1]
    assert dead_share == [("t", 1, 10 * MiB, 3 * MB_S, 0.0, 3.0)]
    resplit = [s for s in cell.segments if s[0] == "t" and s[4] > 0]
    assert {s[1] for s in resplit} == {0, 2}  # the rest went over the live members only
    assert {s[1] for s in cell.segments if s[0] == "after"} == {0, 2}
    cell.assert_delivered_once("after", 30 * MiB)
    cell.assert_exclusive_turns()
    assert set(cell.scheduler.rates()) == {0, 2}


def test_the_source_dying_fails_its_transfers_naming_it_and_the_cell_moves_on():
    cell = SimulatedCell({0: MB_S, 1: MB_S, 2: MB_S}, site="lab")
    cell.at(0.0, "submit", 1, 30 * MiB, "mine")
    cell.at(0.0, "submit", 1, 30 * MiB, "mine-queued")
    cell.at(0.0, "submit", 2, 30 * MiB, "other")
    cell.at(4.0, "die", 1)
    cell.at(5.0, "submit", 1, MiB, "too-late")
    cell.run()
    assert set(cell.failed) == {"mine", "mine-queued", "too-late"}
    for error in cell.failed.values():
        assert isinstance(error, PeerLost) and isinstance(error, ConnectionError)
        assert "rank 1" in str(error) and "LocalDPRank 1" in str(error) and "'lab'" in str(error)
    assert cell.finished["other"].started == pytest.approx(4.0)
    cell.assert_delivered_once("other", 30 * MiB)
    assert not any(s[0] == "mine" and s[4] >= 4.0 for s in cell.segments)  # no share of it was sent after


def test_forecast_matches_the_timeline_when_rates_are_known():
    cell = SimulatedCell({0: MB_S, 1: 3 * MB_S})
    scheduler = cell.scheduler
    for key, (source, size) in enumerate([(0, 40 * MiB), (0, 8 * MiB), (1, 16 * MiB)]):
        cell.apply(scheduler.submit(source, size, key))
    forecast = scheduler.forecast()
    cell.run()
    assert [key for key, _s, _e in forecast] == [0, 2, 1]
    for key, start, end in forecast:
        assert (cell.finished[key].started, cell.finished[key].finished) == pytest.approx((start, end))
    assert scheduler.forecast() == [] and scheduler.owner is None and scheduler.queued() == 0


def test_an_empty_transfer_finishes_at_once_and_the_next_one_starts():
    clock = [7.0]
    scheduler = CellScheduler([0, 1], [MB_S, MB_S], clock=lambda: clock[0])
    assert scheduler.submit(0, 0, "empty") == [TransferFinished("empty", 0, 7.0, 7.0)]
    actions = scheduler.submit(1, 2 * MiB, "next")
    assert actions == [SendShare("next", 1, 0, MiB), SendShare("next", 0, MiB, MiB)]
    assert scheduler.owner == "next" and scheduler.local_rank(1) == 1


@pytest.mark.parametrize("ranks, rates, kwargs", [
    ([], [], {}),
    ([0, 0], [1.0, 1.0], {}),
    ([0, 1], [1.0], {}),
    ([0], [0.0], {}),
    ([0], [float("inf")], {}),
    ([0], ["fast"], {}),
    ([0], [1.0], {"granule": 0}),
    ([0], [1.0], {"smoothing": 0.0}),
])
def test_bad_cells_are_refused(ranks, rates, kwargs):
    with pytest.raises(ConfigError):
        CellScheduler(ranks, rates, clock=lambda: 0.0, **kwargs)


def test_misuse_is_refused_with_what_the_caller_knows():
    scheduler = CellScheduler([4, 5], [MB_S, MB_S], clock=lambda: 0.0)
    with pytest.raises(ConfigError, match=r"rank 9 is not a member .*\[4, 5\]"):
        scheduler.submit(9, 10, "x")
    with pytest.raises(ConfigError, match="non-negative"):
        scheduler.submit(4, -1, "x")
    scheduler.submit(4, 4 * MiB, "x")
    with pytest.raises(ConfigError, match="already queued"):
        scheduler.submit(5, 10, "x")
    with pytest.raises(ConfigError, match=f"rank 5 reported {2 * MiB + 1} bytes"):
        scheduler.progress(5, 2 * MiB + 1)
    assert scheduler.member_lost(5) and scheduler.member_lost(5) == []
    assert scheduler.progress(5, 10) == []  # a late report from a lost member is ignored


def test_cancelling_ends_the_owners_turn_at_once_and_drops_a_queued_transfer():
    now = [0.0]
    cell = CellScheduler([0, 1], [MB_S, MB_S], clock=lambda: now[0])
    assert [a.key for a in cell.submit(0, 4 * MiB, "first")] == ["first", "first"]
    assert cell.submit(1, 4 * MiB, "queued") == [] and cell.submit(0, 2 * MiB, "dropped") == []
    assert cell.cancel("dropped") == [] and cell.queued() == 1
    now[0] = 1.0
    actions = cell.cancel("first")  # its source gave up: the turn passes on without it
    assert cell.owner == "queued" and {a.key for a in actions} == {"queued"}
    assert cell.cancel("first") == [] and cell.cancel("never") == []
    assert cell.progress(1, 2 * MiB) == [] and cell.progress(0, 2 * MiB)[0].key == "queued"
    assert cell.owner is None and cell.queued() == 0


def test_bytes_moved_to_a_member_that_drained_first_are_its_to_report_and_measure_it():
    """The source dealt the tail of member 1's share to member 0 (``move``): member 1's share ends
    early, member 0 reports its share and the moved bytes, and the rates follow what each delivered."""
    now = [0.0]
    cell = CellScheduler([0, 1], [MB_S, MB_S], clock=lambda: now[0], smoothing=1.0)
    shares = cell.submit(0, 8 * MiB, "t")
    assert [(a.rank, a.offset, a.length) for a in shares] == [(0, 0, 4 * MiB), (1, 4 * MiB, 4 * MiB)]
    now[0] = 2.0
    cell.move("t", 1, 0, 2 * MiB)
    assert cell.progress(1, 2 * MiB) == []  # member 1's share is now its first 2 MiB
    now[0] = 6.0
    (finished,) = cell.progress(0, 6 * MiB)
    assert finished == TransferFinished("t", 8 * MiB, 0.0, 6.0)
    assert cell.rates() == pytest.approx({0: MiB, 1: MiB})  # 6 MiB in 6 s (both shares), 2 MiB in 2 s
    cell.submit(1, 4 * MiB, "u")
    cell.move("u", 0, 1, 2 * MiB)  # the whole of member 0's share: it has nothing left to report
    (finished,) = cell.progress(1, 4 * MiB)
    assert finished.key == "u"


def test_moves_that_do_not_fit_are_refused():
    cell = CellScheduler([0, 1], [MB_S, MB_S], clock=lambda: 0.0)
    with pytest.raises(ConfigError, match="does not own the cell"):
        cell.move("t", 1, 0, MiB)
    cell.submit(0, 8 * MiB, "t")
    with pytest.raises(ConfigError, match=f"cannot move {4 * MiB + 1} bytes .* rank 1, which has {4 * MiB}"):
        cell.move("t", 1, 0, 4 * MiB + 1)
    cell.member_lost(0)  # (the source: the transfer failed)
    cell.submit(1, 8 * MiB, "u")
    with pytest.raises(ConfigError, match="rank 0: it was lost"):
        cell.move("u", 1, 0, MiB)


class HandingOverCell(SimulatedCell):
    """A SimulatedCell whose caller deals each turn out piece by piece: its last piece is dealt, and the
    caller says so (``dealt``), as soon as a live member has drained everything it was given."""

    def _complete_heads(self):
        super()._complete_heads()
        owner = self.scheduler.owner
        if owner is not None and any(not queue for rank, queue in self.pending.items() if rank not in self.dead):
            self.apply(self.scheduler.dealt(owner))

    def link(self, rank):
        """Member ``rank``'s WAN link: the (key, start, end) of what it sent, in time order."""
        return sorted(((key, start, end) for key, r, _o, _n, start, end in self.segments if r == rank),
                      key=lambda segment: segment[1:])


def test_the_next_turn_takes_each_link_as_it_drains_and_never_shares_one():
    """Per-link hand-over with unequal rates misjudged at first: the fast member drains its share of
    the first turn early and starts the second's at once, the slow one after its own tail; no link idles
    or carries two transfers at once, and the second turn's shares end together."""
    true = {0: 1 * MB_S, 1: 3 * MB_S}
    cell = HandingOverCell(true, estimates=[1 * MB_S, 2 * MB_S], smoothing=1.0)
    cell.at(0.0, "submit", 0, 40 * MiB, "first")
    cell.at(0.0, "submit", 1, 40 * MiB, "second")
    cell.run()
    for key in ("first", "second"):
        cell.assert_delivered_once(key, 40 * MiB)
    for rank in true:
        link = cell.link(rank)
        assert [key for key, _s, _e in link] == ["first", "second"]
        assert link[1][1] == pytest.approx(link[0][2])  # no idle gap, no overlap
    drained = cell.finished["second"].started
    assert drained == pytest.approx(27 * MiB / (3 * MB_S))  # when member 1 drained its 27 of 40 granules
    ends = [end for key, *_rest, end in cell.segments if key == "second"]
    assert max(ends) == pytest.approx(80 * MiB / (4 * MB_S), rel=0.01)  # both links busy to the end
    assert max(ends) - min(ends) < MiB / MB_S  # (a granule's rounding)
    # without the hand-over the second turn waits for the slow member's tail
    waiting = SimulatedCell(true, estimates=[1 * MB_S, 2 * MB_S], smoothing=1.0)
    waiting.at(0.0, "submit", 0, 40 * MiB, "first")
    waiting.at(0.0, "submit", 1, 40 * MiB, "second")
    waiting.run()
    assert waiting.finished["second"].finished > 1.1 * cell.finished["second"].finished


def test_a_member_dying_during_a_hand_over_leaves_both_transfers_to_the_survivors():
    """Member 1 dies while it still sends the first transfer's tail and holds its share of the second:
    both are re-split over the live members and finish; the source dying fails only its own."""
    cell = HandingOverCell({0: MB_S, 1: MB_S, 2: 2 * MB_S}, estimates=[MB_S] * 3)
    cell.at(0.0, "submit", 2, 40 * MiB, "first")  # equal shares: member 2 drains first, at 7 s
    cell.at(0.0, "submit", 0, 40 * MiB, "second")
    cell.at(0.0, "submit", 1, 8 * MiB, "third")
    cell.at(8.0, "die", 1)
    cell.run()
    assert cell.finished["second"].started < 8.0 < cell.finished["first"].finished  # both had bytes with member 1
    assert set(cell.failed) == {"third"} and "rank 1" in str(cell.failed["third"])
    for key in ("first", "second"):
        cell.assert_delivered_once(key, 40 * MiB)
        assert all(start < 8.0 for k, rank, _o, _n, start, _e in cell.segments if k == key and rank == 1)
    for rank in (0, 2):
        link = cell.link(rank)
        for (_k, _s, end), (_k2, start, _e) in zip(link, link[1:]):
            assert start >= end - 1e-9
    assert cell.scheduler.owner is None and cell.scheduler.queued() == 0


def test_only_the_owner_can_be_dealt_and_a_draining_transfer_can_be_cancelled_alone():
    now = [0.0]
    cell = CellScheduler([0, 1], [MB_S, MB_S], clock=lambda: now[0])
    with pytest.raises(ConfigError, match="does not own the cell"):
        cell.dealt("t")
    cell.submit(0, 4 * MiB, "t")
    assert cell.submit(1, 4 * MiB, "u") == []
    handed = cell.dealt("t")
    assert cell.owner == "u" and cell.active("t") and cell.active("u")
    assert [(a.key, a.rank, a.length) for a in handed] == [("u", 1, 2 * MiB), ("u", 0, 2 * MiB)]
    with pytest.raises(ConfigError, match="does not own the cell"):
        cell.dealt("t")
    assert cell.cancel("t") == [] and not cell.active("t")  # its bytes are dropped, "u"'s stay
    now[0] = 2.0
    assert cell.progress(1, 2 * MiB) == []
    (finished,) = cell.progress(0, 2 * MiB)
    assert finished == TransferFinished("u", 4 * MiB, 0.0, 2.0)
