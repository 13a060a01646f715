"""Chooses the frame decoder implementation, in this one place.

``wanlink._wire.FrameDecoder`` (compiled from ``cython_ext/_wire.pyx``) is used when it imports and
matches this package's ABI; otherwise, or when ``WANLINK_PUREPYTHON=1`` is set, the pure-Python
reference ``wanlink.proto.frames.FrameDecoder``. Both take the same bytes to the same events and
raise the same errors on malformed frames (tests/proto/test_decoder.py compares them); the compiled
one decodes headers in C and reads without the GIL. Streams build theirs with :func:`new`, so tests
and benchmarks switch implementations with :func:`use`. (A missing build is not warned about here:
the same build makes ``wanlink._kernels``, whose absence ``wanlink.kernels`` reports.)
"""
from wanlink import _choice
from wanlink.proto import frames
from wanlink.proto.limits import DEFAULT_LIMITS, Limits

__all__ = ["IMPLEMENTATIONS", "WIRE_ABI", "available", "load", "new", "use"]

IMPLEMENTATIONS = _choice.IMPLEMENTATIONS
WIRE_ABI = 1
"""What ``wanlink._wire.WIRE_ABI`` must say for the compiled decoder to be used."""
_choice_made = _choice.Choice("frame decoder", "wanlink._wire", "WIRE_ABI", WIRE_ABI, frames.FrameDecoder,
                              take=lambda module: module.FrameDecoder)
available = _choice_made.available
load = _choice_made.load
use = _choice_made.use


def new(place: frames.PayloadPlacer, limits: Limits = DEFAULT_LIMITS):
    """A decoder of the active implementation; streams opened after :func:`use` get the new one."""
    return _choice_made.active(place, limits)


def __getattr__(name: str):
    if name == "NAME":  # the name of the implementation in use; changes with use()
        return _choice_made.name
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
