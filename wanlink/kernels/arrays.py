"""Checked views of tensors and arrays as the flat, contiguous NumPy arrays the kernels take."""
import numpy as np

from wanlink.errors import ConfigError, UnsupportedError

_TORCH_DTYPE_NAMES = {np.dtype(t): f"torch.{np.dtype(t).name}" for t in (np.float32, np.int32, np.uint8)}


def _is_tensor(value) -> bool:
    return type(value).__module__.startswith("torch") and hasattr(value, "is_contiguous")


def flat_view(value, dtype, what: str, *, writable: bool = False) -> np.ndarray:
    """A 1-D NumPy view (no copy) of a contiguous CPU tensor or array of exactly ``dtype``."""
    dtype = np.dtype(dtype)
    if _is_tensor(value):
        if value.device.type != "cpu":
            raise UnsupportedError(f"{what} is on {value.device}; the block kernels run on CPU tensors")
        if str(value.dtype) != _TORCH_DTYPE_NAMES[dtype]:
            raise UnsupportedError(f"{what} has dtype {value.dtype}; expected {_TORCH_DTYPE_NAMES[dtype]}")
        if str(value.layout) != "torch.strided":
            raise UnsupportedError(f"{what} has layout {value.layout}; expected a dense (strided) tensor")
        if not value.is_contiguous():
            raise ConfigError(f"{what} is not contiguous; pass a contiguous tensor (.contiguous())")
        return value.detach().reshape(-1).numpy()
    if not isinstance(value, np.ndarray):
        raise ConfigError(f"{what} must be a torch.Tensor or numpy.ndarray, not {type(value).__name__}")
    if value.dtype != dtype:
        raise UnsupportedError(f"{what} has dtype {value.dtype}; expected {dtype.name}")
    if not value.flags.c_contiguous:
        raise ConfigError(f"{what} is not C-contiguous")
    if writable and not value.flags.writeable:
        raise ConfigError(f"{what} is read-only")
    return value.reshape(-1)


def block_values_view(values, count: int, block: int, what: str = "values") -> np.ndarray:
    """Flat float32 view of ``count`` blocks of ``block`` values: shape (count, block) or (count*block,)."""
    shape = tuple(values.shape)
    if shape != (count, block) and shape != (count * block,):
        raise ConfigError(f"{what} has shape {shape}; expected ({count}, {block}) for {count} blocks")
    return flat_view(values, np.float32, what)


def check_block_size(block) -> int:
    """The block size as an int, which must be a power of two in [1, MAX_BLOCK_SIZE]."""
    from wanlink.kernels.reference import MAX_BLOCK_SIZE

    if isinstance(block, bool) or not isinstance(block, (int, np.integer)):
        raise ConfigError(f"block must be an int, not {type(block).__name__}")
    block = int(block)
    if block < 1 or block > MAX_BLOCK_SIZE or block & (block - 1):
        raise ConfigError(f"block must be a power of two in [1, {MAX_BLOCK_SIZE}], got {block}")
    return block


def block_count(numel: int, block: int) -> int:
    """Number of blocks covering ``numel`` elements (the last one possibly partial)."""
    return -(-numel // block)
