"""Which site each rank is in, the cells the sites form and each member's LocalDPRank (sans-I/O).

A site is a set of ranks that share a fast local network (a data centre, a lab); sites are
joined by the WAN. The ranks of one site form its cell; a member's LocalDPRank is its index
among the cell's ranks in rank order. Every rank names its site with a string: ``WANLINK_SITE``
when set, else one derived from its host (:func:`site_name`), so the ranks a launcher such as
torchrun starts on one machine share a site and, left alone, a single-host job is one site.
"""
from __future__ import annotations

from collections.abc import Sequence

from wanlink.errors import ConfigError

MAX_SITE_NAME = 128
"""Longest site name accepted (bytes of UTF-8), so exchanging names over the Store stays bounded."""


def check_site_name(name: str, what: str = "site name") -> str:
    """``name`` stripped; ConfigError (saying ``what``) when it is empty, too long or has control characters."""
    if not isinstance(name, str):
        raise ConfigError(f"{what} must be a string, got {name!r}")
    stripped = name.strip()
    if not stripped:
        raise ConfigError(f"{what} is empty")
    if len(stripped.encode()) > MAX_SITE_NAME:
        raise ConfigError(f"{what} is {len(stripped.encode())} bytes long, more than {MAX_SITE_NAME}: "
                          f"{stripped[:40]!r}...")
    if not stripped.isprintable():
        raise ConfigError(f"{what} has control characters: {stripped!r}")
    return stripped


def site_name(explicit: str | None, host_key: str, hostname: str) -> str:
    """The site of this rank: ``explicit`` (WANLINK_SITE) when given, else ``host:<host key>``.

    ``host_key`` identifies the machine (boot id and network namespace; "" where unknown, then
    ``hostname`` stands in), so every rank on one machine is in the same site.
    """
    if explicit is not None:
        return check_site_name(explicit, "WANLINK_SITE")
    return check_site_name(f"host:{host_key or hostname}", "derived site name")


class SiteMap:
    """The site of every rank of a group, and the cells they form.

    ``sites[r]`` is rank r's site name. Cells are listed in the order of their lowest rank, so
    every rank builds the same map from the same names.
    """

    def __init__(self, sites: Sequence[str]):
        if not sites:
            raise ConfigError("a site map needs at least one rank")
        self.sites: tuple[str, ...] = tuple(check_site_name(s, f"site name of rank {r}") for r, s in enumerate(sites))
        cells: dict[str, list[int]] = {}
        for rank, site in enumerate(self.sites):
            cells.setdefault(site, []).append(rank)
        self.cells: dict[str, tuple[int, ...]] = {site: tuple(ranks) for site, ranks in cells.items()}
        self._local = {rank: i for ranks in self.cells.values() for i, rank in enumerate(ranks)}

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SiteMap) and other.sites == self.sites

    def __repr__(self) -> str:
        return f"SiteMap({dict(self.cells)!r})"

    @property
    def world_size(self) -> int:
        return len(self.sites)

    @property
    def spans_sites(self) -> bool:
        """More than one site: collectives over this group cross the WAN."""
        return len(self.cells) > 1

    def site(self, rank: int) -> str:
        """Rank ``rank``'s site."""
        return self.sites[self._check(rank)]

    def cell(self, rank: int) -> tuple[int, ...]:
        """The ranks of ``rank``'s site, in rank order (its cell)."""
        return self.cells[self.site(rank)]

    def local_rank(self, rank: int) -> int:
        """Rank ``rank``'s LocalDPRank: its index in its cell."""
        return self._local[self._check(rank)]

    def subgroup(self, ranks: Sequence[int]) -> "SiteMap":
        """The map of a subgroup made of these ranks (its rank i is ``ranks[i]`` here)."""
        return SiteMap([self.site(rank) for rank in ranks])

    def describe(self, rank: int) -> dict:
        """What ``wanlink.stats()`` reports: this rank's site and LocalDPRank, and every cell."""
        return {"site": self.site(rank), "local_dp_rank": self.local_rank(rank),
                "cells": {site: list(ranks) for site, ranks in self.cells.items()}}

    def _check(self, rank: int) -> int:
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < len(self.sites):
            raise ConfigError(f"rank {rank!r} is outside this group of {len(self.sites)} ranks")
        return rank
