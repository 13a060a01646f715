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


class LinkComm(Comm):
    """The ``Comm`` of one collective (or p2p op) of a group whose rank k is ``mesh_ranks[k]`` on ``mesh``."""

    def __init__(self, mesh: Mesh, mesh_ranks: Sequence[int], rank: int, piece_bytes: int, base_tag: int,
                 deadline: tuple = URGENT):
        self.rank, self.size, self.piece_bytes = rank, len(mesh_ranks), piece_bytes
        self._mesh, self._mesh_ranks, self._base_tag, self._deadline = mesh, mesh_ranks, base_tag, deadline
        self._borrowed: list[torch.Tensor] = []
        self._waiting: dict[int, int] = {}  # peer -> this comm's unfinished sends and receives with it

    @property
    def mesh(self) -> Mesh:
        return self._mesh

    def mesh_rank(self, peer: int) -> int:
        """Group rank ``peer``'s rank on the mesh (the world)."""
        return self._mesh_ranks[peer]

    def waiting_for(self) -> list[int]:
        """The peers this collective still waits on: sends not yet written, receives not yet complete."""
        return [peer for peer, count in self._waiting.items() if count]

    def silent(self, peers: Sequence[int], longer_than: float) -> dict[int, float]:
        """Of ``peers``, those whose link received nothing for ``longer_than`` s: peer -> seconds (loop thread).

        A peer whose process runs keeps pinging, even while it waits on someone else; one that is
        frozen (stopped, swapping, stuck holding the GIL) or cut off goes silent.
        """
        silent = {}
        for peer in peers:
            link = self._mesh.cached(self._mesh_ranks[peer])
            quiet = float("-inf") if link is None else link.silent_s()
            if quiet > longer_than:
                silent[peer] = quiet
        return silent

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
