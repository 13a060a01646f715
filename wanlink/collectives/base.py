"""The interface collective algorithms run on, and helpers to cut buffers into pipelined pieces."""
from __future__ import annotations

import asyncio
from typing import Awaitable, Callable, Protocol, Sequence

import torch

Reducer = Callable[..., None]
"""``reducer(accumulator, incoming)`` folds ``incoming`` into ``accumulator`` in place;
``reducer(accumulator, incoming, out)`` writes ``accumulator op incoming`` to ``out`` instead."""

MAX_PIECES = 4096
"""Upper bound on pieces per collective; piece tags of a phase lie in [k*MAX_PIECES, (k+1)*MAX_PIECES)
(the tag layout reserves 16 bits, 0xFFFF excluded)."""


class Comm(Protocol):
    """Point-to-point messaging between the ``size`` members of one group, for one collective.

    Messages between two members are matched by ``piece``: the k-th ``send(peer, _, piece)`` is
    received by the k-th ``recv(_, _, piece)`` posted for that sender. Tensors are flat, contiguous
    CPU tensors; empty tensors carry no message (both sides skip them, as their sizes agree).
    A Comm may also have ``exchange(sends, receives)``, several of both at once (see ``exchange``).
    """

    rank: int
    size: int
    piece_bytes: int

    async def send(self, peer: int, tensor: torch.Tensor, piece: int = 0) -> None: ...

    async def recv(self, peer: int, tensor: torch.Tensor, piece: int = 0) -> None: ...

    async def compute(self, fn: Callable[..., None], *args) -> None:
        """Run a (possibly heavy) tensor kernel without stalling message progress."""

    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A scratch tensor valid until the collective ends (implementations may reuse memory)."""


def piece_bounds(numel: int, pieces: int) -> list[tuple[int, int]]:
    """Split ``range(numel)`` into ``pieces`` contiguous, nearly equal (start, stop) ranges."""
    base, extra = divmod(numel, pieces)
    bounds, start = [], 0
    for index in range(pieces):
        stop = start + base + (1 if index < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


def piece_count(largest_numel: int, itemsize: int, piece_bytes: int) -> int:
    """How many pieces to cut a buffer of ``largest_numel`` elements into for pipelining."""
    nbytes = largest_numel * itemsize
    return max(1, min(MAX_PIECES - 1, -(-nbytes // max(1, piece_bytes)), largest_numel))


def split(tensor: torch.Tensor, pieces: int) -> list[torch.Tensor]:
    """Views of ``tensor`` (1-D) as ``pieces`` contiguous pieces (some may be empty)."""
    return [tensor[start:stop] for start, stop in piece_bounds(tensor.numel(), pieces)]


async def _cancel(tasks: list[asyncio.Task]) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


class Tasks:
    """Tasks an algorithm spawned (a ring's piece, receives posted ahead); all awaited at the end,
    all cancelled on failure."""

    def __init__(self) -> None:
        self.tasks: list[asyncio.Task] = []

    def spawn(self, awaitable) -> asyncio.Task:
        task = asyncio.ensure_future(awaitable)
        self.tasks.append(task)
        return task

    async def run(self, body: Callable[["Tasks"], object]) -> None:
        try:
            await body(self)
            await asyncio.gather(*self.tasks)
        except BaseException:
            await _cancel(self.tasks)
            raise


async def gather_all(awaitables: Sequence[Awaitable]) -> None:
    """Await all; on the first failure cancel the rest at once and re-raise it (no orphaned tasks).

    The first runs inline in the calling task, the others as tasks: one task fewer, and the first
    still starts before the others (sends queued together keep their order). A failing task
    cancels the caller, and so the one running inline, at once.
    """
    if len(awaitables) <= 1:  # nothing to run beside it: no task (each costs a loop iteration)
        for item in awaitables:
            await item
        return
    first, *rest = awaitables
    tasks = [asyncio.ensure_future(item) for item in rest]
    caller = asyncio.current_task()
    culprit: list = [None]  # the first task that failed; False once the caller is cleaning up

    def on_done(task: asyncio.Future) -> None:
        if culprit[0] is None and not task.cancelled() and task.exception() is not None:
            culprit[0] = task
            caller.cancel()

    for task in tasks:
        task.add_done_callback(on_done)
    try:
        await first
        for task in tasks:
            await task
        return
    except BaseException:
        failed, culprit[0] = culprit[0], False
        await _cancel(tasks)
        if failed is None:
            raise
    caller.uncancel()  # the cancel was ours, to stop the one running inline: report the failure
    raise failed.exception()


async def exchange(comm: Comm, sends: Sequence[tuple], receives: Sequence[tuple]) -> None:
    """Every (peer, tensor, piece) of ``sends`` sent and of ``receives`` received, all at once, with
    ``gather_all``'s outcome (the first failure ends it). Through the Comm's own ``exchange`` where it
    has one (``LinkComm``: no task per message), else one ``send`` / ``recv`` each under ``gather_all``."""
    own = getattr(comm, "exchange", None)
    if own is not None:
        await own(sends, receives)
    else:
        await gather_all([comm.send(*item) for item in sends] + [comm.recv(*item) for item in receives])
