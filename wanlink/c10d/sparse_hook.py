"""DDP comm hook: block-sparse gradients with error feedback, per-layer EDF deadlines, optional staleness.

    state = BlockSparseState(density=0.01, warmup_steps=50, staleness=1)
    model.register_comm_hook(state, block_sparse_hook)

``density="auto"`` (with ``min_density``/``max_density``) lets a controller choose the density per
step from the measured compute time and the links' delivery rate (wanlink/c10d/auto_density.py): the same
on every rank, switched between steps without losing error feedback.

Per bucket, every gradient tensor is sparsified by its own BlockSparsifier (error feedback kept per
bucket, in the state), the bucket's block-COO frames are exchanged among all ranks in one
all-gather over the group's links, and the peers' blocks are scatter-added into the bucket and
averaged. Each exchange runs under an EDF deadline (iteration, -bucket index): DDP's last bucket
holds the model's first layers, which the next forward pass needs first, so they leave first.

With ``staleness=1`` (StellaTrain's partial staleness) the optimizer at step t applies the
aggregated update of step t-1: the hook returns the previous step's result and lets this step's
exchange overlap the next forward and backward. Call ``state.flush()`` before the last optimizer
step and before checkpoints. With ``sparse_optimizer=True`` the hook keeps the aggregated blocks for
``SparseSGD.step(sparse_grads=state.sparse_grads())`` and leaves ``.grad`` as this rank's own,
unaveraged gradient, which that step does not read (clearing 100 MB per step would cost more
than the sparse step itself).

Momentum: an optimizer with momentum behind sparse updates diverges (error feedback delivers a
block's gradients in bursts, which the momentum keeps applying for tens of steps), so it is
refused at its first step. Either ``momentum=`` here (Deep Gradient Compression's momentum
correction: the velocity is sparsified, a sent block's velocity restarts) with a momentum-free
optimizer (torch's, or SparseSGD with ``sparse_optimizer=True``). SparseSGD's own momentum behind
``sparse_optimizer=True`` is allowed but warns with ``staleness=1``: it moves a block only at its
deliveries, so a burst keeps being applied for ~1/(1-momentum) deliveries (docs/sparse.md).
Adam's first moment is momentum too: Adam/AdamW with ``beta1 > 0`` is refused the same way, and
``momentum=beta1`` here with ``betas=(0.0, beta2)`` is what to use.
"""
# no `from __future__ import annotations`: DDP checks the hook's annotations as real objects
import itertools
import time
import warnings
import weakref

import numpy as np
import torch
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_pre_hook

from wanlink.c10d.auto_density import PROPOSAL_BYTES, AutoDensity, LinkDeliveryRate, group_links
from wanlink.c10d.deadlines import deadline_scope
from wanlink.compress import BlockSparsifier, decode_blocks, encode_blocks, encoded_size, scatter_add_
from wanlink.errors import ConfigError, UnsupportedError

BLOCK = 16
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in torch 2.13


