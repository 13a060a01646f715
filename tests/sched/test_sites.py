"""Site maps: cells from per-rank site names, LocalDPRank, pairing across sites, and bad names."""
import pytest

from wanlink.errors import ConfigError
from wanlink.sched.sites import MAX_SITE_NAME, SiteMap, check_site_name, site_name


def test_cells_are_ranks_of_one_site_in_rank_order_listed_by_lowest_rank():
    sites = SiteMap(["eu", "us", "eu", "us", "eu"])
    assert sites.cells == {"eu": (0, 2, 4), "us": (1, 3)}
    assert list(sites.cells) == ["eu", "us"]
    assert [sites.local_rank(r) for r in range(5)] == [0, 0, 1, 1, 2]
    assert sites.cell(3) == (1, 3) and sites.site(4) == "eu"
    assert sites.spans_sites and sites.world_size == 5


def test_one_site_does_not_span_sites():
    single = SiteMap(["lab"] * 3)
    assert not single.spans_sites and single.cells == {"lab": (0, 1, 2)}


def test_subgroup_keeps_each_ranks_site():
    sites = SiteMap(["a", "b", "a", "b"])
    sub = sites.subgroup([3, 0, 1])
    assert sub.sites == ("b", "a", "b") and sub.cells == {"b": (0, 2), "a": (1,)}
    assert sub == SiteMap(["b", "a", "b"]) and sub != sites


def test_describe_is_what_stats_reports():
    assert SiteMap(["x", "y", "x"]).describe(2) == {"site": "x", "local_dp_rank": 1,
                                                    "cells": {"x": [0, 2], "y": [1]}}


def test_site_name_prefers_the_explicit_one_and_else_names_the_host():
    assert site_name(" aws-us-east ", "boot/42", "node1") == "aws-us-east"
    assert site_name(None, "boot/42", "node1") == "host:boot/42"
    assert site_name(None, "", "node1") == "host:node1"


@pytest.mark.parametrize("bad, message", [
    ("", "empty"), ("   ", "empty"), ("x" * (MAX_SITE_NAME + 1), "129 bytes"), ("a\nb", "control"), (7, "string"),
])
def test_bad_site_names_are_refused(bad, message):
    with pytest.raises(ConfigError, match=message):
        check_site_name(bad)


def test_bad_maps_and_ranks_are_refused_naming_the_rank():
    with pytest.raises(ConfigError, match="at least one rank"):
        SiteMap([])
    with pytest.raises(ConfigError, match="site name of rank 1 is empty"):
        SiteMap(["a", ""])
    with pytest.raises(ConfigError, match="rank 3 is outside this group of 2"):
        SiteMap(["a", "b"]).local_rank(3)
