"""All-reduce (sum) of sparse COO tensors: an all-gather of every member's nonzeros, then a local sum.

Each member sends every other member its nonzero count (8 bytes), then its coalesced indices and
values as one message of ``nnz * (8 * sparse_dim + bytes per value row)`` bytes: what the nonzeros
need, nothing per dense element. Every member concatenates the contributions in rank order and
coalesces (sums duplicate indices), so all members compute bit-identical results.
"""
from __future__ import annotations

import math

import torch

from wanlink.collectives import direct
from wanlink.collectives.base import Comm
from wanlink.errors import ConfigError


def _pack(indices: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    return torch.cat([indices.contiguous().reshape(-1).view(torch.uint8),
                      values.contiguous().reshape(-1).view(torch.uint8)])


async def allreduce_coo(comm: Comm, tensor: torch.Tensor) -> torch.Tensor:
    """The coalesced sum over members of ``tensor`` (a coalesced sparse COO tensor on the CPU)."""
    indices, values = tensor.indices(), tensor.values()
    sparse_dim, row_shape = indices.shape[0], values.shape[1:]
    row_bytes = 8 * sparse_dim + math.prod(row_shape) * values.element_size()
    counts = torch.empty(comm.size, dtype=torch.int64)
    await direct.all_gather(comm, torch.tensor([indices.shape[1]], dtype=torch.int64), list(counts.split(1)))
    payloads = [torch.empty(int(count) * row_bytes, dtype=torch.uint8) for count in counts]
    await direct.all_gather(comm, _pack(indices, values), payloads)
    all_indices, all_values = [], []
    for count, payload in zip(counts.tolist(), payloads):
        index_bytes = 8 * sparse_dim * count
        all_indices.append(payload[:index_bytes].view(torch.int64).view(sparse_dim, count))
        all_values.append(payload[index_bytes:].view(values.dtype).view(count, *row_shape))
    try:
        summed = torch.sparse_coo_tensor(torch.cat(all_indices, 1), torch.cat(all_values), tensor.shape,
                                         check_invariants=True)  # indices from peers: checked before use
    except RuntimeError as error:
        raise ConfigError(f"sparse all_reduce: the members' indices do not fit shape {tuple(tensor.shape)} "
                          f"(do all ranks pass tensors of one shape?): {error}") from None
    return summed.coalesce()
