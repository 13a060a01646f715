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

The source deals the pieces (:class:`Dealer`): each route pulls its next piece as it drains, its
own share's first; a route whose share is all dealt takes the last undealt piece of the route with
the most left, so the routes end together even where the rates the split was made with were off.
Every piece travels with a header saying where it belongs (:func:`piece_header`), so relays and the
destination need no byte ranges in advance, and a relay holds a few pieces at a time, never a
whole share.
"""
from __future__ import annotations

import dataclasses
import struct
from collections.abc import Sequence

from wanlink.errors import ConfigError
from wanlink.sched.sites import SiteMap

MAX_ROUTES = 255
"""Most shares one striped transfer is split into (cells larger than this are not striped)."""
REPORT_WINDOW = MAX_ROUTES + 1
"""Most reports on one striped transfer that :class:`InOrder` holds ahead of a missing one: more than
a burst of every route's end, all overtaking the one report delayed on its stream."""
_HEADER = struct.Struct("<qq")
HEADER_BYTES = _HEADER.size
"""Bytes of the header that goes ahead of every piece on a route: its offset and length."""
TAIL_SHRINK = 8
"""A transfer's last pieces are down to 1/TAIL_SHRINK of the piece size (:class:`Dealer`): what a route
holds when the last piece is dealt, FEED_DEPTH of them, ends within about one of them of the others'
(with 4 MiB pieces: 512 KiB, 8 ms at 500 Mbit/s; halves of 4 MiB left a turn's routes ending up to
24 ms apart in traces, and up to 55 ms in the simulation of tests/sched/test_stripes.py)."""
FIRST_SHRINK = 8
"""A route's first piece is 1/FIRST_SHRINK of the piece size: a carrier forwards a piece once all of
it has crossed the local network, so its WAN hop starts that much sooner (traced: 30-40 ms after the
source's own with a whole 4 MiB piece)."""


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


def piece_header(offset: int, length: int) -> bytes:
    """The header ahead of a piece of ``length`` bytes at ``offset``; length 0: the route's end."""
    return _HEADER.pack(offset, length)


def read_piece_header(header, nbytes: int, what: str) -> tuple[int, int]:
    """``(offset, length)`` of a piece header; length 0 ends the route. A piece outside a transfer of
    ``nbytes`` bytes is refused (ConfigError naming ``what``)."""
    offset, length = _HEADER.unpack(header)
    if length < 0 or (length and (offset < 0 or offset + length > nbytes)):
        raise ConfigError(f"{what}: a piece of {length} bytes at offset {offset} does not fit the "
                          f"{nbytes}-byte transfer")
    return offset, length


class Dealer:
    """Deals the pieces of one striped transfer to its routes, each piece when its route asks.

    ``shares`` are the scheduler's ``(carrier, offset, length)``. A route asks for its next piece
    when it has room (:meth:`next`): it gets the next piece of its own share, and once that is all
    dealt, the last undealt piece of the route with the most undealt bytes (work stealing: a route
    that was given too much for its real rate is relieved at its end). Each such move is kept in
    :attr:`moves` as ``(from_carrier, to_carrier, nbytes)`` for the cell's scheduler. A route holds
    at most ``depth`` pieces dealt and not yet sent on; pieces are ``piece_bytes`` (a route's first
    ``piece_bytes // FIRST_SHRINK``) until the transfer's undealt bytes fall below ``depth`` pieces
    per route, then they shrink with them, down to ``piece_bytes // TAIL_SHRINK``, so what the routes
    hold when everything is dealt ends about together.
    """

    def __init__(self, shares: Sequence[tuple[int, int, int]], piece_bytes: int, depth: int = 2):
        if piece_bytes < 1 or depth < 1:
            raise ConfigError(f"piece size and depth must be >= 1, got {piece_bytes} bytes and {depth}")
        self.piece_bytes, self.depth = piece_bytes, depth
        self._smallest = max(1, piece_bytes // TAIL_SHRINK)
        self._undealt = {carrier: [offset, offset + length] for carrier, offset, length in shares}
        self.dealt = {carrier: 0 for carrier in self._undealt}
        self.moves: list[tuple[int, int, int]] = []

    def left(self, carrier: int) -> int:
        """Bytes of ``carrier``'s share not dealt yet."""
        start, end = self._undealt[carrier]
        return end - start

    def undealt(self) -> int:
        """Bytes of the transfer not dealt yet (0: every route's last piece is out)."""
        return sum(map(self.left, self._undealt))

    def next(self, carrier: int) -> tuple[int, int] | None:
        """``(offset, length)`` of the next piece for ``carrier``'s route; None when nothing is left."""
        piece = min(self.piece_bytes, max(self._smallest, self.undealt() // (self.depth * len(self._undealt))))
        if not self.dealt[carrier]:
            piece = max(1, min(piece, self.piece_bytes // FIRST_SHRINK))
        span = self._undealt[carrier]
        if span[0] < span[1]:
            offset, length = span[0], min(piece, span[1] - span[0])
            span[0] += length
        else:
            victim = max(self._undealt, key=self.left)
            if not self.left(victim):
                return None
            span = self._undealt[victim]
            length = min(piece, span[1] - span[0])
            span[1] -= length
            offset = span[1]
            self.moves.append((victim, carrier, length))
        self.dealt[carrier] += length
        return offset, length


class InOrder:
    """Hands numbered items on in the order of their numbers (0, 1, 2, ...), holding any that come early.

    The source's reports on a striped transfer to its cell's leader (pieces moved, last piece dealt,
    a route's end) travel as control messages, which keep their order on each of a link's streams but
    not across them; applied as they come, a route's end could overtake the move it counts.

    Items may come at most ``window`` - 1 ahead of the next one due: the source sends its reports over
    the cell's local network as it deals pieces, so only those sent while one of them is delayed on its
    stream can come ahead of it. An item ``window`` or more ahead of the next one due would make its transfer
    wait for the missing ones until the transfer's timeout: it is refused at once, with
    ``what`` (e.g. "rank 1's striped transfer 3") in the error.
    """

    def __init__(self, what: str = "numbered items", window: int = REPORT_WINDOW):
        if window < 1:
            raise ConfigError(f"{what}: the reordering window must be at least 1, got {window}")
        self.what, self.window = what, window
        self._next = 0
        self._early: dict[int, object] = {}

    def add(self, number: int, item) -> list:
        """Item ``number`` came: the items now due, in order (none while an earlier one is missing)."""
        if number < self._next or number in self._early:
            raise ConfigError(f"{self.what}: numbered item {number} came twice")
        if number >= self._next + self.window:
            raise ConfigError(f"{self.what}: numbered item {number} came while {self._next} is the next due; "
                              f"at most {self.window - 1} may come ahead of it")
        self._early[number] = item
        due = []
        while self._next in self._early:
            due.append(self._early.pop(self._next))
            self._next += 1
        return due
