"""The process group exempts the objects alive at its creation from the cyclic GC, once per process."""
import gc

import pytest

from wanlink.c10d import gc_freeze


@pytest.fixture
def gc_calls(monkeypatch):
    calls = []
    monkeypatch.setattr(gc_freeze, "_gc_frozen", False)
    monkeypatch.setattr(gc, "collect", lambda *args: calls.append("collect"))
    monkeypatch.setattr(gc, "freeze", lambda: calls.append("freeze"))
    return calls


def test_freezes_after_collecting_and_only_once(gc_calls):
    gc_freeze.freeze_gc_once(True)
    gc_freeze.freeze_gc_once(True)
    assert gc_calls == ["collect", "freeze"]


def test_opt_out(gc_calls):
    gc_freeze.freeze_gc_once(False)
    assert gc_calls == []
