"""The striped point-to-point planner: which sends are striped and the route of every share."""
import pytest

from wanlink.errors import ConfigError
from wanlink.sched.sites import SiteMap
from wanlink.sched.stripes import Route, pieces, routes, striped

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


def test_pieces_cover_a_share_in_order():
    assert pieces(10, 4) == [(0, 4), (4, 4), (8, 2)]
    assert pieces(0, 4) == []
    with pytest.raises(ConfigError, match="piece size"):
        pieces(10, 0)
