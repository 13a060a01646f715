"""TORCH_DISTRIBUTED_DEBUG=DETAIL: a fixed-size header opens every collective and is checked.

Each member sends ``(sequence, op, dtype, count, root)`` to its ring neighbours before any data
and compares what it receives with its own; a difference raises DesyncError on both sides of
every mismatching pair instead of a hang or silently wrong numbers.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass

import torch

from wanlink.c10d.checks import SUPPORTED_DTYPES as DTYPES
from wanlink.c10d.tags import HEADER_PIECE
from wanlink.collectives.base import Comm, exchange
from wanlink.errors import DesyncError

OPS = ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter",
       "reduce_scatter_tensor", "reduce", "gather", "scatter", "all_to_all", "all_to_all_single",
       "barrier", "all_reduce_coalesced", "monitored_barrier", "all_gather_coalesced",
       "all_gather_into_tensor_coalesced", "reduce_scatter_tensor_coalesced")
_HEADER = struct.Struct("<qhhqq")
VARIES = -1
"""``count`` for collectives whose per-member sizes may legitimately differ (all_to_all)."""


@dataclass(frozen=True)
class Fingerprint:
    sequence: int
    op: str
    dtype: torch.dtype | None
    count: int
    root: int = -1

    def pack(self) -> torch.Tensor:
        dtype_id = -1 if self.dtype is None else DTYPES.index(self.dtype)
        raw = _HEADER.pack(self.sequence, OPS.index(self.op), dtype_id, self.count, self.root)
        return torch.frombuffer(bytearray(raw), dtype=torch.uint8)

    @classmethod
    def unpack(cls, buffer: torch.Tensor) -> "Fingerprint":
        sequence, op_id, dtype_id, count, root = _HEADER.unpack(buffer.numpy().tobytes())
        op = OPS[op_id] if 0 <= op_id < len(OPS) else f"<op {op_id}>"
        dtype = DTYPES[dtype_id] if 0 <= dtype_id < len(DTYPES) else None
        return cls(sequence, op, dtype, count, root)

    def describe(self) -> str:
        dtype = "-" if self.dtype is None else str(self.dtype).replace("torch.", "")
        count = "varies" if self.count == VARIES else str(self.count)
        root = "" if self.root < 0 else f", root {self.root}"
        return f"#{self.sequence} {self.op}(dtype {dtype}, {count} elements{root})"


async def check_fingerprint(comm: Comm, mine: Fingerprint, group_name: str) -> None:
    """Exchange headers with both ring neighbours; raise DesyncError on any difference."""
    n, me = comm.size, comm.rank
    if n == 1:
        return
    neighbours = sorted({(me - 1) % n, (me + 1) % n})
    packed = mine.pack()
    incoming = {peer: torch.empty(_HEADER.size, dtype=torch.uint8) for peer in neighbours}
    await exchange(comm, [(peer, packed, HEADER_PIECE) for peer in neighbours],
                   [(peer, incoming[peer], HEADER_PIECE) for peer in neighbours])
    for peer in neighbours:
        theirs = Fingerprint.unpack(incoming[peer])
        if theirs != mine:
            raise DesyncError(
                f"wanlink: collectives out of step in group {group_name!r}: rank {me} issued "
                f"{mine.describe()} but rank {peer} issued {theirs.describe()}")
