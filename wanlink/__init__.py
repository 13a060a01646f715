"""wanlink: fast distributed PyTorch training over slow, long links.

Public API: ``connect``, ``serve``, ``stats`` and the error tree in ``wanlink.errors``.
Importing wanlink is cheap: the transport and torch pieces load on first use.
Log records go to the ``wanlink`` logger tree (``wanlink.io.link``, ``wanlink.c10d.mesh``, ...),
which has a NullHandler: configure logging to see them; messages carry no prefix of their own.
"""
import logging

from wanlink.errors import (
    AuthenticationError,
    ConfigError,
    DeadlineExceeded,
    DesyncError,
    LimitExceeded,
    LocalProtocolError,
    MessageSizeError,
    NonFiniteGradientError,
    PeerLost,
    ProtocolError,
    RemoteProtocolError,
    ServerBusy,
    UnsupportedError,
    WanlinkError,
)

from wanlink.c10d._register import install as _install_torch_backend

__version__ = "0.1.0"  # the one place the version is written (pyproject.toml reads it)
logging.getLogger(__name__).addHandler(logging.NullHandler())
_install_torch_backend()  # registers backend "wanlink" with torch.distributed, now or once it is imported

_LAZY = {
    "connect": ("wanlink.endpoints", "connect"),
    "serve": ("wanlink.endpoints", "serve"),
    "stats": ("wanlink.io.registry", "stats"),
    "Link": ("wanlink.io.link", "Link"),
}

__all__ = [
    "AuthenticationError", "ConfigError", "DeadlineExceeded", "DesyncError", "LimitExceeded", "LocalProtocolError",
    "MessageSizeError", "NonFiniteGradientError", "PeerLost", "ProtocolError", "RemoteProtocolError",
    "ServerBusy", "UnsupportedError", "WanlinkError",
    *_LAZY,
]


def __getattr__(name):
    if name in _LAZY:
        import importlib

        module_name, attribute = _LAZY[name]
        value = getattr(importlib.import_module(module_name), attribute)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'wanlink' has no attribute {name!r}")
