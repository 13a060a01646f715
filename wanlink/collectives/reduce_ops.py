"""Elementwise reductions for every supported dtype: ``reducer(acc, x)`` does ``acc op= x`` in place,
``reducer(acc, x, out)`` writes ``acc op x`` to ``out`` (which may alias ``x``) without touching ``acc``."""
from __future__ import annotations

import torch

from wanlink.errors import UnsupportedError

_INTEGER_DTYPES = {torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.bool}


def _sum(acc: torch.Tensor, x: torch.Tensor, out: torch.Tensor | None = None) -> None:
    if acc.dtype == torch.bool:
        torch.logical_or(acc, x, out=acc if out is None else out)
    else:
        torch.add(acc, x, out=acc if out is None else out)


def _product(acc: torch.Tensor, x: torch.Tensor, out: torch.Tensor | None = None) -> None:
    if acc.dtype == torch.bool:
        torch.logical_and(acc, x, out=acc if out is None else out)
    else:
        torch.mul(acc, x, out=acc if out is None else out)


def _min(acc: torch.Tensor, x: torch.Tensor, out: torch.Tensor | None = None) -> None:
    torch.minimum(acc, x, out=acc if out is None else out)


def _max(acc: torch.Tensor, x: torch.Tensor, out: torch.Tensor | None = None) -> None:
    torch.maximum(acc, x, out=acc if out is None else out)


def _band(acc: torch.Tensor, x: torch.Tensor, out: torch.Tensor | None = None) -> None:
    torch.bitwise_and(acc, x, out=acc if out is None else out)


def _bor(acc: torch.Tensor, x: torch.Tensor, out: torch.Tensor | None = None) -> None:
    torch.bitwise_or(acc, x, out=acc if out is None else out)


def _bxor(acc: torch.Tensor, x: torch.Tensor, out: torch.Tensor | None = None) -> None:
    torch.bitwise_xor(acc, x, out=acc if out is None else out)


REDUCE_OPS = {
    "sum": _sum, "avg": _sum, "product": _product, "min": _min, "max": _max,
    "band": _band, "bor": _bor, "bxor": _bxor,
}
"""Reduction name -> in-place reducer. ``avg`` reduces like ``sum``; see ``finish_average``."""

_BITWISE = {"band", "bor", "bxor"}


def reducer_for(op: str, dtype: torch.dtype, collective: str):
    """The reducer for ``op`` on ``dtype``; raises UnsupportedError naming the collective."""
    if op not in REDUCE_OPS:
        raise UnsupportedError(f"wanlink {collective}: reduce op {op!r} is not supported")
    if op in _BITWISE and dtype not in _INTEGER_DTYPES:
        raise UnsupportedError(f"wanlink {collective}: {op.upper()} needs an integer or bool tensor, got {dtype}")
    if op == "avg" and dtype == torch.bool:
        raise UnsupportedError(f"wanlink {collective}: AVG is not defined for bool tensors")
    return REDUCE_OPS[op]


def finish_average(tensor: torch.Tensor, world_size: int) -> None:
    """Turn a sum into a mean: true division for floats, truncating division for integers."""
    if tensor.is_floating_point():
        tensor.div_(world_size)
    else:
        tensor.div_(world_size, rounding_mode="trunc")
