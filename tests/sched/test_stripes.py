"""The striped point-to-point planner: which sends are striped and the route of every share."""
import pytest

from wanlink.errors import ConfigError
from wanlink.sched.sites import SiteMap
from wanlink.sched.stripes import (
    FIRST_SHRINK, REPORT_WINDOW, TAIL_SHRINK, Dealer, InOrder, Route, piece_header, read_piece_header, routes, striped,
)

MiB = 1 << 20


def test_only_large_sends_from_a_site_of_several_to_another_site_are_striped():
    sites = SiteMap(["a", "a", "b", "b", "c"])
    assert striped(sites, 0, 2, 16 * MiB, 16 * MiB)
    assert not striped(sites, 0, 2, 16 * MiB - 1, 16 * MiB)  # below the threshold
    assert not striped(sites, 0, 1, 64 * MiB, 16 * MiB)  # inside a site
    assert not striped(sites, 4, 0, 64 * MiB, 16 * MiB)  # a site of one has nobody to share with
    assert striped(sites, 2, 4, 64 * MiB, 16 * MiB)  # to a site of one
    assert not striped(sites, 0, 2, 64 * MiB, 0)  # 0 turns it off


def test_the_sources_share_goes_straight_and_the_others_pair_with_the_remote_members():
    sites = SiteMap(["a", "b", "a", "b", "a"])  # interleaved ranks: a = 0, 2, 4; b = 1, 3
    plan = routes(sites, 2, 3, [(2, 0, 4), (0, 4, 4), (4, 8, 3)])
    assert plan == [Route(0, 4, 2, 3), Route(4, 4, 0, 1), Route(8, 3, 4, 3)]  # three carriers, two remote members
    assert plan[0].hops(2, 3) == [2, 3] and plan[0].last_hop(3) == 2
    assert plan[1].hops(2, 3) == [2, 0, 1, 3] and plan[1].last_hop(3) == 1
    assert plan[2].hops(2, 3) == [2, 4, 3] and plan[2].last_hop(3) == 4  # its WAN hop reaches the destination
    with pytest.raises(ConfigError, match="carrier rank 1 is not in the cell of source rank 2"):
        routes(sites, 2, 3, [(1, 0, 4)])


def deal(shares, rates, piece, depth=2, lags=None):
    """A simulated timeline of a Dealer: each route sends its dealt pieces one after another at its
    true rate (after its lag), and asks for the next whenever fewer than ``depth`` are left to send.
    Returns each route's end time and the pieces each was dealt."""
    dealer = Dealer(shares, piece, depth)
    lags = lags or {}
    busy = {carrier: lags.get(carrier, 0.0) for carrier, _o, _n in shares}  # when its last dealt piece ends
    got = {carrier: [] for carrier in busy}
    ends = {carrier: [] for carrier in busy}  # end times of the pieces dealt and not yet sent
    for carrier in busy:
        for _ in range(depth):
            if (dealt := dealer.next(carrier)) is not None:
                got[carrier].append(dealt)
                busy[carrier] += dealt[1] / rates[carrier]
                ends[carrier].append(busy[carrier])
    while any(ends.values()):
        now, carrier = min((times[0], c) for c, times in ends.items() if times)
        ends[carrier].pop(0)
        if (dealt := dealer.next(carrier)) is not None:
            got[carrier].append(dealt)
            busy[carrier] = max(busy[carrier], now) + dealt[1] / rates[carrier]
            ends[carrier].append(busy[carrier])
    return busy, got, dealer


def test_the_dealer_deals_each_route_its_own_share_in_order_shrinking_pieces_at_the_end():
    busy, got, dealer = deal([(0, 0, 64), (1, 64, 64)], {0: 1.0, 1: 1.0}, piece=8)
    for carrier, start in ((0, 0), (1, 64)):
        offsets = [offset for offset, _n in got[carrier]]
        assert offsets[0] == start and offsets == sorted(offsets)
        assert sum(n for _o, n in got[carrier]) == 64
    sizes = [n for _o, n in got[0]]
    assert sizes[0] == 8 // FIRST_SHRINK  # a small first piece: its route's next hop starts sooner
    assert sizes[1:4] == [8] * 3 and sizes[1:] == sorted(sizes[1:], reverse=True) and sizes[-1] == 8 // TAIL_SHRINK < 8
    assert dealer.moves == [] and dealer.dealt == {0: 64, 1: 64} and busy[0] == busy[1]
    with pytest.raises(ConfigError, match="piece size and depth must be >= 1, got 0 bytes"):
        Dealer([(0, 0, 10)], 0)


