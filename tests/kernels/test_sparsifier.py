"""BlockSparsifier: the public selection API, its AIMD threshold, dtype handling and checkpoints."""
import numpy as np
import pytest
import torch

from wanlink.compress import BlockSparsifier, NonFiniteGradientError, target_blocks
from wanlink.errors import ConfigError, UnsupportedError
from wanlink.kernels.arrays import aligned_empty


def gradients(rng, numel, steps, scale=1.0):
    return [torch.from_numpy((rng.standard_normal(numel) * scale).astype(np.float32)) for _ in range(steps)]


@pytest.mark.parametrize("numel", [1, 17, 50_001])
@pytest.mark.parametrize("density", [0.0, 0.001, 0.05, 1.0])
def test_compress_keeps_exactly_k_and_conserves_gradient(implementation, rng, numel, density):
    sparsifier = BlockSparsifier(numel, density)
    nblocks = -(-numel // 16)
    assert sparsifier.k == (0 if density == 0 else min(nblocks, int(np.ceil(density * nblocks))))
    sent = torch.zeros(numel, dtype=torch.float64)
    total = torch.zeros(numel, dtype=torch.float64)
    for grad in gradients(rng, numel, 6):
        indices, values = sparsifier.compress(grad)
        assert indices.dtype == torch.int32 and values.dtype == torch.float32
        assert indices.shape == (sparsifier.k,) and values.shape == (sparsifier.k, 16)
        assert torch.all(indices[1:] > indices[:-1])
        dense = torch.zeros(nblocks * 16, dtype=torch.float64)
        dense.view(nblocks, 16)[indices.long()] = values.double()
        assert not dense[numel:].any()  # tail padding is zero
        sent += dense[:numel]
        total += grad.double()
    # Error feedback loses nothing: everything ever sent plus what is left equals all gradients.
    torch.testing.assert_close(sent + sparsifier.residual.double(), total, rtol=0, atol=1e-4)
    if density == 1.0:
        assert not sparsifier.residual.any()
    if density == 0.0:
        torch.testing.assert_close(sparsifier.residual.double(), total, rtol=0, atol=1e-4)


def test_without_error_feedback_values_are_the_gradient(implementation, rng):
    sparsifier = BlockSparsifier(1000, 0.1, error_feedback=False)
    assert sparsifier.residual is None
    grad = gradients(rng, 1000, 1)[0]
    indices, values = sparsifier.compress(grad)
    padded = torch.zeros(63 * 16)
    padded[:1000] = grad
    torch.testing.assert_close(values, padded.view(63, 16)[indices.long()], rtol=0, atol=0)


def test_aimd_rule(implementation):
    # Block b holds 16 copies of (b + 1) / 1000, so its score is 16 (b + 1) / 1000.
    grad = torch.repeat_interleave(torch.arange(1, 1001, dtype=torch.float32) / 1000, 16)
    sparsifier = BlockSparsifier(grad.numel(), 0.01, error_feedback=False)  # k = 10
    cutoff = np.float32(16 * 991 / 1000)
    sparsifier.compress(grad)
    assert sparsifier.last_cutoff == pytest.approx(cutoff) and sparsifier.threshold == sparsifier.last_cutoff
    for start, above, step in [
        (1.0, 938, 0.5 * (cutoff - 1.0)),  # far too low: the increase covers half the gap
        (0.995 * cutoff, 14, 0.01 * cutoff),  # slightly low: at least 1% of the cutoff
    ]:
        sparsifier.threshold = start
        sparsifier.compress(grad)
        assert sparsifier.last_above == above
        assert sparsifier.threshold == pytest.approx(start + step)
    sparsifier.threshold = 16.0  # too high: nothing passes, multiplicative decrease
    sparsifier.compress(grad)
    assert sparsifier.last_above == 0 and sparsifier.threshold == pytest.approx(16.0 * 0.95)
    sparsifier.threshold = float(np.float32(16 * 990 / 1000))  # exactly k pass: unchanged
    sparsifier.compress(grad)
    assert sparsifier.last_above == 10 and sparsifier.threshold == float(np.float32(16 * 990 / 1000))


@pytest.mark.parametrize("error_feedback, tolerance", [(False, 0.5), (True, 1.5)])
def test_aimd_tracks_k(implementation, rng, error_feedback, tolerance):
    sparsifier = BlockSparsifier(16 * 20_000, 0.01, error_feedback=error_feedback)  # k = 200
    above, candidates = [], []
    for grad in gradients(rng, 16 * 20_000, 50):
        sparsifier.compress(grad)
        above.append(sparsifier.last_above)
        candidates.append(sparsifier.last_candidates)
    late_above, late_candidates = np.array(above[15:]), np.array(candidates[15:])
    assert abs(late_above.mean() - sparsifier.k) < tolerance * sparsifier.k
    # Candidates stay a small multiple of k (selection is cheap) and rarely fall short of k
    # (which would need a scan of every block's score).
    assert late_candidates.mean() < 10 * sparsifier.k
    assert np.count_nonzero(late_candidates < sparsifier.k) <= 3


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_is_converted(implementation, rng, dtype):
    grad = gradients(rng, 999, 1)[0].to(dtype)
    half = BlockSparsifier(999, 0.2)
    full = BlockSparsifier(999, 0.2)
    for a, b in zip(half.compress(grad), full.compress(grad.float())):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("make_grad, error", [
    (lambda: torch.zeros(100, dtype=torch.float64), UnsupportedError),
    (lambda: torch.zeros(100, dtype=torch.int32), UnsupportedError),
    (lambda: torch.zeros(99), ConfigError),
    (lambda: torch.zeros(20, 10).t(), ConfigError),
    (lambda: torch.zeros(200)[::2], ConfigError),
    (lambda: torch.zeros(200, dtype=torch.float16)[::2], ConfigError),
    (lambda: [0.0] * 100, ConfigError),
    (lambda: np.zeros(100, dtype=np.float64), UnsupportedError),
])
def test_bad_gradients_are_rejected(implementation, make_grad, error):
    with pytest.raises(error):
        BlockSparsifier(100, 0.5).compress(make_grad())


def test_shapes_are_flattened(implementation, rng):
    grad = gradients(rng, 120, 1)[0]
    a = BlockSparsifier(120, 0.5).compress(grad.view(10, 12))
    b = BlockSparsifier(120, 0.5).compress(grad)
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=0, atol=0)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nonfinite_gradient_raises_and_resets_residual(implementation, rng, bad):
    sparsifier = BlockSparsifier(1000, 0.1)
    sparsifier.compress(gradients(rng, 1000, 1)[0])
    assert sparsifier.residual.any()
    grad = gradients(rng, 1000, 1)[0]
    grad[500] = bad
    with pytest.raises(NonFiniteGradientError, match="NaN/Inf"):
        sparsifier.compress(grad)
    assert not sparsifier.residual.any()
    sparsifier.compress(gradients(rng, 1000, 1)[0])  # usable afterwards


