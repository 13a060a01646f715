"""Direct exchange: every member talks to the members it needs in a single round.

One round trip instead of the ring's 2(n-1) steps, at the price of sending whole buffers: the
right choice for small tensors on long links, and for rooted operations (gather, scatter) and
all-to-all, whose data has exactly one source and one destination. Reductions fold contributions
in rank order, so every member computes bit-identical results.
"""
from __future__ import annotations

import asyncio
from typing import Sequence

import torch

from wanlink.collectives.base import Comm, Reducer, exchange
from wanlink.errors import DeadlineExceeded, PeerLost


async def _fold_in_rank_order(comm: Comm, reducer: Reducer, contributions: Sequence[torch.Tensor],
                              out: torch.Tensor) -> None:
    """``out = contributions[0] op contributions[1] op ...`` (``out`` may alias contributions[0] or
    contributions[1]: the first step then writes ``c0 op c1`` into it, elementwise, with no copy first)."""
    rest = contributions[1:]
    if rest and out.numel() and out.data_ptr() == rest[0].data_ptr():
        await comm.compute(reducer, contributions[0], rest[0], out)
        rest = rest[1:]
    elif out.data_ptr() != contributions[0].data_ptr() or out.numel() == 0:
        out.copy_(contributions[0])
    for contribution in rest:
        await comm.compute(reducer, out, contribution)


async def allreduce(comm: Comm, tensor: torch.Tensor, reducer: Reducer) -> None:
    """In place: every member ends with the reduction of all members' ``tensor``."""
    n, me = comm.size, comm.rank
    peers = [peer for peer in range(n) if peer != me]
    incoming = {peer: comm.empty(tensor.numel(), tensor.dtype) for peer in peers}
    await exchange(comm, [(peer, tensor, 0) for peer in peers], [(peer, incoming[peer], 0) for peer in peers])
    await _reduce_in_place(comm, reducer, tensor, incoming)


async def _reduce_in_place(comm: Comm, reducer: Reducer, tensor: torch.Tensor, incoming: dict) -> None:
    """``tensor`` = reduction, in rank order, of this member's ``tensor`` and the peers' ``incoming``.
    Members 0 and 1 fold straight into ``tensor`` (it is the fold's first or second term); the others
    fold into member 0's copy, as ``tensor`` is still to be read, and copy the result."""
    me = comm.rank
    contributions = [tensor if k == me else incoming[k] for k in range(comm.size)]
    if me <= 1:
        await _fold_in_rank_order(comm, reducer, contributions, tensor)
    else:
        accumulator = incoming[0]
        await _fold_in_rank_order(comm, reducer, contributions, accumulator)
        tensor.copy_(accumulator)


async def reduce_scatter(comm: Comm, blocks: Sequence[torch.Tensor], output: torch.Tensor,
                         reducer: Reducer) -> None:
    """``output`` on member r = reduction over members of their ``blocks[r]``."""
    n, me = comm.size, comm.rank
    peers = [peer for peer in range(n) if peer != me]
    incoming = {peer: comm.empty(output.numel(), output.dtype) for peer in peers}
    await exchange(comm, [(peer, blocks[peer], 0) for peer in peers], [(peer, incoming[peer], 0) for peer in peers])
    contributions = [blocks[me] if k == me else incoming[k] for k in range(n)]
    await _fold_in_rank_order(comm, reducer, contributions, output)


async def reduce(comm: Comm, tensor: torch.Tensor, root: int, reducer: Reducer) -> None:
    """``tensor`` on ``root`` becomes the reduction of all members' tensors; others only send."""
    n, me = comm.size, comm.rank
    if me != root:
        await comm.send(root, tensor)
        return
    peers = [peer for peer in range(n) if peer != me]
    incoming = {peer: comm.empty(tensor.numel(), tensor.dtype) for peer in peers}
    await exchange(comm, [], [(peer, incoming[peer], 0) for peer in peers])
    await _reduce_in_place(comm, reducer, tensor, incoming)


async def broadcast(comm: Comm, tensor: torch.Tensor, root: int) -> None:
    """``root`` sends ``tensor`` to every member at once."""
    if comm.rank == root:
        await exchange(comm, [(peer, tensor, 0) for peer in range(comm.size) if peer != root], [])
    else:
        await comm.recv(root, tensor)


