"""Cache-aware block sparsification with error feedback and an AIMD-tuned threshold (StellaTrain §3.2)."""
import math

import numpy as np
import torch

from wanlink import kernels
from wanlink.errors import ConfigError, NonFiniteGradientError, UnsupportedError
from wanlink.kernels.arrays import aligned_empty, block_count, check_block_size, flat_view

_CONVERTIBLE = (torch.float16, torch.bfloat16)


CATCH_UP = 0.5  # an additive increase covers at least half the gap to this call's k-th score


def target_blocks(density: float, nblocks: int) -> int:
    """k = ceil(density x nblocks), 0 when density is 0; products within 1e-9 of an integer round to it."""
    product = density * nblocks
    nearest = round(product)
    k = nearest if abs(product - nearest) <= 1e-9 * max(1.0, product) else math.ceil(product)
    return min(nblocks, int(k))


class _Scratch:
    """A kernel call's working space: block scores, candidates, and the kept ids and values."""

    def __init__(self, nblocks: int, k: int, block: int):
        self.scores = aligned_empty(nblocks, np.float32)
        self.candidates = np.empty(nblocks, dtype=np.int32)
        self.candidate_scores = np.empty(nblocks, dtype=np.float32)
        self.indices = torch.empty(k, dtype=torch.int32)
        self.values = torch.empty((k, block), dtype=torch.float32)
        self.indices_array = self.indices.numpy()
        self.values_array = self.values.numpy().reshape(-1)


