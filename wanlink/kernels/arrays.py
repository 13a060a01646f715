"""Checked views of tensors and arrays as the flat, contiguous NumPy arrays the kernels take."""
import sys

import numpy as np

from wanlink.errors import ConfigError, UnsupportedError
from wanlink.kernels.reference import MAX_BLOCK_SIZE

_torch_dtypes = {}  # NumPy dtype -> torch dtype, filled on first use (torch is loaded once a tensor exists)


def _torch_dtype(dtype):
    found = _torch_dtypes.get(dtype)
    if found is None:
        found = _torch_dtypes[dtype] = getattr(sys.modules["torch"], np.dtype(dtype).name)
    return found


def _is_tensor(value) -> bool:
    return type(value).__module__.startswith("torch") and hasattr(value, "is_contiguous")


def _one_dimensional(array: np.ndarray) -> np.ndarray:
    return array if array.ndim == 1 else array.reshape(-1)


def flat_view(value, dtype, what: str, *, writable: bool = False) -> np.ndarray:
    """A 1-D NumPy view (no copy) of a contiguous CPU tensor or array of exactly ``dtype``.

    Called on every kernel call, so the common cases take the fewest attribute lookups.
    """
    if isinstance(value, np.ndarray):
        if value.dtype != dtype:
            raise UnsupportedError(f"{what} has dtype {value.dtype}; expected {np.dtype(dtype).name}")
        if not value.flags.c_contiguous:
            raise ConfigError(f"{what} is not C-contiguous")
        if writable and not value.flags.writeable:
            raise ConfigError(f"{what} is read-only")
        return _one_dimensional(value)
    if not _is_tensor(value):
        raise ConfigError(f"{what} must be a torch.Tensor or numpy.ndarray, not {type(value).__name__}")
    if not value.is_cpu:
        raise UnsupportedError(f"{what} is on {value.device}; the block kernels run on CPU tensors")
    if value.dtype is not _torch_dtype(dtype):
        raise UnsupportedError(f"{what} has dtype {value.dtype}; expected {_torch_dtype(dtype)}")
    if value.layout is not sys.modules["torch"].strided:
        raise UnsupportedError(f"{what} has layout {value.layout}; expected a dense (strided) tensor")
    if not value.is_contiguous():
        raise ConfigError(f"{what} is not contiguous; pass a contiguous tensor (.contiguous())")
    return _one_dimensional(value.detach().numpy() if value.requires_grad else value.numpy())


def block_values_view(values, count: int, block: int, what: str = "values") -> np.ndarray:
    """Flat float32 view of ``count`` blocks of ``block`` values: shape (count, block) or (count*block,)."""
    shape = values.shape
    if shape != (count, block) and shape != (count * block,):
        raise ConfigError(f"{what} has shape {tuple(shape)}; expected ({count}, {block}) for {count} blocks")
    return flat_view(values, np.float32, what)


def check_block_size(block) -> int:
    """The block size as an int, which must be a power of two in [1, MAX_BLOCK_SIZE]."""
    if isinstance(block, bool) or not isinstance(block, (int, np.integer)):
        raise ConfigError(f"block must be an int, not {type(block).__name__}")
    block = int(block)
    if block < 1 or block > MAX_BLOCK_SIZE or block & (block - 1):
        raise ConfigError(f"block must be a power of two in [1, {MAX_BLOCK_SIZE}], got {block}")
    return block


def block_count(numel: int, block: int) -> int:
    """Number of blocks covering ``numel`` elements (the last one possibly partial)."""
    return -(-numel // block)


def aligned_empty(count: int, dtype, alignment: int = 64) -> np.ndarray:
    """An uninitialised 1-D array whose first element sits on an ``alignment``-byte boundary.

    The compiled sparsify pass writes the block scores with streaming stores (no read for
    ownership) when the scores array is 32-byte aligned; NumPy's own large arrays are not.
    """
    itemsize = np.dtype(dtype).itemsize
    raw = np.empty(count * itemsize + alignment, dtype=np.uint8)
    offset = -raw.ctypes.data % alignment
    return raw[offset: offset + count * itemsize].view(dtype)
