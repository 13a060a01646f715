# cython: boundscheck=False, wraparound=False, initializedcheck=False, cdivision=True, nonecheck=False
"""Compiled block-sparse kernels (wanlink._kernels).

Same functions, signatures and results as ``wanlink/kernels/reference.py``; see that module for the
contract of each kernel. Callers (``wanlink.kernels``) validate shapes, dtypes and index ranges
before calling: these loops do no bounds checks. Every loop runs without the GIL, split over at
most ``num_threads`` OpenMP threads (one when the work is too small to pay for waking another),
and allocates nothing: scratch space comes from the caller.
"""
from cython.parallel cimport prange
from libc.math cimport fabsf, isfinite
from libc.stdint cimport int32_t, int64_t, uint8_t, uint32_t
from libc.string cimport memcpy, memmove, memset

cdef extern from *:
    """
    #if defined(__GNUC__) || defined(__clang__)
    #define WANLINK_PREFETCH(address) __builtin_prefetch((address), 1, 3)
    #else
    #define WANLINK_PREFETCH(address) ((void)0)
    #endif

    #if (defined(__GNUC__) || defined(__clang__)) && defined(__x86_64__)
    #include <immintrin.h>
    #include <float.h>

    static int wanlink_cpu_has_avx2(void) {
        __builtin_cpu_init();
        return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("popcnt");
    }

    /* score_chunk's loop for full 16-float blocks [first, last), eight at a time (last - first a
       multiple of 8): acc = residual + grad (stored back when residual is not NULL), score = sum
       |acc| added in score_block16's pairwise-halving order (so the bits are the same), and the
       same counts and candidate list. The eight blocks' partial sums share registers, so the
       horizontal additions cost a few shuffles per eight blocks instead of a chain per block.
       Returns how many candidates it wrote to candidates[0:] and candidate_scores[0:]. */
    __attribute__((target("avx2,popcnt")))
    static Py_ssize_t wanlink_score16_avx2(const float* grad, float* residual, float* scores,
                                           int32_t* candidates, float* candidate_scores,
                                           Py_ssize_t first, Py_ssize_t last, float threshold, float band,
                                           Py_ssize_t* above, Py_ssize_t* nonfinite) {
        const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
        const __m256 largest = _mm256_set1_ps(FLT_MAX);
        const __m256 threshold8 = _mm256_set1_ps(threshold), band8 = _mm256_set1_ps(band);
        Py_ssize_t b, found = 0, count_above = 0, count_nonfinite = 0;
        /* scores are only read again when too few blocks are candidates: stream them past the caches
           (no read for ownership), when aligned */
        const int stream_scores = ((size_t)(scores + first) & 31) == 0;
        for (b = first; b < last; b += 8) {
            const float* g = grad + b * 16;
            float* r = residual != NULL ? residual + b * 16 : NULL;
            __m256 half[8], quarter[4], t0, t1, t2, t3, score;
            float lanes[8];
            int i, mask;
            for (i = 0; i < 8; i++) {  /* half[i][j] = |acc[j]| + |acc[j + 8]| of block b + i */
                __m256 low = _mm256_loadu_ps(g + 16 * i), high = _mm256_loadu_ps(g + 16 * i + 8);
                if (r != NULL) {
                    low = _mm256_add_ps(_mm256_loadu_ps(r + 16 * i), low);
                    high = _mm256_add_ps(_mm256_loadu_ps(r + 16 * i + 8), high);
                    _mm256_storeu_ps(r + 16 * i, low);
                    _mm256_storeu_ps(r + 16 * i + 8, high);
                }
                half[i] = _mm256_add_ps(_mm256_and_ps(low, abs_mask), _mm256_and_ps(high, abs_mask));
            }
            for (i = 0; i < 4; i++)  /* quarter[i][j] = half[j] + half[j + 4]: block b + i low, b + i + 4 high */
                quarter[i] = _mm256_add_ps(_mm256_permute2f128_ps(half[i], half[i + 4], 0x20),
                                           _mm256_permute2f128_ps(half[i], half[i + 4], 0x31));
            /* transpose the 4 x 4 quarters in each 128-bit lane, then (q0 + q2) + (q1 + q3) */
            t0 = _mm256_unpacklo_ps(quarter[0], quarter[1]);
            t1 = _mm256_unpackhi_ps(quarter[0], quarter[1]);
            t2 = _mm256_unpacklo_ps(quarter[2], quarter[3]);
            t3 = _mm256_unpackhi_ps(quarter[2], quarter[3]);
            score = _mm256_add_ps(
                _mm256_add_ps(_mm256_shuffle_ps(t0, t2, _MM_SHUFFLE(1, 0, 1, 0)),
                              _mm256_shuffle_ps(t1, t3, _MM_SHUFFLE(1, 0, 1, 0))),
                _mm256_add_ps(_mm256_shuffle_ps(t0, t2, _MM_SHUFFLE(3, 2, 3, 2)),
                              _mm256_shuffle_ps(t1, t3, _MM_SHUFFLE(3, 2, 3, 2))));
            if (stream_scores)
                _mm256_stream_ps(scores + b, score);
            else
                _mm256_storeu_ps(scores + b, score);
            count_nonfinite += 8 - __builtin_popcount(_mm256_movemask_ps(_mm256_cmp_ps(score, largest, _CMP_LE_OQ)));
            count_above += __builtin_popcount(_mm256_movemask_ps(_mm256_cmp_ps(score, threshold8, _CMP_GT_OQ)));
            mask = _mm256_movemask_ps(_mm256_cmp_ps(score, band8, _CMP_GT_OQ));
            if (mask != 0)
                _mm256_storeu_ps(lanes, score);
            while (mask != 0) {
                i = __builtin_ctz(mask);
                candidates[found] = (int32_t)(b + i);
                candidate_scores[found] = lanes[i];
                found++;
                mask &= mask - 1;
            }
        }
        _mm_sfence();
        *above += count_above;
        *nonfinite += count_nonfinite;
        return found;
    }
    #else
    static int wanlink_cpu_has_avx2(void) { return 0; }
    /* never called: score_chunk uses it only when wanlink_cpu_has_avx2() */
    #define wanlink_score16_avx2(grad, residual, scores, candidates, candidate_scores, first, last, threshold, band, above, nonfinite) ((Py_ssize_t)0)
    #endif
    """
    void prefetch "WANLINK_PREFETCH"(const void* address) noexcept nogil
    bint cpu_has_avx2 "wanlink_cpu_has_avx2"() noexcept nogil
    Py_ssize_t score16_avx2 "wanlink_score16_avx2"(
        const float* grad, float* residual, float* scores, int32_t* candidates, float* candidate_scores,
        Py_ssize_t first, Py_ssize_t last, float threshold, float band, Py_ssize_t* above,
        Py_ssize_t* nonfinite) noexcept nogil

