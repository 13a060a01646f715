"""ProcessGroupWanlink: a torch.distributed ProcessGroup whose collectives run over wanlink Links.

Each call validates its arguments in the caller's thread (unsupported things raise at once),
stages tensors into flat CPU buffers, and submits one coroutine to the process's I/O loop; the
returned Work finishes when that coroutine does. Small tensors use direct exchange, large ones
pipelined rings (``wanlink.collectives``).
"""
from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import threading
from datetime import timedelta
from typing import Awaitable, Callable, Sequence

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import ProcessGroup

from wanlink.c10d import tags
from wanlink.c10d.deadlines import URGENT, current_deadline
from wanlink.c10d.debug import VARIES, Fingerprint, check_fingerprint
from wanlink.c10d.mesh import Mesh
from wanlink.c10d.staging import Staging
from wanlink.c10d.work import WanlinkWork
from wanlink.collectives import direct, ring
from wanlink.collectives.base import Comm, gather_all, split
from wanlink.collectives.reduce_ops import finish_average, reducer_for
from wanlink.envvars import env_int
from wanlink.errors import ConfigError, DeadlineExceeded, PeerLost, UnsupportedError

logger = logging.getLogger(__name__)

SUPPORTED_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int8,
                    torch.int16, torch.int32, torch.int64, torch.uint8, torch.bool)
_REDUCE_NAMES = {
    dist.ReduceOp.RedOpType.SUM: "sum", dist.ReduceOp.RedOpType.AVG: "avg",
    dist.ReduceOp.RedOpType.PRODUCT: "product", dist.ReduceOp.RedOpType.MIN: "min",
    dist.ReduceOp.RedOpType.MAX: "max", dist.ReduceOp.RedOpType.BAND: "band",
    dist.ReduceOp.RedOpType.BOR: "bor", dist.ReduceOp.RedOpType.BXOR: "bxor",
}


DIRECT_MAX_BYTES = 256 * 1024
"""Collectives on at most this many bytes per member use direct exchange (``WANLINK_DIRECT_MAX_BYTES``)."""
PIECE_BYTES = 4 * 1024 * 1024
"""Ring/chain pipelining unit (``WANLINK_PIECE_BYTES``)."""
SHUTDOWN_DRAIN_SECONDS = 10.0
"""Longest the world group waits at shutdown for peers to finish reading what it sent."""


_gc_frozen = False


def freeze_gc_once() -> None:
    """Exempt the objects alive now from Python's cyclic garbage collector, once per process
    (``gc.collect()`` first, so no garbage is frozen); ``WANLINK_GC_FREEZE=0`` opts out.

    A full collection walks every tracked object (about 170 000 once torch is imported: 50-90 ms
    here). Collectives allocate enough to trigger one every few large calls, and a rank paused
    in one stalls every rank's ring (4-rank 256 MiB all_reduce on loopback: 120-190 ms of GC per
    call summed over ranks; 3-6 ms frozen).
    Frozen objects are never collected, so cycles among them that become garbage later leak.
    """
    global _gc_frozen
    if _gc_frozen or not env_int("WANLINK_GC_FREEZE", 1):
        return
    _gc_frozen = True
    gc.collect()
    gc.freeze()


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _as_buffer(tensor: torch.Tensor) -> memoryview:
    return memoryview(tensor.view(torch.uint8).numpy())


class ScratchPool:
    """Reuses large scratch buffers across collectives (I/O thread only).

    Fresh multi-MiB allocations are returned to the OS on free and page-fault again on the next
    collective; on loopback that cost ~40% of a 256 MiB all-reduce. Keeps at most ``limit`` bytes.
    """

    def __init__(self, limit: int = 1 << 30):
        self.limit, self.cached = limit, 0
        self._free: dict[int, list[torch.Tensor]] = {}

    def take(self, nbytes: int) -> torch.Tensor:
        free = self._free.get(nbytes)
        if free:
            self.cached -= nbytes
            return free.pop()
        return torch.empty(nbytes, dtype=torch.uint8)

    def give(self, buffer: torch.Tensor) -> None:
        nbytes = buffer.numel()
        if self.cached + nbytes <= self.limit:
            self._free.setdefault(nbytes, []).append(buffer)
            self.cached += nbytes


_scratch_pool = ScratchPool()


