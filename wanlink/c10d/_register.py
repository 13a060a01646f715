"""Registration of the "wanlink" backend with torch.distributed; cheap and idempotent.

Three ways in, one function behind them:
- ``import wanlink`` calls ``install()``: registers now if torch.distributed is loaded, else
  registers right after it is first imported (a one-shot import hook).
- the ``torch.backends`` entry point (run by every ``import torch``, torch >= 2.5, off with
  ``TORCH_DEVICE_BACKEND_AUTOLOAD=0``) calls ``autoload()``, which never raises;
- the ``torch.distributed.backends`` entry point, for torch versions that read it, calls ``register()``.

Nothing here imports the transport or the process group until a group is created.
"""
from __future__ import annotations

import importlib.abc
import logging
import sys
import threading

BACKEND_NAME = "wanlink"
_lock = threading.Lock()
_registered = False
logger = logging.getLogger(__name__)


def _create(dist_options, backend_options=None):
    from wanlink.c10d.backend import create_process_group

    return create_process_group(dist_options, backend_options)


def register() -> bool:
    """Register backend "wanlink" for cpu and cuda (once); returns True when it is registered."""
    global _registered
    with _lock:
        if _registered:
            return True
        import torch.distributed as dist

        if not dist.is_available():
            return False
        if BACKEND_NAME.upper() not in dist.Backend._plugins:
            dist.Backend.register_backend(BACKEND_NAME, _create, extended_api=True, devices=["cpu", "cuda"])
        _registered = True
        return True


def autoload() -> None:
    """Entry point for torch's ``torch.backends`` group: register, and never raise."""
    try:
        if "torch.distributed" in sys.modules:
            register()
        else:
            install()
    except Exception as error:  # noqa: BLE001 - must never break `import torch`
        logger.warning("could not register the torch.distributed backend: %r", error)


class _RegisterAfterImport(importlib.abc.MetaPathFinder):
    """Wraps torch.distributed's loader so ``register()`` runs right after the module executes."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "torch.distributed":
            return None
        _uninstall_hook()
        import importlib.util

        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        original_exec = spec.loader.exec_module

        def exec_module(module):
            original_exec(module)
            autoload()

        spec.loader.exec_module = exec_module
        return spec


_hook = _RegisterAfterImport()


def _uninstall_hook() -> None:
    try:
        sys.meta_path.remove(_hook)
    except ValueError:
        pass


def install() -> None:
    """Called by ``import wanlink``: register now, or right after torch.distributed loads."""
    if "torch.distributed" in sys.modules:
        try:
            register()
        except Exception as error:  # noqa: BLE001 - a broken torch must not break `import wanlink`
            logger.warning("could not register the torch.distributed backend: %r", error)
    elif _hook not in sys.meta_path:
        sys.meta_path.insert(0, _hook)
