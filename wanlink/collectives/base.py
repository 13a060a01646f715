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


def _synchronous(futures: Sequence) -> bool:
    """Whether ``futures`` are a synchronous Comm's (``completes_when_awaited``): awaiting one moves
    that Comm's bytes on the calling thread until it is done, so there is no event loop to gather on."""
    return bool(futures) and getattr(futures[0], "completes_when_awaited", False)


async def _cancel(tasks: list) -> None:
    for task in tasks:
        task.cancel()
    if not _synchronous(tasks):
        await asyncio.gather(*tasks, return_exceptions=True)


class Tasks:
    """What an algorithm started and did not await at once (a ring's sends, receives posted ahead, a
    piece's helper): all awaited at the end, all cancelled on failure.

    ``send`` and ``recv`` start a message without a task where the Comm can (``start_send`` /
    ``start_recv``, a process group's ``LinkComm``: the message is queued or the receive posted now,
    and its future is what is awaited; a same-host group's ``ExpressComm``, whose futures complete
    when awaited); elsewhere they spawn the Comm's ``send`` / ``recv``."""

    def __init__(self) -> None:
        self.tasks: list[asyncio.Future] = []
        self._give_back: list[Callable[[], None]] = []  # for receives posted without a task

    def spawn(self, awaitable) -> asyncio.Future:
        task = asyncio.ensure_future(awaitable)
        self.tasks.append(task)
        return task

    def send(self, comm: Comm, peer: int, tensor: torch.Tensor, piece: int = 0) -> asyncio.Future:
        start = getattr(comm, "start_send", None)
        future = start(peer, tensor, piece) if start is not None else None
        if future is None:
            return self.spawn(comm.send(peer, tensor, piece))
        self.tasks.append(future)
        return future

    def recv(self, comm: Comm, peer: int, tensor: torch.Tensor, piece: int = 0) -> asyncio.Future:
        start = getattr(comm, "start_recv", None)
        posted = start(peer, tensor, piece) if start is not None else None
        if posted is None:
            return self.spawn(comm.recv(peer, tensor, piece))
        future, give_back = posted
        self.tasks.append(future)
        self._give_back.append(give_back)
        return future

    async def run(self, body: Callable[["Tasks"], object]) -> None:
        try:
            await body(self)
            if _synchronous(self.tasks):
                for task in self.tasks:
                    await task
            else:
                await asyncio.gather(*self.tasks)
        except BaseException:
            for give_back in self._give_back:  # (a receive still posted goes to the next one on its tag)
                give_back()
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