class LinkComm(Comm):
    """The ``Comm`` of one collective (or p2p op): group ranks -> links, pieces -> tags."""

    def __init__(self, group: "ProcessGroupWanlink", base_tag: int, deadline: tuple = URGENT):
        self.rank, self.size = group.group_rank, group.group_size
        self.piece_bytes = group.piece_bytes
        self._group, self._base_tag, self._deadline = group, base_tag, deadline
        self._borrowed: list[torch.Tensor] = []

    async def _link(self, peer: int):
        mesh_rank = self._group.mesh_ranks[peer]
        return self._group.mesh.cached(mesh_rank) or await self._group.mesh.link(mesh_rank)

    async def send(self, peer: int, tensor: torch.Tensor, piece: int = 0) -> None:
        if tensor.numel() == 0:
            return
        link = await self._link(peer)
        await link.send(_as_buffer(tensor), tag=self._base_tag | piece, deadline=self._deadline)

    async def recv(self, peer: int, tensor: torch.Tensor, piece: int = 0) -> None:
        if tensor.numel() == 0:
            return
        link = await self._link(peer)
        await link.recv_into(_as_buffer(tensor), tag=self._base_tag | piece)

    async def recv_any(self, peers: Sequence[int], tensor: torch.Tensor, piece: int = 0) -> int:
        """Receive the next message on this tag from whichever of ``peers`` sends one; returns that peer.

        Only a message that has started arriving is claimed, so when several peers send, one message
        is received and the others stay queued for the next receive.
        """
        links = {peer: await self._link(peer) for peer in peers}
        tag = self._base_tag | piece
        while True:
            for peer, link in links.items():
                if link.message_started(tag):  # checked and claimed with no await in between
                    await link.recv_into(_as_buffer(tensor), tag=tag)
                    return peer
            waits = [asyncio.ensure_future(link.wait_message_started(tag)) for link in links.values()]
            try:
                done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for wait in waits:
                    wait.cancel()
            failure = next((error for error in [wait.exception() for wait in done] if error is not None), None)
            if failure is not None:  # a failed link (PeerLost)
                raise failure

    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        itemsize = torch.empty(0, dtype=dtype).element_size()
        buffer = _scratch_pool.take(numel * itemsize)
        self._borrowed.append(buffer)
        return buffer.view(dtype)

    def release(self) -> None:
        """Hand scratch buffers back once nothing (including cancelled sends) can touch them."""
        for buffer in self._borrowed:
            _scratch_pool.give(buffer)
        self._borrowed.clear()

    async def compute(self, fn: Callable[..., None], *args) -> None:
        """Reduce on the I/O thread: a piece is at most ``piece_bytes``, so the loop stalls for
        about a millisecond; measured faster than a thread pool (GIL hand-offs) on loopback."""
        fn(*args)


def _check_tensors(op: str, tensors: Sequence[torch.Tensor], same_dtype: bool = True) -> None:
    dtypes = set()
    for tensor in tensors:
        if not isinstance(tensor, torch.Tensor):
            raise UnsupportedError(f"wanlink {op}: expected tensors, got {type(tensor).__name__}")
        if tensor.layout != torch.strided:
            raise UnsupportedError(f"wanlink {op}: {tensor.layout} tensors are not supported")
        if tensor.dtype not in SUPPORTED_DTYPES:
            raise UnsupportedError(f"wanlink {op}: dtype {tensor.dtype} is not supported "
                                   f"(supported: {', '.join(str(d) for d in SUPPORTED_DTYPES)})")
        if tensor.device.type not in ("cpu", "cuda"):
            raise UnsupportedError(f"wanlink {op}: device {tensor.device} is not supported (cpu, cuda)")
        dtypes.add(tensor.dtype)
    if same_dtype and len(dtypes) > 1:
        raise UnsupportedError(f"wanlink {op}: all tensors must share one dtype, got {sorted(map(str, dtypes))}")


