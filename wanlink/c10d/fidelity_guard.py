"""Warns, once, when low-density block-sparse training meets a model that is still learning (docs/sparse.md).

Error feedback holds each block of the gradient back for about ``1 / density`` steps. A model that
settles (its gradient falls to a few percent of its early size: the digits shapes of
``bench/fidelity.py``, which fit their training set) gets the held-back part before the end, and
ends where dense training does. A model whose gradient stays large (the stdlib language model: far
from fitting its data, its loss falling for thousands of steps) pays the delay all the way: at
1 % it needed about 1.8x dense's steps, and every 1 % cell of it missed the fidelity target.

The per-bucket statistics of the sparsifier (the share of ``|residual + gradient|^2`` the kept
blocks carry, the steps of update waiting in the residual, how much of a step's gradient its top
1 % blocks hold) were measured on the three shapes and do not tell them apart; the trend of the
gradient's size does, if narrowly (docs/sparse.md, at step 550 of the matrix runs: 1-21 % of its
largest on the digits cells with the hook's momentum, up to 56 % with SparseSGD's own, 25-92 % on
the LM's; the digits cells above 20 % are false alarms). So the guard watches that, on this
rank's own gradient as the hook sees it: a strided sample of each bucket (``sample_stride``),
summed per step, averaged over ``window``-step windows. Once ``max(min_steps, block_waits /
density)`` sparse steps have run, it compares the latest window with the largest so far; a ratio
of at least ``threshold`` (the gradient norm still that share of its peak) gives one
``SparseFidelityWarning`` saying what to use instead. Only below ``applies_below`` (10 %,
``density="auto"``'s default ceiling, where the LM was within the target). It judges once and
then costs nothing.

Pure (no torch, no clock): ``FidelityGuard.add`` and ``end_step`` are fed by ``block_sparse_hook``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from wanlink.errors import ConfigError

SAMPLE_STRIDE = 7  # every 7th element of a bucket (at least): the trend of the norm, at a seventh of a norm's cost
SAMPLE_ELEMENTS = 16384  # ... and about this many at most per bucket: ~0.1 ms for a 25 MB DDP bucket


def sample_stride(numel: int) -> int:
    """The stride of the guard's sample of a bucket of ``numel`` elements."""
    return max(SAMPLE_STRIDE, numel // SAMPLE_ELEMENTS)


@dataclass(frozen=True)
class Verdict:
    """What the guard found once it judged: at which sparse step, the ratio, and whether it warned."""

    sparse_steps: int
    density: float
    ratio: float  # latest window's gradient norm / the largest window's
    warned: bool
    message: str | None


class FidelityGuard:
    """One rank's judgement of whether its model is still learning after many sparse steps (module docs)."""

    def __init__(self, *, window: int = 50, min_steps: int = 500, block_waits: float = 5.0,
                 threshold: float = 0.2, applies_below: float = 0.1):
        if not isinstance(window, int) or window < 1:
            raise ConfigError(f"window must be an int >= 1, got {window!r}")
        if not isinstance(min_steps, int) or min_steps < 0:
            raise ConfigError(f"min_steps must be an int >= 0, got {min_steps!r}")
        if not 0.0 < threshold <= 1.0:
            raise ConfigError(f"threshold must be in (0, 1], got {threshold!r}")
        if not (isinstance(block_waits, (int, float)) and 0.0 <= block_waits < math.inf):
            raise ConfigError(f"block_waits must be a finite number >= 0, got {block_waits!r}")
        if not 0.0 < applies_below <= 1.0:
            raise ConfigError(f"applies_below must be a density in (0, 1], got {applies_below!r}")
        self.window, self.min_steps, self.block_waits = window, min_steps, float(block_waits)
        self.threshold, self.applies_below = float(threshold), float(applies_below)
        self.verdict: Verdict | None = None
        self._step: int | None = None
        self._energy = 0.0  # of the step being summed
        self._window_sum, self._window_steps = 0.0, 0
        self._largest = 0.0  # largest window mean so far
        self._latest = None  # latest complete window's mean

    @property
    def done(self) -> bool:
        return self.verdict is not None

    def judge_after(self, density: float) -> int:
        """Sparse steps before judging at ``density``: ``block_waits`` times a block's mean wait, at least min_steps."""
        return max(self.min_steps, math.ceil(self.block_waits / density))

    def add(self, step: int, energy: float) -> None:
        """Part of step ``step``'s squared gradient norm (one bucket's sample)."""
        if self._step is not None and step != self._step:
            self._close_step()
        self._step = step
        self._energy += energy

    def end_step(self, density: float, sparse_steps: int) -> Verdict | None:
        """Called at a step's last bucket; returns the verdict at the step it is reached (else None)."""
        if self.done:
            return None
        self._close_step()
        if (self._latest is None or density >= self.applies_below or sparse_steps < self.judge_after(density)
                or self._window_steps):  # judge on a window that has just closed
            return None
        ratio = math.sqrt(self._latest / self._largest) if self._largest > 0 else 0.0
        warned = ratio >= self.threshold
        self.verdict = Verdict(sparse_steps, density, ratio, warned,
                               _message(density, sparse_steps, ratio, self.window) if warned else None)
        return self.verdict

    def _close_step(self) -> None:
        if self._step is None:
            return
        self._window_sum += self._energy
        self._window_steps += 1
        self._energy, self._step = 0.0, None
        if self._window_steps == self.window:
            self._latest = self._window_sum / self.window
            self._largest = max(self._largest, self._latest)
            self._window_sum, self._window_steps = 0.0, 0


def _message(density: float, sparse_steps: int, ratio: float, window: int) -> str:
    return (f"block-sparse training at density {density:g}: after {sparse_steps} sparse steps this rank's gradient "
            f"norm is still {ratio:.0%} of its largest ({window}-step means), so the model is still learning. "
            f"Error feedback holds each block back ~{1 / density:.0f} steps; a model that keeps learning to the end "
            f"pays that all the way (the stdlib LM of docs/sparse.md needed ~1.8x dense's steps at 1 %, where "
            f"models that settle lose nothing). Use a higher density: density='auto' takes up to max_density=0.1 "
            f"as the link allows (at 10 % that LM, with AdamW and momentum=beta1 in the hook at staleness 0, was "
            f"within 2 % of dense), or plan ~1.8x the steps. BlockSparseState(fidelity_guard=False) turns this "
            f"check off")
