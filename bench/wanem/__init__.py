"""Userspace WAN emulator over TUN between two network namespaces (see docs/wanem.md).

Names are imported lazily so that ``python3 -m bench.wanem.netns`` runs cleanly.
"""
import importlib

_EXPORTS = {"BuildError": "builder", "build": "builder", "Link": "netns", "WanPath": "netns",
            "WanemError": "netns", "check_environment": "netns", "cleanup_stale": "netns"}
__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