class BlockSparsifier:
    """Keeps exactly k = ceil(density x blocks) blocks of ``block`` floats per call, with error feedback.

    ``compress(grad)`` scores each block on acc = residual + grad (sum |acc|), keeps the k best blocks
    and returns ``(indices, values)``: sorted int32 block ids and their float32 acc values, shape
    (k, block). The residual becomes acc with the kept blocks zeroed. A threshold per tensor, tuned
    by AIMD, keeps the candidate list near k so selection costs O(k), not O(blocks). Both returned
    tensors are views of buffers reused by the next call: copy them if you keep them longer.
    """

    def __init__(self, numel: int, density: float, block: int = 16, *, error_feedback: bool = True,
                 increase_fraction: float = 0.01, decrease_factor: float = 0.95,
                 residual: torch.Tensor | None = None):
        """``residual``: where to keep the residual (a float32 tensor of ``numel`` elements, zeroed
        here), e.g. a view of a bucket's flat residual (BucketSparsifier); None allocates one."""
        if isinstance(numel, bool) or not isinstance(numel, (int, np.integer)) or numel < 1:
            raise ConfigError(f"numel must be a positive int, got {numel!r}")
        self.block = check_block_size(block)
        if not isinstance(density, (int, float)) or not 0.0 <= density <= 1.0:
            raise ConfigError(f"density must be a number in [0, 1], got {density!r}")
        if not 0.0 < increase_fraction <= 1.0:
            raise ConfigError(f"increase_fraction must be in (0, 1], got {increase_fraction!r}")
        if not 0.0 < decrease_factor < 1.0:
            raise ConfigError(f"decrease_factor must be in (0, 1), got {decrease_factor!r}")
        self.numel = int(numel)
        self.nblocks = block_count(self.numel, self.block)
        if self.nblocks > np.iinfo(np.int32).max:
            raise ConfigError(f"{self.nblocks} blocks do not fit int32 block ids")
        self.density = float(density)
        self.k = target_blocks(self.density, self.nblocks)
        self.error_feedback = bool(error_feedback)
        self.increase_fraction = float(increase_fraction)
        self.decrease_factor = float(decrease_factor)
        self.catch_up = CATCH_UP
        self.threshold = 0.0
        self.last_above = 0
        self.last_candidates = 0
        self.last_cutoff = 0.0
        if residual is not None:
            if (not self.error_feedback or not isinstance(residual, torch.Tensor) or residual.dtype != torch.float32
                    or residual.numel() != self.numel or not residual.is_contiguous()):
                raise ConfigError(f"residual must be a contiguous float32 tensor of {self.numel} elements, "
                                  "with error_feedback=True")
            self.residual = residual.reshape(-1).zero_()
        else:
            self.residual = torch.zeros(self.numel, dtype=torch.float32) if self.error_feedback else None
        self._residual_array = self.residual.numpy() if self.error_feedback else None
        self._scratch = None  # made at the first compress(): a BucketSparsifier's parts never need it
        self._staging = None

    def __repr__(self) -> str:
        return (f"BlockSparsifier(numel={self.numel}, density={self.density}, block={self.block}, "
                f"k={self.k}, error_feedback={self.error_feedback}, threshold={self.threshold:.6g})")

    def _grad_array(self, grad) -> np.ndarray:
        if isinstance(grad, torch.Tensor):
            if grad.numel() != self.numel:
                raise ConfigError(f"gradient has {grad.numel()} elements; this sparsifier expects {self.numel}")
            if grad.dtype in _CONVERTIBLE and grad.device.type == "cpu" and grad.layout == torch.strided:
                if not grad.is_contiguous():
                    raise ConfigError("gradient is not contiguous; pass a contiguous tensor (.contiguous())")
                if self._staging is None:
                    self._staging = torch.empty(self.numel, dtype=torch.float32)
                self._staging.copy_(grad.reshape(-1))
                return self._staging.numpy()
            if grad.dtype != torch.float32:
                raise UnsupportedError(f"gradient dtype {grad.dtype} is not supported; use float32 "
                                       "(float16 and bfloat16 are converted)")
        elif isinstance(grad, np.ndarray) and grad.size != self.numel:
            raise ConfigError(f"gradient has {grad.size} elements; this sparsifier expects {self.numel}")
        return flat_view(grad, np.float32, "gradient")

    def compress(self, grad) -> tuple[torch.Tensor, torch.Tensor]:
        """Select the k best blocks of residual + grad; returns (block ids int32 [k], values float32 [k, block])."""
        grad_array = self._grad_array(grad)
        if self._scratch is None:
            self._scratch = _Scratch(self.nblocks, self.k, self.block)
        scratch = self._scratch
        above, candidates, cutoff, nonfinite = kernels.active().sparsify_blocks(
            grad_array, self._residual_array, scratch.scores, scratch.candidates, scratch.candidate_scores,
            self.threshold, self.threshold * self.decrease_factor, self.k,
            scratch.indices_array, scratch.values_array, self.block, kernels.num_threads())
        self.last_above, self.last_candidates = above, candidates
        if nonfinite:
            if self.residual is not None:
                self.residual.zero_()
            raise NonFiniteGradientError(
                f"{nonfinite} of {self.nblocks} blocks hold NaN/Inf (or overflow float32) in the gradient "
                "plus residual; the residual was reset to zero")
        self.last_cutoff = cutoff
        self._tune_threshold(above, cutoff)
        return scratch.indices, scratch.values

    def _tune_threshold(self, above: int, cutoff: float) -> None:
        """AIMD: raise the threshold additively when too many blocks pass it, cut it when too few.

        The increase is max(increase_fraction x cutoff, CATCH_UP x (cutoff - threshold)), with cutoff
        the k-th best score of this call: a step in score units, so it keeps pace when error
        feedback makes scores grow. The decrease multiplies by decrease_factor.
        """
        if self.k == 0:
            return
        if self.threshold <= 0.0:
            self.threshold = cutoff  # first call (or all-zero history): start at this call's k-th score
        elif above > self.k:
            self.threshold += max(self.increase_fraction * cutoff, self.catch_up * (cutoff - self.threshold))
        elif above < self.k:
            self.threshold *= self.decrease_factor

    def reset(self) -> None:
        """Forget the residual and the tuned threshold."""
        if self.residual is not None:
            self.residual.zero_()
        self.threshold = 0.0

    def state_dict(self) -> dict:
        """Checkpointable state: configuration, threshold and a copy of the residual."""
        return {
            "numel": self.numel, "density": self.density, "block": self.block,
            "error_feedback": self.error_feedback, "threshold": self.threshold,
            "residual": None if self.residual is None else self.residual.clone(),
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore a state_dict() taken from a sparsifier of the same numel, block and error feedback."""
        try:
            numel, block, error_feedback = state["numel"], state["block"], state["error_feedback"]
            threshold, residual = float(state["threshold"]), state["residual"]
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"not a BlockSparsifier state_dict: {exc!r}") from exc
        if (numel, block, bool(error_feedback)) != (self.numel, self.block, self.error_feedback):
            raise ConfigError(f"state_dict is for numel={numel}, block={block}, error_feedback={error_feedback}; "
                              f"this sparsifier has numel={self.numel}, block={self.block}, "
                              f"error_feedback={self.error_feedback}")
        if not math.isfinite(threshold) or threshold < 0.0:
            raise ConfigError(f"state_dict threshold must be finite and >= 0, got {threshold}")
        if self.residual is not None:
            if not isinstance(residual, torch.Tensor) or residual.numel() != self.numel:
                raise ConfigError(f"state_dict residual must be a tensor of {self.numel} elements")
            self.residual.copy_(residual.reshape(-1))
        self.threshold = threshold


class BucketSparsifier:
    """One BlockSparsifier per tensor of a flat buffer (a DDP bucket: tensors back to back), in one kernel call.

    ``compress(flat)`` gives each tensor exactly what its own ``BlockSparsifier.compress`` would: its
    own blocks (a tensor's tail block never takes elements of the next), its k, AIMD threshold and
    error-feedback residual, and the same stats. The residuals are views of one flat buffer
    (``residual``); ``parts`` are the per-tensor sparsifiers (for their state, thresholds and stats).
    """

    def __init__(self, numels: list[int], density: float, block: int = 16):
        if not numels:
            raise ConfigError("a BucketSparsifier needs at least one tensor")
        self.block = check_block_size(block)
        self.offsets = np.concatenate([[0], np.cumsum(numels)]).astype(np.int64)
        self.residual = torch.zeros(int(self.offsets[-1]), dtype=torch.float32)
        self.parts = [BlockSparsifier(int(numel), density, block, residual=self.residual[start:end])
                      for numel, start, end in zip(numels, self.offsets[:-1], self.offsets[1:])]
        self.numels = np.array([part.numel for part in self.parts], dtype=np.int64)
        self.ks = np.array([part.k for part in self.parts], dtype=np.int64)
        self.kept_offsets = np.concatenate([[0], np.cumsum(self.ks)]).astype(np.int64)  # where each part's ids start
        self.k = int(self.kept_offsets[-1])
        nblocks = np.array([part.nblocks for part in self.parts], dtype=np.int64)
        self.block_offsets = np.concatenate([[0], np.cumsum(nblocks)]).astype(np.int64)
        self._decrease = np.array([part.decrease_factor for part in self.parts])
        self._scratch = _Scratch(int(self.block_offsets[-1]), max(self.k, 1), self.block)
        self._stats = [np.empty(len(self.parts), dtype=np.int64) for _ in range(3)]
        self._cutoffs = np.empty(len(self.parts), dtype=np.float32)

    def compress(self, flat) -> tuple[torch.Tensor, torch.Tensor]:
        """Sparsify every tensor of ``flat`` (float32, the tensors back to back): (ids int32 [k], values
        float32 [k, block]), part i's local ids ascending at [kept_offsets[i], kept_offsets[i + 1]).
        Views of buffers the next call reuses."""
        if isinstance(flat, torch.Tensor) and (flat.dtype != torch.float32 or flat.device.type != "cpu"):
            raise UnsupportedError(f"a bucket's gradients must be float32 on the CPU, got {flat.dtype} on "
                                   f"{flat.device}")
        if isinstance(flat, torch.Tensor) and flat.numel() != self.offsets[-1]:
            raise ConfigError(f"the flat buffer has {flat.numel()} elements; the tensors hold {int(self.offsets[-1])}")
        grad = flat_view(flat, np.float32, "gradient")
        thresholds = np.array([part.threshold for part in self.parts])
        scratch, (above, candidates, nonfinite) = self._scratch, self._stats
        kernels.active().sparsify_segments(
            grad, self.residual.numpy(), scratch.scores, scratch.candidates, scratch.candidate_scores, self.offsets,
            thresholds, thresholds * self._decrease, self.ks, scratch.indices_array, scratch.values_array,
            self.block, kernels.num_threads(), above, candidates, self._cutoffs, nonfinite)
        for part, part_above, part_candidates, cutoff, part_nonfinite in zip(
                self.parts, above.tolist(), candidates.tolist(), self._cutoffs.tolist(), nonfinite.tolist()):
            part.last_above, part.last_candidates = part_above, part_candidates
            if not part_nonfinite:
                part.last_cutoff = cutoff
                part._tune_threshold(part_above, cutoff)
        bad = np.flatnonzero(nonfinite)
        if bad.size:
            for i in bad:
                self.parts[i].residual.zero_()
            raise NonFiniteGradientError(
                f"tensors {bad.tolist()} of the bucket (of {len(self.parts)}) hold NaN/Inf (or overflow float32) in "
                f"{int(nonfinite.sum())} blocks of gradient plus residual; their residuals were reset to zero")
        return scratch.indices[:self.k], scratch.values[:self.k]
