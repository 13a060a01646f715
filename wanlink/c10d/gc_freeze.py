"""Exempting the objects alive at the first group's creation from Python's cyclic collector."""
from __future__ import annotations

import gc

_gc_frozen = False


def freeze_gc_once(enabled: bool) -> None:
    """``gc.collect()`` then ``gc.freeze()``, once per process, when ``enabled`` (``WANLINK_GC_FREEZE``).

    A full collection walks every tracked object (about 170 000 once torch is imported: 50-90 ms
    here). Collectives allocate enough to trigger one every few large calls, and a rank paused
    in one stalls every rank's ring (4-rank 256 MiB all_reduce on loopback: 120-190 ms of GC per
    call summed over ranks; 3-6 ms frozen).
    Frozen objects are never collected, so cycles among them that become garbage later leak.
    """
    global _gc_frozen
    if _gc_frozen or not enabled:
        return
    _gc_frozen = True
    gc.collect()
    gc.freeze()