def _single(op: str, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    if len(tensors) != 1:
        raise UnsupportedError(f"wanlink {op}: exactly one tensor per call is supported, got {len(tensors)}")
    return tensors[0]


def _reduce_name(op: str, reduce_op) -> str:
    kind = getattr(reduce_op, "op", reduce_op)
    name = _REDUCE_NAMES.get(kind)
    if name is None:
        raise UnsupportedError(f"wanlink {op}: reduce op {kind} is not supported")
    return name


def _same_numel(op: str, tensors: Sequence[torch.Tensor], expected: int, what: str) -> None:
    for tensor in tensors:
        if tensor.numel() != expected:
            raise ConfigError(f"wanlink {op}: every {what} must have {expected} elements, got {tensor.numel()}")


def _check_batch(op: str, outputs: Sequence, inputs: Sequence) -> None:
    """A coalesced call needs one output per input, at least one of each."""
    if not inputs or len(outputs) != len(inputs):
        raise ConfigError(f"wanlink {op}: need one output per input and at least one input, "
                          f"got {len(outputs)} outputs and {len(inputs)} inputs")


def _copy_parts(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    """Copy consecutive parts of ``flat`` into ``tensors`` (any layout, any device)."""
    with torch.no_grad():
        for tensor, part in zip(tensors, flat.split([tensor.numel() for tensor in tensors])):
            tensor.copy_(part.view(tensor.shape))


class ProcessGroupWanlink(ProcessGroup):
    """The "wanlink" backend: see docs/c10d.md."""

    def __init__(self, mesh: Mesh, owns_mesh: bool, mesh_ranks: Sequence[int], group_rank: int,
                 group_name: str, timeout: timedelta):
        super().__init__(group_rank, len(mesh_ranks))
        self.mesh, self.owns_mesh = mesh, owns_mesh
        self.mesh_ranks = list(mesh_ranks)
        self.group_rank, self.group_size = group_rank, len(mesh_ranks)
        self.label, self.default_timeout = group_name, timeout
        self._group_name, self._group_desc = group_name, group_name
        self.slot = mesh.claim_slot(group_name)
        self.direct_max_bytes = env_int("WANLINK_DIRECT_MAX_BYTES", DIRECT_MAX_BYTES)
        self.piece_bytes = max(1, env_int("WANLINK_PIECE_BYTES", PIECE_BYTES))
        self.detail = dist.get_debug_level() == dist.DebugLevel.DETAIL or \
            os.environ.get("TORCH_DISTRIBUTED_DEBUG", "").upper() == "DETAIL"
        self._sequence = 0
        self._sequence_lock = threading.Lock()
        freeze_gc_once()

    # -- identity -----------------------------------------------------------------------------
    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return "wanlink"

    def name(self) -> str:
        return "wanlink"

    # torch's ProcessGroup keeps its name and description in its per-device Backends; a Python
    # ProcessGroup has none, so `group_name` (which functional collectives, DTensor and FSDP2
    # resolve groups by) would raise "ProcessGroup name not set". These overrides are what
    # C++ (ProcessGroup::getGroupName) and Python (`pg.group_name`, `_set_group_name`) reach.
    def getGroupName(self) -> str:  # noqa: N802 - torch's name
        return self._group_name

    def setGroupName(self, name: str) -> None:  # noqa: N802
        self._group_name = name

    def getGroupDesc(self) -> str:  # noqa: N802
        return self._group_desc

    def setGroupDesc(self, desc: str) -> None:  # noqa: N802
        self._group_desc = desc

    def __repr__(self) -> str:
        return f"ProcessGroupWanlink(group={self.label!r}, rank={self.group_rank}, size={self.group_size})"

    def set_timeout(self, timeout: timedelta) -> None:
        """The default per-collective timeout (init_process_group's ``timeout``)."""
        self.default_timeout = timeout

    # -- machinery ----------------------------------------------------------------------------
    def _next_sequence(self, count: int = 1) -> int:
        """The first of ``count`` consecutive collective sequence numbers."""
        with self._sequence_lock:
            first = self._sequence
            self._sequence += count
            return first

    def _deadline_seconds(self, opts=None) -> float:
        timeout = getattr(opts, "timeout", None)
        if isinstance(timeout, timedelta) and timeout.total_seconds() > 0:
            return timeout.total_seconds()
        return self.default_timeout.total_seconds()

    def _launch(self, op: str, label: str, body: Awaitable, outputs: list, seconds: float,
                reports_source: bool = False) -> WanlinkWork:
        async def guarded():
            try:
                return await asyncio.wait_for(body, seconds)
            except DeadlineExceeded:  # raised inside the collective: already says what timed out
                raise
            except asyncio.TimeoutError:
                raise DeadlineExceeded(
                    f"wanlink {label} (group {self.label!r}, rank {self.group_rank} of {self.group_size}) "
                    f"did not finish within {seconds:g} s: a peer is dead, stuck or not calling it") from None
            except PeerLost as error:
                raise PeerLost(f"wanlink {label} (group {self.label!r}, rank {self.group_rank}): {error}") from error

        traced = torch.autograd._profiler_enabled()  # a range costs ~5 us and a GIL hand-off: only when traced
        with torch.profiler.record_function(f"wanlink:{op}") if traced else contextlib.nullcontext():
            return WanlinkWork(op, outputs, self.mesh.runtime.submit(guarded()), reports_source)

    def _collective(self, op: str, fingerprint: tuple, body: Callable[..., Awaitable[None]],
                    staging: Staging, outputs: list, opts=None, parts: int = 1) -> WanlinkWork:
        """Run ``body`` under a fresh sequence number; write staged outputs back at the end.

        ``parts`` > 1 (coalesced calls): ``body`` gets that many Comms, one per sub-collective, each
        with its own sequence number and so its own tags.
        """
        sequence = self._next_sequence(parts)
        dtype, count, root = fingerprint
        deadline = current_deadline()  # the launching thread's deadline_scope, URGENT outside one

        async def run() -> None:
            comms = [LinkComm(self, tags.collective_tag(self.slot, sequence + k), deadline) for k in range(parts)]
            if self.detail:
                await check_fingerprint(comms[0], Fingerprint(sequence, op, dtype, count, root), self.label)
            await body(*comms)
            staging.finish()
            for comm in comms:
                comm.release()  # only on success: after a failure a send may still read its buffer

        return self._launch(op, f"{op} #{sequence}", run(), outputs, self._deadline_seconds(opts))

    def _is_small(self, nbytes: int) -> bool:
        return nbytes <= self.direct_max_bytes

    def _check_one_per_member(self, op: str, tensors: Sequence, kind: str, who: str = "") -> None:
        """Raise ConfigError unless ``tensors`` holds exactly one tensor per group member."""
        if len(tensors) != self.group_size:
            raise ConfigError(f"wanlink {op}: {who}need{'s' if who else ''} {self.group_size} {kind} tensors, "
                              f"got {len(tensors)}")

    def _root_tensor_list(self, op: str, tensor_lists, tensor: torch.Tensor, root: int, kind: str):
        """The root's checked list of one tensor per member (gather outputs, scatter inputs); None elsewhere."""
        if self.group_rank != root:
            _check_tensors(op, [tensor])
            if tensor_lists and any(tensor_lists):
                raise ConfigError(f"wanlink {op}: only the root (rank {root}) passes {kind} tensors")
            return None
        tensors = _single(op, tensor_lists)
        self._check_one_per_member(op, tensors, kind, who="root ")
        _check_tensors(op, [tensor, *tensors])
        _same_numel(op, tensors, tensor.numel(), f"{kind} tensor")
        return tensors

    def _check_root(self, op: str, root: int) -> None:
        if not 0 <= root < self.group_size:
            raise ConfigError(f"wanlink {op}: root {root} is not a rank of a group of {self.group_size}")

    # -- algorithm choice (shared by single and coalesced calls) ----------------------------------
    async def _run_allreduce(self, comm: Comm, buffer: torch.Tensor, reducer, name: str) -> None:
        await (direct.allreduce if self._is_small(_nbytes(buffer)) else ring.allreduce)(comm, buffer, reducer)
        if name == "avg":
            finish_average(buffer, self.group_size)

    async def _run_reduce_scatter(self, comm: Comm, blocks: list[torch.Tensor], result: torch.Tensor,
                                  reducer, name: str) -> None:
        if self._is_small(_nbytes(result) * self.group_size):
            await direct.reduce_scatter(comm, blocks, result, reducer)
        else:
            await ring.reduce_scatter_into(comm, blocks, result, reducer)
        if name == "avg":
            finish_average(result, self.group_size)

    async def _run_all_gather(self, comm: Comm, source: torch.Tensor, targets: list[torch.Tensor]) -> None:
        if self._is_small(sum(_nbytes(target) for target in targets)):
            await direct.all_gather(comm, source, targets)
        else:
            targets[self.group_rank].copy_(source)
            await ring.all_gather(comm, targets)

    # -- reductions ---------------------------------------------------------------------------
    def allreduce(self, tensors, opts=None):
        op = "all_reduce"
        tensor = _single(op, tensors)
        _check_tensors(op, [tensor])
        name = _reduce_name(op, opts.reduceOp if opts is not None else dist.ReduceOp.SUM)
        reducer = reducer_for(name, tensor.dtype, op)
        staging = Staging()
        buffer = staging.write(tensor, fill=True)

        async def body(comm: Comm) -> None:
            await self._run_allreduce(comm, buffer, reducer, name)

        return self._collective(op, (tensor.dtype, tensor.numel(), -1), body, staging, list(tensors), opts)

    def allreduce_coalesced(self, tensors, opts=None):
        op = "all_reduce_coalesced"
        _check_tensors(op, tensors)
        if not tensors:
            raise ConfigError(f"wanlink {op}: no tensors given")
        name = _reduce_name(op, opts.reduceOp if opts is not None else dist.ReduceOp.SUM)
        reducer = reducer_for(name, tensors[0].dtype, op)
        staging = Staging()
        flat = torch.cat([staging.read(tensor) for tensor in tensors])

        async def body(comm: Comm) -> None:
            await self._run_allreduce(comm, flat, reducer, name)
            _copy_parts(flat, tensors)

        return self._collective(op, (flat.dtype, flat.numel(), -1), body, staging, list(tensors), opts)

    def _reduce_scatter_blocks(self, op: str, blocks: list[torch.Tensor], output: torch.Tensor,
                               name: str, staging: Staging, outputs: list, opts) -> WanlinkWork:
        reducer = reducer_for(name, output.dtype, op)
        result = staging.write(output)

        async def body(comm: Comm) -> None:
            await self._run_reduce_scatter(comm, blocks, result, reducer, name)

        return self._collective(op, (output.dtype, output.numel(), -1), body, staging, outputs, opts)

    def reduce_scatter(self, output_tensors, input_tensors, opts=None):
        op = "reduce_scatter"
        output = _single(op, output_tensors)
        inputs = _single(op, input_tensors)
        self._check_one_per_member(op, inputs, "input")
        _check_tensors(op, [output, *inputs])
        _same_numel(op, inputs, output.numel(), "input tensor")
        staging = Staging()
        blocks = [staging.read(tensor) for tensor in inputs]
        name = _reduce_name(op, opts.reduceOp if opts is not None else dist.ReduceOp.SUM)
        return self._reduce_scatter_blocks(op, blocks, output, name, staging, list(output_tensors), opts)

    def _reduce_scatter_base(self, output, input, opts=None):  # noqa: A002 - torch's name
        op = "reduce_scatter_tensor"
        _check_tensors(op, [output, input])
        if input.numel() != output.numel() * self.group_size:
            raise ConfigError(f"wanlink {op}: input must have {self.group_size} x {output.numel()} elements, "
                              f"got {input.numel()}")
        staging = Staging()
        blocks = self._blocks_of(input, output, staging)
        name = _reduce_name(op, opts.reduceOp if opts is not None else dist.ReduceOp.SUM)
        return self._reduce_scatter_blocks(op, blocks, output, name, staging, [output], opts)

    def _blocks_of(self, source: torch.Tensor, output: torch.Tensor, staging: Staging) -> list[torch.Tensor]:
        """The per-rank blocks of a reduce_scatter_tensor input (copied when ``output`` lies inside it)."""
        in_place = output.untyped_storage().data_ptr() == source.untyped_storage().data_ptr()
        return list(split(staging.scratch(source) if in_place else staging.read(source), self.group_size))

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):
        """Several reduce_scatter_tensor calls as one Work. Small ones are reduced together (block k of
        each, concatenated, goes to rank k: one round instead of one each); large ones run as their
        own reduce-scatters, all at once."""
        op = "reduce_scatter_tensor_coalesced"
        _check_batch(op, outputs, inputs)
        _check_tensors(op, [*outputs, *inputs])
        for output, source in zip(outputs, inputs):
            if source.numel() != output.numel() * self.group_size:
                raise ConfigError(f"wanlink {op}: each input must have {self.group_size} x its output's "
                                  f"{output.numel()} elements, got {source.numel()}")
        name = _reduce_name(op, opts.reduceOp if opts is not None else dist.ReduceOp.SUM)
        dtype = outputs[0].dtype
        reducer = reducer_for(name, dtype, op)
        staging = Staging()
        is_small = [self._is_small(_nbytes(output) * self.group_size) for output in outputs]
        small = [i for i, flag in enumerate(is_small) if flag]
        jobs = [(self._blocks_of(source, output, staging), staging.write(output))  # (blocks, result) each
                for flag, output, source in zip(is_small, outputs, inputs) if not flag]
        joint = [outputs[i] for i in small]
        if joint:
            stacked = torch.empty(self.group_size, sum(output.numel() for output in joint), dtype=dtype)
            with torch.no_grad():  # row k: block k of every small input
                for i, part in zip(small, stacked.split([output.numel() for output in joint], dim=1)):
                    part.copy_(inputs[i].detach().reshape(part.shape))
            jobs.append((list(stacked), torch.empty(stacked.shape[1], dtype=dtype)))

        async def body(*comms: Comm) -> None:
            await gather_all([self._run_reduce_scatter(comm, blocks, result, reducer, name)
                              for comm, (blocks, result) in zip(comms, jobs)])
            if joint:
                _copy_parts(jobs[-1][1], joint)

        total = sum(output.numel() for output in outputs)
        return self._collective(op, (dtype, total, -1), body, staging, list(outputs), opts, parts=len(jobs))

    def reduce(self, tensors, opts=None):
        op = "reduce"
        tensor = _single(op, tensors)
        _check_tensors(op, [tensor])
        root = opts.rootRank if opts is not None else 0
        self._check_root(op, root)
        name = _reduce_name(op, opts.reduceOp if opts is not None else dist.ReduceOp.SUM)
        reducer = reducer_for(name, tensor.dtype, op)
        staging = Staging()
        is_root = self.group_rank == root
        small = self._is_small(_nbytes(tensor))
        buffer = staging.write(tensor, fill=True) if is_root else staging.read(tensor)

        async def body(comm: Comm) -> None:
            await (direct.reduce if small else ring.reduce)(comm, buffer, root, reducer)
            if is_root and name == "avg":
                finish_average(buffer, self.group_size)

        return self._collective(op, (tensor.dtype, tensor.numel(), root), body, staging, list(tensors), opts)

    # -- data movement ------------------------------------------------------------------------
    def broadcast(self, tensors, opts=None):
        op = "broadcast"
        tensor = _single(op, tensors)
        _check_tensors(op, [tensor])
        root = opts.rootRank if opts is not None else 0
        self._check_root(op, root)
        staging = Staging()
        buffer = staging.read(tensor) if self.group_rank == root else staging.write(tensor)

        async def body(comm: Comm) -> None:
            await (direct.broadcast if self._is_small(_nbytes(buffer)) else ring.broadcast)(comm, buffer, root)

        return self._collective(op, (tensor.dtype, tensor.numel(), root), body, staging, list(tensors), opts)

    def _all_gather_into(self, op: str, source: torch.Tensor, targets: list[torch.Tensor],
                         staging: Staging, outputs: list, opts) -> WanlinkWork:
        async def body(comm: Comm) -> None:
            await self._run_all_gather(comm, source, targets)

        return self._collective(op, (source.dtype, source.numel(), -1), body, staging, outputs, opts)

    def allgather(self, output_tensors, input_tensors, opts=None):
        op = "all_gather"
        tensor = _single(op, input_tensors)
        outputs = _single(op, output_tensors)
        self._check_one_per_member(op, outputs, "output")
        _check_tensors(op, [tensor, *outputs])
        if outputs[self.group_rank].numel() != tensor.numel():
            raise ConfigError(f"wanlink {op}: output[{self.group_rank}] must match the input's "
                              f"{tensor.numel()} elements")
        staging = Staging()
        source = staging.read(tensor)
        targets = [staging.write(output) for output in outputs]
        return self._all_gather_into(op, source, targets, staging, list(output_tensors), opts)

    def _allgather_base(self, output, input, opts=None):  # noqa: A002 - torch's name
        op = "all_gather_into_tensor"
        _check_tensors(op, [output, input])
        if output.numel() != input.numel() * self.group_size:
            raise ConfigError(f"wanlink {op}: output must have {self.group_size} x {input.numel()} elements, "
                              f"got {output.numel()}")
        staging = Staging()
        source = staging.read(input)
        targets = list(split(staging.write(output), self.group_size))
        return self._all_gather_into(op, source, targets, staging, [output], opts)

    def _all_gather_batch(self, op: str, inputs: Sequence[torch.Tensor], destinations: list[list[torch.Tensor]],
                          staging: Staging, outputs: list, opts) -> WanlinkWork:
        """Rank k's inputs[i] lands in destinations[k][i], as one Work. Small inputs travel together
        as one all-gather of their bytes, concatenated (one round instead of one each); large ones
        run as their own all-gathers, all at once."""
        is_small = [self._is_small(_nbytes(tensor) * self.group_size) for tensor in inputs]
        small = [i for i, flag in enumerate(is_small) if flag]
        jobs = [(staging.read(tensor), [staging.write(row[i]) for row in destinations])  # (source, targets) each
                for i, (flag, tensor) in enumerate(zip(is_small, inputs)) if not flag]
        if small:
            sources = [staging.read(inputs[i]).view(torch.uint8) for i in small]
            gathered = list(torch.empty(self.group_size, sum(source.numel() for source in sources), dtype=torch.uint8))
            torch.cat(sources, out=gathered[self.group_rank])  # a private copy: outputs may overlap inputs
            landing = [[staging.write(row[i]).view(torch.uint8) for i in small] for row in destinations]
            jobs.append((gathered[self.group_rank], gathered))

        async def body(*comms: Comm) -> None:
            await gather_all([self._run_all_gather(comm, source, targets)
                              for comm, (source, targets) in zip(comms, jobs)])
            if small:
                for target, row in zip(gathered, landing):
                    _copy_parts(target, row)

        dtypes = {tensor.dtype for tensor in inputs}
        count = sum(t.numel() for t in inputs) if len(dtypes) == 1 else sum(_nbytes(t) for t in inputs)
        fingerprint = (inputs[0].dtype if len(dtypes) == 1 else torch.uint8, count, -1)
        return self._collective(op, fingerprint, body, staging, outputs, opts, parts=len(jobs))

    def allgather_coalesced(self, output_lists, input_list, opts=None):
        """``output_lists[k][i]`` = rank k's ``input_list[i]``, every tensor in one collective."""
        op = "all_gather_coalesced"
        if not input_list or len(output_lists) != self.group_size:
            raise ConfigError(f"wanlink {op}: need at least one input and {self.group_size} output lists, "
                              f"got {len(input_list)} inputs and {len(output_lists)} lists")
        _check_tensors(op, input_list, same_dtype=False)
        for row in output_lists:
            _check_tensors(op, row, same_dtype=False)
            if len(row) != len(input_list) or any(output.dtype != source.dtype or output.numel() != source.numel()
                                                  for output, source in zip(row, input_list)):
                raise ConfigError(f"wanlink {op}: every output list must hold one tensor of each input's "
                                  f"dtype and size")
        return self._all_gather_batch(op, input_list, output_lists, Staging(), [list(row) for row in output_lists],
                                      opts)

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        """Several all_gather_into_tensor calls as one collective (``_coalescing_manager``, FSDP)."""
        op = "all_gather_into_tensor_coalesced"
        _check_batch(op, outputs, inputs)
        _check_tensors(op, [*outputs, *inputs], same_dtype=False)
        for output, source in zip(outputs, inputs):
            if output.dtype != source.dtype or output.numel() != source.numel() * self.group_size:
                raise ConfigError(f"wanlink {op}: each output must have {self.group_size} x its input's "
                                  f"{source.numel()} elements of {source.dtype}, "
                                  f"got {output.numel()} of {output.dtype}")
        staging = Staging()
        chunks = [split(staging.write(output), self.group_size) for output in outputs]
        destinations = [[chunk[k] for chunk in chunks] for k in range(self.group_size)]
        return self._all_gather_batch(op, inputs, destinations, staging, list(outputs), opts)

    def gather(self, output_tensors, input_tensors, opts=None):
        op = "gather"
        tensor = _single(op, input_tensors)
        root = opts.rootRank if opts is not None else 0
        self._check_root(op, root)
        staging = Staging()
        source = staging.read(tensor)
        outputs = self._root_tensor_list(op, output_tensors, tensor, root, "output")
        targets = None if outputs is None else [staging.write(output) for output in outputs]

        async def body(comm: Comm) -> None:
            await direct.gather(comm, source, root, targets)

        return self._collective(op, (tensor.dtype, tensor.numel(), root), body, staging, list(output_tensors), opts)

    def scatter(self, output_tensors, input_tensors, opts=None):
        op = "scatter"
        tensor = _single(op, output_tensors)
        root = opts.rootRank if opts is not None else 0
        self._check_root(op, root)
        staging = Staging()
        inputs = self._root_tensor_list(op, input_tensors, tensor, root, "input")
        sources = None if inputs is None else [staging.read(item) for item in inputs]
        target = staging.write(tensor)

        async def body(comm: Comm) -> None:
            await direct.scatter(comm, sources, root, target)

        return self._collective(op, (tensor.dtype, tensor.numel(), root), body, staging, list(output_tensors), opts)

    def alltoall(self, output_tensors, input_tensors, opts=None):
        op = "all_to_all"
        self._check_one_per_member(op, input_tensors, "input")
        self._check_one_per_member(op, output_tensors, "output")
        _check_tensors(op, [*output_tensors, *input_tensors])
        if output_tensors[self.group_rank].numel() != input_tensors[self.group_rank].numel():
            raise ConfigError(f"wanlink {op}: output[{self.group_rank}] and input[{self.group_rank}] differ in size")
        staging = Staging()
        sources = [staging.read(tensor) for tensor in input_tensors]
        targets = [staging.write(tensor) for tensor in output_tensors]

        async def body(comm: Comm) -> None:
            await direct.all_to_all(comm, sources, targets)

        return self._collective(op, (input_tensors[0].dtype, VARIES, -1), body, staging, list(output_tensors), opts)

    def _split_rows(self, op: str, tensor: torch.Tensor, split_sizes: Sequence[int]) -> list[int]:
        """Element counts of the per-rank blocks of ``tensor`` split along dim 0."""
        rows = tensor.shape[0] if tensor.dim() else 1
        if not split_sizes:
            if rows % self.group_size:
                raise ConfigError(f"wanlink {op}: dim 0 ({rows}) is not divisible by the group size "
                                  f"{self.group_size}; pass split sizes")
            split_sizes = [rows // self.group_size] * self.group_size
        if len(split_sizes) != self.group_size or sum(split_sizes) != rows or min(split_sizes) < 0:
            raise ConfigError(f"wanlink {op}: split sizes {list(split_sizes)} do not split {rows} rows "
                              f"among {self.group_size} ranks")
        row_numel = tensor.numel() // rows if rows else 0
        return [size * row_numel for size in split_sizes]

    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts=None):  # noqa: A002
        op = "all_to_all_single"
        _check_tensors(op, [output, input])
        input_counts = self._split_rows(op, input, input_split_sizes)
        output_counts = self._split_rows(op, output, output_split_sizes)
        if input_counts[self.group_rank] != output_counts[self.group_rank]:
            raise ConfigError(f"wanlink {op}: this rank sends itself {input_counts[self.group_rank]} elements "
                              f"but expects {output_counts[self.group_rank]}")
        staging = Staging()
        sources = list(staging.read(input).split(input_counts))
        targets = list(staging.write(output).split(output_counts))

        async def body(comm: Comm) -> None:
            await direct.all_to_all(comm, sources, targets)

        return self._collective(op, (input.dtype, VARIES, -1), body, staging, [output], opts)

    # -- synchronisation ----------------------------------------------------------------------
    def barrier(self, opts=None):
        async def body(comm: Comm) -> None:
            await direct.barrier(comm)

        return self._collective("barrier", (None, 0, -1), body, Staging(), [], opts)

    def monitored_barrier(self, timeout=None, wait_all_ranks: bool = False):
        """Rank 0 waits for every rank and names the ones that did not arrive (DeadlineExceeded)."""
        seconds = timeout.total_seconds() if isinstance(timeout, timedelta) and timeout.total_seconds() > 0 \
            else self.default_timeout.total_seconds()
        sequence = self._next_sequence()

        async def body() -> None:
            comm = LinkComm(self, tags.collective_tag(self.slot, sequence))
            if self.detail:
                await check_fingerprint(comm, Fingerprint(sequence, "monitored_barrier", None, 0), self.label)
            await monitored_barrier_exchange(comm, seconds, wait_all_ranks)

        work = self._launch("monitored_barrier", f"monitored_barrier #{sequence}", body(), [], seconds * 2 + 1)
        work.wait()

    # -- point to point -----------------------------------------------------------------------
    def _p2p(self, op: str, tensors, peer: int | None, tag: int, sending: bool) -> WanlinkWork:
        """Send to or receive from ``peer`` (a group rank; None: receive from whichever rank sends)."""
        tensor = _single(op, tensors)
        _check_tensors(op, [tensor])
        others = [rank for rank in range(self.group_size) if rank != self.group_rank]
        if peer is None:
            if not others:
                raise ConfigError(f"wanlink {op}: a group of one has no other rank to receive from")
            if tensor.numel() == 0:
                raise UnsupportedError(f"wanlink {op}: an empty tensor carries no message, so its sender "
                                       f"cannot be found; pass src=")
        elif peer not in others:
            raise ConfigError(f"wanlink {op}: peer {peer} is not another rank of a group of {self.group_size}")
        comm = LinkComm(self, tags.p2p_tag(self.slot, tag), current_deadline())
        staging = Staging()
        buffer = staging.read(tensor) if sending else staging.write(tensor)

        async def body() -> int:
            source = peer
            if sending:
                await comm.send(peer, buffer)
            elif peer is None:
                source = await comm.recv_any(others, buffer)
            else:
                await comm.recv(peer, buffer)
            staging.finish()
            return source

        label = f"{op} {'any rank' if peer is None else f'peer {peer}'} tag {tag}"
        return self._launch(op, label, body(), list(tensors), self._deadline_seconds(), reports_source=not sending)

    def send(self, tensors, dstRank: int, tag: int):  # noqa: N803 - torch's names
        return self._p2p("send", tensors, dstRank, tag, sending=True)

    def recv(self, tensors, srcRank: int, tag: int):  # noqa: N803
        return self._p2p("recv", tensors, srcRank, tag, sending=False)

    def recv_anysource(self, tensors, tag: int):
        """Receive from whichever rank sends on ``tag`` first; ``work._source_rank()`` names it."""
        return self._p2p("recv", tensors, None, tag, sending=False)

    # torch >= 2.13 names; the underscore names are what older torch calls
    all_gather_single = _allgather_base
    reduce_scatter_single = _reduce_scatter_base
    all_to_all_single = alltoall_base

    all_gather_single_coalesced = allgather_into_tensor_coalesced
    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced

    # -- lifecycle ----------------------------------------------------------------------------
    def shutdown(self) -> None:
        if self.owns_mesh:
            self._drain()
            from wanlink.c10d import backend

            backend.forget_mesh(self.mesh)
            self.mesh.close()

    def abort(self) -> None:
        if self.owns_mesh:
            from wanlink.c10d import backend

            backend.forget_mesh(self.mesh)
            self.mesh.close()

    def _drain(self) -> None:
        """Best-effort barrier before closing links, so no peer is still waiting for our acks."""
        sequence = self._next_sequence()

        async def barrier() -> None:
            await direct.barrier(LinkComm(self, tags.collective_tag(self.slot, sequence)))

        try:
            self.mesh.runtime.run(barrier(), timeout=min(SHUTDOWN_DRAIN_SECONDS, self.default_timeout.total_seconds()))
        except Exception as error:  # noqa: BLE001 - peers may be gone already; closing anyway
            logger.debug("shutdown drain of group %r: %r", self.label, error)


async def monitored_barrier_exchange(comm: Comm, seconds: float, wait_all_ranks: bool) -> None:
    """Everyone reports to rank 0, which then releases everyone; rank 0 names latecomers."""
    me, n = comm.rank, comm.size
    token = torch.ones(1, dtype=torch.uint8)
    if me != 0:
        await comm.send(0, token)
        await comm.recv(0, torch.empty(1, dtype=torch.uint8))
        return
    arrivals = {peer: asyncio.ensure_future(comm.recv(peer, torch.empty(1, dtype=torch.uint8)))
                for peer in range(1, n)}
    done, pending = await asyncio.wait(arrivals.values(), timeout=seconds,
                                       return_when=asyncio.ALL_COMPLETED if wait_all_ranks
                                       else asyncio.FIRST_EXCEPTION)
    missing = [peer for peer, task in arrivals.items() if task in pending]
    failed = [peer for peer, task in arrivals.items() if task in done and task.exception() is not None]
    for task in pending:
        task.cancel()
    if missing or failed:
        culprits = sorted(missing + failed) if wait_all_ranks else sorted(missing + failed)[:1]
        raise DeadlineExceeded(f"wanlink monitored_barrier: rank(s) {culprits} did not reach the barrier "
                               f"within {seconds:g} s")
    await gather_all([comm.send(peer, token) for peer in range(1, n)])
