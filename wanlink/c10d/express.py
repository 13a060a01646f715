"""The express path: a same-host group's round-based collectives, run off the I/O loop.

A small collective on the I/O loop crosses about a dozen hand-offs (caller -> loop thread -> link
writer -> peer's reader -> algorithm task -> Work -> caller), each tens of microseconds of cold
Python on a busy host, where gloo blocks in one thread on a socket. When every member of a group
shares this host and network namespace, the collectives whose algorithm posts every receive before
waiting on any (``ROUND_BASED``: direct exchange, halving) run instead in issue order, on the
caller's thread (a blocking call: torch's ``asyncOp=False``) or the group's own thread (an async one),
over one Unix socket per pair of members (wanlink/io/express.py): the algorithm's coroutine is
driven to its end in one step, each await moving bytes on the thread that runs it. The
rule depends only on the operation and the group, so every member routes a collective alike;
everything else keeps the I/O loop. ``WANLINK_EXPRESS=0`` turns it off.

The sockets are made by the group's first express collective (the higher group rank dials), under
that collective's timeout. A collective that fails (timeout, lost peer, mismatched sizes) is
abandoned on its sockets (wanlink/proto/express.py) and the next one starts clean.
"""
from __future__ import annotations

import collections
import math
import queue
import threading
import time
from typing import Callable, Coroutine, Sequence

import torch

from wanlink.c10d.link_comm import ScratchPool, as_buffer
from wanlink.c10d.mesh import Mesh
from wanlink.c10d.work import WanlinkWork
from wanlink.collectives.base import Comm
from wanlink.errors import DeadlineExceeded, PeerLost, ProtocolError
from wanlink.io.express import ExpressSockets, dial

LOST_POLL_S = 0.5
"""How often a waiting collective (express or on the I/O loop) checks whether the link to one of its
members failed."""
SCRATCH_BYTES = 256 << 20
"""Scratch memory an express group keeps between collectives (halving's receive buffers)."""


class _Expired(Exception):
    """The collective's deadline passed; the group names whom it still waited for."""


class _Finished:
    done = True


class ExpressFuture:
    """A message of an ``ExpressComm``: awaiting it moves the group's bytes until it is done."""

    completes_when_awaited = True  # (collectives.base.Tasks: no event loop to gather these on)
    __slots__ = ("_comm", "_item")

    def __init__(self, comm: ExpressComm | None, item):
        self._comm, self._item = comm, item

    def done(self) -> bool:
        return self._item.done

    def cancel(self) -> None:
        """Nothing to do: a failed collective is abandoned on its sockets as a whole (``ExpressGroup``)."""

    def __await__(self):
        yield from ()  # a generator that never suspends
        if not self._item.done:
            self._comm.finish(self._item)


_STOP = object()  # queued by close(): the group's thread ends there
_DONE = ExpressFuture(None, _Finished())  # an empty tensor's message: there is none


def _nothing() -> None:
    pass