KERNEL_ABI = 4
MAX_BLOCK_SIZE = MAX_BLOCK

cdef bint avx2_scoring = cpu_has_avx2()
VECTOR_SCORING = "avx2" if avx2_scoring else "none"  # which scorer full 16-float blocks go through

cdef enum:
    MAX_CHUNKS = 256          # per-chunk counters live on the stack
    MAX_BLOCK = 1024          # largest block size (a power of two) the scorer's stack buffer holds
    CHUNKS_PER_THREAD = 8     # dynamic scheduling slack for threads slowed by other processes
    PARALLEL_GRAIN = 65536    # floats per thread below which waking another thread costs more than it saves
    PREFETCH_AHEAD = 32       # blocks: random block accesses overlap their cache and TLB misses this far ahead
    RANDOM_ACCESS_COST = 4    # a float reached through a block id costs about this many streamed floats


cdef inline int threads_for(Py_ssize_t floats, int requested) noexcept nogil:
    """Threads worth using for ``floats`` of streaming work: at most ``requested``, at least 1."""
    cdef Py_ssize_t useful = floats // PARALLEL_GRAIN
    if useful < 1:
        return 1
    if useful < requested:
        return <int>useful
    return requested if requested > 1 else 1


cdef union FloatBits:
    float f
    uint32_t u


