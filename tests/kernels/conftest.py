"""Kernel tests run once per implementation: compiled wanlink._kernels and the NumPy reference.

With WANLINK_PUREPYTHON=1 only the reference is available, so the compiled cases are skipped and
the rest of the suite exercises the reference through the public API.
"""
import zlib

import numpy as np
import pytest
import wanlink.compress
import wanlink.optim  # noqa: F401
from wanlink import kernels

@pytest.fixture(params=kernels.IMPLEMENTATIONS)
def implementation(request):
    """Switch the public API to one implementation for the test; yields its module."""
    name = request.param
    if name not in kernels.available():
        pytest.skip(f"{name} kernels unavailable in this process")
    previous = kernels.use(name)
    try:
        yield kernels.active()
    finally:
        kernels.use(previous)


@pytest.fixture
def both_implementations():
    """(compiled, reference) modules, for bit-for-bit comparisons; skips when compiled is unavailable."""
    if "compiled" not in kernels.available():
        pytest.skip("compiled kernels unavailable in this process")
    return kernels.load("compiled"), kernels.load("reference")


@pytest.fixture
def rng(request):
    """A generator seeded by the test's id, so every run of a test sees the same data."""
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))