class ExpressComm(Comm):
    """The Comm of one express collective (sequence number ``sequence``) of ``group``."""

    def __init__(self, group: ExpressGroup, sequence: int):
        self.rank, self.size, self.piece_bytes = group.group_rank, group.size, group.piece_bytes
        self.sequence = sequence
        self.deadline = math.inf  # (time.monotonic(); set when the collective starts)
        self._group = group
        self._items: list[tuple[int, object]] = []  # (peer, message or receive) of every message
        self._borrowed: list[torch.Tensor] = []

    def start_send(self, peer: int, tensor: torch.Tensor, piece: int = 0) -> ExpressFuture:
        if not tensor.numel():
            return _DONE
        message = self._group.sockets.outgoing(peer).push(self.sequence, piece, as_buffer(tensor))
        self._items.append((peer, message))
        return ExpressFuture(self, message)

    def start_recv(self, peer: int, tensor: torch.Tensor, piece: int = 0) -> tuple:
        if not tensor.numel():
            return _DONE, _nothing
        receive = self._group.sockets.incoming(peer).post(self.sequence, piece, as_buffer(tensor))
        self._items.append((peer, receive))
        return ExpressFuture(self, receive), _nothing

    async def send(self, peer: int, tensor: torch.Tensor, piece: int = 0) -> None:
        await self.start_send(peer, tensor, piece)

    async def recv(self, peer: int, tensor: torch.Tensor, piece: int = 0) -> None:
        await self.start_recv(peer, tensor, piece)[0]

    async def exchange(self, sends: Sequence[tuple], receives: Sequence[tuple]) -> None:
        """Every send queued and started, every receive posted, then all moved together."""
        sent = [self.start_send(*item) for item in sends]
        if sent:
            self._group.sockets.move()  # the bytes leave now, before the receives are posted
        for future in [self.start_recv(*item)[0] for item in receives] + sent:
            await future

    def finish(self, item) -> None:
        """Move bytes until ``item`` is done; _Expired once the deadline passed; PeerLost once the
        link to a member failed, checked whenever nothing moved for LOST_POLL_S (a rank waiting on
        a survivor that gave up on a dead member would otherwise wait for its deadline). Members
        this collective still waits for are left to their sockets: their process's death closes
        them at once, and their silence (a frozen process) is for the timeout to name."""
        check_at = time.monotonic() + LOST_POLL_S
        while not item.done:
            if not self._group.sockets.progress(min(self.deadline, check_at)):
                now = time.monotonic()
                if now >= self.deadline:
                    raise _Expired()
                self._group.check_members(self.waiting_for())
                check_at = now + LOST_POLL_S

    async def compute(self, fn: Callable[..., None], *args) -> None:
        fn(*args)

    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        buffer = self._group.scratch.take(numel * dtype.itemsize)
        self._borrowed.append(buffer)
        return buffer.view(dtype)

    def release(self) -> None:
        for buffer in self._borrowed:
            self._group.scratch.give(buffer)
        self._borrowed.clear()

    def waiting_for(self) -> list[int]:
        """The peers whose messages of this collective are not all written or read."""
        return sorted({peer for peer, item in self._items if not item.done})


