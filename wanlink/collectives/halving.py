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

from wanlink.collectives.base import MAX_PIECES, Comm, Reducer, Tasks, piece_bounds

GATHER = MAX_PIECES  # all-gather steps use pieces GATHER + s, reduce-scatter steps s


def usable(size: int) -> bool:
    """Whether a group of ``size`` members can halve down to one block each (a power of two >= 2)."""
    return size >= 2 and size & (size - 1) == 0


async def allreduce(comm: Comm, tensor: torch.Tensor, reducer: Reducer) -> None:
    """In place: every member ends with the reduction of all members' ``tensor`` (``usable(comm.size)``).

    Every receive is posted at the start, the halving steps' into scratch and the doubling steps'
    straight into the blocks they fill, so a partner's message that comes before this member is
    ready for it lands in place instead of in staging (a copy more); on a process group's Comm
    without a task each (``base.Tasks``), their grants leaving with the first step's chunks. A step
    waits for its receive, not for its send (as in the ring): a halving step's send reads blocks
    this member no longer reduces into. A block a doubling step fills was sent from in a halving
    step, and its final sum exists only once the partner received all of that send: nothing this
    member still sends is overwritten (chunks re-sent after a stream died are dropped there as
    duplicates), as in the ring.
    """
    n, me = comm.size, comm.rank
    bounds = piece_bounds(tensor.numel(), n)

    def blocks(span: tuple[int, int]) -> torch.Tensor:
        return tensor[bounds[span[0]][0]:bounds[span[1] - 1][1]]

    halving, (lo, hi), distance = [], (0, n), n // 2  # (partner, kept blocks, given blocks) per step
    while distance:
        partner, mid = me ^ distance, (lo + hi) // 2
        keep, give = ((lo, mid), (mid, hi)) if me < partner else ((mid, hi), (lo, mid))
        halving.append((partner, keep, give))
        (lo, hi), distance = keep, distance // 2
    doubling, distance = [], 1  # (partner, finished blocks, blocks received) per step
    while distance < n:
        partner, width = me ^ distance, hi - lo
        other = (lo - width, lo) if me & distance else (hi, hi + width)
        doubling.append((partner, (lo, hi), other))
        lo, hi, distance = min(lo, other[0]), max(hi, other[1]), distance * 2

    async def body(tasks: Tasks) -> None:
        incoming = [comm.empty(blocks(keep).numel(), tensor.dtype) for _partner, keep, _give in halving]
        halved = [tasks.recv(comm, partner, incoming[step], step)
                  for step, (partner, _keep, _give) in enumerate(halving)]
        gathered = [tasks.recv(comm, partner, blocks(other), GATHER + step)
                    for step, (partner, _mine, other) in enumerate(doubling)]
        for step, (partner, keep, give) in enumerate(halving):
            tasks.send(comm, partner, blocks(give), step)
            await halved[step]
            await comm.compute(reducer, blocks(keep), incoming[step])
        for step, (partner, mine, _other) in enumerate(doubling):
            tasks.send(comm, partner, blocks(mine), GATHER + step)
            await gathered[step]

    await Tasks().run(body)
