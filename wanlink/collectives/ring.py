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
import collections
from typing import Sequence

import torch

from wanlink.collectives.base import MAX_PIECES, Comm, Reducer, Tasks, gather_all, piece_count, split

ALL_GATHER = MAX_PIECES
TO_ROOT = 2 * MAX_PIECES
READY = 3 * MAX_PIECES
ROTATING_BUFFERS = 3
"""Receive buffers per piece in the reduce-scatter phase (bounds its extra memory for large rings)."""
RECEIVE_BUFFER_BYTES = 128 * 1024 * 1024
"""Receive buffers one reduce-scatter holds at once, recycled from piece to piece: its extra memory
whatever the tensor's size (fresh buffers for every piece cost a 2.25 GiB all-reduce 1.1 GiB more
than gloo, and page faults on every first use). On 2 ranks that keeps 32 pieces of 4 MiB in flight,
several bandwidth-delay products of a 2 Gbit/s, 80 ms path."""


class _ReceiveBuffers:
    """The reduce-scatter's receive buffers: sets of ``slots`` buffers of ``numel`` elements, at most
    ``RECEIVE_BUFFER_BYTES`` of them, handed to pieces strictly in the order they ask.

    Every member's pieces ask in piece order, so all members work on the same pieces (the lowest
    unfinished piece always holds a set everywhere: no deadlock) and a member posts a piece's receive
    about when its neighbour sends it, instead of staging pieces it has no buffer for.
    """

    def __init__(self, comm: Comm, numel: int, dtype: torch.dtype, slots: int):
        self._comm, self._numel, self._dtype, self._slots = comm, numel, dtype, slots
        set_bytes = max(1, numel * slots * dtype.itemsize)
        self._room = max(1, RECEIVE_BUFFER_BYTES // set_bytes)  # sets not made yet
        self._free: list[list[torch.Tensor]] = []
        self._waiting: collections.deque[asyncio.Future] = collections.deque()

    async def take(self) -> list[torch.Tensor]:
        if not self._waiting:
            if self._free:
                return self._free.pop()
            if self._room:
                self._room -= 1
                return [self._comm.empty(self._numel, self._dtype) for _ in range(self._slots)]
        waiter = asyncio.get_running_loop().create_future()
        self._waiting.append(waiter)
        return await waiter

    def give(self, buffers: list[torch.Tensor]) -> None:
        while self._waiting:
            waiter = self._waiting.popleft()
            if not waiter.done():  # (a cancelled piece no longer waits)
                waiter.set_result(buffers)
                return
        self._free.append(buffers)


def _pieces(comm: Comm, segments: Sequence[torch.Tensor]) -> tuple[int, list[list[torch.Tensor]]]:
    count = piece_count(max(segment.numel() for segment in segments), segments[0].element_size(),
                        comm.piece_bytes)
    return count, [split(segment, count) for segment in segments]


async def _reduce_scatter_piece(comm: Comm, pieces: list[list[torch.Tensor]], p: int, out: torch.Tensor,
                                reducer: Reducer, receive_buffers: _ReceiveBuffers, tasks: Tasks) -> None:
    """Reduce-scatter piece ``p`` into ``out``, reading ``pieces`` only (``out`` may be one of them).

    Each member folds its block into the partial sum it receives and forwards that buffer; the
    last step writes the sum straight to ``out``. Receives are posted ahead into rotating
    buffers, in step order (the tag's FIFO order); the piece starts once it holds a set of them.
    """
    n, me = comm.size, comm.rank
    right, left = (me + 1) % n, (me - 1) % n
    steps = n - 1
    sizes = [pieces[(me - step - 2) % n][p].numel() for step in range(steps)]
    slots = min(ROTATING_BUFFERS, steps)
    buffers = await receive_buffers.take()
    tasks.send(comm, right, pieces[(me - 1) % n][p], p)
    receives: dict[int, asyncio.Future] = {}
    forwards: list[asyncio.Future] = []

    def post(step: int) -> asyncio.Future:
        return tasks.recv(comm, left, buffers[step % slots][: sizes[step]], p)

    async def post_after(forwarded: asyncio.Future, previous: asyncio.Future | None, step: int) -> asyncio.Future:
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
        forwards.append(tasks.send(comm, right, incoming, p))
        if step + slots < steps:
            receives[step + slots] = tasks.spawn(post_after(forwards[-1], receives.get(step + slots - 1),
                                                            step + slots))
    await asyncio.gather(*forwards)
    receive_buffers.give(buffers)


def _receive_buffers(comm: Comm, pieces: list[list[torch.Tensor]]) -> _ReceiveBuffers:
    """Buffer sets that fit any piece (the first piece of a segment is its largest)."""
    return _ReceiveBuffers(comm, max(segment[0].numel() for segment in pieces), pieces[0][0].dtype,
                           min(ROTATING_BUFFERS, comm.size - 1))


async def reduce_scatter_into(comm: Comm, blocks: Sequence[torch.Tensor], output: torch.Tensor,
                              reducer: Reducer) -> None:
    """Ring reduce-scatter that leaves ``blocks`` untouched: ``output`` = reduction of ``blocks[rank]``."""
    if comm.size == 1:
        output.copy_(blocks[0])
        return
    count, pieces = _pieces(comm, blocks)
    outputs = split(output, count)
    receive_buffers = _receive_buffers(comm, pieces)

    async def run_piece(p: int) -> None:
        async def body(tasks: Tasks) -> None:
            await _reduce_scatter_piece(comm, pieces, p, outputs[p], reducer, receive_buffers, tasks)
        await Tasks().run(body)

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
    receive_buffers = _receive_buffers(comm, pieces)

    async def run_piece(p: int) -> None:
        async def body(tasks: Tasks) -> None:
            gathered = [tasks.recv(comm, left, pieces[(me - step - 1) % n][p], ALL_GATHER + p)
                        for step in range(n - 1)]
            await _reduce_scatter_piece(comm, pieces, p, pieces[me][p], reducer, receive_buffers, tasks)
            for step in range(n - 1):
                tasks.send(comm, right, pieces[(me - step) % n][p], ALL_GATHER + p)
                await gathered[step]
        await Tasks().run(body)

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
        async def body(tasks: Tasks) -> None:
            gathered = [tasks.recv(comm, left, pieces[(me - step - 1) % n][p], ALL_GATHER + p)
                        for step in range(n - 1)]
            for step in range(n - 1):
                tasks.send(comm, right, pieces[(me - step) % n][p], ALL_GATHER + p)
                await gathered[step]
        await Tasks().run(body)

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

    async def body(tasks: Tasks) -> None:
        received = []
        if position > 0:
            received = [tasks.recv(comm, previous, piece, p) for p, piece in enumerate(pieces)]
            # started after the receives: it leaves once they are posted
            tasks.send(comm, previous, torch.ones(1, dtype=torch.uint8), READY)
        if position == n - 1:
            return
        ready = tasks.recv(comm, following, torch.empty(1, dtype=torch.uint8), READY)
        for p, piece in enumerate(pieces):
            if received:
                await received[p]
            if p == 1:
                await ready
            tasks.send(comm, following, piece, p)

    await Tasks().run(body)
