"""scatter_add_: adding one or many peers' blocks into a dense accumulator."""
import numpy as np
import pytest
import torch

from wanlink.compress import decode_blocks, encode_blocks, scatter_add_
from wanlink.errors import ConfigError, UnsupportedError


def peer_blocks(rng, numel, count, block=16):
    nblocks = -(-numel // block)
    indices = np.sort(rng.choice(nblocks, size=min(count, nblocks), replace=False)).astype(np.int32)
    return indices, rng.standard_normal((indices.shape[0], block)).astype(np.float32)


def dense_oracle(numel, peers, block=16):
    nblocks = -(-numel // block)
    total = np.zeros(nblocks * block, dtype=np.float64)
    for indices, values in peers:
        for i, b in enumerate(indices):
            total[b * block: (b + 1) * block] += values[i]
    return total[:numel]


@pytest.mark.parametrize("numel", [1, 16, 17, 1000, 100_003])
@pytest.mark.parametrize("peers", [1, 3])
def test_scatter_add_matches_dense_sum(implementation, rng, numel, peers):
    blocks = [peer_blocks(rng, numel, max(1, numel // 50)) for _ in range(peers)]
    dense = torch.from_numpy(rng.standard_normal(numel).astype(np.float32))
    start = dense.clone()
    if peers == 1:
        result = scatter_add_(dense, *blocks[0])
    else:
        result = scatter_add_(dense, [b[0] for b in blocks], [b[1] for b in blocks])
    assert result is dense
    np.testing.assert_allclose(dense.numpy(), start.numpy() + dense_oracle(numel, blocks), rtol=1e-5, atol=1e-5)


def test_scatter_add_of_decoded_frames_into_reused_accumulator(implementation, rng):
    accumulator = np.zeros(5000, dtype=np.float32)
    peers = [peer_blocks(rng, 5000, 40) for _ in range(4)]
    frames = [decode_blocks(bytes(encode_blocks(i, v, 5000))) for i, v in peers]  # read-only views
    for _ in range(2):
        accumulator[:] = 0
        scatter_add_(accumulator, [f.indices for f in frames], [f.values for f in frames])
        np.testing.assert_allclose(accumulator, dense_oracle(5000, peers), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("block", [1, 8, 64])
def test_scatter_add_other_block_sizes(implementation, rng, block):
    indices, values = peer_blocks(rng, 999, 9, block)
    dense = np.zeros(999, dtype=np.float32)
    scatter_add_(dense, indices, values)
    np.testing.assert_allclose(dense, dense_oracle(999, [(indices, values)], block), rtol=1e-6)
    flat = np.zeros(999, dtype=np.float32)
    scatter_add_(flat, indices, values.reshape(-1), block=block)
    np.testing.assert_array_equal(flat, dense)


def test_compiled_matches_reference(both_implementations, rng):
    compiled, ref = both_implementations
    indices, values = peer_blocks(rng, 100_001, 3000)  # enough blocks for the parallel path
    indices[-1] = 6250  # the partial tail block
    indices = np.unique(indices)
    values = values[: indices.shape[0]]
    a = rng.standard_normal(100_001).astype(np.float32)
    b = a.copy()
    compiled.scatter_add_blocks(a, indices, values.reshape(-1), 16, 2)
    ref.scatter_add_blocks(b, indices, values.reshape(-1), 16, 1)
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("dense, indices, values, error", [
    (np.zeros(100, np.float32), np.array([7], np.int32), np.zeros((1, 16), np.float32), ConfigError),
    (np.zeros(100, np.float32), np.array([2, 1], np.int32), np.zeros((2, 16), np.float32), ConfigError),
    (np.zeros(100, np.float32), np.array([1], np.int32), np.zeros((2, 16), np.float32), ConfigError),
    (np.zeros(100, np.float32), np.array([1], np.int64), np.zeros((1, 16), np.float32), UnsupportedError),
    (np.zeros(100, np.float64), np.array([1], np.int32), np.zeros((1, 16), np.float32), UnsupportedError),
    (torch.zeros(100, dtype=torch.float16), np.array([1], np.int32), np.zeros((1, 16), np.float32), UnsupportedError),
    (torch.zeros(200)[::2], np.array([1], np.int32), np.zeros((1, 16), np.float32), ConfigError),
    (np.zeros(100, np.float32), [np.array([1], np.int32)], np.zeros((1, 16), np.float32), ConfigError),
])
def test_scatter_add_rejects_bad_input(implementation, dense, indices, values, error):
    with pytest.raises(error):
        scatter_add_(dense, indices, values)


def test_scatter_add_checks_every_peer_before_adding(implementation):
    dense = np.zeros(100, np.float32)
    good = (np.array([0], np.int32), np.ones((1, 16), np.float32))
    bad = (np.array([9], np.int32), np.ones((1, 16), np.float32))
    with pytest.raises(ConfigError, match="peer 1"):
        scatter_add_(dense, [good[0], bad[0]], [good[1], bad[1]])
    assert not dense.any()


def test_scatter_add_rejects_read_only_accumulator(implementation):
    frozen = np.zeros(100, np.float32)
    frozen.flags.writeable = False
    with pytest.raises(ConfigError, match="read-only"):
        scatter_add_(frozen, np.array([1], np.int32), np.zeros((1, 16), np.float32))
