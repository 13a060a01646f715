"""Argument checks for the process group's collectives, run in the caller's thread before anything
is sent: unsupported requests raise UnsupportedError, inconsistent ones ConfigError, naming the op."""
from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from wanlink.errors import ConfigError, UnsupportedError

SUPPORTED_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int8,
                    torch.int16, torch.int32, torch.int64, torch.uint8, torch.bool)
"""Every dtype the backend moves; a dtype's index here is also its id in the DETAIL header."""

_REDUCE_NAMES = {
    dist.ReduceOp.RedOpType.SUM: "sum", dist.ReduceOp.RedOpType.AVG: "avg",
    dist.ReduceOp.RedOpType.PRODUCT: "product", dist.ReduceOp.RedOpType.MIN: "min",
    dist.ReduceOp.RedOpType.MAX: "max", dist.ReduceOp.RedOpType.BAND: "band",
    dist.ReduceOp.RedOpType.BOR: "bor", dist.ReduceOp.RedOpType.BXOR: "bxor",
}


def nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def check_tensors(op: str, tensors: Sequence[torch.Tensor], same_dtype: bool = True) -> None:
    """Dense tensors of supported dtypes on cpu or cuda (and one dtype unless ``same_dtype`` is False)."""
    dtypes = set()
    for tensor in tensors:
        if not isinstance(tensor, torch.Tensor):
            raise UnsupportedError(f"wanlink {op}: expected tensors, got {type(tensor).__name__}")
        if tensor.layout != torch.strided:
            raise UnsupportedError(f"wanlink {op}: {tensor.layout} tensors are not supported")
        if tensor.dtype not in SUPPORTED_DTYPES:
            raise UnsupportedError(f"wanlink {op}: dtype {tensor.dtype} is not supported "
                                   f"(supported: {', '.join(str(d) for d in SUPPORTED_DTYPES)})")
        if tensor.device.type not in ("cpu", "cuda"):
            raise UnsupportedError(f"wanlink {op}: device {tensor.device} is not supported (cpu, cuda)")
        dtypes.add(tensor.dtype)
    if same_dtype and len(dtypes) > 1:
        raise UnsupportedError(f"wanlink {op}: all tensors must share one dtype, got {sorted(map(str, dtypes))}")


def check_sparse(op: str, tensor: torch.Tensor, opts) -> None:
    """A sparse COO tensor of a supported dtype on cpu or cuda, reduced with SUM (all gloo supports)."""
    if tensor.dtype not in SUPPORTED_DTYPES or tensor.dtype == torch.bool:
        raise UnsupportedError(f"wanlink {op}: sparse tensors of dtype {tensor.dtype} are not supported")
    if tensor.device.type not in ("cpu", "cuda"):
        raise UnsupportedError(f"wanlink {op}: device {tensor.device} is not supported (cpu, cuda)")
    name = reduce_name(op, opts)
    if name != "sum":
        raise UnsupportedError(f"wanlink {op}: sparse tensors are reduced with SUM only, got {name.upper()}")


def single(op: str, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The one tensor of a one-tensor call."""
    if len(tensors) != 1:
        raise UnsupportedError(f"wanlink {op}: exactly one tensor per call is supported, got {len(tensors)}")
    return tensors[0]


def reduce_name(op: str, opts) -> str:
    """The name (``"sum"``, ``"avg"``, ...) of ``opts.reduceOp``, SUM without options."""
    reduce_op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
    kind = getattr(reduce_op, "op", reduce_op)
    name = _REDUCE_NAMES.get(kind)
    if name is None:
        raise UnsupportedError(f"wanlink {op}: reduce op {kind} is not supported")
    return name


def root_of(op: str, opts, size: int) -> int:
    """``opts.rootRank`` (0 without options), checked against a group of ``size``."""
    root = opts.rootRank if opts is not None else 0
    if not 0 <= root < size:
        raise ConfigError(f"wanlink {op}: root {root} is not a rank of a group of {size}")
    return root


def same_numel(op: str, tensors: Sequence[torch.Tensor], expected: int, what: str) -> None:
    for tensor in tensors:
        if tensor.numel() != expected:
            raise ConfigError(f"wanlink {op}: every {what} must have {expected} elements, got {tensor.numel()}")


def check_batch(op: str, outputs: Sequence, inputs: Sequence) -> None:
    """A coalesced call needs one output per input, at least one of each."""
    if not inputs or len(outputs) != len(inputs):
        raise ConfigError(f"wanlink {op}: need one output per input and at least one input, "
                          f"got {len(outputs)} outputs and {len(inputs)} inputs")


def check_one_per_member(op: str, tensors: Sequence, size: int, kind: str, who: str = "") -> None:
    """Exactly one tensor per member of a group of ``size``."""
    if len(tensors) != size:
        raise ConfigError(f"wanlink {op}: {who}need{'s' if who else ''} {size} {kind} tensors, got {len(tensors)}")


def root_tensor_list(op: str, tensor_lists, tensor: torch.Tensor, root: int, rank: int, size: int, kind: str):
    """The root's checked list of one tensor per member (gather outputs, scatter inputs); None elsewhere."""
    if rank != root:
        check_tensors(op, [tensor])
        if tensor_lists and any(tensor_lists):
            raise ConfigError(f"wanlink {op}: only the root (rank {root}) passes {kind} tensors")
        return None
    tensors = single(op, tensor_lists)
    check_one_per_member(op, tensors, size, kind, who="root ")
    check_tensors(op, [tensor, *tensors])
    same_numel(op, tensors, tensor.numel(), f"{kind} tensor")
    return tensors


def split_counts(op: str, tensor: torch.Tensor, split_sizes: Sequence[int], size: int) -> list[int]:
    """Element counts of the per-rank blocks of ``tensor`` split along dim 0 (all_to_all_single)."""
    rows = tensor.shape[0] if tensor.dim() else 1
    if not split_sizes:
        if rows % size:
            raise ConfigError(f"wanlink {op}: dim 0 ({rows}) is not divisible by the group size {size}; "
                              f"pass split sizes")
        split_sizes = [rows // size] * size
    if len(split_sizes) != size or sum(split_sizes) != rows or min(split_sizes) < 0:
        raise ConfigError(f"wanlink {op}: split sizes {list(split_sizes)} do not split {rows} rows "
                          f"among {size} ranks")
    row_numel = tensor.numel() // rows if rows else 0
    return [count * row_numel for count in split_sizes]
