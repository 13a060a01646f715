"""DDP comm hook: block-sparse gradients with error feedback, per-layer EDF deadlines, optional staleness.

    state = BlockSparseState(density=0.01, warmup_steps=50, staleness=1)
    model.register_comm_hook(state, block_sparse_hook)

``density="auto"`` (with ``min_density``/``max_density``) lets a controller choose the density per
step from the measured compute time and the links' delivery rate (wanlink/c10d/auto_density.py): the same
on every rank, switched between steps without losing error feedback.

Per bucket, every gradient tensor is sparsified on its own blocks with its own k, threshold and
residual (error feedback kept per bucket, in the state), all in one kernel call (BucketSparsifier);
the bucket's block-COO frames are exchanged among all ranks in one all-gather over the group's
links, and the peers' blocks are summed and averaged into the bucket. Each exchange runs under an
EDF deadline (iteration, -bucket index): DDP's last bucket holds the model's first layers, which
the next forward pass needs first, so they leave first.

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

Fidelity guard (``fidelity_guard=True``, wanlink/c10d/fidelity_guard.py): below 10 % density the hook
watches the size of this rank's gradient and warns once (SparseFidelityWarning) when, after
``max(500, 5 / density)`` sparse steps, it is still 20 % or more of its largest: a model
still learning, which pays error feedback's delay to the end (docs/sparse.md, "Fidelity").

Exchanging a bucket as the hook does, without DDP (a bench timing the hook's traffic and CPU, a
planner): ``BucketCodec(numels, density)`` encodes a bucket-shaped tensor into its message and
averages the messages every rank sent (``average_into``, or ``next_result().fill`` as staleness 1
does), and ``all_gather_single`` is the all-gather into one tensor that carries them (torch's name
for it in this version).
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
from wanlink.c10d.fidelity_guard import FidelityGuard, sample_stride
from wanlink.compress import BlockSparsifier, BucketSparsifier, decode_blocks, encode_blocks, encoded_size
from wanlink.errors import ConfigError, SparseFidelityWarning, UnsupportedError

BLOCK = 16
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in torch 2.13


class BucketCodec:
    """One bucket's sparsification and the layout of its message: one block-COO frame per gradient.

    The whole bucket is sparsified in one kernel call (BucketSparsifier: per gradient its own blocks,
    k, threshold and residual), and since every frame's size and header are fixed by its gradient's
    numel and k, the message is a template whose id and value slots are filled by two copies;
    decoding reads every rank's ids and values back through the same slots.
    """

    def __init__(self, numels: list[int], density: float, trailer: int = 0):
        self.numels = numels
        self.density = density
        self.trailer = trailer  # bytes after the frames (density="auto": the sender's proposal)
        self.sparsifier = BucketSparsifier(numels, density, BLOCK)
        self.sparsifiers = self.sparsifier.parts
        sizes = [encoded_size(s.k, BLOCK) for s in self.sparsifiers]  # multiples of 64: values stay aligned
        self.frame_offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        self.frames_size = int(self.frame_offsets[-1])
        self.message_size = self.frames_size + trailer
        self.element_offsets = self.sparsifier.offsets
        self._result_buffers: list[_ResultBuffer] = []
        template = np.zeros(self.message_size, dtype=np.uint8)
        id_slots, value_rows = [], []
        for sparsifier, start in zip(self.sparsifiers, self.frame_offsets):
            frame = template[start:start + encoded_size(sparsifier.k, BLOCK)]
            encode_blocks(np.arange(sparsifier.k, dtype=np.int32), np.zeros((sparsifier.k, BLOCK), np.float32),
                          sparsifier.numel, block=BLOCK, out=frame)
            ids = decode_blocks(frame).indices
            frame[32:32 + 4 * sparsifier.k] = 0
            id_slots.append((ids.ctypes.data - template.ctypes.data) // 4 + np.arange(sparsifier.k))
            value_rows.append((start + frame.shape[0] - 4 * BLOCK * sparsifier.k) // (4 * BLOCK)
                              + np.arange(sparsifier.k))
        self._template = torch.from_numpy(template)
        self._id_slots, self._value_rows = np.concatenate(id_slots), np.concatenate(value_rows)
        fixed = np.ones(self.frames_size, dtype=bool)  # headers and padding: the same in every valid message
        fixed.view(np.int32)[self._id_slots] = False
        fixed.reshape(-1, 4 * BLOCK)[self._value_rows] = False
        self._fixed = np.flatnonzero(fixed)
        kept = self.sparsifier.ks
        self._part_of_kept = np.repeat(np.arange(len(numels)), kept)  # which gradient each kept block is of
        self._block_base = np.repeat(self.sparsifier.block_offsets[:-1], kept)  # local id -> bucket-wide id
        self._element_base = self.element_offsets[:-1]
        self._nblocks = np.repeat(np.diff(self.sparsifier.block_offsets), kept)
        self._segment_starts = self.sparsifier.kept_offsets[:-1][kept > 0]
        tail = np.repeat(np.asarray(numels) - (np.diff(self.sparsifier.block_offsets) - 1) * BLOCK, kept)
        self._ragged = tail < BLOCK  # a kept block of this gradient may be its partial last block
        self._tail_padding = np.where(np.arange(BLOCK) >= tail[:, None], np.uint32(0xFFFFFFFF), np.uint32(0))

    def encode(self, flat: torch.Tensor, mask_sent: torch.Tensor | None = None) -> torch.Tensor:
        """One message with each gradient's kept blocks of the bucket-shaped ``flat``; ``mask_sent``
        (bucket-shaped) gets those blocks zeroed afterwards (momentum factor masking of the velocities)."""
        indices, values = self.sparsifier.compress(flat)
        message = self._template.clone()
        raw = message.numpy()[:self.frames_size]
        raw.view(np.int32)[self._id_slots] = indices.numpy()
        raw.view(np.float32).reshape(-1, BLOCK)[self._value_rows] = values.numpy()
        if mask_sent is not None:
            positions, valid = self._elements_of(self._part_of_kept, indices.numpy())
            mask_sent.numpy()[positions[valid]] = 0
        return message

    def with_density(self, density: float) -> "BucketCodec":
        """A codec for the same gradients at another density, carrying over each sparsifier's residual
        and threshold (so error feedback loses nothing); this one stays valid for exchanges in flight."""
        codec = BucketCodec(self.numels, density, self.trailer)
        for new, old in zip(codec.sparsifiers, self.sparsifiers):
            new.load_state_dict(old.state_dict())
        return codec

    def proposal_of(self, gathered: torch.Tensor, rank: int, world: int) -> float:
        """The float64 that ``rank`` put in its trailer."""
        row = gathered.numpy().reshape(world, self.message_size)[rank]
        return float(row[self.message_size - PROPOSAL_BYTES:].view(np.float64)[0])

    def _elements_of(self, parts: np.ndarray, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """For blocks ``ids`` of gradients ``parts``: their elements' positions in the bucket [n, BLOCK]
        and which of them lie inside their gradient (a tail block's padding does not)."""
        inside = ids.astype(np.int64)[:, None] * BLOCK + np.arange(BLOCK)
        return self._element_base[parts][:, None] + inside, inside < np.asarray(self.numels)[parts][:, None]

    def _union(self, gathered: torch.Tensor, world: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Every rank's blocks, validated, summed per block and divided by ``world``: (gradient of each
        block, its local id, its values [n, BLOCK]), ordered by gradient then id."""
        raw = np.ascontiguousarray(gathered.numpy().reshape(world, self.message_size)[:, :self.frames_size])
        ids = raw.view(np.int32)[:, self._id_slots]
        values = raw.view(np.float32).reshape(world, -1, BLOCK)[:, self._value_rows]
        self._check(raw, ids, values)
        order, merged, firsts = _merge(list(ids + self._block_base))
        parts = np.tile(self._part_of_kept, world)[order][firsts]
        summed = np.add.reduceat(values.reshape(-1, BLOCK)[order], firsts, axis=0) if firsts.size else values[0, :0]
        summed /= world
        local = merged[firsts] - self.sparsifier.block_offsets[parts]
        return parts, local, summed

    def _check(self, raw: np.ndarray, ids: np.ndarray, values: np.ndarray) -> None:
        """What decode_blocks checks, for every rank's frames at once: headers and padding as in this
        codec's template, ids in range and increasing per gradient, a partial last block's padding zero."""
        changed = raw[:, self._fixed] != self._template.numpy()[self._fixed]
        increasing = np.ones(ids.shape, dtype=bool)
        increasing[:, 1:] = ids[:, 1:] > ids[:, :-1]
        increasing[:, self._segment_starts] = True
        tails = (ids == self._nblocks - 1) & self._ragged
        bad = ~increasing | (ids < 0) | (ids >= self._nblocks)
        if tails.any():
            bad |= tails & (values.view(np.uint32) & self._tail_padding).any(axis=2)
        if not changed.any() and not bad.any():
            return
        if changed.any():
            rank, byte = np.argwhere(changed)[0]
            frame = int(np.searchsorted(self.frame_offsets, self._fixed[byte], side="right") - 1)
        else:
            rank, kept = np.argwhere(bad)[0]
            frame = int(self._part_of_kept[kept])
        decoded = decode_blocks(raw[rank, self.frame_offsets[frame]:self.frame_offsets[frame + 1]])  # raises first
        raise ConfigError(f"rank {rank} sent a frame of {decoded.indices.shape[0]} blocks of {decoded.numel} "
                          f"elements where this bucket's gradient {frame} has {self.sparsifiers[frame].k} of "
                          f"{self.numels[frame]}: ranks disagree on the model or the density")

    def average_into(self, gathered: torch.Tensor, world: int, out: torch.Tensor,
                     nonzero: np.ndarray | None = None) -> np.ndarray:
        """``out`` = every rank's blocks summed and divided by ``world``, zero elsewhere.

        ``nonzero``: the only elements of ``out`` that may hold values (what the previous call on
        ``out`` returned), cleared; None zeroes all of ``out``. Returns the elements written.
        """
        parts, local, summed = self._union(gathered, world)
        flat = out.numpy()
        if nonzero is None:
            out.zero_()
        else:
            flat[nonzero] = 0
        positions, valid = self._elements_of(parts, local)
        written = positions[valid]
        flat[written] = summed[valid]
        return written

    def next_result(self) -> "_ResultBuffer":
        """Staleness 1: the next of the bucket's two result buffers (step t's is read while t+1's is written)."""
        if not self._result_buffers:
            self._result_buffers = [_ResultBuffer(int(self.element_offsets[-1])) for _ in range(2)]
        self._result_buffers.reverse()
        return self._result_buffers[0]

    def average_sparse(self, gathered: torch.Tensor, world: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per gradient, the union of the ranks' blocks with their values summed and averaged."""
        parts, local, summed = self._union(gathered, world)
        bounds = np.searchsorted(parts, np.arange(len(self.numels) + 1))
        ids = torch.from_numpy(local.astype(np.int32))
        values = torch.from_numpy(summed)
        return [(ids[a:b], values[a:b]) for a, b in zip(bounds[:-1].tolist(), bounds[1:].tolist())]


class _ResultBuffer:
    """A bucket-sized dense result that is zero outside ``nonzero``, so refilling it clears only those blocks."""

    def __init__(self, numel: int):
        self.tensor = torch.zeros(numel, dtype=torch.float32)
        self.nonzero: np.ndarray | None = None

    def fill(self, codec: BucketCodec, gathered: torch.Tensor, world: int) -> torch.Tensor:
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


class BlockSparseState:
    """Configuration and per-bucket state of ``block_sparse_hook`` (error feedback, staleness)."""

    def __init__(self, process_group=None, *, density: float | str = 0.01, warmup_steps: int = 0, staleness: int = 0,
                 sparse_optimizer: bool = False, momentum: float = 0.0, min_density: float = 0.001,
                 max_density: float = 0.1, bandwidth=None, controller_options: dict | None = None,
                 fidelity_guard: bool | FidelityGuard = True):
        """``density="auto"``: chosen per step within [min_density, max_density] (see
        wanlink/c10d/auto_density.py); ``bandwidth`` (a callable of the time returning bytes/s, or
        None for no sample) replaces the links' measured delivery rate, ``controller_options`` go
        to ``wanlink.sched.density.DensityController``. ``fidelity_guard``: warn once when, below
        10 % density, the gradient is still large after some hundred sparse steps (a model still
        learning: wanlink/c10d/fidelity_guard.py); False turns it off, a FidelityGuard replaces it."""
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
        self._codecs: dict[int, BucketCodec] = {}
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
        self._bucket_velocity: dict[int, tuple[tuple, torch.Tensor]] = {}  # bucket -> (its parameters' ids, velocity)
        self._loaded_velocities: list[torch.Tensor] = []
        self._param_ids: set[int] = set()  # every parameter the hook has seen, for check_optimizer
        self._checked = weakref.WeakSet()  # optimizers found compatible
        # tracing, off unless set to a list: (iteration, bucket index, time.perf_counter()) as each exchange completes
        self.exchange_log: list | None = None
        if not isinstance(fidelity_guard, (bool, FidelityGuard)):
            raise ConfigError(f"fidelity_guard must be True, False or a FidelityGuard, got {fidelity_guard!r}")
        self.fidelity_guard = (FidelityGuard() if fidelity_guard is True else fidelity_guard) or None
        _watch(self)

    # -- used by the hook ------------------------------------------------------------------------
    def codec_for(self, index: int, params: list) -> BucketCodec:
        numels = [param.numel() for param in params]
        codec = self._codecs.get(index)
        if codec is None or codec.numels != numels:  # first use, or DDP rebuilt its buckets
            codec = BucketCodec(numels, self.density, PROPOSAL_BYTES if self.auto else 0)
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

    def velocities_for(self, index: int, params: list, buffer: torch.Tensor, write_back: bool) -> torch.Tensor:
        """Momentum correction: u = momentum x u + g for the bucket's parameters at once, with g the
        bucket ``buffer`` (parameters back to back); returns u, laid out like the buffer (each
        parameter's velocity is a view of it). ``write_back`` puts u into the buffer (dense steps:
        their average is then the averaged velocity)."""
        layout, velocity = self._bucket_velocity.get(index, ((), None))
        if layout != tuple(map(id, params)):  # first use, or DDP rebuilt its buckets: lay the velocities out anew
            velocity = torch.zeros(buffer.numel())
            offset = 0
            for param in params:
                view = velocity[offset:offset + param.numel()]
                previous = self._velocity.get(param)
                if previous is None and self._loaded_velocities:
                    previous = self._loaded_velocities.pop(0)
                if previous is not None:
                    view.copy_(previous)
                self._velocity[param] = view
                offset += param.numel()
            self._bucket_velocity[index] = (tuple(map(id, params)), velocity)
        velocity.mul_(self.momentum).add_(buffer)
        if write_back:
            buffer.copy_(velocity)
        return velocity

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

    def watch_gradient(self, iteration: int, buffer: torch.Tensor, last: bool) -> None:
        """The fidelity guard's sample of this bucket's gradient; at the step's last bucket, its verdict."""
        guard = self.fidelity_guard
        guard.add(iteration, float(torch.linalg.vector_norm(buffer[::sample_stride(buffer.numel())])) ** 2)
        if last:
            verdict = guard.end_step(self.density, iteration + 1 - self.warmup_steps)
            if verdict is not None and verdict.warned:
                warnings.warn(verdict.message, SparseFidelityWarning, stacklevel=2)

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
        self._bucket_velocity = {}
        self._loaded_velocities = [v.clone() for v in state.get("velocities", [])]
        self._codecs = {}
        for index, sparsifier_states in state["buckets"].items():
            codec = BucketCodec([s["numel"] for s in sparsifier_states], self.density)
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
    if state.fidelity_guard is not None and not state.fidelity_guard.done:
        state.watch_gradient(iteration, buffer, bucket.is_last())
    velocity = state.velocities_for(index, params, buffer, write_back=dense) if state.momentum else None
    if dense:
        state.apply_step(None)
        return _dense_average(state, buffer)

    if state.auto:
        state.begin_auto_step(iteration, params)
    codec = state.codec_for(index, params)
    # momentum factor masking: a block's velocity restarts once it is sent (not at density 1: that is dense SGD)
    message = codec.encode(buffer if velocity is None else velocity,
                           mask_sent=velocity if velocity is not None and state.density < 1.0 else None)
    if state.auto:
        message[codec.message_size - PROPOSAL_BYTES:].numpy().view(np.float64)[0] = state.auto.proposal()
        started = state.auto.exchange_started(iteration)
    world = state.world_size()
    gathered = torch.empty(world * codec.message_size, dtype=torch.uint8)
    with deadline_scope((iteration, -index)):
        work = all_gather_single(gathered, message, group=state.process_group, async_op=True)
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
