"""Elementwise reductions (in place, ``accumulator op= incoming``) for every supported dtype."""
from __future__ import annotations

import torch

from wanlink.errors import UnsupportedError

_INTEGER_DTYPES = {torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.bool}


def _sum(acc: torch.Tensor, x: torch.Tensor) -> None:
    if acc.dtype == torch.bool:
        acc.logical_or_(x)
    else:
        acc.add_(x)


def _product(acc: torch.Tensor, x: torch.Tensor) -> None:
    if acc.dtype == torch.bool:
        acc.logical_and_(x)
    else:
        acc.mul_(x)


def _min(acc: torch.Tensor, x: torch.Tensor) -> None:
    torch.minimum(acc, x, out=acc)


def _max(acc: torch.Tensor, x: torch.Tensor) -> None:
    torch.maximum(acc, x, out=acc)


def _band(acc: torch.Tensor, x: torch.Tensor) -> None:
    acc.bitwise_and_(x)


def _bor(acc: torch.Tensor, x: torch.Tensor) -> None:
    acc.bitwise_or_(x)


def _bxor(acc: torch.Tensor, x: torch.Tensor) -> None:
    acc.bitwise_xor_(x)


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
