"""Which algorithm a collective runs: direct exchange (one round) when every member's share is at
most ``direct_max_bytes``, pipelined rings and chains above, or the site-aware algorithms above it
when ``sites`` is given (a group spanning sites where they pay off: ``hierarchical.pays_off``).
AVG is a SUM finished by a division."""
from __future__ import annotations

from typing import Sequence

import torch

from wanlink.collectives import direct, hierarchical, ring
from wanlink.collectives.base import Comm, Reducer
from wanlink.collectives.reduce_ops import finish_average
from wanlink.sched.sites import SiteMap


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


async def allreduce(comm: Comm, buffer: torch.Tensor, reducer: Reducer, name: str, direct_max_bytes: int,
                    sites: SiteMap | None = None) -> None:
    if _nbytes(buffer) <= direct_max_bytes:
        await direct.allreduce(comm, buffer, reducer)
    elif sites is not None:
        await hierarchical.allreduce(comm, sites, buffer, reducer)
    else:
        await ring.allreduce(comm, buffer, reducer)
    if name == "avg":
        finish_average(buffer, comm.size)


async def reduce_scatter(comm: Comm, blocks: Sequence[torch.Tensor], result: torch.Tensor, reducer: Reducer,
                         name: str, direct_max_bytes: int, sites: SiteMap | None = None) -> None:
    """``result`` = the reduction over members of their ``blocks[rank]``."""
    if _nbytes(result) * comm.size <= direct_max_bytes:
        await direct.reduce_scatter(comm, blocks, result, reducer)
    elif sites is not None:
        await hierarchical.reduce_scatter(comm, sites, blocks, result, reducer)
    else:
        await ring.reduce_scatter_into(comm, blocks, result, reducer)
    if name == "avg":
        finish_average(result, comm.size)


async def all_gather(comm: Comm, source: torch.Tensor, targets: list[torch.Tensor], direct_max_bytes: int,
                     sites: SiteMap | None = None) -> None:
    """``targets[k]`` = member k's ``source``."""
    if sum(_nbytes(target) for target in targets) <= direct_max_bytes:
        await direct.all_gather(comm, source, targets)
        return
    targets[comm.rank].copy_(source)
    if sites is not None:
        await hierarchical.all_gather(comm, sites, targets)
    else:
        await ring.all_gather(comm, targets)


async def reduce(comm: Comm, buffer: torch.Tensor, root: int, reducer: Reducer, name: str,
                 direct_max_bytes: int) -> None:
    await (direct.reduce if _nbytes(buffer) <= direct_max_bytes else ring.reduce)(comm, buffer, root, reducer)
    if comm.rank == root and name == "avg":
        finish_average(buffer, comm.size)


async def broadcast(comm: Comm, buffer: torch.Tensor, root: int, direct_max_bytes: int,
                    sites: SiteMap | None = None) -> None:
    if _nbytes(buffer) <= direct_max_bytes:
        await direct.broadcast(comm, buffer, root)
    elif sites is not None:
        await hierarchical.broadcast(comm, sites, buffer, root)
    else:
        await ring.broadcast(comm, buffer, root)
