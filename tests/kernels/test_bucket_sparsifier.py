"""BucketSparsifier: a DDP bucket's tensors sparsified in one kernel call (sparsify_segments), each
exactly as its own BlockSparsifier would be: same blocks, values, residual, threshold and stats."""
import numpy as np
import pytest
import torch

from wanlink.compress import BlockSparsifier, BucketSparsifier, NonFiniteGradientError
from wanlink.errors import ConfigError, UnsupportedError

# ragged sizes (tail blocks), a tensor smaller than a block, one large enough for the parallel path
NUMELS = [10, 2560, 256, 65_536 + 7, 1, 144, 300_000]


def bucket_gradients(rng, numels, steps):
    scales = rng.exponential(1.0, len(numels))  # tensors of very different magnitudes, like layers
    return [torch.from_numpy(np.concatenate([rng.standard_normal(n) * s for n, s in zip(numels, scales)])
                             .astype(np.float32)) for _ in range(steps)]


@pytest.mark.parametrize("density", [0.0, 0.01, 0.3, 1.0])
def test_one_call_equals_one_sparsifier_per_tensor(implementation, rng, density):
    bucket = BucketSparsifier(NUMELS, density)
    alone = [BlockSparsifier(n, density) for n in NUMELS]
    offsets = np.concatenate([[0], np.cumsum(NUMELS)])
    for grad in bucket_gradients(rng, NUMELS, 8):
        indices, values = bucket.compress(grad)
        assert indices.shape == (bucket.k,) and values.shape == (bucket.k, 16)
        for i, sparsifier in enumerate(alone):
            expected_ids, expected_values = sparsifier.compress(grad[offsets[i]:offsets[i + 1]])
            part = slice(bucket.kept_offsets[i], bucket.kept_offsets[i + 1])
            torch.testing.assert_close(indices[part], expected_ids, rtol=0, atol=0)
            torch.testing.assert_close(values[part], expected_values, rtol=0, atol=0)
            mine = bucket.parts[i]
            torch.testing.assert_close(mine.residual, sparsifier.residual, rtol=0, atol=0)
            assert (mine.threshold, mine.last_above, mine.last_candidates, mine.last_cutoff) == (
                sparsifier.threshold, sparsifier.last_above, sparsifier.last_candidates, sparsifier.last_cutoff)
    # the parts' residuals are the bucket's flat residual
    torch.testing.assert_close(bucket.residual, torch.cat([p.residual for p in bucket.parts]), rtol=0, atol=0)
    assert bucket.parts[3].residual.data_ptr() == bucket.residual[offsets[3]:].data_ptr()


def test_error_feedback_loses_nothing(implementation, rng):
    bucket = BucketSparsifier(NUMELS, 0.01)
    offsets = np.concatenate([[0], np.cumsum(NUMELS)])
    sent = torch.zeros(offsets[-1], dtype=torch.float64)
    total = torch.zeros(offsets[-1], dtype=torch.float64)
    for grad in bucket_gradients(rng, NUMELS, 6):
        indices, values = bucket.compress(grad)
        for i in range(len(NUMELS)):
            part = slice(bucket.kept_offsets[i], bucket.kept_offsets[i + 1])
            padded = torch.zeros(bucket.parts[i].nblocks * 16, dtype=torch.float64)
            padded.view(-1, 16)[indices[part].long()] = values[part].double()
            assert not padded[NUMELS[i]:].any()  # a tail block's padding is zero, never the next tensor's
            sent[offsets[i]:offsets[i + 1]] += padded[:NUMELS[i]]
        total += grad.double()
    torch.testing.assert_close(sent + bucket.residual.double(), total, rtol=0, atol=1e-4)


def test_parts_checkpoint_like_single_sparsifiers(implementation, rng):
    bucket = BucketSparsifier([40, 33], 0.1)
    grad = bucket_gradients(rng, [40, 33], 1)[0]
    bucket.compress(grad)
    again = BucketSparsifier([40, 33], 0.1)
    for new, old in zip(again.parts, bucket.parts):
        new.load_state_dict(old.state_dict())  # writes into the new bucket's flat residual
    torch.testing.assert_close(again.residual, bucket.residual, rtol=0, atol=0)
    for a, b in zip(again.compress(grad), bucket.compress(grad)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_nonfinite_tensors_are_named_and_reset(implementation, rng):
    bucket = BucketSparsifier([32, 48, 32], 0.5)
    grad = torch.ones(112)
    bucket.compress(grad)
    grad[40] = float("nan")
    with pytest.raises(NonFiniteGradientError, match=r"tensors \[1\]"):
        bucket.compress(grad)
    assert not bucket.parts[1].residual.any()
    assert bucket.parts[0].residual.any() and bucket.parts[2].residual.any()  # the others keep theirs


def test_bad_input_is_rejected():
    bucket = BucketSparsifier([16, 16], 0.5)
    with pytest.raises(ConfigError, match="33 elements; the tensors hold 32"):
        bucket.compress(torch.zeros(33))
    with pytest.raises(UnsupportedError, match="float32"):
        bucket.compress(torch.zeros(32, dtype=torch.float64))
    with pytest.raises(ConfigError, match="at least one tensor"):
        BucketSparsifier([], 0.5)
    with pytest.raises(ConfigError, match="residual must be"):
        BlockSparsifier(16, 0.5, residual=torch.zeros(15))


def test_compiled_segments_match_reference_bit_for_bit(both_implementations, rng):
    compiled, ref = both_implementations
    numels = np.array(NUMELS, dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(numels)]).astype(np.int64)
    nblocks = -(-numels // 16)
    ks = np.maximum(1, nblocks // 10).astype(np.int64)
    grad = (rng.standard_normal(offsets[-1]) * rng.exponential(1.0, offsets[-1])).astype(np.float32)
    thresholds = rng.uniform(0.0, 20.0, len(numels))
    outcomes = []
    for module in (compiled, ref):
        residual = np.ones(offsets[-1], dtype=np.float32)
        scores, candidates, candidate_scores = (np.zeros(nblocks.sum(), dtype) for dtype in (np.float32, np.int32,
                                                                                               np.float32))
        out_ids, out_values = np.zeros(ks.sum(), np.int32), np.zeros(ks.sum() * 16, np.float32)
        stats = [np.zeros(len(numels), dtype) for dtype in (np.int64, np.int64, np.float32, np.int64)]
        module.sparsify_segments(grad, residual, scores, candidates, candidate_scores, offsets, thresholds,
                                 thresholds * 0.9, ks, out_ids, out_values, 16, 3, *stats)
        outcomes.append((residual, out_ids, out_values, *stats))
    for a, b in zip(*outcomes):
        np.testing.assert_array_equal(a, b)