class ExpressGroup:
    """A same-host group's express sockets and the thread that runs its express collectives in order.

    ``mesh_ranks[k]`` is group rank k's world rank; this process is ``group_rank``.
    """

    def __init__(self, mesh: Mesh, mesh_ranks: Sequence[int], group_rank: int, slot: int, piece_bytes: int):
        self.mesh, self.mesh_ranks, self.slot = mesh, list(mesh_ranks), slot
        self.group_rank, self.size, self.piece_bytes = group_rank, len(mesh_ranks), piece_bytes
        self._others = [peer for peer in range(self.size) if peer != group_rank]
        self._connected = False  # a socket to every other member
        self.sockets = ExpressSockets()
        self.scratch = ScratchPool(SCRATCH_BYTES)
        self._jobs: collections.deque = collections.deque()  # collectives not begun, in issue order
        self._wakeups: queue.SimpleQueue = queue.SimpleQueue()  # the Work of each job the thread runs
        self._running = threading.Lock()  # held by whichever thread runs a collective of the group
        self._thread: threading.Thread | None = None
        self._closed = False
        self._lock = threading.Lock()

    @classmethod
    def for_group(cls, mesh: Mesh, mesh_ranks: Sequence[int], group_rank: int, slot: int,
                  piece_bytes: int) -> ExpressGroup | None:
        """An ExpressGroup where every other member shares this host and offers express sockets, else None."""
        others = [rank for k, rank in enumerate(mesh_ranks) if k != group_rank]
        if not others or mesh.express is None or any(rank not in mesh.express_names for rank in others):
            return None
        return cls(mesh, mesh_ranks, group_rank, slot, piece_bytes)

    def comm(self, sequence: int) -> ExpressComm:
        return ExpressComm(self, sequence)

    def submit(self, work: WanlinkWork, where: object, body: Coroutine, comm: ExpressComm, seconds: float,
               timed_out: Callable[[list[int]], DeadlineExceeded], blocking: bool) -> None:
        """Run ``body`` (which uses ``comm``) after the collectives submitted before it, under a
        ``seconds`` timeout, and tell ``work`` how it ended; errors start with ``where``.

        ``blocking`` (torch's ``asyncOp=False``: the caller waits for ``work`` next): on the calling
        thread, before returning; no thread hand-off. Otherwise on the group's thread."""
        with self._lock:
            if self._closed:
                body.close()
                work.fail(PeerLost(f"{where}: the group was shut down or aborted"))
                return
            if self._thread is None and not blocking:
                self._thread = threading.Thread(target=self._serve, name="wanlink-express", daemon=True)
                self._thread.start()
            self._jobs.append((work, where, body, comm, seconds, timed_out))
        if blocking:
            self._run_through(work)
        else:
            self._wakeups.put(work)

    def _serve(self) -> None:
        while (work := self._wakeups.get()) is not _STOP:
            self._run_through(work)

    def _run_through(self, work: WanlinkWork) -> None:
        """Run the queued collectives in order until ``work``'s has run (by this thread or another)."""
        with self._running:
            while not work.is_completed():
                with self._lock:
                    job = self._jobs.popleft() if self._jobs else None
                if job is None:
                    return
                self._run(*job)

    def close(self) -> None:
        """Stop the thread after the collectives queued so far, and close the sockets."""
        thread = self._stop()
        if thread is not None:
            thread.join()
        self.sockets.close()

    def abort(self) -> None:
        """Fail the running and queued collectives at once (their sockets shut) and stop the thread."""
        self._stop()
        self.sockets.shut()

    def _stop(self) -> threading.Thread | None:
        """Refuse new collectives; the thread ends after the queued ones (returned, to join)."""
        with self._lock:
            thread, self._thread, self._closed = self._thread, None, True
        if thread is not None:
            self._wakeups.put(_STOP)
        return thread

    def _run(self, work: WanlinkWork, where: object, body: Coroutine, comm: ExpressComm, seconds: float,
             timed_out: Callable[[list[int]], DeadlineExceeded]) -> None:
        others = self._others
        try:
            if seconds <= 0:  # expired before it began: nothing is sent
                raise _Expired()
            comm.deadline = time.monotonic() + seconds
            missing = self._connect(comm.deadline) if not self._connected else None
            if missing:
                body.close()
                work.fail(timed_out(missing))
                return
            try:
                body.send(None)
            except StopIteration as stop:
                work.succeed(stop.value)
                return
            raise RuntimeError(f"{where}: its algorithm waited on something other than its messages "
                               f"(not one of wanlink.collectives.choice.ROUND_BASED)")
        except BaseException as failure:  # (all of them: an interrupted caller leaves clean sockets too)
            if isinstance(failure, _Expired):
                error: BaseException = timed_out(comm.waiting_for() or others)
            elif isinstance(failure, (PeerLost, ProtocolError)):
                error = type(failure)(f"{where}: {failure}")
            else:
                error = failure
            body.close()
            self._abandon(comm.sequence)
            work.fail(error)
            if not isinstance(failure, Exception):
                raise

    def _connect(self, deadline: float) -> list[int]:
        """Open the sockets still missing (the higher group rank dials); the peers still missing at ``deadline``."""
        mesh, others = self.mesh, self._others
        for peer in others:
            if peer < self.group_rank and not self.sockets.has(peer):
                world_rank = self.mesh_ranks[peer]
                try:
                    sock = dial(mesh.express_names[world_rank], mesh.secret, mesh.world, self.slot, mesh.rank)
                except OSError as error:
                    raise PeerLost(f"cannot open an express socket to rank {peer} (world rank {world_rank}): "
                                   f"{error}") from error
                self.sockets.add(peer, sock, f"rank {peer}")
        for peer in others:
            if peer > self.group_rank and not self.sockets.has(peer):
                sock = self._take(peer, deadline)
                if sock is not None:
                    self.sockets.add(peer, sock, f"rank {peer}")
        missing = [peer for peer in others if not self.sockets.has(peer)]
        self._connected = not missing
        return missing

    def _take(self, peer: int, deadline: float):
        """The socket ``peer`` dials for this group, or None at ``deadline``; PeerLost as soon as the
        link to a member failed (checked every LOST_POLL_S: a dead peer never dials)."""
        while True:
            until = min(deadline, time.monotonic() + LOST_POLL_S)
            sock = self.mesh.express.take(self.slot, self.mesh_ranks[peer], until)
            if sock is not None or time.monotonic() >= deadline:
                return sock
            self.check_members(())

    def check_members(self, waiting: Sequence[int]) -> None:
        """PeerLost if the link to a member not in ``waiting`` failed (its process died, or broke the protocol)."""
        lost = self.mesh.first_lost(rank for peer, rank in enumerate(self.mesh_ranks) if peer not in waiting)
        if lost is not None:
            raise PeerLost(f"this collective cannot complete: {lost}") from lost

    def _abandon(self, sequence: int) -> None:
        for peer in range(self.size):
            if self.sockets.has(peer):
                self.sockets.outgoing(peer).abandon(sequence)
                self.sockets.incoming(peer).abandon(sequence)
