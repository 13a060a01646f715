"""Recursive halving and doubling (Rabenseifner's all-reduce) for groups of 2^k members.

Reduce-scatter by halving: in step s each member swaps half of the blocks it still reduces with the
member whose rank differs in one bit (distance n/2, n/4, ..., 1), keeping the half that holds its
own block and folding the partner's copy of it in; after log2(n) steps it holds its block's sum.
All-gather by doubling reverses the steps, each swap doubling the finished range. Every member sends
2(n-1)/n of the buffer, as in the ring, but in 2·log2(n) steps instead of 2(n-1): the choice where
the ring's steps cannot pipeline (one piece per segment), so each step's latency is paid in full.
Each block's sum is computed by one member and then copied, so every member ends bit-identical.
"""
from __future__ import annotations

import torch

from wanlink.collectives.base import MAX_PIECES, Comm, Reducer, exchange, piece_bounds

GATHER = MAX_PIECES  # all-gather steps use pieces GATHER + s, reduce-scatter steps s


def usable(size: int) -> bool:
    """Whether a group of ``size`` members can halve down to one block each (a power of two >= 2)."""
    return size >= 2 and size & (size - 1) == 0


async def allreduce(comm: Comm, tensor: torch.Tensor, reducer: Reducer) -> None:
    """In place: every member ends with the reduction of all members' ``tensor`` (``usable(comm.size)``)."""
    n, me = comm.size, comm.rank
    bounds = piece_bounds(tensor.numel(), n)

    def blocks(lo: int, hi: int) -> torch.Tensor:
        return tensor[bounds[lo][0]:bounds[hi - 1][1]]

    lo, hi, distance, step = 0, n, n // 2, 0
    while distance:
        partner, mid = me ^ distance, (lo + hi) // 2
        (keep_lo, keep_hi), (give_lo, give_hi) = ((lo, mid), (mid, hi)) if me < partner else ((mid, hi), (lo, mid))
        keep = blocks(keep_lo, keep_hi)
        incoming = comm.empty(keep.numel(), tensor.dtype)
        await exchange(comm, [(partner, blocks(give_lo, give_hi), step)], [(partner, incoming, step)])
        await comm.compute(reducer, keep, incoming)
        lo, hi, distance, step = keep_lo, keep_hi, distance // 2, step + 1
    distance, step = 1, 0
    while distance < n:
        partner, width = me ^ distance, hi - lo
        other = (lo - width, lo) if me & distance else (hi, hi + width)
        await exchange(comm, [(partner, blocks(lo, hi), GATHER + step)], [(partner, blocks(*other), GATHER + step)])
        lo, hi, distance, step = min(lo, other[0]), max(hi, other[1]), distance * 2, step + 1