class _BucketCodec:
    """One bucket's sparsifiers and the layout of its message: one block-COO frame per gradient."""

    def __init__(self, numels: list[int], density: float, trailer: int = 0):
        self.numels = numels
        self.density = density
        self.trailer = trailer  # bytes after the frames (density="auto": the sender's proposal)
        self.sparsifiers = [BlockSparsifier(n, density, BLOCK) for n in numels]
        sizes = [encoded_size(s.k, BLOCK) for s in self.sparsifiers]
        self.frame_offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        self.message_size = int(self.frame_offsets[-1]) + trailer
        self.element_offsets = np.concatenate([[0], np.cumsum(numels)]).astype(np.int64)
        self._result_buffers: list[_ResultBuffer] = []

    def encode(self, gradients: list[torch.Tensor], mask_sent: bool = False) -> torch.Tensor:
        """One message with each gradient's kept blocks; ``mask_sent`` zeroes those blocks in the
        inputs afterwards (momentum factor masking when the inputs are the hook's velocities)."""
        message = torch.empty(self.message_size, dtype=torch.uint8)
        raw = message.numpy()
        for i, (sparsifier, grad) in enumerate(zip(self.sparsifiers, gradients)):
            indices, values = sparsifier.compress(grad.detach().reshape(-1))
            start, end = self.frame_offsets[i], self.frame_offsets[i + 1]
            encode_blocks(indices.numpy(), values.numpy(), sparsifier.numel, block=BLOCK, out=raw[start:end])
            if mask_sent:
                rows, inside, tail = _blocks_of(grad.numpy(), indices.numpy())
                rows[inside] = 0
                tail[:] = 0
        return message

    def with_density(self, density: float) -> "_BucketCodec":
        """A codec for the same gradients at another density, carrying over each sparsifier's residual
        and threshold (so error feedback loses nothing); this one stays valid for exchanges in flight."""
        codec = _BucketCodec(self.numels, density, self.trailer)
        for new, old in zip(codec.sparsifiers, self.sparsifiers):
            new.load_state_dict(old.state_dict())
        return codec

    def proposal_of(self, gathered: torch.Tensor, rank: int, world: int) -> float:
        """The float64 that ``rank`` put in its trailer."""
        row = gathered.numpy().reshape(world, self.message_size)[rank]
        return float(row[self.message_size - PROPOSAL_BYTES:].view(np.float64)[0])

    def frames(self, gathered: torch.Tensor, world: int):
        """Per gradient, the decoded frames of every rank: [[BlockFrame per rank] per gradient]."""
        raw = gathered.numpy().reshape(world, self.message_size)
        per_gradient = []
        for i, numel in enumerate(self.numels):
            start, end = self.frame_offsets[i], self.frame_offsets[i + 1]
            rank_frames = [decode_blocks(raw[r, start:end]) for r in range(world)]
            for frame in rank_frames:
                if frame.numel != numel or frame.block != BLOCK:
                    raise ConfigError(f"a rank sent a frame for {frame.numel} elements where this bucket has {numel}: "
                                      "ranks disagree on the model or the density")
            per_gradient.append(rank_frames)
        return per_gradient

    def average_into(self, gathered: torch.Tensor, world: int, out: torch.Tensor,
                     nonzero: list[np.ndarray] | None = None) -> list[np.ndarray]:
        """``out`` = every rank's blocks summed and divided by ``world``, zero elsewhere.

        ``nonzero``: the only blocks of ``out`` that may hold values (what the previous call on
        ``out`` returned), cleared block by block; None zeroes all of ``out``. Returns the blocks
        written, per gradient.
        """
        if nonzero is None:
            out.zero_()
        flat = out.numpy()
        written = []
        for i, rank_frames in enumerate(self.frames(gathered, world)):
            segment = flat[self.element_offsets[i]:self.element_offsets[i + 1]]
            if nonzero is not None:
                rows, inside, tail = _blocks_of(segment, nonzero[i])
                rows[inside] = 0
                tail[:] = 0
            scatter_add_(segment, [f.indices for f in rank_frames], [f.values for f in rank_frames], block=BLOCK)
            _order, ids, firsts = _merge([f.indices for f in rank_frames])
            blocks = ids[firsts]
            rows, inside, tail = _blocks_of(segment, blocks)
            rows[inside] /= world
            tail /= world
            written.append(blocks)
        return written

    def next_result(self) -> "_ResultBuffer":
        """Staleness 1: the next of the bucket's two result buffers (step t's is read while t+1's is written)."""
        if not self._result_buffers:
            self._result_buffers = [_ResultBuffer(int(self.element_offsets[-1])) for _ in range(2)]
        self._result_buffers.reverse()
        return self._result_buffers[0]

    def average_sparse(self, gathered: torch.Tensor, world: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per gradient, the union of the ranks' blocks with their values summed and averaged."""
        results = []
        for rank_frames in self.frames(gathered, world):
            order, ids, firsts = _merge([f.indices for f in rank_frames])
            values = np.concatenate([f.values.reshape(-1, BLOCK) for f in rank_frames])
            summed = np.add.reduceat(values[order], firsts, axis=0) if firsts.size else values[:0].copy()
            summed /= world
            results.append((torch.from_numpy(ids[firsts].astype(np.int32)), torch.from_numpy(summed)))
        return results


class _ResultBuffer:
    """A bucket-sized dense result that is zero outside ``nonzero``, so refilling it clears only those blocks."""

    def __init__(self, numel: int):
        self.tensor = torch.zeros(numel, dtype=torch.float32)
        self.nonzero: list[np.ndarray] | None = None

    def fill(self, codec: _BucketCodec, gathered: torch.Tensor, world: int) -> torch.Tensor:
        self.nonzero = codec.average_into(gathered, world, self.tensor, self.nonzero)
        return self.tensor


def _merge(index_lists: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The ranks' sorted block-id lists merged: (the stable order that sorts their concatenation,
    the sorted ids, where each distinct id starts among them). Equal ids keep rank order."""
    ids = np.concatenate(index_lists)
    order = np.argsort(ids, kind="stable")  # sorted runs, one per rank: a merge
    ids = ids[order]
    starts = np.ones(ids.shape[0], dtype=bool)
    starts[1:] = ids[1:] != ids[:-1]
    return order, ids, np.flatnonzero(starts)


def _blocks_of(segment: np.ndarray, blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For sorted block ids of a flat segment: (its whole blocks as rows, the ids among them, the
    partial last block's elements if it is listed, else an empty slice)."""
    whole = segment.shape[0] // BLOCK
    rows = segment[:whole * BLOCK].reshape(whole, BLOCK)
    listed_tail = blocks.shape[0] > 0 and blocks[-1] >= whole
    tail = segment[whole * BLOCK:] if listed_tail else segment[:0]
    return rows, (blocks[:-1] if listed_tail else blocks), tail


class BlockSparseState:
    """Configuration and per-bucket state of ``block_sparse_hook`` (error feedback, staleness)."""

    def __init__(self, process_group=None, *, density: float | str = 0.01, warmup_steps: int = 0, staleness: int = 0,
                 sparse_optimizer: bool = False, momentum: float = 0.0, min_density: float = 0.001,
                 max_density: float = 0.1, bandwidth=None, controller_options: dict | None = None):
        """``density="auto"``: chosen per step within [min_density, max_density] (see
        wanlink/c10d/auto_density.py); ``bandwidth`` (a callable of the time returning bytes/s, or
        None for no sample) replaces the links' measured delivery rate, ``controller_options`` go
        to ``wanlink.sched.density.DensityController``."""
        self.auto = None
        if density == "auto":
            link_rate = None if bandwidth else LinkDeliveryRate(lambda: group_links(self.process_group))
            self.auto = AutoDensity(min_density=min_density, max_density=max_density, staleness=staleness,
                                    bandwidth=bandwidth, link_rate=link_rate, **(controller_options or {}))
            density = self.auto.density
        elif not isinstance(density, (int, float)) or not 0.0 < density <= 1.0:
            raise ConfigError(f"density must be in (0, 1] or 'auto', got {density!r}")
        if isinstance(momentum, bool) or not isinstance(momentum, (int, float)) or not 0.0 <= momentum < 1.0:
            raise ConfigError(f"momentum must be in [0, 1), got {momentum!r}")
        if not isinstance(warmup_steps, int) or warmup_steps < 0:
            raise ConfigError(f"warmup_steps must be an int >= 0, got {warmup_steps!r}")
        if staleness not in (0, 1):
            raise ConfigError(f"staleness must be 0 or 1 (never more than one step stale), got {staleness!r}")
        self.process_group = process_group
        self.density = float(density)
        self.warmup_steps = warmup_steps
        self.staleness = staleness
        self.sparse_optimizer = sparse_optimizer
        self.momentum = float(momentum)
        self.iteration = 0
        self.bytes_sent = 0
        self._codecs: dict[int, _BucketCodec] = {}
        self._sparsifier_of: dict[torch.Tensor, BlockSparsifier] = {}  # parameter -> its sparsifier now
        self._elements: dict[torch.Tensor, int] = {}  # density="auto": parameter -> elements, for the full size
        self._auto_step: int | None = None
        # staleness: per step, where each parameter's aggregate will be: (future of its bucket, offset, numel).
        # Keyed by parameter, not bucket, because DDP rebuilds its buckets after the first step.
        self._results: dict[int, dict[torch.Tensor, tuple]] = {}
        # sparse optimizer: per step, parameter -> (block ids, averaged values), filled as exchanges finish
        self._sparse_steps: dict[int, dict[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]] = {}
        self._step_to_apply: int | None = None
        # momentum correction: each parameter's local velocity, flat (parameter -> tensor)
        self._velocity: dict[torch.Tensor, torch.Tensor] = {}
        self._loaded_velocities: list[torch.Tensor] = []
        self._param_ids: set[int] = set()  # every parameter the hook has seen, for check_optimizer
        self._checked = weakref.WeakSet()  # optimizers found compatible
        # tracing, off unless set to a list: (iteration, bucket index, time.perf_counter()) as each exchange completes
        self.exchange_log: list | None = None
        _watch(self)

    # -- used by the hook ------------------------------------------------------------------------
    def codec_for(self, index: int, gradients: list[torch.Tensor], params: list) -> _BucketCodec:
        numels = [g.numel() for g in gradients]
        codec = self._codecs.get(index)
        if codec is None or codec.numels != numels:  # first use, or DDP rebuilt its buckets
            codec = _BucketCodec(numels, self.density, PROPOSAL_BYTES if self.auto else 0)
            for param, sparsifier in zip(params, codec.sparsifiers):
                previous = self._sparsifier_of.get(param)
                if previous is not None:  # the parameter's residual from its bucket before the rebuild
                    sparsifier.load_state_dict(previous.state_dict())
                self._sparsifier_of[param] = sparsifier
            self._codecs[index] = codec
        elif codec.density != self.density:
            codec = self._codecs[index] = codec.with_density(self.density)
            self._sparsifier_of.update(zip(params, codec.sparsifiers))
        return codec

    def begin_auto_step(self, iteration: int, params: list) -> None:
        """density="auto": at each bucket, note its parameters' sizes; at a step's first, take the agreed density."""
        self._elements.update((param, param.numel()) for param in params)
        if self._auto_step == iteration:
            self.auto.bucket_called(iteration)
            return
        self._auto_step = iteration
        full_bytes = encoded_size(-(-sum(self._elements.values()) // BLOCK), BLOCK) * (self.world_size() - 1)
        self.density = self.auto.begin_step(iteration, max(full_bytes, 1))

    def density_stats(self) -> dict:
        """The density of the current step; with density="auto" also its changes and the controller's inputs."""
        return self.auto.stats() if self.auto else {"density": self.density, "changes": []}

    def velocities_for(self, params: list, buffer: torch.Tensor, write_back: bool) -> list[torch.Tensor]:
        """Momentum correction: per parameter u = momentum x u + g, with g read from the bucket
        ``buffer`` (parameters back to back); ``write_back`` puts u into the buffer (dense steps:
        their average is then the averaged velocity)."""
        velocities = []
        offset = 0
        for param in params:
            numel = param.numel()
            velocity = self._velocity.get(param)
            if velocity is None:
                velocity = self._loaded_velocities.pop(0) if self._loaded_velocities else torch.zeros(numel)
                self._velocity[param] = velocity
            gradient = buffer[offset:offset + numel]
            velocity.mul_(self.momentum).add_(gradient)
            if write_back:
                gradient.copy_(velocity)
            velocities.append(velocity)
            offset += numel
        return velocities

    def velocities(self) -> list[torch.Tensor]:
        """The hook's local velocities (momentum correction), one flat tensor per parameter."""
        return list(self._velocity.values())

    def check_optimizer(self, optimizer) -> None:
        """Refuse an optimizer that would apply momentum to this hook's sparse updates (called before
        every optimizer step, through a torch.optim global step pre-hook)."""
        if optimizer in self._checked or not self._param_ids:
            return
        for group in optimizer.param_groups:
            if not any(id(p) in self._param_ids for p in group["params"]):
                continue
            if self.momentum or (self.density < 1.0 and not self.sparse_optimizer):
                if group.get("momentum", 0):
                    raise ConfigError(_momentum_refusal(type(optimizer).__name__, group["momentum"], self))
                if group.get("betas", (0.0,))[0]:
                    raise ConfigError(_beta1_refusal(type(optimizer).__name__, group["betas"], self))
            elif self.staleness and self.density < 1.0 and group.get("momentum", 0):
                warnings.warn(_own_momentum_warning(type(optimizer).__name__, group["momentum"]), stacklevel=4)
        self._checked.add(optimizer)

    def world_size(self) -> int:
        return dist.get_world_size(self.process_group)

    def record_sparse(self, step: int, params: list, results: list) -> None:
        """Called as an exchange finishes (completion thread): its averaged blocks per parameter."""
        self._sparse_steps.setdefault(step, {}).update(zip(params, results))

    def apply_step(self, step: int | None) -> None:
        """The step whose aggregate the next optimizer step applies, None for a dense warm-up step."""
        self._step_to_apply = step
        for older in [s for s in list(self._sparse_steps) if step is None or s < step]:
            del self._sparse_steps[older]

    # -- public ------------------------------------------------------------------------------------
    def sparse_grads(self) -> dict | None:
        """Parameter -> (block indices, averaged values) to apply now: ``SparseSGD.step(sparse_grads=...)``.

        That is the step just computed, or with staleness 1 the one before it (empty on the first
        sparse step); after ``flush()``, the flushed step. None after a dense warm-up step: the
        averaged gradients are in ``.grad`` and ``SparseSGD.step(sparse_grads=None)`` applies them.
        """
        if not self.sparse_optimizer:
            raise ConfigError("sparse_grads() needs BlockSparseState(sparse_optimizer=True)")
        if self._step_to_apply is None:
            return None
        return dict(self._sparse_steps.get(self._step_to_apply, {}))

    def flush(self) -> bool:
        """Wait for the step still in flight (staleness 1) and put its result where the optimizer reads it.

        Dense mode writes the aggregated gradients into the parameters' ``.grad``; sparse-optimizer
        mode refreshes ``sparse_grads()``. Returns True when there was a step to apply: then call
        the optimizer's ``step`` once more. Needed at the end of training and before checkpoints.
        """
        if not self._results:
            return False
        step = max(self._results)
        latest = self._results.pop(step)
        self._results.clear()
        if self.sparse_optimizer:
            self.apply_step(step)
        for param, (future, offset, numel) in latest.items():
            aggregated = future.wait()
            if not self.sparse_optimizer:
                if param.grad is None:
                    param.grad = torch.zeros_like(param)
                param.grad.copy_(aggregated[offset:offset + numel].view_as(param))
        return True

    def state_dict(self) -> dict:
        """Error-feedback residuals and thresholds per bucket, and the step counter. Flush first."""
        if self._results:
            raise ConfigError("a step is still in flight: call flush() and step the optimizer before checkpointing")
        return {"iteration": self.iteration, "density": self.density, "velocities": self.velocities(),
                "buckets": {index: [s.state_dict() for s in codec.sparsifiers]
                            for index, codec in self._codecs.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.iteration = int(state["iteration"])
        # velocities go to parameters in the order the hook first meets them, as when they were saved
        self._velocity = {}
        self._loaded_velocities = [v.clone() for v in state.get("velocities", [])]
        self._codecs = {}
        for index, sparsifier_states in state["buckets"].items():
            codec = _BucketCodec([s["numel"] for s in sparsifier_states], self.density)
            for sparsifier, saved in zip(codec.sparsifiers, sparsifier_states):
                sparsifier.load_state_dict(saved)
            self._codecs[int(index)] = codec


_states = weakref.WeakSet()  # live states, for the optimizer check
_check_handle = None


def _watch(state: BlockSparseState) -> None:
    global _check_handle
    _states.add(state)
    if _check_handle is None:
        _check_handle = register_optimizer_step_pre_hook(_check_optimizer)


def _check_optimizer(optimizer, _args, _kwargs) -> None:
    for state in list(_states):
        state.check_optimizer(optimizer)


def _momentum_refusal(optimizer: str, momentum: float, state: BlockSparseState) -> str:
    if state.momentum:
        return (f"{optimizer}(momentum={momentum}) behind BlockSparseState(momentum={state.momentum}) applies "
                f"momentum twice: give the optimizer momentum=0 (the hook already applies it)")
    return (f"{optimizer}(momentum={momentum}) on block-sparse updates (density {state.density}) diverges: "
            f"error feedback delivers many steps of a block's gradient at once and the optimizer's momentum "
            f"keeps pushing it for ~1/(1-momentum) steps after (docs/sparse.md). Move the momentum into the "
            f"hook: BlockSparseState(..., momentum={momentum}) with {optimizer}(momentum=0), or with "
            f"sparse_optimizer=True and wanlink.optim.SparseSGD(momentum=0)")


def _own_momentum_warning(optimizer: str, momentum: float) -> str:
    return (f"{optimizer}(momentum={momentum}) on stale block-sparse updates: a block's momentum moves only when "
            f"the block is delivered, so a burst keeps being applied at its next ~1/(1-momentum) deliveries, long "
            f"after its gradient changed (out of fidelity target on the digits CNN at staleness 1, docs/sparse.md). "
            f"Use momentum correction: BlockSparseState(..., momentum={momentum}) with {optimizer}(momentum=0)")


def _beta1_refusal(optimizer: str, betas: tuple, state: BlockSparseState) -> str:
    beta1, beta2 = betas[0], betas[1]
    if state.momentum:
        return (f"{optimizer}(betas=({beta1}, {beta2})) behind BlockSparseState(momentum={state.momentum}) applies "
                f"momentum twice: give the optimizer betas=(0.0, {beta2}) (the hook already applies the first moment)")
    return (f"{optimizer}(betas=({beta1}, {beta2})) on block-sparse updates (density {state.density}): its first "
            f"moment keeps pushing each burst that error feedback delivers for ~1/(1-beta1) steps, like SGD's "
            f"momentum (docs/sparse.md). Move beta1 into the hook: BlockSparseState(..., momentum={beta1}) with "
            f"{optimizer}(betas=(0.0, {beta2})); or use BlockSparseState(..., momentum={beta1}, "
            f"sparse_optimizer=True) with wanlink.optim.SparseSGD(momentum=0)")


def _completed(value: torch.Tensor) -> torch.futures.Future:
    future = torch.futures.Future()
    future.set_result(value)
    return future


def _dense_average(state: BlockSparseState, buffer: torch.Tensor) -> torch.futures.Future:
    world = state.world_size()
    work = dist.all_reduce(buffer, group=state.process_group, async_op=True)
    return work.get_future().then(lambda _f: buffer.div_(world))


def block_sparse_hook(state: BlockSparseState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook (``model.register_comm_hook(state, block_sparse_hook)``); see the module docs."""
    index = bucket.index()
    buffer = bucket.buffer()
    if buffer.dtype != torch.float32 or buffer.device.type != "cpu":
        raise UnsupportedError(f"block_sparse_hook needs float32 CPU gradients, got {buffer.dtype} on {buffer.device}")
    iteration = state.iteration
    if bucket.is_last():
        state.iteration += 1
    params = list(bucket.parameters())
    state._param_ids.update(map(id, params))
    dense = iteration < state.warmup_steps
    velocities = state.velocities_for(params, buffer, write_back=dense) if state.momentum else None
    if dense:
        state.apply_step(None)
        return _dense_average(state, buffer)

    gradients = velocities or bucket.gradients()
    if state.auto:
        state.begin_auto_step(iteration, params)
    codec = state.codec_for(index, gradients, params)
    # momentum factor masking: a block's velocity restarts once it is sent (not at density 1: that is dense SGD)
    message = codec.encode(gradients, mask_sent=velocities is not None and state.density < 1.0)
    if state.auto:
        message[codec.message_size - PROPOSAL_BYTES:].numpy().view(np.float64)[0] = state.auto.proposal()
        started = state.auto.exchange_started(iteration)
    world = state.world_size()
    gathered = torch.empty(world * codec.message_size, dtype=torch.uint8)
    with deadline_scope((iteration, -index)):
        work = _all_gather_single(gathered, message, group=state.process_group, async_op=True)
    state.bytes_sent += message.numel() * (world - 1)

    if state.sparse_optimizer:
        def finish(_future):
            state.record_sparse(iteration, params, codec.average_sparse(gathered, world))
    elif state.staleness:
        result = codec.next_result()  # the bucket buffer belongs to the next step by then

        def finish(_future):
            return result.fill(codec, gathered, world)
    else:
        def finish(_future):
            codec.average_into(gathered, world, buffer)
            return buffer

    if state.auto:
        decode, sent = finish, message.numel() * (world - 1)

        def finish(future):
            state.auto.exchange_done(iteration, started, sent, codec.proposal_of(gathered, 0, world))
            return decode(future)

    if state.exchange_log is not None:  # tracing: when this bucket's last byte arrived
        work.get_future().then(lambda _f: state.exchange_log.append((iteration, index, time.perf_counter())))
    exchange = work.get_future().then(finish)
    if state.sparse_optimizer:
        state.apply_step(iteration - state.staleness)
        ready = (_futures_of(_previous_step_sources(state, iteration, params, exchange)) if state.staleness
                 else [exchange])
        return torch.futures.collect_all(ready).then(lambda _done: buffer)
    if not state.staleness:
        return exchange
    return _previous_step_result(state, iteration, params, exchange, buffer)


def _previous_step_sources(state: BlockSparseState, iteration: int, params: list, exchange) -> list:
    """Staleness 1: record where this step's aggregate will be; per parameter, where last step's is (or None)."""
    current = state._results.setdefault(iteration, {})
    offset = 0
    for param in params:
        current[param] = (exchange, offset, param.numel())
        offset += param.numel()
    for older in [step for step in state._results if step < iteration - 1]:
        del state._results[older]
    previous = state._results.get(iteration - 1, {})
    return [previous.get(param) for param in params]


def _futures_of(sources: list) -> list:
    return list({id(src[0]): src[0] for src in sources if src is not None}.values())


def _previous_step_result(state: BlockSparseState, iteration: int, params: list, exchange, buffer: torch.Tensor):
    """Staleness 1, dense result: last step's aggregate for this bucket's parameters.

    When last step's bucket held the same parameters in the same order (always, once DDP has
    rebuilt its buckets), that is its exchange's result as is; otherwise it is assembled.
    """
    sources = _previous_step_sources(state, iteration, params, exchange)
    futures = _futures_of(sources)
    if not futures:  # first sparse step: nothing aggregated yet, this step applies no update
        return _completed(buffer.zero_())
    offsets = list(itertools.accumulate((param.numel() for param in params), initial=0))[:-1]
    if len(futures) == 1 and all(src is not None and src[1] == offset for src, offset in zip(sources, offsets)):
        numel = buffer.numel()
        return futures[0].then(lambda done: done.value()[:numel])

    def assemble(_done):
        buffer.zero_()
        for offset, _param, source in zip(offsets, params, sources):
            if source is not None:
                future, start, numel = source
                buffer[offset:offset + numel] = future.value()[start:start + numel]
        return buffer

    return torch.futures.collect_all(futures).then(assemble)
