"""EDF deadlines for collectives: a context that tags the collectives it launches.

Collectives launched inside ``deadline_scope((iteration, layer))`` give their chunks that
deadline; outside any scope a collective's deadline is 0, the most urgent, so a blocking call
issued by the training loop never waits behind queued gradient traffic (FIFO among equals).
"""
from __future__ import annotations

import contextlib
import contextvars

from wanlink.sched.chunking import deadline_key

_current: contextvars.ContextVar = contextvars.ContextVar("wanlink_deadline", default=None)
URGENT = (0,)


@contextlib.contextmanager
def deadline_scope(deadline):
    """Collectives launched in this block carry ``deadline`` (a number or tuple; smaller goes first)."""
    token = _current.set(deadline_key(deadline))
    try:
        yield
    finally:
        _current.reset(token)


def current_deadline() -> tuple:
    """The deadline of the innermost scope, or URGENT outside any scope."""
    value = _current.get()
    return URGENT if value is None else value
