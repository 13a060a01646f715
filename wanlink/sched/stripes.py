"""Cell-striped point-to-point, sans-I/O: which sends are striped and which member carries what.

A send from rank S in site A to rank D in site B is striped when it is at least
``WANLINK_STRIPE_MIN_BYTES`` long and A's cell has more than one member. The cell's scheduler
(:class:`~wanlink.sched.cells.CellScheduler`, run by the cell's LocalDPRank 0) gives the transfer
its turn and its shares: byte ranges, one per live member of A, the source's first. Each share
travels on a *route*: the source hands it over the local network to its *carrier* (the member of
A whose WAN link it crosses; the source carries its own share), the carrier sends it over its WAN
link to its *partner* in B, and the partner forwards it over B's local network to D. Carriers
are paired with B's members in LocalDPRank order, D first, so the source's share goes straight to
D and each of B's members receives at most its share of the cell's ingress (round-robin when A
has more members than B).

Every hop moves a share as consecutive pieces of ``piece_bytes`` (:func:`pieces`), so a relay
holds a few pieces at a time, never a whole share.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from wanlink.errors import ConfigError
from wanlink.sched.sites import SiteMap

MAX_ROUTES = 255
"""Most shares one striped transfer is split into (cells larger than this are not striped)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Route:
    """Bytes [offset, offset + length) go source -> ``carrier`` -> (WAN) -> ``partner`` -> destination.

    ``carrier`` is the source itself for its own share; ``partner`` is the destination itself when
    the WAN hop reaches it directly.
    """

    offset: int
    length: int
    carrier: int
    partner: int

    def hops(self, source: int, destination: int) -> list[int]:
        """The ranks the share visits, source to destination, without repeats."""
        path = [source]
        for rank in (self.carrier, self.partner, destination):
            if rank != path[-1]:
                path.append(rank)
        return path

    def last_hop(self, destination: int) -> int:
        """The rank that hands the share to the destination."""
        return self.partner if self.partner != destination else self.carrier


def striped(sites: SiteMap, source: int, destination: int, nbytes: int, min_bytes: int) -> bool:
    """Whether a send of ``nbytes`` from ``source`` to ``destination`` is striped over the source's cell.

    Both ends decide alone and agree, since they know the same map, size and threshold
    (``min_bytes`` 0: never striped).
    """
    return (min_bytes > 0 and nbytes >= min_bytes and sites.site(source) != sites.site(destination)
            and len(sites.cell(source)) > 1)


def routes(sites: SiteMap, source: int, destination: int, shares: Sequence[tuple[int, int, int]]) -> list[Route]:
    """The route of every ``(carrier, offset, length)`` share of a striped send (the scheduler's shares).

    Carriers must be members of the source's cell; the source's share (if any) goes straight to the
    destination, the i-th other carrier to the i-th member of the destination's cell after it.
    """
    cell = sites.cell(source)
    remote = [destination, *[rank for rank in sites.cell(destination) if rank != destination]]
    carriers = [source, *[rank for rank in cell if rank != source]]
    result = []
    for carrier, offset, length in shares:
        if carrier not in cell:
            raise ConfigError(f"share carrier rank {carrier} is not in the cell of source rank {source} "
                              f"(site {sites.site(source)!r}: ranks {list(cell)})")
        result.append(Route(offset, length, carrier, remote[carriers.index(carrier) % len(remote)]))
    return result


def pieces(length: int, piece_bytes: int) -> list[tuple[int, int]]:
    """``(offset, length)`` of the consecutive pieces of a share of ``length`` bytes."""
    if piece_bytes < 1:
        raise ConfigError(f"piece size must be >= 1 byte, got {piece_bytes}")
    return [(offset, min(piece_bytes, length - offset)) for offset in range(0, length, piece_bytes)]
