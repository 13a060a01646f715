"""sparsify_blocks (the fused accumulate/score/select/residual pass) and the kernel chooser."""
import importlib

import numpy as np
import pytest

from wanlink import kernels
from wanlink.errors import ConfigError, UnsupportedError
from wanlink.kernels import reference
from wanlink.kernels.arrays import aligned_empty

SIZES = [1, 7, 15, 16, 17, 33, 1000, 4099, 65536 + 5]


def run_sparsify(module, grad, residual, k, threshold=0.0, band=0.0, block=16, threads=2, aligned_scores=False):
    nblocks = -(-grad.shape[0] // block)
    scores = aligned_empty(nblocks, np.float32) if aligned_scores else np.empty(nblocks, dtype=np.float32)
    scores[:] = -1.0
    candidates = np.full(nblocks, -1, dtype=np.int32)
    candidate_scores = np.full(nblocks, -1.0, dtype=np.float32)
    out_indices = np.full(k, -1, dtype=np.int32)
    out_values = np.full(k * block, np.nan, dtype=np.float32)
    stats = module.sparsify_blocks(grad, residual, scores, candidates, candidate_scores, threshold, band, k,
                                   out_indices, out_values, block, threads)
    np.testing.assert_array_equal(candidate_scores[: stats[1]], scores[candidates[: stats[1]]])
    return stats, scores, candidates[: stats[1]], out_indices, out_values.reshape(k, block)


def padded(flat, block):
    nblocks = -(-flat.shape[0] // block)
    out = np.zeros(nblocks * block, dtype=np.float32)
    out[: flat.shape[0]] = flat
    return out.reshape(nblocks, block)


@pytest.mark.parametrize("numel", SIZES)
@pytest.mark.parametrize("density", [0.0, 0.01, 0.25, 1.0])
@pytest.mark.parametrize("error_feedback", [True, False])
def test_selection_semantics(implementation, rng, numel, density, error_feedback):
    grad = rng.standard_normal(numel).astype(np.float32) * rng.choice([0.1, 1.0, 30.0], numel).astype(np.float32)
    residual = rng.standard_normal(numel).astype(np.float32) if error_feedback else None
    acc = grad + residual if error_feedback else grad.copy()
    residual_in = None if residual is None else residual.copy()
    nblocks = -(-numel // 16)
    k = int(np.ceil(density * nblocks))
    threshold = float(rng.uniform(0, 20))
    (above, ncand, cutoff, nonfinite), scores, candidates, ids, values = run_sparsify(
        implementation, grad, residual, k, threshold, threshold / 2)

    expected_scores = np.abs(padded(acc, 16)).astype(np.float64).sum(axis=1)
    np.testing.assert_allclose(scores, expected_scores, rtol=1e-5)
    assert nonfinite == 0
    assert above == np.count_nonzero(scores > np.float32(threshold))
    np.testing.assert_array_equal(candidates, np.flatnonzero(scores > np.float32(threshold / 2)))
    assert ids.shape == (k,) and np.all(np.diff(ids) > 0) and (k == 0 or (ids[0] >= 0 and ids[-1] < nblocks))
    kept = np.zeros(nblocks, dtype=bool)
    kept[ids] = True
    if 0 < k < nblocks:
        assert scores[kept].min() >= scores[~kept].max()
        assert cutoff == scores[kept].min()
    np.testing.assert_array_equal(values, padded(acc, 16)[ids])
    if error_feedback:
        new_residual = padded(residual, 16)
        assert not new_residual[kept].any()
        np.testing.assert_array_equal(new_residual[~kept], padded(acc, 16)[~kept])
        # Nothing is lost: what is sent plus what stays equals residual + grad.
        restored = new_residual.copy()
        restored[ids] += values
        np.testing.assert_array_equal(restored.reshape(-1)[:numel], residual_in + grad)
    else:
        assert np.array_equal(grad, acc)  # the gradient is read-only input


def test_ties_go_to_lower_block_ids(implementation):
    grad = np.ones(16 * 10, dtype=np.float32)
    grad[16 * 7: 16 * 8] = 2.0
    _, _, _, ids, _ = run_sparsify(implementation, grad, None, 4)
    np.testing.assert_array_equal(ids, [0, 1, 2, 7])


def test_all_zero_gradient_keeps_first_blocks(implementation):
    _, _, _, ids, values = run_sparsify(implementation, np.zeros(100, dtype=np.float32), None, 3)
    np.testing.assert_array_equal(ids, [0, 1, 2])
    assert not values.any()


@pytest.mark.parametrize("block", [1, 2, 4, 8, 32, 64])
def test_other_block_sizes(implementation, rng, block):
    grad = rng.standard_normal(1001).astype(np.float32)
    nblocks = -(-1001 // block)
    k = max(1, nblocks // 10)
    (_, _, cutoff, _), scores, _, ids, values = run_sparsify(implementation, grad, None, k, block=block)
    np.testing.assert_allclose(scores, np.abs(padded(grad, block)).astype(np.float64).sum(1), rtol=1e-5)
    np.testing.assert_array_equal(values, padded(grad, block)[ids])
    assert np.sort(scores)[-k] == cutoff


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_nonfinite_is_reported(implementation, bad):
    grad = np.ones(100, dtype=np.float32)
    grad[37] = bad
    (_, _, _, nonfinite), *_ = run_sparsify(implementation, grad, np.zeros(100, np.float32), 2)
    assert nonfinite == 1


# Blocks 0-63 go through the compiled kernel's eight-block (AVX2) scorer where the CPU has one,
# the partial block 64 and any leftovers through the one-block loop.
@pytest.mark.parametrize("positions", [[0], [16 * 9 + 3], [16 * 40, 16 * 40 + 15, 16 * 47 + 1], [16 * 64 + 4]])
def test_nonfinite_blocks_are_counted(implementation, positions):
    grad = np.ones(16 * 64 + 5, dtype=np.float32)
    grad[positions] = np.nan
    grad[16 * 20: 16 * 21] = 3e38  # finite values whose block magnitude overflows float32
    (_, _, _, nonfinite), *_ = run_sparsify(implementation, grad, np.zeros_like(grad), 2)
    assert nonfinite == len({position // 16 for position in positions}) + 1


# The compiled kernels go parallel only above 64 K floats per thread: the last sizes split into chunks.
@pytest.mark.parametrize("numel", SIZES + [300_007, 1_000_003])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_compiled_matches_reference_bit_for_bit(both_implementations, rng, numel, threads):
    compiled, ref = both_implementations
    grad = (rng.standard_normal(numel) * rng.exponential(1.0, numel)).astype(np.float32)
    residual = rng.standard_normal(numel).astype(np.float32)
    nblocks = -(-numel // 16)
    for k in sorted({0, 1, nblocks // 100, nblocks // 3, nblocks}):
        for threshold in (0.0, 5.0, 15.0, 1e9):
            results = []
            for module in (compiled, ref):
                res = residual.copy()
                # 64-byte aligned scores: the compiled pass writes them with streaming stores
                out = run_sparsify(module, grad, res, k, threshold, threshold * 0.8, threads=threads,
                                   aligned_scores=numel % 2 == 1)
                results.append((out, res))
            (stats_c, *arrays_c), res_c = results[0]
            (stats_r, *arrays_r), res_r = results[1]
            assert stats_c == stats_r
            for a, b in zip(arrays_c, arrays_r):
                np.testing.assert_array_equal(a, b)
            np.testing.assert_array_equal(res_c, res_r)


def test_kernel_module_contract():
    for name in kernels.available():
        module = kernels.load(name)
        assert module.KERNEL_ABI == reference.KERNEL_ABI
        for function in ("sparsify_blocks", "sparsify_segments", "scatter_add_blocks", "first_invalid_block_index",
                         "sgd_step_blocks"):
            assert callable(getattr(module, function))
    with pytest.raises(ConfigError):
        kernels.load("fortran")


def test_purepython_variable_forces_reference(monkeypatch):
    monkeypatch.setenv("WANLINK_PUREPYTHON", "1")
    fresh = importlib.reload(kernels)
    try:
        assert fresh.available() == ["reference"]
        assert fresh.active() is reference and fresh.NAME == "reference"
        with pytest.raises(UnsupportedError):
            fresh.load("compiled")
    finally:
        monkeypatch.delenv("WANLINK_PUREPYTHON")
        importlib.reload(kernels)


def test_first_invalid_block_index(implementation):
    check = implementation.first_invalid_block_index
    assert check(np.array([], np.int32), 0) == -1
    assert check(np.array([0, 3, 9], np.int32), 10) == -1
    assert check(np.array([0, 3, 10], np.int32), 10) == 2
    assert check(np.array([-1, 3], np.int32), 10) == 0
    assert check(np.array([4, 4], np.int32), 10) == 1
    assert check(np.array([5, 2], np.int32), 10) == 1


def test_thread_count_follows_torch():
    import torch

    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert kernels.num_threads() == 1
        torch.set_num_threads(2)
        assert kernels.num_threads() == 2
    finally:
        torch.set_num_threads(previous)