@pytest.mark.parametrize("kwargs", [
    dict(numel=0, density=0.1), dict(numel=-5, density=0.1), dict(numel=10.0, density=0.1),
    dict(numel=10, density=-0.1), dict(numel=10, density=1.5), dict(numel=10, density=float("nan")),
    dict(numel=10, density=0.1, block=12), dict(numel=10, density=0.1, block=0),
    dict(numel=10, density=0.1, block=2048), dict(numel=10, density=0.1, decrease_factor=1.0),
])
def test_bad_configuration(kwargs):
    with pytest.raises(ConfigError):
        BlockSparsifier(**kwargs)


def test_target_blocks_rounding():
    assert target_blocks(0.0, 100) == 0
    assert target_blocks(0.07, 100) == 7  # 0.07 * 100 is 7.000000000000001 in floating point
    assert target_blocks(0.071, 100) == 8
    assert target_blocks(1e-9, 100) == 1
    assert target_blocks(1.0, 100) == 100


def test_state_dict_round_trip(implementation, rng):
    grads = gradients(rng, 5000, 8)
    original = BlockSparsifier(5000, 0.02)
    for grad in grads[:4]:
        original.compress(grad)
    restored = BlockSparsifier(5000, 0.02)
    restored.load_state_dict(original.state_dict())
    assert restored.threshold == original.threshold
    for grad in grads[4:]:
        for a, b in zip(original.compress(grad), restored.compress(grad)):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    torch.testing.assert_close(original.residual, restored.residual, rtol=0, atol=0)


def test_state_dict_mismatch_is_rejected():
    state = BlockSparsifier(100, 0.1).state_dict()
    with pytest.raises(ConfigError):
        BlockSparsifier(101, 0.1).load_state_dict(state)
    with pytest.raises(ConfigError):
        BlockSparsifier(100, 0.1, block=8).load_state_dict(state)
    with pytest.raises(ConfigError):
        BlockSparsifier(100, 0.1).load_state_dict({"numel": 100})
    with pytest.raises(ConfigError):
        BlockSparsifier(100, 0.1).load_state_dict({**state, "threshold": float("nan")})


@pytest.mark.parametrize("count, dtype", [(0, np.float32), (1, np.float32), (1_000_003, np.float32), (77, np.int32)])
def test_aligned_empty(count, dtype):
    array = aligned_empty(count, dtype)
    assert array.shape == (count,) and array.dtype == dtype and array.flags.writeable
    assert count == 0 or array.ctypes.data % 64 == 0
    array[:] = 7
    assert np.all(array == 7)


def test_scores_buffer_is_aligned_for_streaming_stores():
    sparsifier = BlockSparsifier(1_000_001, 0.01)
    sparsifier.compress(np.zeros(1_000_001, dtype=np.float32))
    assert sparsifier._scratch.scores.ctypes.data % 64 == 0
