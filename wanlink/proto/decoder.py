"""Chooses the frame decoder implementation, in this one place.

``wanlink._wire.FrameDecoder`` (compiled from ``cython_ext/_wire.pyx``) is used when it imports and
matches this package's ABI; otherwise, or when ``WANLINK_PUREPYTHON=1`` is set, the pure-Python
reference ``wanlink.proto.frames.FrameDecoder``. Both take the same bytes to the same events and
raise the same errors on malformed frames (tests/proto/test_decoder.py compares them); the compiled
one decodes headers in C and reads without the GIL. Streams build theirs with :func:`new`, so tests
and benchmarks switch implementations with :func:`use`. (A missing build is not warned about here:
the same build makes ``wanlink._kernels``, whose absence ``wanlink.kernels`` reports.)
"""
import importlib
from types import ModuleType

from wanlink.errors import ConfigError, UnsupportedError
from wanlink.proto import frames
from wanlink.proto.limits import DEFAULT_LIMITS, Limits
from wanlink.settings import from_env

__all__ = ["IMPLEMENTATIONS", "WIRE_ABI", "available", "load", "new", "use"]

IMPLEMENTATIONS = ("compiled", "reference")
WIRE_ABI = 1
"""What ``wanlink._wire.WIRE_ABI`` must say for the compiled decoder to be used."""
_REFERENCE_FORCED = from_env().pure_python  # read once, at import, like wanlink.kernels


def _import_compiled() -> ModuleType | None:
    try:
        module = importlib.import_module("wanlink._wire")
    except ImportError:
        return None
    return module if getattr(module, "WIRE_ABI", None) == WIRE_ABI else None


_compiled = None if _REFERENCE_FORCED else _import_compiled()


def available() -> list[str]:
    """Implementations usable in this process, best first (only "reference" when forced)."""
    return (["compiled"] if _compiled is not None else []) + ["reference"]


def load(name: str) -> type:
    """The FrameDecoder class implementing ``name`` ("compiled" or "reference")."""
    if name == "reference":
        return frames.FrameDecoder
    if name == "compiled":
        if _compiled is None:
            reason = "WANLINK_PUREPYTHON is set" if _REFERENCE_FORCED else "wanlink._wire is not built (or stale)"
            raise UnsupportedError(f"compiled frame decoder unavailable: {reason}")
        return _compiled.FrameDecoder
    raise ConfigError(f"unknown frame decoder implementation {name!r}; expected one of {IMPLEMENTATIONS}")


NAME = available()[0]
_active = load(NAME)


def new(place: frames.PayloadPlacer, limits: Limits = DEFAULT_LIMITS):
    """A decoder of the active implementation."""
    return _active(place, limits)


def use(name: str) -> str:
    """Switch the process-wide implementation (for tests and benchmarks); returns the previous name.
    Streams opened afterwards use it."""
    global _active, NAME
    cls = load(name)
    previous, _active, NAME = NAME, cls, name
    return previous
