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


class BlockSparsifier:
    """Keeps exactly k = ceil(density x blocks) blocks of ``block`` floats per call, with error feedback.

    ``compress(grad)`` scores each block on acc = residual + grad (sum |acc|), keeps the k best blocks
    and returns ``(indices, values)``: sorted int32 block ids and their float32 acc values, shape
    (k, block). The residual becomes acc with the kept blocks zeroed. A threshold per tensor, tuned
    by AIMD, keeps the candidate list near k so selection costs O(k), not O(blocks). Both returned
    tensors are views of buffers reused by the next call: copy them if you keep them longer.
    """

    def __init__(self, numel: int, density: float, block: int = 16, *, error_feedback: bool = True,
                 increase_fraction: float = 0.01, decrease_factor: float = 0.95):
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
        self.residual = torch.zeros(self.numel, dtype=torch.float32) if self.error_feedback else None
        self._residual_array = self.residual.numpy() if self.error_feedback else None
        self._scores = aligned_empty(self.nblocks, np.float32)
        self._candidates = np.empty(self.nblocks, dtype=np.int32)
        self._candidate_scores = np.empty(self.nblocks, dtype=np.float32)
        self._indices = torch.empty(self.k, dtype=torch.int32)
        self._values = torch.empty((self.k, self.block), dtype=torch.float32)
        self._indices_array = self._indices.numpy()
        self._values_array = self._values.numpy().reshape(-1)
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
        band = self.threshold * self.decrease_factor
        above, candidates, cutoff, nonfinite = kernels.active().sparsify_blocks(
            grad_array, self._residual_array, self._scores, self._candidates, self._candidate_scores,
            self.threshold, band, self.k,
            self._indices_array, self._values_array, self.block, kernels.num_threads())
        self.last_above, self.last_candidates = above, candidates
        if nonfinite:
            if self.residual is not None:
                self.residual.zero_()
            raise NonFiniteGradientError(
                f"{nonfinite} of {self.nblocks} blocks hold NaN/Inf (or overflow float32) in the gradient "
                "plus residual; the residual was reset to zero")
        self.last_cutoff = cutoff
        self._tune_threshold(above, cutoff)
        return self._indices, self._values

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
