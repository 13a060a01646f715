"""Chooses the block-sparse kernel implementation, in this one place.

``wanlink._kernels`` (compiled from ``cython_ext/_kernels.pyx``: nogil, OpenMP) is used when it
imports and matches this package's kernel ABI; otherwise, or when ``WANLINK_PUREPYTHON=1`` is set,
the NumPy twin ``wanlink.kernels.reference`` is used. Both expose the same functions with the same
results:

``sparsify_blocks``, ``sparsify_segments``, ``scatter_add_blocks``, ``first_invalid_block_index``,
``sgd_step_blocks``.

Callers go through :func:`active` (the public layers in ``wanlink.compress`` and ``wanlink.optim``
do), so tests can switch implementations with :func:`use`.
"""
import os
import sys
from types import ModuleType

from wanlink import _choice
from wanlink.kernels import reference

__all__ = ["IMPLEMENTATIONS", "NAME", "active", "available", "load", "num_threads", "use"]

IMPLEMENTATIONS = _choice.IMPLEMENTATIONS


def _should_have_compiled() -> bool:
    """CPython on Linux or macOS: where ``pip install`` builds the kernels unless something went wrong."""
    return sys.implementation.name == "cpython" and sys.platform in ("linux", "darwin")


_choice_made = _choice.Choice(
    "kernels", "wanlink._kernels", "KERNEL_ABI", reference.KERNEL_ABI, reference,
    advice=("The NumPy reference is 10-100x slower. Reinstall with a C compiler and Cython available "
            "(`pip install -v` prints a line starting 'wanlink: compiled kernels' saying why they were "
            f"skipped), or set {_choice.FORCE_REFERENCE_VARIABLE}=1 to choose the reference and silence this "
            "warning."), warn_if_missing=_should_have_compiled())
available = _choice_made.available
load = _choice_made.load
use = _choice_made.use


def active() -> ModuleType:
    """The implementation the public API uses now."""
    return _choice_made.active


def __getattr__(name: str):
    if name == "NAME":  # the name of the implementation in use; changes with use()
        return _choice_made.name
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def num_threads() -> int:
    """Threads a kernel call may use: torch.get_num_threads() when torch is loaded, else the CPU count."""
    torch = sys.modules.get("torch")
    if torch is not None:
        return max(1, torch.get_num_threads())
    return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1))
