"""wanlink.c10d: the "wanlink" torch.distributed backend (the only package importing torch.distributed).

Importing this package is cheap; ``ProcessGroupWanlink`` and ``create_process_group`` load on use.
See docs/c10d.md.
"""
from wanlink.c10d._register import BACKEND_NAME, autoload, install, register

_LAZY = {
    "ProcessGroupWanlink": ("wanlink.c10d.process_group", "ProcessGroupWanlink"),
    "create_process_group": ("wanlink.c10d.backend", "create_process_group"),
    "monitored_barrier": ("wanlink.c10d.api", "monitored_barrier"),
    "site_map": ("wanlink.c10d.api", "site_map"),
}

__all__ = ["BACKEND_NAME", "autoload", "install", "register", *_LAZY]


def __getattr__(name):
    if name in _LAZY:
        import importlib

        module_name, attribute = _LAZY[name]
        return getattr(importlib.import_module(module_name), attribute)
    raise AttributeError(f"module 'wanlink.c10d' has no attribute {name!r}")
