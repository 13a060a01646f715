"""Which algorithm a collective runs: direct exchange (one round) when every member's share is at
most ``direct_max_bytes``; above it, the site-aware algorithms (collectives/hierarchical.py) when the
group spans sites where they pay off, else pipelined rings and chains where they pipeline (more
than one piece), and where they would not direct broadcast, all-gather and reduce-scatter, and for
all-reduce direct exchange (two members) or halving. AVG is a SUM finished by a division."""
from __future__ import annotations

import dataclasses
from typing import Sequence

import torch

from wanlink.collectives import direct, halving, hierarchical, ring
from wanlink.collectives.base import Comm, Reducer, piece_count
from wanlink.collectives.reduce_ops import finish_average
from wanlink.sched.sites import SiteMap


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

    def _one_piece(self, comm: Comm, block: torch.Tensor) -> bool:
        """Whether a flat group's ring would carry ``block`` (a member's share) as one piece: it
        cannot pipeline, and its n-1 steps would each wait for the last. Direct exchange then moves
        the same bytes per member ((n-1) blocks out, (n-1) in) in one round, as one exchange from
        the collective's task (the chain's rule for broadcast below)."""
        return self.sites is None and piece_count(block.numel(), block.element_size(), comm.piece_bytes) == 1

    async def allreduce(self, comm: Comm, buffer: torch.Tensor, reducer: Reducer, name: str) -> None:
        """Direct when small; site-aware where that pays; else the pipelined ring, but where it would
        not pipeline: for two members, a buffer of one piece goes direct (each member sends the other
        the whole buffer: the ring's bytes, half each way twice, in one round instead of two dependent
        ones; each member then reduces the whole buffer instead of half, which only the ring's pieces
        could overlap with the transfer); for a power of two > 2 whose segments are one piece each,
        recursive halving and doubling: the ring's bytes in 2 log2(n) steps instead of 2(n-1)."""
        if self.is_small(_nbytes(buffer)):
            await direct.allreduce(comm, buffer, reducer)
        elif self.sites is not None:
            await hierarchical.allreduce(comm, self.sites, buffer, reducer)
        elif comm.size == 2 and piece_count(buffer.numel(), buffer.element_size(), comm.piece_bytes) == 1:
            await direct.allreduce(comm, buffer, reducer)
        elif comm.size > 2 and halving.usable(comm.size) and \
                piece_count(-(-buffer.numel() // comm.size), buffer.element_size(), comm.piece_bytes) == 1:
            await halving.allreduce(comm, buffer, reducer)
        else:
            await ring.allreduce(comm, buffer, reducer)
        if name == "avg":
            finish_average(buffer, comm.size)

    async def reduce_scatter(self, comm: Comm, blocks: Sequence[torch.Tensor], result: torch.Tensor,
                             reducer: Reducer, name: str) -> None:
        """``result`` = the reduction over members of their ``blocks[rank]``: direct when small, or in
        a flat group where the ring's blocks are one piece each (``_one_piece``); else site-aware or the ring."""
        if self.is_small(_nbytes(result) * comm.size) or self._one_piece(comm, result):
            await direct.reduce_scatter(comm, blocks, result, reducer)
        elif self.sites is not None:
            await hierarchical.reduce_scatter(comm, self.sites, blocks, result, reducer)
        else:
            await ring.reduce_scatter_into(comm, blocks, result, reducer)
        if name == "avg":
            finish_average(result, comm.size)

    async def all_gather(self, comm: Comm, source: torch.Tensor, targets: list[torch.Tensor]) -> None:
        """``targets[k]`` = member k's ``source``: direct when small, or in a flat group where the
        ring's blocks are one piece each (``_one_piece``); else site-aware or the ring."""
        if self.is_small(sum(_nbytes(target) for target in targets)) or \
                self._one_piece(comm, max(targets, key=lambda target: target.numel())):
            await direct.all_gather(comm, source, targets)
            return
        targets[comm.rank].copy_(source)
        if self.sites is not None:
            await hierarchical.all_gather(comm, self.sites, targets)
        else:
            await ring.all_gather(comm, targets)

    async def reduce(self, comm: Comm, buffer: torch.Tensor, root: int, reducer: Reducer, name: str) -> None:
        await (direct.reduce if self.is_small(_nbytes(buffer)) else ring.reduce)(comm, buffer, root, reducer)
        if comm.rank == root and name == "avg":
            finish_average(buffer, comm.size)

    async def broadcast(self, comm: Comm, buffer: torch.Tensor, root: int) -> None:
        """Direct when small; else site-aware where that pays; else the pipelined chain, but only
        where it pipelines: a buffer of one piece would cross the chain's n-1 hops one after the
        other, (n-1) times the transfer plus n-1 latencies, where the root sending every member
        its copy at once costs the same bytes on its uplink and one latency."""
        if self.is_small(_nbytes(buffer)):
            await direct.broadcast(comm, buffer, root)
        elif self.sites is not None:
            await hierarchical.broadcast(comm, self.sites, buffer, root)
        elif piece_count(buffer.numel(), buffer.element_size(), comm.piece_bytes) == 1:
            await direct.broadcast(comm, buffer, root)
        else:
            await ring.broadcast(comm, buffer, root)
