"""ProcessGroupWanlink: a torch.distributed ProcessGroup whose collectives run over wanlink Links.

Each call validates its arguments in the caller's thread (unsupported things raise at once),
stages tensors into flat CPU buffers, and submits one coroutine to the process's I/O loop; the
returned Work finishes when that coroutine does. Small tensors use direct exchange, large ones
pipelined rings (``wanlink.collectives``), or the site-aware algorithms when the group spans
sites where they pay off (docs/sites.md).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from datetime import timedelta
from typing import Awaitable, Callable, Coroutine, Sequence

import torch
from torch._C._distributed_c10d import ProcessGroup

from wanlink.c10d import striped_p2p, tags
from wanlink.c10d.checks import (check_batch, check_one_per_member, check_sparse, check_tensors, nbytes,
                                 reduce_name, root_of, root_tensor_list, same_numel, single, split_counts)
from wanlink.c10d.deadlines import URGENT, current_deadline
from wanlink.c10d.debug import VARIES, Fingerprint, check_fingerprint
from wanlink.c10d.express import LOST_POLL_S, ExpressGroup
from wanlink.c10d.gc_freeze import freeze_gc_once
from wanlink.c10d.identity import GroupIdentity
from wanlink.c10d.link_comm import LinkComm, silent_peers
from wanlink.c10d.mesh import Mesh
from wanlink.c10d.staging import Staging, copy_parts
from wanlink.c10d.work import WanlinkWork
from wanlink.collectives import direct, sparse
from wanlink.collectives.choice import ROUND_BASED, AlgorithmChoice
from wanlink.collectives.base import Comm, gather_all, split
from wanlink.collectives.reduce_ops import reducer_for
from wanlink.errors import ConfigError, DeadlineExceeded, PeerLost, UnsupportedError
from wanlink.settings import Settings

logger = logging.getLogger(__name__)

SILENT_S = 3.0
"""A peer whose link received nothing for this long (3 missed pings) is named as frozen in a timeout."""
SHUTDOWN_DRAIN_SECONDS = 10.0
"""Longest the world group waits at shutdown for peers to finish reading what it sent."""


class _Where:
    """What an op's errors call it, e.g. "wanlink all_reduce #3 (group 'g', rank 0 of 2)": formatted
    only when one is raised (a blocking 64 KiB collective takes ~100 us; the f-string took 5)."""

    __slots__ = ("label", "group", "sequence")

    def __init__(self, label: str, group: str, sequence: int | None = None):
        self.label, self.group, self.sequence = label, group, sequence

    def __str__(self) -> str:
        number = "" if self.sequence is None else f" #{self.sequence}"
        return f"wanlink {self.label}{number} {self.group}"


def _traced(op: str):
    """A profiler range named after ``op`` when torch's profiler runs (a range costs ~5 us and a GIL
    hand-off: only then)."""
    return torch.profiler.record_function(f"wanlink:{op}") if torch.autograd._profiler_enabled() \
        else contextlib.nullcontext()


class OpWatch:
    """One timer per op for both things that end it early: its timeout, and (for a collective, whose
    ``ranks`` are every member) a failed link to any member, checked every LOST_POLL_S on the loop,
    so that it fails at once naming that rank, even while it waits on another one. Either cancels
    the op's task; ``expired`` / ``lost`` then say why. (``asyncio.timeout`` beside a poll timer
    would cost a second timer and its context manager per op.)"""

    def __init__(self, mesh, ranks: Sequence[int], seconds: float):
        self.mesh, self.ranks = mesh, ranks
        self.task = asyncio.current_task()
        self.loop = self.task.get_loop()
        self.deadline = self.loop.time() + seconds
        self.lost: BaseException | None = None
        self.expired = False
        self._timer = self._next(self.loop.time())

    def _next(self, now: float) -> asyncio.TimerHandle:
        if self.ranks and now + LOST_POLL_S < self.deadline:
            return self.loop.call_at(now + LOST_POLL_S, self._check)
        return self.loop.call_at(self.deadline, self._expire)

    def _check(self) -> None:
        if not self._member_lost():
            self._timer = self._next(self.loop.time())

    def _expire(self) -> None:
        if not self._member_lost():
            self.expired = True
            self.task.cancel()

    def _member_lost(self) -> bool:
        self.lost = self.mesh.first_lost(self.ranks)
        if self.lost is not None:
            self.task.cancel()
        return self.lost is not None

    def stop(self) -> None:
        self._timer.cancel()


class ProcessGroupWanlink(GroupIdentity, ProcessGroup):
    """The "wanlink" backend: see docs/c10d.md."""

    def __init__(self, mesh: Mesh, owns_mesh: bool, mesh_ranks: Sequence[int], group_rank: int,
                 group_name: str, timeout: timedelta, settings: Settings, detail: bool = False):
        super().__init__(group_rank, len(mesh_ranks))
        self.mesh, self.owns_mesh = mesh, owns_mesh
        self.mesh_ranks = list(mesh_ranks)
        self.group_rank, self.group_size = group_rank, len(mesh_ranks)
        self.label, self.default_timeout = group_name, timeout
        self._group_name, self._group_desc = group_name, group_name
        self.slot = mesh.claim_slot(group_name)
        self.site_map = mesh.sites.subgroup(self.mesh_ranks)
        striped_p2p.serve(mesh, settings.stripe_min_bytes, settings.piece_bytes)  # relays on the loop thread
        self.algorithms = AlgorithmChoice.for_group(settings.direct_max_bytes, self.site_map)
        self.piece_bytes = settings.piece_bytes
        self.express = ExpressGroup.for_group(mesh, self.mesh_ranks, group_rank, self.slot, settings.piece_bytes)
        self.detail = detail  # TORCH_DISTRIBUTED_DEBUG=DETAIL: check every collective's fingerprint
        self._in_group = f"(group {self.label!r}, rank {self.group_rank} of {self.group_size})"
        self._sequence = 0
        self._sequence_lock = threading.Lock()
        freeze_gc_once(settings.gc_freeze)

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

    def _comm(self, base_tag: int, deadline: tuple = URGENT) -> LinkComm:
        return LinkComm(self.mesh, self.mesh_ranks, self.group_rank, self.piece_bytes, base_tag, deadline)

    def _timeout_seconds(self, timeout) -> float:
        """A call's timeout: its own when set (zero included: expires at once), else the group's.
        torch marks "unset" with a negative timedelta (-1 ms) in its options objects."""
        if isinstance(timeout, timedelta) and timeout >= timedelta(0):
            return timeout.total_seconds()
        return self.default_timeout.total_seconds()

    def _launch(self, op: str, label: str, body: Coroutine, outputs: list, seconds: float,
                comms: Sequence[LinkComm], reports_source: bool = False, everyone: bool = False) -> WanlinkWork:
        """Submit ``body`` to the I/O loop under a ``seconds`` timeout; its errors name the op and group.

        ``everyone``: every member takes part (a collective), so a failed link to any member fails
        ``body`` at once, naming that rank, even while it waits on another one.
        """
        where = _Where(label, self._in_group)
        work = WanlinkWork(op, outputs, reports_source, where)

        def timed_out() -> DeadlineExceeded:
            return self._timed_out(where, seconds, sorted({peer for comm in comms for peer in comm.waiting_for()}),
                                   everyone)

        async def guarded():
            try:
                if seconds <= 0:  # expired before it began: nothing is sent
                    body.close()
                    raise timed_out()
                watch = OpWatch(self.mesh, self.mesh_ranks if everyone else (), seconds)
                try:
                    result = await body  # (wait_for would run the body as one more task)
                except asyncio.CancelledError:
                    if watch.lost is None and not watch.expired:
                        raise
                    asyncio.current_task().uncancel()
                    if watch.lost is None:
                        raise timed_out() from None
                    raise PeerLost(f"{where}: this collective cannot complete: {watch.lost}") from watch.lost
                except asyncio.TimeoutError as error:
                    if isinstance(error, DeadlineExceeded):  # from inside the algorithm: it says whom it missed
                        raise DeadlineExceeded(f"{where}: {error}") from None
                    raise timed_out() from None
                except PeerLost as error:
                    raise PeerLost(f"{where}: {error}") from error
                finally:
                    watch.stop()
            except BaseException as error:  # the Work is told here, on the loop: no hand-off through futures
                work.fail(error)
                if not isinstance(error, Exception):  # cancellation, interpreter exit: the task ends so too
                    raise
            else:
                work.succeed(result)

        with _traced(op):
            self.mesh.runtime.start(guarded(), work.task_done)
        return work

    def _timed_out(self, where: _Where, seconds: float, waiting: list[int], everyone: bool = True) -> DeadlineExceeded:
        """What an op that ran out of its ``seconds`` raises: whom it ``waiting`` for (all others when
        unknown), and which of them, or with ``everyone`` (a collective) of all members, went silent
        (frozen or cut off) rather than merely late: a frozen member stalls members that wait on
        others, and its link may have failed of that silence already."""
        others = [rank for rank in range(self.group_size) if rank != self.group_rank]
        waiting = waiting or others
        suspects = others if everyone else waiting
        silent = silent_peers(self.mesh, self.mesh_ranks, suspects, SILENT_S)
        named = "".join(f"; rank {peer} sent nothing for {quiet:.1f} s (frozen or cut off; the others "
                        f"still ping)" for peer, quiet in sorted(silent.items()) if quiet != float("inf"))
        lost = ((peer, self.mesh.lost(self.mesh_ranks[peer])) for peer in suspects)
        named += "".join(f"; rank {peer}: {error}" for peer, error in lost if error is not None)
        return DeadlineExceeded(f"{where} timed out after {seconds:g} s waiting for rank(s) {waiting}: "
                                f"dead, stuck or not calling it{named}")

    def _collective(self, op: str, fingerprint: tuple, body: Callable[..., Awaitable[None]],
                    staging: Staging, outputs: list, opts=None, parts: int = 1,
                    algorithm: Callable | None = None) -> WanlinkWork:
        """Run ``body`` under a fresh sequence number; write staged outputs back at the end.

        ``parts`` > 1 (coalesced calls): ``body`` gets that many Comms, one per sub-collective, each
        with its own sequence number and so its own tags. ``algorithm``: the one ``body`` runs, when
        it runs one; one of ``ROUND_BASED`` takes a same-host group's express path (c10d/express.py).
        """
        sequence = self._next_sequence(parts)
        dtype, count, root = fingerprint
        express = self.express is not None and algorithm in ROUND_BASED
        if express:
            comms = [self.express.comm(sequence)]
        else:
            deadline = current_deadline()  # the launching thread's deadline_scope, URGENT outside one
            comms = [self._comm(tags.collective_tag(self.slot, sequence + k), deadline) for k in range(parts)]

        async def run() -> None:
            if self.detail:
                await check_fingerprint(comms[0], Fingerprint(sequence, op, dtype, count, root), self.label)
            await body(*comms)
            staging.finish()
            for comm in comms:
                comm.release()  # only on success: after a failure a send may still read its buffer

        seconds = self._timeout_seconds(getattr(opts, "timeout", None))
        if not express:
            return self._launch(op, f"{op} #{sequence}", run(), outputs, seconds, comms, everyone=True)
        where = _Where(op, self._in_group, sequence)
        work = WanlinkWork(op, outputs, False, where)
        with _traced(op):
            self.express.submit(work, where, run(), comms[0], seconds,
                                lambda waiting: self._timed_out(where, seconds, waiting),
                                blocking=not getattr(opts, "asyncOp", True))
        return work

    def sites(self) -> dict:
        """This rank's site and LocalDPRank and the group's cells (``wanlink.c10d.site_map``)."""
        return {**self.site_map.describe(self.group_rank), "site_aware": self.algorithms.site_aware}

    # -- reductions ---------------------------------------------------------------------------
    def allreduce(self, tensors, opts=None):
        """``dist.all_reduce``."""
        op = "all_reduce"
        tensor = single(op, tensors)
        if tensor.layout == torch.sparse_coo:
            return self._sparse_allreduce(op, tensor, opts)
        check_tensors(op, [tensor])
        name = reduce_name(op, opts)
        reducer = reducer_for(name, tensor.dtype, op)
        staging = Staging()
        buffer = staging.write(tensor, fill=True)

        algorithm = self.algorithms.allreduce_algorithm(self.group_size, self.piece_bytes, buffer)

        async def body(comm: Comm) -> None:
            await self.algorithms.allreduce(comm, buffer, reducer, name, algorithm)

        return self._collective(op, (tensor.dtype, tensor.numel(), -1), body, staging, list(tensors), opts,
                                algorithm=algorithm)

    def _sparse_allreduce(self, op: str, tensor: torch.Tensor, opts) -> WanlinkWork:
        """All-reduce of a sparse COO tensor: ``tensor`` becomes the coalesced sum, as with gloo."""
        check_sparse(op, tensor, opts)
        local = tensor.detach().coalesce().cpu()

        async def body(comm: Comm) -> None:
            summed = await sparse.allreduce_coo(comm, local)
            with torch.no_grad():
                tensor.copy_(summed)

        return self._collective(op, (tensor.dtype, tensor.numel(), -1), body, Staging(), [tensor], opts)

    def allreduce_coalesced(self, tensors, opts=None):
        """``dist.all_reduce_coalesced``: every tensor in one collective."""
        op = "all_reduce_coalesced"
        check_tensors(op, tensors)
        if not tensors:
            raise ConfigError(f"wanlink {op}: no tensors given")
        name = reduce_name(op, opts)
        reducer = reducer_for(name, tensors[0].dtype, op)
        staging = Staging()
        flat = torch.cat([staging.read(tensor) for tensor in tensors])

        algorithm = self.algorithms.allreduce_algorithm(self.group_size, self.piece_bytes, flat)

        async def body(comm: Comm) -> None:
            await self.algorithms.allreduce(comm, flat, reducer, name, algorithm)
            copy_parts(flat, tensors)

        return self._collective(op, (flat.dtype, flat.numel(), -1), body, staging, list(tensors), opts,
                                algorithm=algorithm)

    def _reduce_scatter_blocks(self, op: str, blocks: list[torch.Tensor], output: torch.Tensor,
                               name: str, staging: Staging, outputs: list, opts) -> WanlinkWork:
        reducer = reducer_for(name, output.dtype, op)
        result = staging.write(output)

        algorithm = self.algorithms.reduce_scatter_algorithm(self.group_size, self.piece_bytes, result)

        async def body(comm: Comm) -> None:
            await self.algorithms.reduce_scatter(comm, blocks, result, reducer, name, algorithm)

        return self._collective(op, (output.dtype, output.numel(), -1), body, staging, outputs, opts,
                                algorithm=algorithm)

    def reduce_scatter(self, output_tensors, input_tensors, opts=None):
        """``dist.reduce_scatter``."""
        op = "reduce_scatter"
        output = single(op, output_tensors)
        inputs = single(op, input_tensors)
        check_one_per_member(op, inputs, self.group_size, "input")
        check_tensors(op, [output, *inputs])
        same_numel(op, inputs, output.numel(), "input tensor")
        staging = Staging()
        blocks = [staging.read(tensor) for tensor in inputs]
        name = reduce_name(op, opts)
        return self._reduce_scatter_blocks(op, blocks, output, name, staging, list(output_tensors), opts)

    def _reduce_scatter_base(self, output, input, opts=None):  # noqa: A002 - torch's name
        """``dist.reduce_scatter_tensor``."""
        op = "reduce_scatter_tensor"
        check_tensors(op, [output, input])
        if input.numel() != output.numel() * self.group_size:
            raise ConfigError(f"wanlink {op}: input must have {self.group_size} x {output.numel()} elements, "
                              f"got {input.numel()}")
        staging = Staging()
        blocks = self._blocks_of(input, output, staging)
        name = reduce_name(op, opts)
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
        check_batch(op, outputs, inputs)
        check_tensors(op, [*outputs, *inputs])
        for output, source in zip(outputs, inputs):
            if source.numel() != output.numel() * self.group_size:
                raise ConfigError(f"wanlink {op}: each input must have {self.group_size} x its output's "
                                  f"{output.numel()} elements, got {source.numel()}")
        name = reduce_name(op, opts)
        dtype = outputs[0].dtype
        reducer = reducer_for(name, dtype, op)
        staging = Staging()
        is_small = [self.algorithms.is_small(nbytes(output) * self.group_size) for output in outputs]
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
            await gather_all([self.algorithms.reduce_scatter(comm, blocks, result, reducer, name)
                              for comm, (blocks, result) in zip(comms, jobs)])
            if joint:
                copy_parts(jobs[-1][1], joint)

        total = sum(output.numel() for output in outputs)
        return self._collective(op, (dtype, total, -1), body, staging, list(outputs), opts, parts=len(jobs))

    def reduce(self, tensors, opts=None):
        """``dist.reduce``."""
        op = "reduce"
        tensor = single(op, tensors)
        check_tensors(op, [tensor])
        root = root_of(op, opts, self.group_size)
        name = reduce_name(op, opts)
        reducer = reducer_for(name, tensor.dtype, op)
        staging = Staging()
        is_root = self.group_rank == root
        buffer = staging.write(tensor, fill=True) if is_root else staging.read(tensor)

        algorithm = self.algorithms.reduce_algorithm(buffer)

        async def body(comm: Comm) -> None:
            await self.algorithms.reduce(comm, buffer, root, reducer, name, algorithm)

        return self._collective(op, (tensor.dtype, tensor.numel(), root), body, staging, list(tensors), opts,
                                algorithm=algorithm)

    # -- data movement ------------------------------------------------------------------------
    def broadcast(self, tensors, opts=None):
        """``dist.broadcast``."""
        op = "broadcast"
        tensor = single(op, tensors)
        check_tensors(op, [tensor])
        root = root_of(op, opts, self.group_size)
        staging = Staging()
        buffer = staging.read(tensor) if self.group_rank == root else staging.write(tensor)

        algorithm = self.algorithms.broadcast_algorithm(self.piece_bytes, buffer)

        async def body(comm: Comm) -> None:
            await self.algorithms.broadcast(comm, buffer, root, algorithm)

        return self._collective(op, (tensor.dtype, tensor.numel(), root), body, staging, list(tensors), opts,
                                algorithm=algorithm)

    def _all_gather_into(self, op: str, source: torch.Tensor, targets: list[torch.Tensor],
                         staging: Staging, outputs: list, opts) -> WanlinkWork:
        algorithm = self.algorithms.all_gather_algorithm(self.piece_bytes, targets)

        async def body(comm: Comm) -> None:
            await self.algorithms.all_gather(comm, source, targets, algorithm)

        return self._collective(op, (source.dtype, source.numel(), -1), body, staging, outputs, opts,
                                algorithm=algorithm)

    def allgather(self, output_tensors, input_tensors, opts=None):
        """``dist.all_gather``."""
        op = "all_gather"
        tensor = single(op, input_tensors)
        outputs = single(op, output_tensors)
        check_one_per_member(op, outputs, self.group_size, "output")
        check_tensors(op, [tensor, *outputs])
        if outputs[self.group_rank].numel() != tensor.numel():
            raise ConfigError(f"wanlink {op}: output[{self.group_rank}] must match the input's "
                              f"{tensor.numel()} elements")
        staging = Staging()
        source = staging.read(tensor)
        targets = [staging.write(output) for output in outputs]
        return self._all_gather_into(op, source, targets, staging, list(output_tensors), opts)

    def _allgather_base(self, output, input, opts=None):  # noqa: A002 - torch's name
        """``dist.all_gather_into_tensor``."""
        op = "all_gather_into_tensor"
        check_tensors(op, [output, input])
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
        is_small = [self.algorithms.is_small(nbytes(tensor) * self.group_size) for tensor in inputs]
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
            await gather_all([self.algorithms.all_gather(comm, source, targets)
                              for comm, (source, targets) in zip(comms, jobs)])
            if small:
                for target, row in zip(gathered, landing):
                    copy_parts(target, row)

        dtypes = {tensor.dtype for tensor in inputs}
        count = sum(t.numel() for t in inputs) if len(dtypes) == 1 else sum(nbytes(t) for t in inputs)
        fingerprint = (inputs[0].dtype if len(dtypes) == 1 else torch.uint8, count, -1)
        return self._collective(op, fingerprint, body, staging, outputs, opts, parts=len(jobs))

    def allgather_coalesced(self, output_lists, input_list, opts=None):
        """``dist.all_gather_coalesced``: ``output_lists[k][i]`` = rank k's ``input_list[i]``, in one collective."""
        op = "all_gather_coalesced"
        if not input_list or len(output_lists) != self.group_size:
            raise ConfigError(f"wanlink {op}: need at least one input and {self.group_size} output lists, "
                              f"got {len(input_list)} inputs and {len(output_lists)} lists")
        check_tensors(op, input_list, same_dtype=False)
        for row in output_lists:
            check_tensors(op, row, same_dtype=False)
            if len(row) != len(input_list) or any(output.dtype != source.dtype or output.numel() != source.numel()
                                                  for output, source in zip(row, input_list)):
                raise ConfigError(f"wanlink {op}: every output list must hold one tensor of each input's "
                                  f"dtype and size")
        return self._all_gather_batch(op, input_list, output_lists, Staging(), [list(row) for row in output_lists],
                                      opts)

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        """Several all_gather_into_tensor calls as one collective (``_coalescing_manager``, FSDP)."""
        op = "all_gather_into_tensor_coalesced"
        check_batch(op, outputs, inputs)
        check_tensors(op, [*outputs, *inputs], same_dtype=False)
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
        """``dist.gather``."""
        op = "gather"
        tensor = single(op, input_tensors)
        root = root_of(op, opts, self.group_size)
        staging = Staging()
        source = staging.read(tensor)
        outputs = root_tensor_list(op, output_tensors, tensor, root, self.group_rank, self.group_size, "output")
        targets = None if outputs is None else [staging.write(output) for output in outputs]

        async def body(comm: Comm) -> None:
            await direct.gather(comm, source, root, targets)

        return self._collective(op, (tensor.dtype, tensor.numel(), root), body, staging, list(output_tensors), opts,
                                algorithm=direct.gather)

    def scatter(self, output_tensors, input_tensors, opts=None):
        """``dist.scatter``."""
        op = "scatter"
        tensor = single(op, output_tensors)
        root = root_of(op, opts, self.group_size)
        staging = Staging()
        inputs = root_tensor_list(op, input_tensors, tensor, root, self.group_rank, self.group_size, "input")
        sources = None if inputs is None else [staging.read(item) for item in inputs]
        target = staging.write(tensor)

        async def body(comm: Comm) -> None:
            await direct.scatter(comm, sources, root, target)

        return self._collective(op, (tensor.dtype, tensor.numel(), root), body, staging, list(output_tensors), opts,
                                algorithm=direct.scatter)

    def alltoall(self, output_tensors, input_tensors, opts=None):
        """``dist.all_to_all``."""
        op = "all_to_all"
        check_one_per_member(op, input_tensors, self.group_size, "input")
        check_one_per_member(op, output_tensors, self.group_size, "output")
        check_tensors(op, [*output_tensors, *input_tensors])
        if output_tensors[self.group_rank].numel() != input_tensors[self.group_rank].numel():
            raise ConfigError(f"wanlink {op}: output[{self.group_rank}] and input[{self.group_rank}] differ in size")
        staging = Staging()
        sources = [staging.read(tensor) for tensor in input_tensors]
        targets = [staging.write(tensor) for tensor in output_tensors]

        async def body(comm: Comm) -> None:
            await direct.all_to_all(comm, sources, targets)

        return self._collective(op, (input_tensors[0].dtype, VARIES, -1), body, staging, list(output_tensors), opts,
                                algorithm=direct.all_to_all)

    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts=None):  # noqa: A002
        """``dist.all_to_all_single``."""
        op = "all_to_all_single"
        check_tensors(op, [output, input])
        input_counts = split_counts(op, input, input_split_sizes, self.group_size)
        output_counts = split_counts(op, output, output_split_sizes, self.group_size)
        if input_counts[self.group_rank] != output_counts[self.group_rank]:
            raise ConfigError(f"wanlink {op}: this rank sends itself {input_counts[self.group_rank]} elements "
                              f"but expects {output_counts[self.group_rank]}")
        staging = Staging()
        sources = list(staging.read(input).split(input_counts))
        targets = list(staging.write(output).split(output_counts))

        async def body(comm: Comm) -> None:
            await direct.all_to_all(comm, sources, targets)

        return self._collective(op, (input.dtype, VARIES, -1), body, staging, [output], opts,
                                algorithm=direct.all_to_all)

    # -- synchronisation ----------------------------------------------------------------------
    def barrier(self, opts=None):
        """``dist.barrier``."""
        async def body(comm: Comm) -> None:
            await direct.barrier(comm)

        return self._collective("barrier", (None, 0, -1), body, Staging(), [], opts, algorithm=direct.barrier)

    def monitored_barrier(self, timeout=None, wait_all_ranks: bool = False):
        """``wanlink.c10d.monitored_barrier`` (torch's ``dist.monitored_barrier`` takes gloo groups only)."""
        seconds = self._timeout_seconds(timeout)
        sequence = self._next_sequence()
        comm = self._comm(tags.collective_tag(self.slot, sequence))

        async def body() -> None:
            if self.detail:
                await check_fingerprint(comm, Fingerprint(sequence, "monitored_barrier", None, 0), self.label)
            await direct.monitored_barrier(comm, seconds, wait_all_ranks)

        # the algorithm times itself (and names the ranks it missed); this bound catches the rest
        self._launch("monitored_barrier", f"monitored_barrier #{sequence}", body(), [], 2 * seconds + 1,
                     [comm]).wait()

    # -- point to point -----------------------------------------------------------------------
    def _p2p(self, op: str, tensors, peer: int | None, tag: int, sending: bool) -> WanlinkWork:
        """Send to or receive from ``peer`` (a group rank; None: receive from whichever rank sends)."""
        tensor = single(op, tensors)
        check_tensors(op, [tensor])
        others = [rank for rank in range(self.group_size) if rank != self.group_rank]
        if peer is None:
            if not others:
                raise ConfigError(f"wanlink {op}: a group of one has no other rank to receive from")
            if tensor.numel() == 0:
                raise UnsupportedError(f"wanlink {op}: an empty tensor carries no message, so its sender "
                                       f"cannot be found; pass src=")
        elif peer not in others:
            raise ConfigError(f"wanlink {op}: peer {peer} is not another rank of a group of {self.group_size}")
        comm = self._comm(tags.p2p_tag(self.slot, tag), current_deadline())
        staging = Staging()
        buffer = staging.read(tensor) if sending else staging.write(tensor)

        async def body() -> int:
            source = peer
            if sending:  # large ones across sites: striped over the cell (docs/sites.md)
                await striped_p2p.send(comm, peer, buffer)
            elif peer is None:
                source = await striped_p2p.recv_any(comm, others, buffer)
            else:
                await striped_p2p.recv(comm, peer, buffer)
            staging.finish()
            return source

        label = f"{op} {'any rank' if peer is None else f'peer {peer}'} tag {tag}"
        return self._launch(op, label, body(), list(tensors), self._timeout_seconds(None), [comm],
                            reports_source=not sending)

    def send(self, tensors, dstRank: int, tag: int):  # noqa: N803 - torch's names
        """``dist.send`` / ``dist.isend``."""
        return self._p2p("send", tensors, dstRank, tag, sending=True)

    def recv(self, tensors, srcRank: int, tag: int):  # noqa: N803
        """``dist.recv`` / ``dist.irecv`` with ``src``."""
        return self._p2p("recv", tensors, srcRank, tag, sending=False)

    def recv_anysource(self, tensors, tag: int):
        """``dist.recv`` / ``dist.irecv`` without ``src``: from whichever rank sends on ``tag`` first.

        ``work._source_rank()`` names that rank.
        """
        return self._p2p("recv", tensors, None, tag, sending=False)

    # torch >= 2.13 names; the underscore names are what older torch calls
    all_gather_single = _allgather_base
    reduce_scatter_single = _reduce_scatter_base
    all_to_all_single = alltoall_base

    all_gather_single_coalesced = allgather_into_tensor_coalesced
    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced

    # -- lifecycle ----------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Drain, then close the links when this group owns them (``destroy_process_group``)."""
        if self.owns_mesh:
            self._drain()
        if self.express is not None:
            self.express.close()
        if self.owns_mesh:
            self.mesh.close()

    def abort(self) -> None:
        """Fail the express collectives and close the links at once (the links when this group owns them)."""
        if self.express is not None:
            self.express.abort()
        if self.owns_mesh:
            self.mesh.close()

    def _drain(self) -> None:
        """Best-effort barrier before closing links, so no peer is still waiting for our acks."""
        sequence = self._next_sequence()

        async def barrier() -> None:
            await direct.barrier(self._comm(tags.collective_tag(self.slot, sequence)))

        try:
            self.mesh.runtime.run(barrier(), timeout=min(SHUTDOWN_DRAIN_SECONDS, self.default_timeout.total_seconds()))
        except Exception as error:  # noqa: BLE001 - peers may be gone already; closing anyway
            logger.debug("shutdown drain of group %r: %r", self.label, error)

