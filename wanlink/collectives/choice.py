"""Which algorithm a collective runs: direct exchange (one round) when every member's share is at
most ``direct_max_bytes``, pipelined rings and chains above. AVG is a SUM finished by a division."""
from __future__ import annotations

from typing import Sequence

import torch

from wanlink.collectives import direct, ring
from wanlink.collectives.base import Comm, Reducer
from wanlink.collectives.reduce_ops import finish_average


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


async def allreduce(comm: Comm, buffer: torch.Tensor, reducer: Reducer, name: str, direct_max_bytes: int) -> None:
    await (direct.allreduce if _nbytes(buffer) <= direct_max_bytes else ring.allreduce)(comm, buffer, reducer)
    if name == "avg":
        finish_average(buffer, comm.size)


async def reduce_scatter(comm: Comm, blocks: Sequence[torch.Tensor], result: torch.Tensor, reducer: Reducer,
                         name: str, direct_max_bytes: int) -> None:
    """``result`` = the reduction over members of their ``blocks[rank]``."""
    if _nbytes(result) * comm.size <= direct_max_bytes:
        await direct.reduce_scatter(comm, blocks, result, reducer)
    else:
        await ring.reduce_scatter_into(comm, blocks, result, reducer)
    if name == "avg":
        finish_average(result, comm.size)


async def all_gather(comm: Comm, source: torch.Tensor, targets: list[torch.Tensor], direct_max_bytes: int) -> None:
    """``targets[k]`` = member k's ``source``."""
    if sum(_nbytes(target) for target in targets) <= direct_max_bytes:
        await direct.all_gather(comm, source, targets)
    else:
        targets[comm.rank].copy_(source)
        await ring.all_gather(comm, targets)


async def reduce(comm: Comm, buffer: torch.Tensor, root: int, reducer: Reducer, name: str,
                 direct_max_bytes: int) -> None:
    await (direct.reduce if _nbytes(buffer) <= direct_max_bytes else ring.reduce)(comm, buffer, root, reducer)
    if comm.rank == root and name == "avg":
        finish_average(buffer, comm.size)


async def broadcast(comm: Comm, buffer: torch.Tensor, root: int, direct_max_bytes: int) -> None:
    await (direct.broadcast if _nbytes(buffer) <= direct_max_bytes else ring.broadcast)(comm, buffer, root)