cdef inline uint32_t float_bits(float value) noexcept nogil:
    cdef FloatBits pun
    pun.f = value
    return pun.u


cdef inline float bits_float(uint32_t bits) noexcept nogil:
    cdef FloatBits pun
    pun.u = bits
    return pun.f


cdef inline float pairwise_sum(float* values, Py_ssize_t block) noexcept nogil:
    """Sum ``block`` (a power of two) values by halving: v[j] += v[j + half]; destroys ``values``."""
    cdef Py_ssize_t half = block >> 1, j
    while half >= 1:
        for j in range(half):
            values[j] = values[j] + values[j + half]
        half >>= 1
    return values[0]


cdef inline float score_block16(const float* grad, float* residual) noexcept nogil:
    """score_block for a full 16-float block, with a fixed-size local array so it vectorizes."""
    cdef float magnitude[16]
    cdef float acc
    cdef Py_ssize_t j
    if residual != NULL:
        for j in range(16):
            acc = residual[j] + grad[j]
            residual[j] = acc
            magnitude[j] = fabsf(acc)
    else:
        for j in range(16):
            magnitude[j] = fabsf(grad[j])
    for j in range(8):
        magnitude[j] = magnitude[j] + magnitude[j + 8]
    for j in range(4):
        magnitude[j] = magnitude[j] + magnitude[j + 4]
    magnitude[0] = magnitude[0] + magnitude[2]
    magnitude[1] = magnitude[1] + magnitude[3]
    return magnitude[0] + magnitude[1]


cdef float score_block(const float* grad, float* residual, Py_ssize_t valid, Py_ssize_t block) noexcept nogil:
    """acc = residual + grad over one block (residual <- acc when given); return sum |acc|.

    Any power-of-two block; ``valid`` < ``block`` only for the tail block, whose missing elements
    count as zero. Sums by pairwise halving, like score_block16 and the NumPy reference.
    """
    cdef float magnitude[MAX_BLOCK]
    cdef float acc
    cdef Py_ssize_t j
    for j in range(valid):
        if residual != NULL:
            acc = residual[j] + grad[j]
            residual[j] = acc
        else:
            acc = grad[j]
        magnitude[j] = fabsf(acc)
    for j in range(valid, block):
        magnitude[j] = 0.0
    return pairwise_sum(magnitude, block)


cdef void score_chunk(const float* grad, float* residual, float* scores, int32_t* candidates,
                      float* candidate_scores, Py_ssize_t first, Py_ssize_t last, Py_ssize_t numel,
                      Py_ssize_t block, float threshold, float band, Py_ssize_t* above_out, Py_ssize_t* candidates_out,
                      Py_ssize_t* nonfinite_out) noexcept nogil:
    """One pass over blocks [first, last): accumulate, score, count, and list candidates.

    Candidate block ids (score > band) and their scores go to candidates[first:] and
    candidate_scores[first:], so chunks never overlap. Full 16-float blocks go eight at a time
    through the AVX2 scorer when the CPU has it; the rest (and every block elsewhere) one by one.
    """
    cdef Py_ssize_t b = first, start, valid, above = 0, found = 0, nonfinite = 0, vector_last
    cdef float score
    if block == 16 and avx2_scoring:
        vector_last = numel // 16 if last > numel // 16 else last
        if vector_last > first:
            b = first + (vector_last - first) // 8 * 8
            found = score16_avx2(grad, residual, scores, candidates + first, candidate_scores + first, first, b,
                                 threshold, band, &above, &nonfinite)
    for b in range(b, last):
        start = b * block
        valid = numel - start
        if valid > block:
            valid = block
        if block == 16 and valid == 16:
            score = score_block16(grad + start, residual + start if residual != NULL else NULL)
        else:
            score = score_block(grad + start, residual + start if residual != NULL else NULL, valid, block)
        scores[b] = score
        if not isfinite(score):
            nonfinite += 1
        if score > threshold:
            above += 1
        if score > band:
            candidates[first + found] = <int32_t>b
            candidate_scores[first + found] = score
            found += 1
    above_out[0] = above
    candidates_out[0] = found
    nonfinite_out[0] = nonfinite