@pytest.mark.parametrize("lags", [None, {1: 3.0}])
def test_a_route_that_drains_first_takes_the_tail_of_the_others_so_they_end_together(lags):
    """The split was made with equal rates, but route 1 runs at 0.7 of route 0 (and, second case,
    starts 3 s late, its local phase): stealing the slow route's last pieces ends both within a
    piece's time, where with the split alone the slow one ends 43 % later (and 3 s more)."""
    rates, piece = {0: 10.0, 1: 7.0}, 4
    busy, got, dealer = deal([(0, 0, 400), (1, 400, 400)], rates, piece, lags=lags)
    assert abs(busy[0] - busy[1]) <= piece / rates[1] + 1e-9, busy
    start = (lags or {}).get(1, 0.0)
    ideal = (800 + start * rates[1]) / (rates[0] + rates[1])
    assert max(busy.values()) <= ideal + piece / rates[1], (busy, ideal)
    covered = sorted(p for pieces in got.values() for p in pieces)
    assert sum(n for _o, n in covered) == 800 and all(o1 + n1 == o2 for (o1, n1), (o2, _n) in zip(covered, covered[1:]))
    moved = sum(n for giver, taker, n in dealer.moves if (giver, taker) == (1, 0))
    assert moved > 0 and dealer.dealt == {0: 400 + moved, 1: 400 - moved}


def test_piece_headers_round_trip_and_a_piece_outside_the_transfer_is_refused():
    assert read_piece_header(piece_header(8, 4), 12, "x") == (8, 4)
    assert read_piece_header(piece_header(0, 0), 12, "x") == (0, 0)
    with pytest.raises(ConfigError, match="recv of 12 bytes: a piece of 4 bytes at offset 9 does not fit"):
        read_piece_header(piece_header(9, 4), 12, "recv of 12 bytes")


def test_numbered_reports_are_handed_on_in_order_whatever_order_they_come_in():
    order = InOrder()
    assert order.add(1, "dealt") == []  # overtook the move it follows: held
    assert order.add(0, "moved") == ["moved", "dealt"]
    assert order.add(3, "done b") == [] and order.add(2, "done a") == ["done a", "done b"]
    with pytest.raises(ConfigError, match="numbered item 2 came twice"):
        order.add(2, "again")


def test_a_report_far_ahead_of_the_next_due_is_refused_naming_the_transfer():
    order = InOrder("rank 1's striped transfer 7 (its reports)", window=4)
    assert order.add(3, "done") == []  # 3 ahead of 0: may have overtaken 0, 1 and 2
    with pytest.raises(ConfigError, match=r"rank 1's striped transfer 7 .*item 4 came while 0 is the next due"):
        order.add(4, "far ahead")
    assert order.add(0, "moved") == ["moved"] and order.add(1, "a") == ["a"] and order.add(2, "b") == ["b", "done"]
    assert order.add(7, "now within reach") == []  # the window moves with the next due (4)
    with pytest.raises(ConfigError, match="item 1000000000 came while 4"):
        order.add(10**9, "forged")
    assert InOrder().window == REPORT_WINDOW  # default: every route's end may overtake one delayed report
    with pytest.raises(ConfigError, match="at least 1"):
        InOrder(window=0)


@pytest.mark.parametrize("lag", [0.0, 0.005, 0.011, 0.021, 0.027])
@pytest.mark.parametrize("rate", [57e6, 59e6, 61e6])
def test_a_turns_routes_at_wan_rates_end_within_a_small_tail_piece_of_each_other(lag, rate):
    """Two routes of 64 MiB at about 500 Mbit/s each (59 MB/s of goodput), 4 MiB pieces, 4 held per
    route as on a cell's WAN links, the carrier's route starting up to 27 ms late (its first piece
    crosses the local network): the pieces dealt last are small enough that the routes end within
    12 ms of each other (with halves of 4 MiB at the tail: up to 55 ms), and no later than the
    ideal end by more than that."""
    rates = {0: 59e6, 1: rate}
    busy, got, _dealer = deal([(0, 0, 64 * MiB), (1, 64 * MiB, 64 * MiB)], rates, 4 * MiB, depth=4, lags={1: lag})
    assert abs(busy[0] - busy[1]) <= 0.012, busy
    assert max(busy.values()) <= (128 * MiB + lag * rate) / (59e6 + rate) + 0.012
