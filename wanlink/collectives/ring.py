"""Pipelined rings for large tensors.

The buffer is cut into one segment per member and each segment into pieces. Every piece index
runs its own chain of steps (send to the right neighbour, receive from the left, reduce), so piece
k never waits for piece k+1 and transfer overlaps reduction. Each link carries 2(n-1)/n of the
data for an all-reduce, and every member waits only on pieces it must reduce or keep.

Receives are posted before the data can arrive wherever the buffer allows it, so the transport
writes payloads straight into place instead of staging them. Reduce-scatter messages use piece
tags ``p``, all-gather messages ``ALL_GATHER + p``, the reduce's final hop ``TO_ROOT`` and the
broadcast's readiness word ``READY``, so the phases never compete for one tag's FIFO order.
"""
from __future__ import annotations

import asyncio
from typing import Callable, Sequence

import torch

from wanlink.collectives.base import MAX_PIECES, Comm, Reducer, gather_all, piece_count, split

ALL_GATHER = MAX_PIECES
TO_ROOT = 2 * MAX_PIECES
READY = 3 * MAX_PIECES
ROTATING_BUFFERS = 3
"""Receive buffers per piece in the reduce-scatter phase (bounds its extra memory for large rings)."""


async def _cancel(tasks: list[asyncio.Task]) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


class _Tasks:
    """The tasks one piece spawned; all awaited at the end, all cancelled on failure."""

    def __init__(self) -> None:
        self.tasks: list[asyncio.Task] = []

    def spawn(self, awaitable) -> asyncio.Task:
        task = asyncio.ensure_future(awaitable)
        self.tasks.append(task)
        return task

    async def run(self, body: Callable[["_Tasks"], object]) -> None:
        try:
            await body(self)
            await asyncio.gather(*self.tasks)
        except BaseException:
            await _cancel(self.tasks)
            raise


def _pieces(comm: Comm, segments: Sequence[torch.Tensor]) -> tuple[int, list[list[torch.Tensor]]]:
    count = piece_count(max(segment.numel() for segment in segments), segments[0].element_size(),
                        comm.piece_bytes)
    return count, [split(segment, count) for segment in segments]


async def _reduce_scatter_piece(comm: Comm, pieces: list[list[torch.Tensor]], p: int, out: torch.Tensor,
                                reducer: Reducer, tasks: _Tasks) -> None:
    """Reduce-scatter piece ``p`` into ``out``, reading ``pieces`` only (``out`` may be one of them).

    Each member folds its block into the partial sum it receives and forwards that buffer; the
    last step writes the sum straight to ``out``. Receives are posted ahead into rotating
    buffers, in step order (the tag's FIFO order).
    """
    n, me = comm.size, comm.rank
    right, left = (me + 1) % n, (me - 1) % n
    steps = n - 1
    sizes = [pieces[(me - step - 2) % n][p].numel() for step in range(steps)]
    slots = min(ROTATING_BUFFERS, steps)
    buffers = [comm.empty(max(sizes), out.dtype) for _ in range(slots)]
    tasks.spawn(comm.send(right, pieces[(me - 1) % n][p], p))
    receives: dict[int, asyncio.Future] = {}

    def post(step: int) -> asyncio.Task:
        return tasks.spawn(comm.recv(left, buffers[step % slots][: sizes[step]], p))

    async def post_after(forwarded: asyncio.Task, previous: asyncio.Future | None, step: int) -> asyncio.Task:
        await forwarded  # the buffer is free again
        if previous is not None:
            await previous  # keep posting in step order
        return post(step)

    for step in range(slots):
        receives[step] = asyncio.get_running_loop().create_future()
        receives[step].set_result(post(step))
    for step in range(steps):
        incoming = buffers[step % slots][: sizes[step]]
        mine = pieces[(me - step - 2) % n][p]
        await (await receives.pop(step))
        if step == steps - 1:
            await comm.compute(reducer, incoming, mine, out)
            break
        await comm.compute(reducer, incoming, mine)
        forwarded = tasks.spawn(comm.send(right, incoming, p))
        if step + slots < steps:
            receives[step + slots] = tasks.spawn(post_after(forwarded, receives.get(step + slots - 1), step + slots))


async def reduce_scatter_into(comm: Comm, blocks: Sequence[torch.Tensor], output: torch.Tensor,
                              reducer: Reducer) -> None:
    """Ring reduce-scatter that leaves ``blocks`` untouched: ``output`` = reduction of ``blocks[rank]``."""
    if comm.size == 1:
        output.copy_(blocks[0])
        return
    count, pieces = _pieces(comm, blocks)
    outputs = split(output, count)

    async def run_piece(p: int) -> None:
        async def body(tasks: _Tasks) -> None:
            await _reduce_scatter_piece(comm, pieces, p, outputs[p], reducer, tasks)
        await _Tasks().run(body)

    await gather_all([run_piece(p) for p in range(count)])


