"""SGD that updates only the blocks a sparse gradient names (StellaTrain's CPU sparse optimizer, §3.1)."""
from collections.abc import Mapping

import numpy as np
import torch
from torch.optim.sgd import sgd as functional_sgd

from wanlink import kernels
from wanlink.errors import ConfigError, UnsupportedError
from wanlink.kernels.arrays import block_count, block_values_view, check_block_size, flat_view


class SparseSGD(torch.optim.Optimizer):
    """torch.optim.SGD (lr, momentum, dampening, weight_decay, nesterov) with a lazy block-sparse step.

    ``step(sparse_grads)`` takes ``{param: (block_ids, values)}`` as ``BlockSparsifier.compress``
    returns them, over the parameter's flattened storage. A listed block's parameter and momentum
    change exactly as torch.optim.SGD would change them; every other block keeps both unchanged
    that step (like torch.optim.SparseAdam). A block's momentum starts from its first gradient, as
    SGD's buffer does. ``step()`` with no sparse_grads is a dense SGD step on ``p.grad``.
    """

    def __init__(self, params, lr: float = 1e-3, momentum: float = 0.0, dampening: float = 0.0,
                 weight_decay: float = 0.0, nesterov: bool = False, *, block: int = 16):
        for name, value in (("lr", lr), ("momentum", momentum), ("weight_decay", weight_decay)):
            if not isinstance(value, (int, float)) or not value >= 0.0:
                raise ConfigError(f"invalid {name}: {value!r} (must be a number >= 0)")
        if not isinstance(dampening, (int, float)) or dampening != dampening:
            raise ConfigError(f"invalid dampening: {dampening!r}")
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ConfigError("nesterov momentum requires a momentum > 0 and zero dampening")
        defaults = dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                        nesterov=nesterov, block=check_block_size(block))
        super().__init__(params, defaults)

    def step(self, sparse_grads: Mapping | None = None, closure=None):
        """Update from ``sparse_grads`` (lazily, listed blocks only) or, when None, densely from p.grad."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if sparse_grads is None:
            self._dense_step()
        else:  # works on NumPy views of the tensors: autograd never sees it, so no torch.no_grad() to pay for
            self._sparse_step(sparse_grads)
        return loss

    @staticmethod
    def _param_array(param: torch.Tensor) -> np.ndarray:
        if param.dtype is not torch.float32:
            raise UnsupportedError(f"SparseSGD updates float32 parameters, got {param.dtype}")
        return flat_view(param, np.float32, "parameter")

    def _momentum_state(self, param: torch.Tensor, group: dict) -> tuple[np.ndarray, np.ndarray | None]:
        """The flat momentum buffer and the per-block 'started' flags (None: every block counts as started).

        A block's first momentum is its gradient (torch's first step). With dampening 0 that equals
        momentum x 0 + gradient, so a zero buffer needs no flags; with dampening the flags are kept
        until every block has started. (Switching dampening from 0 to non-zero mid-training treats
        every block as started.)
        """
        state = self.state[param]
        buffer = state.get("momentum_buffer")
        if buffer is None:
            buffer = state["momentum_buffer"] = torch.zeros_like(param, memory_format=torch.contiguous_format)
            if group["dampening"] != 0:
                state["initialized_blocks"] = torch.zeros(block_count(param.numel(), group["block"]),
                                                          dtype=torch.uint8)
                state["blocks_started"] = 0
        flags = state.get("initialized_blocks")
        if flags is None:
            return flat_view(buffer, np.float32, "momentum buffer"), None
        nblocks = block_count(param.numel(), group["block"])
        if flags.dtype != torch.uint8 or flags.numel() != nblocks:
            if flags.numel() != nblocks:  # a block size change: restart the bookkeeping as all started
                flags = None
            else:  # Optimizer.load_state_dict casts state tensors to the parameter's dtype
                flags = (flags != 0).to(torch.uint8)
                state["blocks_started"] = int(flags.sum())
            state["initialized_blocks"] = flags
            if flags is None:
                state.pop("initialized_blocks")
        return flat_view(buffer, np.float32, "momentum buffer"), (None if flags is None else flags.numpy())

    def _record_started(self, param: torch.Tensor, group: dict, started: int) -> None:
        state = self.state[param]
        if "initialized_blocks" not in state:
            return
        state["blocks_started"] = state.get("blocks_started", 0) + started
        if state["blocks_started"] >= block_count(param.numel(), group["block"]):
            del state["initialized_blocks"], state["blocks_started"]

    def _sparse_step(self, sparse_grads: Mapping) -> None:
        """Validate every entry first, so a bad one leaves all parameters untouched; then apply."""
        if not isinstance(sparse_grads, Mapping):
            raise ConfigError("sparse_grads must map parameters to (block_ids, values), "
                              f"not {type(sparse_grads).__name__}")
        implementation, threads = kernels.active(), kernels.num_threads()
        group_of = {param: group for group in self.param_groups for param in group["params"]}
        updates = []
        for param, pair in sparse_grads.items():
            group = group_of.get(param)
            if group is None:
                raise ConfigError("sparse_grads names a tensor that is not a parameter of this optimizer")
            try:
                indices, values = pair
            except (TypeError, ValueError):
                raise ConfigError("each sparse_grads value must be a (block_ids, values) pair") from None
            block = group["block"]
            weights = self._param_array(param)
            nblocks = block_count(weights.shape[0], block)
            ids = flat_view(indices, np.int32, "block ids")
            flat_values = block_values_view(values, ids.shape[0], block)
            bad = implementation.first_invalid_block_index(ids, nblocks)
            if bad >= 0:
                raise ConfigError(f"block ids[{bad}] = {int(ids[bad])} is out of [0, {nblocks}) or not increasing")
            updates.append((group, param, weights, ids, flat_values))
        for group, param, weights, ids, flat_values in updates:
            self._apply_blocks(implementation, threads, group, param, weights, ids, flat_values)

    def _apply_blocks(self, implementation, threads, group, param, weights, ids, flat_values) -> None:
        momentum = group["momentum"]
        buffer, flags = self._momentum_state(param, group) if momentum != 0 else (None, None)
        started = implementation.sgd_step_blocks(weights, buffer, flags, ids, flat_values, group["block"], group["lr"],
                                                 group["weight_decay"], momentum, group["dampening"],
                                                 group["nesterov"], threads)
        if started:
            self._record_started(param, group, started)

    @torch.no_grad()
    def _dense_step(self) -> None:
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is None:
                    continue
                if param.grad.is_sparse:
                    raise UnsupportedError("SparseSGD's dense step takes dense gradients; pass sparse_grads instead")
                state = self.state[param]
                partly_started = group["momentum"] != 0 and state.get("initialized_blocks") is not None
                if partly_started:
                    # Blocks never stepped must start their momentum from this gradient: do all blocks by block.
                    self._dense_by_blocks(group, param)
                    continue
                buffers = [state.get("momentum_buffer")]
                functional_sgd([param], [param.grad], buffers, foreach=False, weight_decay=group["weight_decay"],
                               momentum=group["momentum"], lr=group["lr"], dampening=group["dampening"],
                               nesterov=group["nesterov"], maximize=False)
                if group["momentum"] != 0:
                    state["momentum_buffer"] = buffers[0]  # every block has started: no flags

    def _dense_by_blocks(self, group, param) -> None:
        block = group["block"]
        weights = self._param_array(param)
        nblocks = block_count(weights.shape[0], block)
        padded = np.zeros(nblocks * block, dtype=np.float32)
        padded[: weights.shape[0]] = flat_view(param.grad.to(torch.float32).contiguous(), np.float32, "gradient")
        ids = np.arange(nblocks, dtype=np.int32)
        self._apply_blocks(kernels.active(), kernels.num_threads(), group, param, weights, ids, padded)
