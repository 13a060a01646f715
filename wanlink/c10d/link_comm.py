"""The ``Comm`` that collectives run on inside a process group: group ranks -> Links, pieces -> tags.

Also the per-process pool of scratch buffers the algorithms borrow (``Comm.empty``).
"""
from __future__ import annotations

import asyncio
import contextlib
from typing import Callable, Sequence

import torch

from wanlink.c10d.deadlines import URGENT
from wanlink.c10d.mesh import Mesh
from wanlink.collectives.base import Comm


def as_buffer(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy."""
    return memoryview(tensor.view(torch.uint8).numpy())


class ScratchPool:
    """Reuses large scratch buffers across collectives (I/O thread only).

    Fresh multi-MiB allocations are returned to the OS on free and page-fault again on the next
    collective; on loopback that cost ~40% of a 256 MiB all-reduce. Keeps at most ``limit`` bytes.
    """

    def __init__(self, limit: int = 1 << 30):
        self.limit, self.cached = limit, 0
        self._free: dict[int, list[torch.Tensor]] = {}

    def take(self, nbytes: int) -> torch.Tensor:
        free = self._free.get(nbytes)
        if free:
            self.cached -= nbytes
            return free.pop()
        return torch.empty(nbytes, dtype=torch.uint8)

    def give(self, buffer: torch.Tensor) -> None:
        nbytes = buffer.numel()
        if self.cached + nbytes <= self.limit:
            self._free.setdefault(nbytes, []).append(buffer)
            self.cached += nbytes


_scratch_pool = ScratchPool()


def _release(held: list) -> None:
    """Release the frames ``exchange`` held on each link (a receive's grant) at the end of this loop
    iteration, after the chunks it queued: a stream writes them together, in one sendmsg."""
    while held:
        held.pop().release_frames(after_wakeups=True)


async def _all_done(futures: Sequence[asyncio.Future], several_links: bool) -> None:
    """Await every future; the first that fails ends the wait at once with its error. Futures of
    one link fail together (the link failed), so awaiting them in order finds a failure as soon as
    it happens; across links, a done callback watches for one while another is awaited."""
    if not several_links:
        for future in futures:
            await future
        return
    task = asyncio.current_task()
    failed: list = []  # the first future that failed; [None] once the wait is over

    def on_done(future: asyncio.Future) -> None:
        if not failed and not future.cancelled() and future.exception() is not None:
            failed.append(future)
            task.cancel()

    for future in futures:
        future.add_done_callback(on_done)
    try:
        for future in futures:
            await future
        return
    except asyncio.CancelledError:
        if not failed:
            raise
    finally:
        culprit = failed[0] if failed else None
        failed.append(None)
    task.uncancel()  # the cancel was ours, to stop the wait: report the failure
    raise culprit.exception()


def _done() -> asyncio.Future:
    future = asyncio.get_running_loop().create_future()
    future.set_result(None)
    return future


def _nothing() -> None:
    pass


def silent_peers(mesh: Mesh, mesh_ranks: Sequence[int], peers: Sequence[int], longer_than: float) -> dict[int, float]:
    """Of group ranks ``peers``, those whose link received nothing for ``longer_than`` s: peer -> seconds.

    A peer whose process runs keeps pinging, even while it waits on someone else; one that is
    frozen (stopped, swapping, stuck holding the GIL) or cut off goes silent. (Reads the links'
    last-heard times, which the loop thread writes.)
    """
    silent = {}
    for peer in peers:
        link = mesh.cached(mesh_ranks[peer])
        quiet = float("-inf") if link is None else link.silent_s()
        if quiet > longer_than:
            silent[peer] = quiet
    return silent


class LinkComm(Comm):
    """The ``Comm`` of one collective (or p2p op) of a group whose rank k is ``mesh_ranks[k]`` on ``mesh``."""

    def __init__(self, mesh: Mesh, mesh_ranks: Sequence[int], rank: int, piece_bytes: int, base_tag: int,
                 deadline: tuple = URGENT):
        self.rank, self.size, self.piece_bytes = rank, len(mesh_ranks), piece_bytes
        self._mesh, self._mesh_ranks, self._base_tag, self._deadline = mesh, mesh_ranks, base_tag, deadline
        self._borrowed: list[torch.Tensor] = []
        self._waiting: dict[int, int] = {}  # peer -> this comm's unfinished sends and receives with it
        self._exchanges: list[list] = []  # per running ``exchange``: [peer, future or None] per message
        self._started: list = []  # [peer, future] of each message of start_send / start_recv
        self._exchanges.append(self._started)

    @property
    def mesh(self) -> Mesh:
        return self._mesh

    def mesh_rank(self, peer: int) -> int:
        """Group rank ``peer``'s rank on the mesh (the world)."""
        return self._mesh_ranks[peer]

    def waiting_for(self) -> list[int]:
        """The peers this collective still waits on: sends not yet written, receives not yet complete."""
        waiting = {peer for peer, count in self._waiting.items() if count}
        for messages in self._exchanges:
            waiting.update(peer for peer, future in messages if future is None or not future.done())
        return sorted(waiting)

    @contextlib.contextmanager
    def _exchanging(self, peers: Sequence[int]):
        for peer in peers:
            self._waiting[peer] = self._waiting.get(peer, 0) + 1
        try:
            yield
        finally:
            for peer in peers:
                self._waiting[peer] -= 1

    async def _link(self, peer: int):
        mesh_rank = self._mesh_ranks[peer]
        return self._mesh.cached(mesh_rank) or await self._mesh.link(mesh_rank)

    async def send(self, peer: int, tensor: torch.Tensor, piece: int = 0) -> None:
        if tensor.numel() == 0:
            return
        waiting = self._waiting  # (what _exchanging does, inline: this runs for every message)
        waiting[peer] = waiting.get(peer, 0) + 1
        try:
            link = self._mesh.cached(self._mesh_ranks[peer]) or await self._link(peer)
            await link.send(as_buffer(tensor), tag=self._base_tag | piece, deadline=self._deadline, until="written")
        finally:
            waiting[peer] -= 1

    async def recv(self, peer: int, tensor: torch.Tensor, piece: int = 0) -> None:
        if tensor.numel() == 0:
            return
        waiting = self._waiting
        waiting[peer] = waiting.get(peer, 0) + 1
        try:
            link = self._mesh.cached(self._mesh_ranks[peer]) or await self._link(peer)
            await link.recv_into(as_buffer(tensor), tag=self._base_tag | piece)
        finally:
            waiting[peer] -= 1

    def start_send(self, peer: int, tensor: torch.Tensor, piece: int = 0) -> asyncio.Future | None:
        """``send`` without a task, where the link to ``peer`` is open (else None: use ``send``): the
        message is queued now; returns the future ``send`` would await (``base.Tasks.send``)."""
        link = self._mesh.cached(self._mesh_ranks[peer])
        if link is None:
            return None
        if tensor.numel() == 0:
            return _done()
        future = link.start_send(as_buffer(tensor), tag=self._base_tag | piece, deadline=self._deadline,
                                 until="written")
        self._started.append([peer, future])
        return future

    def start_recv(self, peer: int, tensor: torch.Tensor, piece: int = 0) -> tuple | None:
        """``recv`` without a task, where the link to ``peer`` is open (else None: use ``recv``): the
        receive is posted now; returns its future and the callable that gives it back (to the next
        receive on its tag) if nobody will await it (``base.Tasks.recv``)."""
        link = self._mesh.cached(self._mesh_ranks[peer])
        if link is None:
            return None
        if tensor.numel() == 0:
            return _done(), _nothing
        link.hold_frames()  # its grant leaves at the end of this loop iteration, with the chunks queued in it
        try:
            entry, future = link.start_recv(as_buffer(tensor), tag=self._base_tag | piece)
        finally:
            link.release_frames(after_wakeups=True)
        self._started.append([peer, future])
        return future, lambda: link.cancel_recv(entry)

    async def exchange(self, sends: Sequence[tuple], receives: Sequence[tuple]) -> None:
        """All of ``receives`` and ``sends`` ((peer, tensor, piece) each) at once, from this task:
        receives are posted and sends queued before the first wait (``Link.start_recv`` /
        ``start_send``), then their futures are awaited. No task per message (``gather_all`` runs
        every message but one as a task: a task, a loop iteration to start it and one more to hand
        its end back). The first failure ends it at once (the other receives are given back; sends
        already queued still go out, as a cancelled ``send``'s)."""
        if not receives and len(sends) == 1:  # (a broadcast's root of two: nothing to run beside it)
            await self.send(*sends[0])
            return
        items = [(sending, peer, tensor, piece) for sending, group in ((False, receives), (True, sends))
                 for peer, tensor, piece in group if tensor.numel()]
        if not items:
            return
        messages = [[peer, None] for _sending, peer, _tensor, _piece in items]  # futures filled in as started
        self._exchanges.append(messages)  # (waiting_for names their peers until their futures are done)
        posted: list[tuple] = []  # (link, entry) of each receive posted
        held: list = []  # links whose frames wait for the chunks queued here
        try:
            for message, (sending, peer, tensor, piece) in zip(messages, items):
                link = self._mesh.cached(self._mesh_ranks[peer]) or await self._link(peer)
                if link not in held:
                    link.hold_frames()
                    held.append(link)
                tag = self._base_tag | piece
                if sending:
                    message[1] = link.start_send(as_buffer(tensor), tag=tag, deadline=self._deadline, until="written")
                else:
                    entry, message[1] = link.start_recv(as_buffer(tensor), tag=tag)
                    posted.append((link, entry))
            _release(held)
            await _all_done([future for _peer, future in messages], len({peer for peer, _future in messages}) > 1)
        except BaseException:
            _release(held)
            for link, entry in posted:
                link.cancel_recv(entry)
            for _peer, future in messages:  # (failures after the first: not logged as never retrieved)
                if future is not None and future.done() and not future.cancelled():
                    future.exception()
            raise
        finally:
            self._exchanges.remove(messages)

    async def recv_any(self, peers: Sequence[int], tensor: torch.Tensor, piece: int = 0,
                       landing: Callable[[int], torch.Tensor] | None = None) -> int:
        """Receive the next message on this tag from whichever of ``peers`` sends one; returns that peer.

        Only a message that has started arriving is claimed, so when several peers send, one message
        is received and the others stay queued for the next receive. ``landing(peer)``, when given,
        picks the tensor a message from ``peer`` is received into instead of ``tensor``.
        """
        with self._exchanging(peers):
            return await self._recv_first(peers, landing or (lambda _peer: tensor), self._base_tag | piece)

    async def _recv_first(self, peers: Sequence[int], landing: Callable[[int], torch.Tensor], tag: int) -> int:
        links = {peer: await self._link(peer) for peer in peers}
        while True:
            for peer, link in links.items():
                if link.message_started(tag):  # checked and claimed with no await in between
                    await link.recv_into(as_buffer(landing(peer)), tag=tag)
                    return peer
            waits = [asyncio.ensure_future(link.wait_message_started(tag)) for link in links.values()]
            try:
                done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for wait in waits:
                    wait.cancel()
            failure = next((error for error in [wait.exception() for wait in done] if error is not None), None)
            if failure is not None:  # a failed link (PeerLost)
                raise failure

    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        itemsize = dtype.itemsize
        buffer = _scratch_pool.take(numel * itemsize)
        self._borrowed.append(buffer)
        return buffer.view(dtype)

    def release(self) -> None:
        """Hand scratch buffers back once nothing (including cancelled sends) can touch them."""
        for buffer in self._borrowed:
            _scratch_pool.give(buffer)
        self._borrowed.clear()

    async def compute(self, fn: Callable[..., None], *args) -> None:
        """Reduce on the I/O thread: a piece is at most ``piece_bytes``, so the loop stalls for
        about a millisecond; measured faster than a thread pool (GIL hand-offs) on loopback."""
        fn(*args)