cdef uint32_t histogram_select(const float* pool_scores, Py_ssize_t pool_size, Py_ssize_t k,
                               Py_ssize_t* take_equal) noexcept nogil:
    """Bits of the k-th largest of pool_scores[:pool_size] (1 <= k <= pool_size).

    Sets take_equal to how many entries equal to it belong to the top k (the first ones in pool
    order, i.e. the lowest block ids). Scores are finite and >= 0, so their bit patterns order like
    the values. Each pass histograms the bit patterns inside the current range [low, high] into
    up to 4096 equal bins and narrows the range to the bin holding the k-th; bins span the actual
    range of the data, so they spread (no long chains of increments to one counter) and two or
    three passes reach a single value.
    """
    cdef Py_ssize_t counts[4096]
    cdef Py_ssize_t low, high, span, shift, i, digit, seen, remaining = k, bits
    low = float_bits(pool_scores[0])
    high = low
    for i in range(1, pool_size):
        bits = float_bits(pool_scores[i])
        if bits < low:
            low = bits
        if bits > high:
            high = bits
    while True:
        span = high - low
        shift = 0
        while (span >> shift) >= 4096:
            shift += 1
        memset(counts, 0, ((span >> shift) + 1) * sizeof(Py_ssize_t))
        for i in range(pool_size):
            bits = float_bits(pool_scores[i])
            if low <= bits <= high:
                counts[(bits - low) >> shift] += 1
        seen = 0
        digit = span >> shift
        while digit > 0 and seen + counts[digit] < remaining:
            seen += counts[digit]
            digit -= 1
        remaining -= seen
        low = low + (digit << shift)
        if low + (1 << shift) - 1 < high:
            high = low + (1 << shift) - 1
        if shift == 0:
            break
    take_equal[0] = remaining
    return <uint32_t>low


cdef Py_ssize_t emit_selected(const float* pool_scores, const int32_t* pool_ids, Py_ssize_t pool_size,
                              uint32_t cutoff_bits, Py_ssize_t take_equal, Py_ssize_t k,
                              int32_t* out_indices) noexcept nogil:
    """Write the ids of the (at most k) top blocks in ascending order; return how many were written.

    pool_ids NULL means the pool is every block in order (id = position). Branch-free per entry (an
    unpredictable branch per entry cost more than the rest): every id is stored, the count moves
    only for the kept ones, and the loop stops once k are kept so no store goes past out_indices[k-1].
    """
    cdef Py_ssize_t i, written = 0
    cdef uint32_t bits
    cdef bint equal, keep
    for i in range(pool_size):
        if written == k:
            break
        bits = float_bits(pool_scores[i])
        equal = bits == cutoff_bits
        keep = (bits > cutoff_bits) | (equal & (take_equal > 0))
        take_equal -= equal & keep
        out_indices[written] = pool_ids[i] if pool_ids != NULL else <int32_t>i
        written += keep
    return written


cdef inline Py_ssize_t chunk_bound(Py_ssize_t chunk, Py_ssize_t nchunks, Py_ssize_t count) noexcept nogil:
    """Start of chunk ``chunk`` when [0, count) is cut into ``nchunks`` near-equal chunks."""
    return (count * chunk) // nchunks


cdef void gather_range(const float* grad, float* residual, const int32_t* out_indices, float* out_values,
                       Py_ssize_t first, Py_ssize_t last, Py_ssize_t k, Py_ssize_t numel,
                       Py_ssize_t block) noexcept nogil:
    """Copy the selected blocks [first, last) out (from the residual, then zeroed, or the gradient)."""
    cdef Py_ssize_t i, start, valid, ahead
    for i in range(first, last):
        if i + PREFETCH_AHEAD < k:
            ahead = (<Py_ssize_t>out_indices[i + PREFETCH_AHEAD]) * block
            prefetch(residual + ahead if residual != NULL else grad + ahead)
        start = (<Py_ssize_t>out_indices[i]) * block
        valid = numel - start
        if valid > block:
            valid = block
        if residual != NULL:
            memcpy(out_values + i * block, residual + start, valid * sizeof(float))
            memset(residual + start, 0, valid * sizeof(float))
        else:
            memcpy(out_values + i * block, grad + start, valid * sizeof(float))
        if valid < block:
            memset(out_values + i * block + valid, 0, (block - valid) * sizeof(float))


