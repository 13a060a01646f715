"""Which algorithm a collective runs: direct exchange (one round) when every member's share is at
most ``direct_max_bytes``; above it, the site-aware algorithms (collectives/hierarchical.py) when the
group spans sites where they pay off, else pipelined rings and chains where they pipeline (more
than one piece), and where they would not direct broadcast, all-gather and reduce-scatter, and for
all-reduce direct exchange (two members) or halving. AVG is a SUM finished by a division."""
from __future__ import annotations

import dataclasses
import functools
from typing import Awaitable, Callable, Sequence

import torch

from wanlink.collectives import direct, halving, hierarchical, ring
from wanlink.collectives.base import Comm, Reducer, piece_count
from wanlink.collectives.reduce_ops import finish_average
from wanlink.sched.sites import SiteMap

Algorithm = Callable[..., Awaitable[None]]
"""A collective algorithm: ``await algorithm(comm, *the operation's arguments)``."""

ROUND_BASED = frozenset({direct.allreduce, direct.reduce_scatter, direct.all_gather, direct.broadcast,
                         direct.reduce, direct.gather, direct.scatter, direct.all_to_all, direct.barrier,
                         halving.allreduce})
"""Algorithms that post every receive before they wait on any message: they run unchanged on a Comm
whose awaits complete on the calling thread (a same-host group's express path, wanlink/c10d/express.py)."""


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


