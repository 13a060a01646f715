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
import importlib
import os
import sys
import warnings
from types import ModuleType

from wanlink.errors import ConfigError, UnsupportedError
from wanlink.kernels import reference
from wanlink.settings import from_env

__all__ = ["IMPLEMENTATIONS", "NAME", "active", "available", "load", "num_threads", "use"]

IMPLEMENTATIONS = ("compiled", "reference")
FORCE_REFERENCE_VARIABLE = "WANLINK_PUREPYTHON"
_REFERENCE_FORCED = from_env().pure_python  # read once, at import: this module is the kernels' edge


def _should_have_compiled() -> bool:
    """CPython on Linux or macOS: where ``pip install`` builds the kernels unless something went wrong."""
    return sys.implementation.name == "cpython" and sys.platform in ("linux", "darwin")


def _import_compiled() -> ModuleType | None:
    try:
        module = importlib.import_module("wanlink._kernels")
    except ImportError as exc:
        if _should_have_compiled():
            warnings.warn(
                f"wanlink's compiled kernels are missing ({exc}); using the NumPy reference, 10-100x slower. "
                "Reinstall with a C compiler and Cython available (`pip install -v` prints a line starting "
                "'wanlink: compiled kernels' saying why they were skipped), or set "
                f"{FORCE_REFERENCE_VARIABLE}=1 to choose the reference and silence this warning.",
                RuntimeWarning, stacklevel=3)
        return None
    if getattr(module, "KERNEL_ABI", None) != reference.KERNEL_ABI:
        warnings.warn("wanlink._kernels is stale (kernel ABI mismatch); rebuild it. Using the NumPy reference.",
                      RuntimeWarning, stacklevel=3)
        return None
    return module


_compiled = None if _REFERENCE_FORCED else _import_compiled()


def available() -> list[str]:
    """Implementations usable in this process, best first (only "reference" when forced)."""
    return (["compiled"] if _compiled is not None else []) + ["reference"]


def load(name: str) -> ModuleType:
    """The module implementing ``name`` ("compiled" or "reference")."""
    if name == "reference":
        return reference
    if name == "compiled":
        if _compiled is None:
            reason = f"{FORCE_REFERENCE_VARIABLE} is set" if _REFERENCE_FORCED else "wanlink._kernels is not built"
            raise UnsupportedError(f"compiled kernels unavailable: {reason}")
        return _compiled
    raise ConfigError(f"unknown kernel implementation {name!r}; expected one of {IMPLEMENTATIONS}")


_active = load(available()[0])
NAME = available()[0]


def active() -> ModuleType:
    """The implementation the public API uses now."""
    return _active


def use(name: str) -> str:
    """Switch the process-wide implementation (for tests and benchmarks); returns the previous name."""
    global _active, NAME
    module = load(name)
    previous, _active, NAME = NAME, module, name
    return previous


def num_threads() -> int:
    """Threads a kernel call may use: torch.get_num_threads() when torch is loaded, else the CPU count."""
    torch = sys.modules.get("torch")
    if torch is not None:
        return max(1, torch.get_num_threads())
    return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1))