cdef Py_ssize_t sparsify_one(const float* grad_ptr, float* residual_ptr, float* scores_ptr, int32_t* candidates_ptr,
                             float* candidate_scores_ptr, Py_ssize_t numel, float threshold32, float band32,
                             Py_ssize_t k, int32_t* out_indices, float* out_values, Py_ssize_t block,
                             int num_threads, Py_ssize_t* above_out, Py_ssize_t* candidates_out, float* cutoff_out,
                             Py_ssize_t* nonfinite_out) noexcept nogil:
    """sparsify_blocks on raw pointers (numel > 0): the stats go to the *_out pointers; returns how
    many blocks it selected (k, or 0 when it selects nothing: non-finite scores or k == 0)."""
    cdef Py_ssize_t nblocks = (numel + block - 1) // block
    cdef Py_ssize_t above_counts[MAX_CHUNKS]
    cdef Py_ssize_t candidate_counts[MAX_CHUNKS]
    cdef Py_ssize_t nonfinite_counts[MAX_CHUNKS]
    cdef Py_ssize_t nchunks, chunk_blocks, chunk, first, last, gather_chunks
    cdef Py_ssize_t above = 0, ncandidates = 0, nonfinite = 0, take_equal = 0, written = 0
    cdef const int32_t* pool_ids = NULL
    cdef const float* pool_scores = NULL
    cdef Py_ssize_t pool_size = 0
    cdef uint32_t cutoff_bits = 0
    num_threads = threads_for(numel, num_threads)
    nchunks = 1 if num_threads == 1 else num_threads * CHUNKS_PER_THREAD
    if nchunks > MAX_CHUNKS:
        nchunks = MAX_CHUNKS
    if nchunks > nblocks:
        nchunks = nblocks
    chunk_blocks = ((nblocks + nchunks - 1) // nchunks + 7) // 8 * 8  # eight-block groups keep their alignment
    nchunks = (nblocks + chunk_blocks - 1) // chunk_blocks
    for chunk in prange(nchunks, schedule="dynamic", num_threads=num_threads):
        first = chunk * chunk_blocks
        last = first + chunk_blocks
        if last > nblocks:
            last = nblocks
        score_chunk(grad_ptr, residual_ptr, scores_ptr, candidates_ptr, candidate_scores_ptr, first, last,
                    numel, block, threshold32, band32, &above_counts[chunk], &candidate_counts[chunk],
                    &nonfinite_counts[chunk])
    for chunk in range(nchunks):
        above += above_counts[chunk]
        nonfinite += nonfinite_counts[chunk]
        if candidate_counts[chunk] > 0 and chunk * chunk_blocks != ncandidates:
            memmove(candidates_ptr + ncandidates, candidates_ptr + chunk * chunk_blocks,
                    candidate_counts[chunk] * sizeof(int32_t))
            memmove(candidate_scores_ptr + ncandidates, candidate_scores_ptr + chunk * chunk_blocks,
                    candidate_counts[chunk] * sizeof(float))
        ncandidates += candidate_counts[chunk]
    above_out[0] = above
    candidates_out[0] = ncandidates
    nonfinite_out[0] = nonfinite
    cutoff_out[0] = 0.0
    if nonfinite > 0 or k == 0:
        return 0
    if ncandidates >= k:
        pool_ids, pool_scores, pool_size = candidates_ptr, candidate_scores_ptr, ncandidates
    else:  # the threshold was too high: select among all blocks
        pool_ids, pool_scores, pool_size = NULL, scores_ptr, nblocks
    cutoff_bits = histogram_select(pool_scores, pool_size, k, &take_equal)
    written = emit_selected(pool_scores, pool_ids, pool_size, cutoff_bits, take_equal, k, out_indices)
    num_threads = threads_for(k * block * RANDOM_ACCESS_COST, num_threads)
    gather_chunks = num_threads * CHUNKS_PER_THREAD
    if num_threads == 1:
        gather_range(grad_ptr, residual_ptr, out_indices, out_values, 0, k, k, numel, block)
    else:
        for chunk in prange(gather_chunks, schedule="dynamic", num_threads=num_threads):
            gather_range(grad_ptr, residual_ptr, out_indices, out_values,
                         chunk_bound(chunk, gather_chunks, k), chunk_bound(chunk + 1, gather_chunks, k),
                         k, numel, block)
    cutoff_out[0] = bits_float(cutoff_bits)
    return written


def sparsify_blocks(const float[::1] grad, float[::1] residual, float[::1] scores,
                    int32_t[::1] candidates, float[::1] candidate_scores, double threshold, double band, Py_ssize_t k,
                    int32_t[::1] out_indices, float[::1] out_values, Py_ssize_t block,
                    int num_threads):
    """Score, select the exact top-k blocks and update the residual; see reference.sparsify_blocks."""
    cdef Py_ssize_t numel = grad.shape[0]
    cdef Py_ssize_t above = 0, ncandidates = 0, nonfinite = 0, written = 0
    cdef float cutoff = 0.0
    cdef float* residual_ptr = NULL
    if numel == 0:
        return 0, 0, 0.0, 0
    if residual is not None:
        residual_ptr = &residual[0]
    with nogil:
        written = sparsify_one(&grad[0], residual_ptr, &scores[0], &candidates[0], &candidate_scores[0], numel,
                               <float>threshold, <float>band, k, &out_indices[0] if k > 0 else NULL,
                               &out_values[0] if k > 0 else NULL, block, num_threads, &above, &ncandidates,
                               &cutoff, &nonfinite)
    if nonfinite > 0 or k == 0:
        return above, ncandidates, 0.0, nonfinite
    if written != k:
        raise AssertionError(f"selected {written} blocks instead of {k}")
    return above, ncandidates, cutoff, 0


def sparsify_segments(const float[::1] grad, float[::1] residual, float[::1] scores,
                      int32_t[::1] candidates, float[::1] candidate_scores, const int64_t[::1] offsets,
                      const double[::1] thresholds, const double[::1] bands, const int64_t[::1] ks,
                      int32_t[::1] out_indices, float[::1] out_values, Py_ssize_t block, int num_threads,
                      int64_t[::1] above, int64_t[::1] ncandidates, float[::1] cutoffs, int64_t[::1] nonfinite):
    """sparsify_blocks on each segment of a flat buffer, in one call; see reference.sparsify_segments."""
    cdef Py_ssize_t segments = ks.shape[0], s, numel, first_block = 0, first_kept = 0, written
    cdef Py_ssize_t seg_above, seg_candidates, seg_nonfinite, bad = -1
    cdef float seg_cutoff
    cdef float* residual_ptr = NULL
    if segments == 0 or offsets[segments] == 0:
        return
    with nogil:
        for s in range(segments):
            numel = offsets[s + 1] - offsets[s]
            above[s] = 0
            ncandidates[s] = 0
            cutoffs[s] = 0.0
            nonfinite[s] = 0
            if numel <= 0:
                continue
            if residual is not None:
                residual_ptr = &residual[0] + offsets[s]
            written = sparsify_one(&grad[0] + offsets[s], residual_ptr, &scores[0] + first_block,
                                   &candidates[0] + first_block, &candidate_scores[0] + first_block, numel,
                                   <float>thresholds[s], <float>bands[s], ks[s], &out_indices[0] + first_kept,
                                   &out_values[0] + first_kept * block, block, num_threads, &seg_above,
                                   &seg_candidates, &seg_cutoff, &seg_nonfinite)
            above[s] = seg_above
            ncandidates[s] = seg_candidates
            cutoffs[s] = seg_cutoff
            nonfinite[s] = seg_nonfinite
            if seg_nonfinite == 0 and written != ks[s] and bad < 0:
                bad = s
            first_block += (numel + block - 1) // block
            first_kept += ks[s]
    if bad >= 0:
        raise AssertionError(f"segment {bad}: selected fewer blocks than its k = {ks[bad]}")


cdef void scatter_range(float* dense, const int32_t* indices, const float* values, Py_ssize_t first,
                        Py_ssize_t last, Py_ssize_t count, Py_ssize_t numel, Py_ssize_t block) noexcept nogil:
    """dense[block b] += values[i] for i in [first, last), b = indices[i]."""
    cdef Py_ssize_t i, j, start, valid
    for i in range(first, last):
        if i + PREFETCH_AHEAD < count:
            prefetch(dense + (<Py_ssize_t>indices[i + PREFETCH_AHEAD]) * block)
        start = (<Py_ssize_t>indices[i]) * block
        valid = numel - start
        if valid > block:
            valid = block
        for j in range(valid):
            dense[start + j] += values[i * block + j]


def scatter_add_blocks(float[::1] dense, const int32_t[::1] indices, const float[::1] values,
                       Py_ssize_t block, int num_threads):
    """dense[b*block : b*block+block] += values[i] for each block id b = indices[i] (ids unique)."""
    cdef Py_ssize_t numel = dense.shape[0], count = indices.shape[0], chunk, nchunks
    cdef float* dense_ptr
    cdef const int32_t* indices_ptr
    cdef const float* values_ptr
    if count == 0:
        return
    dense_ptr = &dense[0]
    indices_ptr = &indices[0]
    values_ptr = &values[0]
    num_threads = threads_for(count * block * RANDOM_ACCESS_COST, num_threads)
    nchunks = num_threads * CHUNKS_PER_THREAD
    with nogil:
        if num_threads == 1:
            scatter_range(dense_ptr, indices_ptr, values_ptr, 0, count, count, numel, block)
        else:
            for chunk in prange(nchunks, schedule="dynamic", num_threads=num_threads):
                scatter_range(dense_ptr, indices_ptr, values_ptr, chunk_bound(chunk, nchunks, count),
                              chunk_bound(chunk + 1, nchunks, count), count, numel, block)


def first_invalid_block_index(const int32_t[::1] indices, Py_ssize_t nblocks):
    """Position of the first id that is out of [0, nblocks) or not above its predecessor; -1 if none."""
    cdef Py_ssize_t count = indices.shape[0], i
    cdef Py_ssize_t previous = -1, current
    with nogil:
        for i in range(count):
            current = indices[i]
            if current <= previous or current >= nblocks:
                break
            previous = current
        else:
            i = -1
    return i if count > 0 else -1


cdef inline void sgd_block(float* param, float* buffer, const float* values, Py_ssize_t valid,
                           float lr, float decay, float momentum, float keep, bint fresh,
                           bint nesterov) noexcept nogil:
    """torch.optim.SGD's update of ``valid`` elements (buffer NULL: no momentum).

    The conditions are loop-invariant, so the compiler unswitches them out of the loop.
    """
    cdef Py_ssize_t j
    cdef float grad, buf
    for j in range(valid):
        grad = values[j]
        if decay != 0.0:
            grad = grad + decay * param[j]
        if buffer != NULL:
            if fresh:
                buf = grad
            else:
                buf = momentum * buffer[j] + keep * grad
            buffer[j] = buf
            if nesterov:
                grad = grad + momentum * buf
            else:
                grad = buf
        param[j] = param[j] - lr * grad


cdef inline void sgd_block16(float* param, float* buffer, const float* values, float lr, float decay,
                             float momentum, float keep, bint fresh, bint nesterov) noexcept nogil:
    """sgd_block for one full 16-float block, on local copies so the fixed-length loops vectorize.

    Same operations in the same order as sgd_block, so the results are identical.
    """
    cdef float grad[16]
    cdef float weight[16]
    cdef float buf[16]
    cdef Py_ssize_t j
    for j in range(16):
        weight[j] = param[j]
        grad[j] = values[j]
    if decay != 0.0:
        for j in range(16):
            grad[j] = grad[j] + decay * weight[j]
    if buffer != NULL:
        if fresh:
            for j in range(16):
                buf[j] = grad[j]
        else:
            for j in range(16):
                buf[j] = momentum * buffer[j] + keep * grad[j]
        for j in range(16):
            buffer[j] = buf[j]
        if nesterov:
            for j in range(16):
                grad[j] = grad[j] + momentum * buf[j]
        else:
            for j in range(16):
                grad[j] = buf[j]
    for j in range(16):
        param[j] = weight[j] - lr * grad[j]


cdef Py_ssize_t sgd_range(float* param, float* buffer, uint8_t* initialized, const int32_t* indices,
                          const float* values, Py_ssize_t first, Py_ssize_t last, Py_ssize_t count,
                          Py_ssize_t numel, Py_ssize_t block, float lr, float decay, float momentum,
                          float keep, bint nesterov) noexcept nogil:
    """SGD on blocks indices[first:last]; returns how many of them started their momentum now.

    Everything arrives by value, so the compiler keeps it in registers (shared variables of an
    OpenMP region would be reloaded after every store).
    """
    cdef Py_ssize_t i, b, start, valid, ahead, started = 0
    cdef bint fresh
    for i in range(first, last):
        if i + PREFETCH_AHEAD < count:
            ahead = indices[i + PREFETCH_AHEAD]
            prefetch(param + ahead * block)
            if buffer != NULL:
                prefetch(buffer + ahead * block)
            if initialized != NULL:
                prefetch(initialized + ahead)
        b = indices[i]
        start = b * block
        valid = numel - start
        if valid > block:
            valid = block
        fresh = initialized != NULL and initialized[b] == 0
        if valid == 16 and block == 16:
            sgd_block16(param + start, buffer + start if buffer != NULL else NULL, values + i * block,
                        lr, decay, momentum, keep, fresh, nesterov)
        else:
            sgd_block(param + start, buffer + start if buffer != NULL else NULL, values + i * block, valid,
                      lr, decay, momentum, keep, fresh, nesterov)
        if fresh:
            initialized[b] = 1
            started += 1
    return started


def sgd_step_blocks(float[::1] param, float[::1] momentum_buffer, uint8_t[::1] initialized,
                    const int32_t[::1] indices, const float[::1] values, Py_ssize_t block,
                    double lr, double weight_decay, double momentum, double dampening, bint nesterov,
                    int num_threads):
    """torch.optim.SGD's update on the listed blocks only; see reference.sgd_step_blocks."""
    cdef Py_ssize_t numel = param.shape[0], count = indices.shape[0], chunk, nchunks, started = 0
    cdef float lr32 = <float>lr, decay32 = <float>weight_decay, momentum32 = <float>momentum
    cdef float keep32 = <float>(1.0 - dampening)
    cdef float* param_ptr
    cdef float* buffer_ptr = NULL
    cdef uint8_t* initialized_ptr = NULL
    cdef const int32_t* indices_ptr
    cdef const float* values_ptr
    if count == 0:
        return 0
    param_ptr = &param[0]
    values_ptr = &values[0]
    indices_ptr = &indices[0]
    if momentum != 0.0:
        buffer_ptr = &momentum_buffer[0]
        if initialized is not None:
            initialized_ptr = &initialized[0]
    num_threads = threads_for(count * block * RANDOM_ACCESS_COST, num_threads)
    nchunks = num_threads * CHUNKS_PER_THREAD
    with nogil:
        if num_threads == 1:
            started = sgd_range(param_ptr, buffer_ptr, initialized_ptr, indices_ptr, values_ptr, 0, count, count,
                                numel, block, lr32, decay32, momentum32, keep32, nesterov)
        else:
            for chunk in prange(nchunks, schedule="dynamic", num_threads=num_threads):
                started += sgd_range(param_ptr, buffer_ptr, initialized_ptr, indices_ptr, values_ptr,
                                     chunk_bound(chunk, nchunks, count), chunk_bound(chunk + 1, nchunks, count),
                                     count, numel, block, lr32, decay32, momentum32, keep32, nesterov)
    return started