async def all_gather(comm: Comm, tensor: torch.Tensor, outputs: Sequence[torch.Tensor]) -> None:
    """``outputs[k]`` on every member = member k's ``tensor`` (sizes may differ per member)."""
    me = comm.rank
    peers = [peer for peer in range(comm.size) if peer != me]
    await exchange(comm, [(peer, tensor, 0) for peer in peers], [(peer, outputs[peer], 0) for peer in peers])
    if outputs[me].data_ptr() != tensor.data_ptr():  # (after the messages: they leave sooner)
        outputs[me].copy_(tensor)


async def gather(comm: Comm, tensor: torch.Tensor, root: int, outputs: Sequence[torch.Tensor] | None) -> None:
    """``outputs[k]`` on ``root`` = member k's ``tensor``; other members only send."""
    me = comm.rank
    if me != root:
        await comm.send(root, tensor)
        return
    outputs[me].copy_(tensor)
    await exchange(comm, [], [(peer, outputs[peer], 0) for peer in range(comm.size) if peer != me])


async def scatter(comm: Comm, inputs: Sequence[torch.Tensor] | None, root: int, output: torch.Tensor) -> None:
    """Member k's ``output`` = ``inputs[k]`` on ``root``."""
    me = comm.rank
    if me != root:
        await comm.recv(root, output)
        return
    output.copy_(inputs[me])
    await exchange(comm, [(peer, inputs[peer], 0) for peer in range(comm.size) if peer != me], [])


async def all_to_all(comm: Comm, inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor]) -> None:
    """``outputs[j]`` on member k = ``inputs[k]`` on member j; all pairs exchange at once."""
    me = comm.rank
    peers = [peer for peer in range(comm.size) if peer != me]
    outputs[me].copy_(inputs[me])
    await exchange(comm, [(peer, inputs[peer], 0) for peer in peers], [(peer, outputs[peer], 0) for peer in peers])


async def barrier(comm: Comm) -> None:
    """Returns once every member has entered: a one-byte token from every member (one round trip)."""
    me = comm.rank
    peers = [peer for peer in range(comm.size) if peer != me]
    token = torch.ones(1, dtype=torch.uint8)
    incoming = {peer: torch.empty(1, dtype=torch.uint8) for peer in peers}
    await exchange(comm, [(peer, token, 0) for peer in peers], [(peer, incoming[peer], 0) for peer in peers])


async def monitored_barrier(comm: Comm, seconds: float, wait_all_ranks: bool) -> None:
    """Every member reports to member 0, which then releases them all.

    Member 0 waits at most ``seconds`` and then names the members that did not report:
    PeerLost for those whose link failed, else DeadlineExceeded for those that did not arrive. It
    names the first such member, or with ``wait_all_ranks`` every one (waiting the whole time).
    """
    token = torch.ones(1, dtype=torch.uint8)
    if comm.rank != 0:
        await comm.send(0, token)
        try:
            await asyncio.wait_for(comm.recv(0, torch.empty(1, dtype=torch.uint8)), seconds)
        except asyncio.TimeoutError:
            raise DeadlineExceeded(f"timed out after {seconds:g} s waiting for rank 0 to release it "
                                   f"(rank 0 waits for every rank)") from None
        return
    arrivals = {peer: asyncio.ensure_future(comm.recv(peer, torch.empty(1, dtype=torch.uint8)))
                for peer in range(1, comm.size)}
    if arrivals:
        await asyncio.wait(arrivals.values(), timeout=seconds,
                           return_when=asyncio.ALL_COMPLETED if wait_all_ranks else asyncio.FIRST_EXCEPTION)
    arrived = {peer for peer, task in arrivals.items() if task.done()}
    for task in arrivals.values():
        task.cancel()
    await asyncio.gather(*arrivals.values(), return_exceptions=True)
    failed = {peer: arrivals[peer].exception() for peer in sorted(arrived) if arrivals[peer].exception() is not None}
    missing = [peer for peer in arrivals if peer not in arrived]
    if failed:
        shown = sorted(failed) if wait_all_ranks else sorted(failed)[:1]
        late = f"; rank(s) {missing} did not reach it within {seconds:g} s" if wait_all_ranks and missing else ""
        raise PeerLost(f"the link to rank(s) {shown} failed "
                       f"({failed[shown[0]]}){late}") from failed[shown[0]]
    if missing:
        shown = missing if wait_all_ranks else missing[:1]
        raise DeadlineExceeded(f"timed out after {seconds:g} s: rank(s) {shown} did not reach the barrier")
    await exchange(comm, [(peer, token, 0) for peer in range(1, comm.size)], [])