async def allreduce(comm: Comm, tensor: torch.Tensor, reducer: Reducer) -> None:
    """In-place ring all-reduce of a flat tensor: reduce-scatter, then all-gather.

    All-gather receives are posted at the start, straight into their segments. That includes
    segment rank-1, whose first reduce-scatter send reads it: its final sum can only exist once
    the right neighbour received all of that send, and chunks of it re-sent after a stream died
    are dropped there as duplicates, so nothing this member still sends is overwritten.
    """
    n, me = comm.size, comm.rank
    if n == 1:
        return
    right, left = (me + 1) % n, (me - 1) % n
    count, pieces = _pieces(comm, split(tensor, n))

    async def run_piece(p: int) -> None:
        async def body(tasks: _Tasks) -> None:
            gathered = [tasks.spawn(comm.recv(left, pieces[(me - step - 1) % n][p], ALL_GATHER + p))
                        for step in range(n - 1)]
            await _reduce_scatter_piece(comm, pieces, p, pieces[me][p], reducer, tasks)
            for step in range(n - 1):
                tasks.spawn(comm.send(right, pieces[(me - step) % n][p], ALL_GATHER + p))
                await gathered[step]
        await _Tasks().run(body)

    await gather_all([run_piece(p) for p in range(count)])


async def all_gather(comm: Comm, segments: Sequence[torch.Tensor]) -> None:
    """Ring all-gather: ``segments[rank]`` filled on entry, all filled on return.

    Every receive is posted at the start; segments are written once and sent only after.
    """
    n, me = comm.size, comm.rank
    if n == 1:
        return
    right, left = (me + 1) % n, (me - 1) % n
    count, pieces = _pieces(comm, segments)

    async def run_piece(p: int) -> None:
        async def body(tasks: _Tasks) -> None:
            gathered = [tasks.spawn(comm.recv(left, pieces[(me - step - 1) % n][p], ALL_GATHER + p))
                        for step in range(n - 1)]
            for step in range(n - 1):
                tasks.spawn(comm.send(right, pieces[(me - step) % n][p], ALL_GATHER + p))
                await gathered[step]
        await _Tasks().run(body)

    await gather_all([run_piece(p) for p in range(count)])


async def reduce(comm: Comm, tensor: torch.Tensor, root: int, reducer: Reducer) -> None:
    """Ring reduce-scatter, then each member sends its finished segment straight to ``root``.

    ``tensor`` is the root's in/out buffer; other members only read theirs.
    """
    n, me = comm.size, comm.rank
    segments = split(tensor, n)
    mine = comm.empty(segments[me].numel(), tensor.dtype)
    await reduce_scatter_into(comm, segments, mine, reducer)
    if me == root:
        await gather_all([comm.recv(peer, segments[peer], TO_ROOT) for peer in range(n) if peer != me])
        segments[me].copy_(mine)
    else:
        await comm.send(root, mine, TO_ROOT)


async def broadcast(comm: Comm, tensor: torch.Tensor, root: int) -> None:
    """Pipelined chain root -> root+1 -> ...: every link carries the tensor once.

    Each member but the root posts all its receives, then tells its predecessor so (a one-byte
    ``READY`` message); the predecessor sends its first piece at once and the rest only after that
    word. Without it a root, which finishes as soon as its successor has everything, runs into the
    next broadcast while the chain still relays this one, and every piece it sends meanwhile is
    staged (copied) by a successor that has not posted its receives yet.
    """
    n, me = comm.size, comm.rank
    if n == 1:
        return
    position = (me - root) % n
    previous, following = (me - 1) % n, (me + 1) % n
    count = piece_count(tensor.numel(), tensor.element_size(), comm.piece_bytes)
    pieces = split(tensor, count)

    async def body(tasks: _Tasks) -> None:
        received = []
        if position > 0:
            received = [tasks.spawn(comm.recv(previous, piece, p)) for p, piece in enumerate(pieces)]
            # spawned after the receives, so it runs once they are posted
            tasks.spawn(comm.send(previous, torch.ones(1, dtype=torch.uint8), READY))
        if position == n - 1:
            return
        ready = tasks.spawn(comm.recv(following, torch.empty(1, dtype=torch.uint8), READY))
        for p, piece in enumerate(pieces):
            if received:
                await received[p]
            if p == 1:
                await ready
            tasks.spawn(comm.send(following, piece, p))

    await _Tasks().run(body)
