"""Every compiled kernel releases the GIL while it runs: another Python thread makes progress meanwhile.

A helper thread counts in a loop, sleeping briefly (GIL released) between counts. The test
thread reads the count, calls a kernel a few times, and reads the count again, with the GIL
switch interval raised so high that the interpreter never takes the GIL from a running thread:
the count can then only change while the test thread has let go of the GIL, that is inside the
kernels' nogil sections. A kernel that kept the GIL would leave the count equal on every attempt,
however loaded the machine; one that releases it lets the helper count as soon as the scheduler
runs it, which the repeated attempts make certain. No time is measured.
"""
import sys
import threading

import numpy as np
import pytest

from wanlink import kernels

NUMEL = 1 << 22  # 16 MB of float32 per array: a few milliseconds per call, long enough for the helper to run
BLOCK = 16
CALLS_PER_ATTEMPT = 3
ATTEMPTS = 50
UNINTERRUPTED = 1000.0  # seconds: a switch interval that never fires during the test


class Counter:
    """A thread that counts while it can get the GIL."""

    def __init__(self):
        self.count = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.wait(0.0001):  # the wait releases the GIL, so the test thread can always take it
            self.count += 1

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def kernel_calls(module, rng):
    """name -> a function making one call of that kernel on inputs of NUMEL floats (one thread)."""
    nblocks = NUMEL // BLOCK
    grad = rng.standard_normal(NUMEL).astype(np.float32)
    residual = np.zeros(NUMEL, dtype=np.float32)
    scores = np.empty(nblocks, dtype=np.float32)
    candidates = np.empty(nblocks, dtype=np.int32)
    candidate_scores = np.empty(nblocks, dtype=np.float32)
    k = nblocks // 4
    out_indices = np.empty(k, dtype=np.int32)
    out_values = np.empty(k * BLOCK, dtype=np.float32)
    every_block = np.arange(nblocks, dtype=np.int32)
    dense = np.zeros(NUMEL, dtype=np.float32)
    momentum = np.zeros(NUMEL, dtype=np.float32)
    halves, thresholds = np.array([0, NUMEL // 2, NUMEL]), np.zeros(2)
    segment_stats = [np.zeros(2, dtype) for dtype in (np.int64, np.int64, np.float32, np.int64)]
    return {
        "sparsify_blocks": lambda: module.sparsify_blocks(
            grad, residual, scores, candidates, candidate_scores, 0.0, 0.0, k, out_indices, out_values, BLOCK, 1),
        "sparsify_segments": lambda: module.sparsify_segments(  # the same buffer as two tensors of half each
            grad, residual, scores, candidates, candidate_scores, halves, thresholds, thresholds,
            np.array([k // 2] * 2), out_indices, out_values, BLOCK, 1, *segment_stats),
        "scatter_add_blocks": lambda: module.scatter_add_blocks(dense, every_block, grad, BLOCK, 1),
        "first_invalid_block_index": lambda: module.first_invalid_block_index(every_block, nblocks),
        "sgd_step_blocks": lambda: module.sgd_step_blocks(
            dense, momentum, None, every_block, grad, BLOCK, 0.01, 0.0, 0.9, 0.0, False, 1),
    }


def count_during_calls(counter: Counter, call) -> int:
    """How far the helper counted across CALLS_PER_ATTEMPT calls, read without giving up the GIL in between."""
    before = counter.count
    for _ in range(CALLS_PER_ATTEMPT):
        call()
    return counter.count - before


@pytest.mark.parametrize("kernel", ["sparsify_blocks", "sparsify_segments", "scatter_add_blocks",
                                    "first_invalid_block_index", "sgd_step_blocks"])
def test_compiled_kernel_releases_the_gil(implementation, rng, kernel):
    if implementation is kernels.reference:
        pytest.skip("the NumPy reference makes no GIL promise (NumPy releases it in some loops, not others)")
    call = kernel_calls(implementation, rng)[kernel]
    call()  # first touch of the arrays (page faults) outside the attempts
    previous_interval = sys.getswitchinterval()
    sys.setswitchinterval(UNINTERRUPTED)
    try:
        with Counter() as counter:
            progressed = any(count_during_calls(counter, call) > 0 for _ in range(ATTEMPTS))
    finally:
        sys.setswitchinterval(previous_interval)
    assert progressed, f"{kernel} kept the GIL: no other thread ran during {ATTEMPTS * CALLS_PER_ATTEMPT} calls"


def test_the_probe_sees_a_kernel_that_keeps_the_gil(rng):
    """The same measurement around a loop that holds the GIL counts nothing (the probe can fail)."""
    values = rng.standard_normal(1 << 16).astype(np.float32)

    def python_loop():
        total = 0.0
        for value in values[:20000]:
            total += float(value)
        return total

    previous_interval = sys.getswitchinterval()
    sys.setswitchinterval(UNINTERRUPTED)
    try:
        with Counter() as counter:
            counter_started = count_during_calls(counter, lambda: None)
            progress = [count_during_calls(counter, python_loop) for _ in range(5)]
    finally:
        sys.setswitchinterval(previous_interval)
    assert counter_started == 0
    assert progress == [0] * 5
