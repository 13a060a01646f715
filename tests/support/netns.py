"""Skipping namespace tests (with the reason) where they cannot run: not root, no TUN, no `ip`, no C compiler."""
import os
import shutil

import pytest

from bench.wanem.builder import compiler


def _missing() -> str | None:
    if os.geteuid() != 0:
        return "needs root (network namespaces and TUN devices)"
    if not os.path.exists("/dev/net/tun"):
        return "/dev/net/tun is missing"
    if shutil.which("ip") is None:
        return "iproute2 'ip' is missing"
    if compiler() is None:
        return "no C compiler to build bench/wanem/wanem.c"
    return None


def needs_netns(test):
    """Mark a test as needing namespaces; skip it with the reason when they are unavailable."""
    return pytest.mark.netns(pytest.mark.skipif(_missing() is not None, reason=_missing() or "")(test))
