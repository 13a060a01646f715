"""Site-aware collectives for groups that span sites: local network inside a site, every member's WAN link across.

A flat ring over two sites of two hosts crosses the WAN on two of its four links, so half of
each site's hosts send nothing over the WAN while the other half carry 1.5x the buffer. Here
every member of a site carries a share across at once (Atlas's observation: a site's WAN
bandwidth is the sum of its members' caps):

- all-reduce: a ring reduce-scatter inside each site leaves member i of a site with the site's
  partial of part i (the site's own even split of the buffer); the members whose parts overlap
  across sites swap those partials member to member and fold them in site order (so every
  member computes bit-identical sums); a ring all-gather inside each site finishes.
- reduce-scatter: the same reduce-scatter inside each site, member i getting the site partial
  of piece i of every block; each member sends its piece of rank r's block to rank r, which
  folds the sites' partials in site order.
- all-gather and broadcast: each block (a rank's contribution; for a broadcast, the part of the
  buffer the root first scatters to each member of its site) travels to every other site split
  into one piece per member there, and each member there passes its piece to its site-mates.

Written against :class:`~wanlink.collectives.base.Comm`, like ``ring`` and ``direct``; the site
of every group rank comes from a :class:`~wanlink.sched.sites.SiteMap`.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

from wanlink.collectives import ring
from wanlink.collectives.base import MAX_PIECES, Comm, Reducer, gather_all, piece_bounds, piece_count, split
from wanlink.errors import ConfigError
from wanlink.sched.sites import SiteMap

CROSS = 4 * MAX_PIECES
"""All-reduce partials between sites: CROSS + piece (ring's tags use the first four phases)."""
SPREAD = 5 * MAX_PIECES
"""A block's piece from its holder to a member of another site (one message per pair and direction)."""
SCATTER = 5 * MAX_PIECES + 1
"""A broadcast root's parts to the members of its site."""
LOCAL = 6 * MAX_PIECES
"""A block (or a piece of it) between members of one site: LOCAL + the group rank that holds the block."""
TO_OWNER = 7 * MAX_PIECES
"""Reduce-scatter: a site's partial of (part of) rank r's block, to rank r."""


class SubComm:
    """Members ``ranks`` of ``comm`` as a Comm of their own (its rank i is ``ranks[i]`` of ``comm``)."""

    def __init__(self, comm: Comm, ranks: Sequence[int]):
        self._comm, self._ranks = comm, tuple(ranks)
        self.rank, self.size, self.piece_bytes = self._ranks.index(comm.rank), len(self._ranks), comm.piece_bytes

    async def send(self, peer: int, tensor: torch.Tensor, piece: int = 0) -> None:
        await self._comm.send(self._ranks[peer], tensor, piece)

    async def recv(self, peer: int, tensor: torch.Tensor, piece: int = 0) -> None:
        await self._comm.recv(self._ranks[peer], tensor, piece)

    async def compute(self, fn: Callable[..., None], *args) -> None:
        await self._comm.compute(fn, *args)

    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return self._comm.empty(numel, dtype)


def pays_off(sites: SiteMap) -> bool:
    """Whether the site-aware all-reduce loads the busiest member's WAN link less than a flat ring.

    A flat ring's members whose neighbour is in another site carry 2(n-1)/n of the buffer over
    the WAN; here each member of the smallest cell exchanges its part (1/c of the buffer) with
    every other site, (S-1)/c in all. So two sites always gain once one has two members, and
    many single-rank sites (every host its own site) keep the ring.
    """
    if not sites.spans_sites:
        return False
    n, others = sites.world_size, len(sites.cells) - 1
    smallest = min(len(ranks) for ranks in sites.cells.values())
    return others / smallest < 2 * (n - 1) / n


def _check(comm: Comm, sites: SiteMap) -> None:
    if sites.world_size != comm.size:
        raise ConfigError(f"site map of {sites.world_size} ranks for a group of {comm.size}")
    if comm.size >= MAX_PIECES:
        raise ConfigError(f"site-aware collectives take groups of up to {MAX_PIECES - 1} ranks, got {comm.size}")


def _overlaps(lo: int, hi: int, bounds: Sequence[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """``(index, start, stop)`` of each non-empty meeting of [lo, hi) with ``bounds[index]``."""
    return [(index, max(lo, a), min(hi, b)) for index, (a, b) in enumerate(bounds) if max(lo, a) < min(hi, b)]


async def allreduce(comm: Comm, sites: SiteMap, tensor: torch.Tensor, reducer: Reducer) -> None:
    """In place: every member ends with the reduction of all members' flat ``tensor``."""
    _check(comm, sites)
    me, numel = comm.rank, tensor.numel()
    cell = sites.cell(me)
    local = SubComm(comm, cell)
    bounds = piece_bounds(numel, len(cell))
    parts = [tensor[a:b] for a, b in bounds]
    mine = parts[local.rank]
    await ring.reduce_scatter_into(local, parts, mine, reducer)

    lo, hi = bounds[local.rank]
    order = list(sites.cells)
    partials: list[torch.Tensor] = []
    transfers = []
    for site, ranks in sites.cells.items():
        if site == sites.site(me):
            partials.append(mine)
            continue
        incoming = comm.empty(hi - lo, tensor.dtype)
        partials.append(incoming)
        for index, start, stop in _overlaps(lo, hi, piece_bounds(numel, len(ranks))):
            peer = ranks[index]
            count = piece_count(stop - start, tensor.element_size(), comm.piece_bytes)
            for p, (ours, theirs) in enumerate(zip(split(tensor[start:stop], count),
                                                   split(incoming[start - lo:stop - lo], count))):
                transfers += [comm.send(peer, ours, CROSS + p), comm.recv(peer, theirs, CROSS + p)]
    await gather_all(transfers)
    if len(order) > 1 and hi > lo:
        # Fold in site order into the first partial (a scratch buffer unless it is ours), the
        # last step straight into ours: ours is read at its turn before it is overwritten.
        accumulator = partials[0]
        for partial in partials[1:-1]:
            await comm.compute(reducer, accumulator, partial)
        await comm.compute(reducer, accumulator, partials[-1], mine)
    await ring.all_gather(local, parts)


async def reduce_scatter(comm: Comm, sites: SiteMap, blocks: Sequence[torch.Tensor], output: torch.Tensor,
                         reducer: Reducer) -> None:
    """``output`` on rank r = reduction over all ranks of their ``blocks[r]``; ``blocks`` are left alone.

    Member i of a site owns piece i (of the site's even split) of every block, so each member
    sends an equal share of the blocks bound for other sites.
    """
    _check(comm, sites)
    me, n = comm.rank, comm.size
    cell = sites.cell(me)
    local = SubComm(comm, cell)
    pieces = [piece_bounds(block.numel(), len(cell)) for block in blocks]
    flat = torch.cat([blocks[r].reshape(-1)[slice(*pieces[r][i])] for i in range(len(cell)) for r in range(n)])
    region_sizes = [sum(pieces[r][i][1] - pieces[r][i][0] for r in range(n)) for i in range(len(cell))]
    regions = _split_sizes(flat, region_sizes)
    mine = regions[local.rank]
    await ring.reduce_scatter_into(local, regions, mine, reducer)

    owned = dict(zip(range(n), _split_sizes(mine, [pieces[r][local.rank][1] - pieces[r][local.rank][0]
                                                   for r in range(n)])))
    transfers = [comm.send(r, piece, TO_OWNER) for r, piece in owned.items() if r != me]
    partials = []
    for ranks in sites.cells.values():
        partial = comm.empty(output.numel(), output.dtype)
        partials.append(partial)
        for j, (a, b) in enumerate(piece_bounds(output.numel(), len(ranks))):
            if ranks[j] == me:
                partial[a:b].copy_(owned[me])
            else:
                transfers.append(comm.recv(ranks[j], partial[a:b], TO_OWNER))
    await gather_all(transfers)
    if len(partials) == 1:
        output.copy_(partials[0])
        return
    await comm.compute(reducer, partials[0], partials[1], output)
    for partial in partials[2:]:
        await comm.compute(reducer, output, partial)


def _split_sizes(tensor: torch.Tensor, sizes: Sequence[int]) -> list[torch.Tensor]:
    """Views of a 1-D tensor as consecutive pieces of the given sizes."""
    views, start = [], 0
    for size in sizes:
        views.append(tensor[start:start + size])
        start += size
    return views


def _carried(sites: SiteMap, holder: int, ranks: Sequence[int], numel: int) -> list[tuple[int, int]]:
    """The piece of holder ``holder``'s block of ``numel`` elements that each member ``ranks[j]`` of another
    site receives over the WAN: where that site has as many members as the holder's, the whole block to the
    member of the same LocalDPRank (its *partner*; the others get nothing); else one piece per member.

    Paired, each member's WAN bytes are the same as split (its block out to each other site, as much in),
    but it talks to one member there instead of all of them: a third fewer messages per all-gather of
    2 x 2 and half the WAN links in use, which is what a small exchange (a sparse bucket's) pays for.
    """
    if len(ranks) == len(sites.cell(holder)):
        partner = sites.local_rank(holder)
        return [(0, numel) if j == partner else (0, 0) for j in range(len(ranks))]
    return list(piece_bounds(numel, len(ranks)))


async def _spread(comm: Comm, sites: SiteMap, blocks: Mapping[int, torch.Tensor], holding: frozenset[int]) -> None:
    """Every rank's ``blocks[h]`` ends equal to holder h's, for every holder h in ``blocks``.

    Each holder sends its block to every other site, whole to its partner there or split into one
    piece per member (:func:`_carried`; SPREAD), and whole to its own site-mates (LOCAL + h); each
    member that received a piece passes it to its site-mates (LOCAL + h). Ranks in ``holding``
    already hold every block.
    """
    me = comm.rank
    my_cell = sites.cell(me)
    transfers = []
    for holder, block in blocks.items():
        home = sites.site(holder)
        mates = [r for r in sites.cell(holder) if r != holder and r not in holding]
        if me == holder:
            transfers += [comm.send(mate, block, LOCAL + holder) for mate in mates]
            for site, ranks in sites.cells.items():
                if site != home:
                    carried = _carried(sites, holder, ranks, block.numel())
                    transfers += [comm.send(ranks[j], block[a:b], SPREAD)
                                  for j, a, b in _overlaps(0, block.numel(), carried)]
        elif sites.site(me) == home:
            if me not in holding:
                transfers.append(comm.recv(holder, block, LOCAL + holder))
        else:
            pieces = _carried(sites, holder, my_cell, block.numel())
            transfers.append(_relay(comm, holder, block, pieces, my_cell, holding))
    await gather_all(transfers)


async def _relay(comm: Comm, holder: int, block: torch.Tensor, pieces: Sequence[tuple[int, int]],
                 cell: Sequence[int], holding: frozenset[int]) -> None:
    """In a site other than the holder's: receive this member's piece of the block over the WAN
    and pass it on to the site-mates, while receiving theirs."""
    me = cell.index(comm.rank)
    a, b = pieces[me]
    others = [j for j in range(len(cell)) if j != me]
    receives = [comm.recv(cell[j], block[pieces[j][0]:pieces[j][1]], LOCAL + holder)
                for j in others if pieces[j][1] > pieces[j][0]]

    async def forward() -> None:
        if b == a:
            return
        await comm.recv(holder, block[a:b], SPREAD)
        await gather_all([comm.send(cell[j], block[a:b], LOCAL + holder) for j in others if cell[j] not in holding])

    await gather_all([forward(), *receives])


async def all_gather(comm: Comm, sites: SiteMap, outputs: Sequence[torch.Tensor]) -> None:
    """``outputs[rank]`` filled on entry, every ``outputs[k]`` equal to rank k's on return."""
    _check(comm, sites)
    await _spread(comm, sites, dict(enumerate(outputs)), frozenset())


async def broadcast(comm: Comm, sites: SiteMap, tensor: torch.Tensor, root: int) -> None:
    """``root``'s flat ``tensor`` to every member: scattered over the root's site, then spread."""
    _check(comm, sites)
    me, cell = comm.rank, sites.cell(root)
    parts = dict(zip(cell, (tensor[a:b] for a, b in piece_bounds(tensor.numel(), len(cell)))))
    if me == root:
        await gather_all([comm.send(member, part, SCATTER) for member, part in parts.items() if member != root])
    elif me in parts:
        await comm.recv(root, parts[me], SCATTER)
    await _spread(comm, sites, parts, frozenset([root]))
