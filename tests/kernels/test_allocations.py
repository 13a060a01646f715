"""The compiled path allocates no buffers per call once warm (NumPy allocations show in tracemalloc)."""
import tracemalloc

import numpy as np
import pytest
import torch

from wanlink import kernels
from wanlink.compress import BlockSparsifier, decode_blocks, encode_blocks, scatter_add_
from wanlink.optim import SparseSGD

NUMEL = 400_000  # 1.6 MB of float32: any per-call buffer would dwarf the limit below
LIMIT = 64 * 1024


@pytest.fixture
def compiled():
    if "compiled" not in kernels.available():
        pytest.skip("compiled kernels unavailable in this process")
    previous = kernels.use("compiled")
    yield
    kernels.use(previous)


def peak_bytes(function, calls=5):
    function()  # warm: buffers created on first use are allowed
    tracemalloc.start()
    try:
        for _ in range(calls):
            function()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_steady_state_calls_allocate_no_buffers(compiled):
    grad = torch.randn(NUMEL)
    sparsifier = BlockSparsifier(NUMEL, 0.05)
    assert peak_bytes(lambda: sparsifier.compress(grad)) < LIMIT
    half = grad.to(torch.bfloat16)
    assert peak_bytes(lambda: sparsifier.compress(half)) < LIMIT  # staged in a buffer made once

    indices, values = (t.clone() for t in sparsifier.compress(grad))
    out = np.empty(2 * NUMEL, dtype=np.uint8)
    assert peak_bytes(lambda: encode_blocks(indices, values, NUMEL, out=out)) < LIMIT
    frame = bytes(encode_blocks(indices, values, NUMEL))
    dense = torch.zeros(NUMEL)
    assert peak_bytes(lambda: scatter_add_(dense, *decode_blocks(frame)[2:])) < LIMIT

    param = torch.nn.Parameter(torch.zeros(NUMEL))
    optimizer = SparseSGD([param], lr=0.1, momentum=0.9)
    assert peak_bytes(lambda: optimizer.step({param: (indices, values)})) < LIMIT
