"""The process group exempts the objects alive at its creation from the cyclic GC, once per process."""
import gc

import pytest

from wanlink.c10d import process_group
from wanlink.errors import ConfigError


@pytest.fixture
def gc_calls(monkeypatch):
    calls = []
    monkeypatch.setattr(process_group, "_gc_frozen", False)
    monkeypatch.setattr(gc, "collect", lambda *args: calls.append("collect"))
    monkeypatch.setattr(gc, "freeze", lambda: calls.append("freeze"))
    return calls


def test_freezes_after_collecting_and_only_once(gc_calls, monkeypatch):
    monkeypatch.delenv("WANLINK_GC_FREEZE", raising=False)
    process_group.freeze_gc_once()
    process_group.freeze_gc_once()
    assert gc_calls == ["collect", "freeze"]


def test_opt_out(gc_calls, monkeypatch):
    monkeypatch.setenv("WANLINK_GC_FREEZE", "0")
    process_group.freeze_gc_once()
    assert gc_calls == []


def test_malformed_setting_is_a_clear_error(gc_calls, monkeypatch):
    monkeypatch.setenv("WANLINK_GC_FREEZE", "yes")
    with pytest.raises(ConfigError, match="WANLINK_GC_FREEZE"):
        process_group.freeze_gc_once()