@dataclasses.dataclass(frozen=True)
class AlgorithmChoice:
    """A group's choice of algorithm by size and sites; ``sites`` is None for a flat group."""

    direct_max_bytes: int
    sites: SiteMap | None = None

    @classmethod
    def for_group(cls, direct_max_bytes: int, sites: SiteMap) -> AlgorithmChoice:
        """Site-aware where :func:`hierarchical.pays_off` for ``sites``, flat otherwise."""
        return cls(direct_max_bytes, sites if hierarchical.pays_off(sites) else None)

    @property
    def site_aware(self) -> bool:
        return self.sites is not None

    def is_small(self, nbytes: int) -> bool:
        return nbytes <= self.direct_max_bytes

    def _one_piece(self, piece_bytes: int, block: torch.Tensor) -> bool:
        """Whether a flat group's ring would carry ``block`` (a member's share) as one piece: it
        cannot pipeline, and its n-1 steps would each wait for the last. Direct exchange then moves
        the same bytes per member ((n-1) blocks out, (n-1) in) in one round, as one exchange from
        the collective's task (the chain's rule for broadcast below)."""
        return self.sites is None and piece_count(block.numel(), block.element_size(), piece_bytes) == 1

    def allreduce_algorithm(self, size: int, piece_bytes: int, buffer: torch.Tensor) -> Algorithm:
        """Direct when small; site-aware where that pays; else the pipelined ring, but where it would
        not pipeline: for two members, a buffer of one piece goes direct (each member sends the other
        the whole buffer: the ring's bytes, half each way twice, in one round instead of two dependent
        ones; each member then reduces the whole buffer instead of half, which only the ring's pieces
        could overlap with the transfer); for a power of two > 2 whose segments are one piece each,
        recursive halving and doubling: the ring's bytes in 2 log2(n) steps instead of 2(n-1)."""
        if self.is_small(_nbytes(buffer)):
            return direct.allreduce
        if self.sites is not None:
            return _site_aware(hierarchical.allreduce, self.sites)
        if size == 2 and piece_count(buffer.numel(), buffer.element_size(), piece_bytes) == 1:
            return direct.allreduce
        if size > 2 and halving.usable(size) and \
                piece_count(-(-buffer.numel() // size), buffer.element_size(), piece_bytes) == 1:
            return halving.allreduce
        return ring.allreduce

    async def allreduce(self, comm: Comm, buffer: torch.Tensor, reducer: Reducer, name: str,
                        algorithm: Algorithm | None = None) -> None:
        """``algorithm``: the one ``allreduce_algorithm`` picked already (routing: c10d/express.py)."""
        await (algorithm or self.allreduce_algorithm(comm.size, comm.piece_bytes, buffer))(comm, buffer, reducer)
        if name == "avg":
            finish_average(buffer, comm.size)

    def reduce_scatter_algorithm(self, size: int, piece_bytes: int, result: torch.Tensor) -> Algorithm:
        """Direct when small, or in a flat group where the ring's blocks are one piece each
        (``_one_piece``); else site-aware or the ring."""
        if self.is_small(_nbytes(result) * size) or self._one_piece(piece_bytes, result):
            return direct.reduce_scatter
        if self.sites is not None:
            return _site_aware(hierarchical.reduce_scatter, self.sites)
        return ring.reduce_scatter_into

    async def reduce_scatter(self, comm: Comm, blocks: Sequence[torch.Tensor], result: torch.Tensor,
                             reducer: Reducer, name: str, algorithm: Algorithm | None = None) -> None:
        """``result`` = the reduction over members of their ``blocks[rank]``."""
        chosen = algorithm or self.reduce_scatter_algorithm(comm.size, comm.piece_bytes, result)
        await chosen(comm, blocks, result, reducer)
        if name == "avg":
            finish_average(result, comm.size)

    def all_gather_algorithm(self, piece_bytes: int, targets: Sequence[torch.Tensor]) -> Algorithm:
        """Direct when small, or in a flat group where the ring's blocks are one piece each
        (``_one_piece``); else site-aware or the ring (both given ``targets`` with this member's
        block already in place)."""
        if self.is_small(sum(_nbytes(target) for target in targets)) or \
                self._one_piece(piece_bytes, max(targets, key=lambda target: target.numel())):
            return direct.all_gather
        if self.sites is not None:
            return functools.partial(_gather_in_place, _site_aware(hierarchical.all_gather, self.sites))
        return functools.partial(_gather_in_place, ring.all_gather)

    async def all_gather(self, comm: Comm, source: torch.Tensor, targets: list[torch.Tensor],
                         algorithm: Algorithm | None = None) -> None:
        """``targets[k]`` = member k's ``source``."""
        await (algorithm or self.all_gather_algorithm(comm.piece_bytes, targets))(comm, source, targets)

    def reduce_algorithm(self, buffer: torch.Tensor) -> Algorithm:
        return direct.reduce if self.is_small(_nbytes(buffer)) else ring.reduce

    async def reduce(self, comm: Comm, buffer: torch.Tensor, root: int, reducer: Reducer, name: str,
                     algorithm: Algorithm | None = None) -> None:
        await (algorithm or self.reduce_algorithm(buffer))(comm, buffer, root, reducer)
        if comm.rank == root and name == "avg":
            finish_average(buffer, comm.size)

    def broadcast_algorithm(self, piece_bytes: int, buffer: torch.Tensor) -> Algorithm:
        """Direct when small; else site-aware where that pays; else the pipelined chain, but only
        where it pipelines: a buffer of one piece would cross the chain's n-1 hops one after the
        other, (n-1) times the transfer plus n-1 latencies, where the root sending every member
        its copy at once costs the same bytes on its uplink and one latency."""
        if self.is_small(_nbytes(buffer)):
            return direct.broadcast
        if self.sites is not None:
            return _site_aware(hierarchical.broadcast, self.sites)
        if piece_count(buffer.numel(), buffer.element_size(), piece_bytes) == 1:
            return direct.broadcast
        return ring.broadcast

    async def broadcast(self, comm: Comm, buffer: torch.Tensor, root: int, algorithm: Algorithm | None = None) -> None:
        await (algorithm or self.broadcast_algorithm(comm.piece_bytes, buffer))(comm, buffer, root)


def _site_aware(algorithm: Callable[..., Awaitable[None]], sites: SiteMap) -> Algorithm:
    """``algorithm`` (a site-aware one, which takes the SiteMap after the Comm) for ``sites``."""
    async def run(comm: Comm, *args) -> None:
        await algorithm(comm, sites, *args)
    return run


async def _gather_in_place(gather: Callable[..., Awaitable[None]], comm: Comm, source: torch.Tensor,
                           targets: list[torch.Tensor]) -> None:
    """A gathering algorithm that finds this member's block in ``targets`` already: put it there first."""
    targets[comm.rank].copy_(source)
    await gather(comm, targets)
