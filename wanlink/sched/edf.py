"""Earliest-deadline-first queue of chunks; FIFO among equal deadlines (sans-I/O).

``order="fcfs"`` ignores deadlines: chunks leave in the order their messages were queued (first
come, first served), the baseline EDF is measured against.

A chunk leaves the queue when a stream pulls it and is then never pre-empted. A chunk handed
back (its stream died before the peer acknowledged it) keeps the position it was first given,
so it goes before later chunks of the same deadline.
"""
from __future__ import annotations

import heapq
import itertools

from wanlink.errors import ConfigError
from wanlink.sched.chunking import Chunk

CHUNK_ORDERS = ("edf", "fcfs")
"""``edf``: earliest deadline (iteration, layer) first; ``fcfs``: arrival order."""


def check_chunk_order(order) -> str:
    if order not in CHUNK_ORDERS:
        raise ConfigError(f"chunk order must be one of {', '.join(CHUNK_ORDERS)}, got {order!r}")
    return order


class EDFQueue:
    def __init__(self, order: str = "edf"):
        self.by_deadline = check_chunk_order(order) == "edf"
        self._heap: list[tuple[tuple, Chunk]] = []
        self._arrival = itertools.count()

    def __len__(self) -> int:
        return len(self._heap)

    def push(self, chunk: Chunk) -> None:
        """Queue a chunk; a chunk queued before keeps its original position."""
        if chunk.order is None:
            arrival = next(self._arrival)
            chunk.order = (chunk.transfer.deadline, arrival) if self.by_deadline else (arrival,)
        heapq.heappush(self._heap, (chunk.order, chunk))

    def peek(self) -> Chunk | None:
        """The chunk ``pop`` would return, left in the queue (None when empty)."""
        return self._heap[0][1] if self._heap else None

    def pop(self) -> Chunk | None:
        """The chunk with the earliest deadline (FIFO among equals), or None when empty."""
        if not self._heap:
            return None
        return heapq.heappop(self._heap)[1]

    def drain(self) -> list[Chunk]:
        """Remove and return every queued chunk (on link failure)."""
        chunks = [chunk for _order, chunk in self._heap]
        self._heap.clear()
        return chunks
