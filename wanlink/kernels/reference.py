"""NumPy reference of every block-sparse kernel (used when wanlink._kernels is missing or forced off).

Each function has the signature and the exact results of its compiled twin in
``cython_ext/_kernels.pyx``; the kernel tests run both and compare. Arrays are 1-D and C-contiguous,
already validated by ``wanlink.kernels`` (the compiled loops do no bounds checks). ``num_threads`` is
accepted for signature parity and ignored here.

Block scores are summed by pairwise halving (v[j] += v[j + half], half = block/2, block/4, ...), an
order both implementations follow so the float32 scores, and hence the selection, agree bit for bit.
"""
import numpy as np

KERNEL_ABI = 4
MAX_BLOCK_SIZE = 1024

_LOW_32_BITS = np.uint64(0xFFFFFFFF)


def _padded_blocks(flat: np.ndarray, block: int) -> np.ndarray:
    """View ``flat`` as (nblocks, block), zero-padding the tail block (a copy only when ragged)."""
    nblocks = -(-flat.shape[0] // block)
    if flat.shape[0] == nblocks * block:
        return flat.reshape(nblocks, block)
    padded = np.zeros(nblocks * block, dtype=np.float32)
    padded[: flat.shape[0]] = flat
    return padded.reshape(nblocks, block)


def block_scores(acc_blocks: np.ndarray) -> np.ndarray:
    """Sum of |x| per row, added by pairwise halving in float32 (a sum past float32 is inf: non-finite)."""
    partial = np.abs(acc_blocks)
    with np.errstate(over="ignore"):
        while partial.shape[1] > 1:
            half = partial.shape[1] // 2
            partial = partial[:, :half] + partial[:, half:]
    return partial[:, 0]


def top_block_ids(scores: np.ndarray, k: int) -> np.ndarray:
    """Ids of the k highest scores (ties: lower id first), ascending. Scores finite and >= 0."""
    ids = np.arange(scores.shape[0], dtype=np.uint64)
    # Non-negative float32 bit patterns order like the values; the low word breaks ties by id.
    keys = (scores.view(np.uint32).astype(np.uint64) << np.uint64(32)) | (_LOW_32_BITS - ids)
    top = np.argpartition(keys, keys.shape[0] - k)[keys.shape[0] - k:]
    return np.sort(top).astype(np.int32)


def sparsify_blocks(grad, residual, scores, candidates, candidate_scores, threshold, band, k,
                    out_indices, out_values, block, num_threads):
    """Fold grad into the residual, score blocks, select exactly the top k, move them out.

    acc = residual + grad (acc = grad when residual is None), written back to residual. scores[b] =
    sum |acc| over block b (tail zero-padded). candidates[:n] = ids with score > band (float32
    compare), candidate_scores[:n] their scores. The k best blocks (by score, ties to the lower id)
    go to out_indices[:k] ascending and their acc values to out_values[:k*block] (tail padding
    zero); their residual becomes zero. Returns (blocks above threshold, n candidates, k-th best
    score, non-finite block count); on non-finite scores or k == 0 nothing is selected.
    """
    numel = grad.shape[0]
    nblocks = -(-numel // block)
    if nblocks == 0:
        return 0, 0, 0.0, 0
    if residual is not None:
        np.add(residual, grad, out=residual)
        acc = residual
    else:
        acc = grad
    acc_blocks = _padded_blocks(acc, block)
    scores[:] = block_scores(acc_blocks)
    with np.errstate(invalid="ignore"):
        nonfinite = int(np.count_nonzero(~np.isfinite(scores)))
        above = int(np.count_nonzero(scores > np.float32(threshold)))
        candidate_ids = np.flatnonzero(scores > np.float32(band))
    candidates[: candidate_ids.shape[0]] = candidate_ids
    candidate_scores[: candidate_ids.shape[0]] = scores[candidate_ids]
    if nonfinite or k == 0:
        return above, int(candidate_ids.shape[0]), 0.0, nonfinite
    chosen = top_block_ids(scores, k)
    out_indices[:k] = chosen
    out_values[: k * block] = acc_blocks[chosen].reshape(-1)
    if residual is not None:
        element_ids = (chosen.astype(np.int64)[:, None] * block + np.arange(block)).reshape(-1)
        residual[element_ids[element_ids < numel]] = 0.0
    return above, int(candidate_ids.shape[0]), float(scores[chosen].min()), 0


def sparsify_segments(grad, residual, scores, candidates, candidate_scores, offsets, thresholds, bands, ks,
                      out_indices, out_values, block, num_threads, above, ncandidates, cutoffs, nonfinite):
    """sparsify_blocks on each segment grad[offsets[s]:offsets[s + 1]] of a flat buffer, in one call.

    Segment s is a tensor of its own: its blocks start at offsets[s] (its tail block is zero-padded,
    never shared with the next segment), with threshold thresholds[s], band bands[s] and k = ks[s].
    Its scores and candidates go to scores/candidates/candidate_scores from its first block's
    position among all segments' blocks, its kept ids (local, ascending) and values to
    out_indices/out_values from sum(ks[:s]) blocks on; above/ncandidates/cutoffs/nonfinite[s] get its
    stats. Each segment's results are exactly sparsify_blocks' on it alone.
    """
    first_block = first_kept = 0
    for s in range(ks.shape[0]):
        start, end, k = int(offsets[s]), int(offsets[s + 1]), int(ks[s])
        last_block = first_block - (-(end - start) // block)
        above[s], ncandidates[s], cutoffs[s], nonfinite[s] = sparsify_blocks(
            grad[start:end], None if residual is None else residual[start:end], scores[first_block:last_block],
            candidates[first_block:last_block], candidate_scores[first_block:last_block], thresholds[s], bands[s], k,
            out_indices[first_kept:], out_values[first_kept * block:], block, num_threads)
        first_block = last_block
        first_kept += k


def scatter_add_blocks(dense, indices, values, block, num_threads):
    """dense[b*block : b*block+block] += values[i] for each block id b = indices[i] (ids unique)."""
    if indices.shape[0] == 0:
        return
    element_ids = (indices.astype(np.int64)[:, None] * block + np.arange(block)).reshape(-1)
    inside = element_ids < dense.shape[0]
    dense[element_ids[inside]] += values[: element_ids.shape[0]][inside]


def first_invalid_block_index(indices, nblocks):
    """Position of the first id that is out of [0, nblocks) or not above its predecessor; -1 if none."""
    if indices.shape[0] == 0:
        return -1
    ids = indices.astype(np.int64)
    bad = (ids < 0) | (ids >= nblocks)
    bad[1:] |= ids[1:] <= ids[:-1]
    positions = np.flatnonzero(bad)
    return int(positions[0]) if positions.shape[0] else -1


def sgd_step_blocks(param, momentum_buffer, initialized, indices, values, block,
                    lr, weight_decay, momentum, dampening, nesterov, num_threads):
    """torch.optim.SGD's update applied to the listed blocks of a flat float32 parameter.

    values holds each block's gradient (block floats per id, tail padding ignored). A block whose
    ``initialized`` flag is 0 starts its momentum from its gradient (torch's first step); the flag
    is then set. ``initialized`` None means every block has started; momentum_buffer and
    initialized are unused (may be None) when momentum is 0. Returns how many blocks started now.
    """
    count = indices.shape[0]
    if count == 0:
        return 0
    element_ids = (indices.astype(np.int64)[:, None] * block + np.arange(block)).reshape(-1)
    inside = element_ids < param.shape[0]
    element_ids = element_ids[inside]
    grad = values[: count * block][inside]
    f32 = np.float32
    weights = param[element_ids]
    if weight_decay != 0.0:
        grad = grad + f32(weight_decay) * weights
    started = 0
    if momentum != 0.0:
        fresh_blocks = np.zeros(count, dtype=bool) if initialized is None else initialized[indices] == 0
        fresh = np.repeat(fresh_blocks, block)[inside]
        previous = momentum_buffer[element_ids]
        buf = np.where(fresh, grad, f32(momentum) * previous + f32(1.0 - dampening) * grad)
        momentum_buffer[element_ids] = buf
        if initialized is not None:
            initialized[indices] = 1
            started = int(np.count_nonzero(fresh_blocks))
        grad = grad + f32(momentum) * buf if nesterov else buf
    param[element_ids] = weights - f32(lr) * grad
    return started
