"""The express path (wanlink/c10d/express.py, docs/c10d.md): a one-host group's round-based
collectives run over its own Unix sockets, and give gloo's results, in issue order, with the
timeouts, errors and recovery of the I/O loop's path.

Each rank records which collectives its groups ran on the express path (``ExpressGroup.submit``),
so every comparison below also checks that the path under test was the one taken. Each world is
spawned once (module cache) and its checks are separate tests.
"""
from __future__ import annotations

import functools
import os
import time
import traceback
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from tests.support.worlds import run_world

R = dist.ReduceOp
DIRECT = 1000  # elements: direct exchange at the default thresholds
HALVING = 1 << 18  # float32 elements (1 MiB): halving and doubling on 4 ranks, one-round exchanges otherwise


def record_express(group) -> list[str]:
    """The ``where`` of every collective ``group`` (a ProcessGroupWanlink) runs on its express path."""
    ran: list[str] = []
    submit = group.express.submit

    def recording(work, where, *args, **kwargs):
        ran.append(str(where))  # (formatted lazily: wanlink.c10d.process_group._Where)
        return submit(work, where, *args, **kwargs)

    group.express.submit = recording
    return ran


def make(rank: int, numel: int, dtype=torch.float32, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(rank * 101 + seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, (numel,), generator=generator).bool()
    return torch.randint(-3, 4, (numel,), generator=generator).to(dtype)  # exact in every dtype


def compare_with_gloo(rank: int, size: int, numel: int, ran: list[str]) -> dict:
    """Every collective on the default (wanlink) group against the same on a gloo group: name ->
    None, or what went wrong (a result differing from gloo's, or the express path not taken)."""
    gloo = dist.new_group(backend="gloo")
    outcomes = {}

    def check(name: str, op: str, call) -> None:
        before = len(ran)
        try:
            got, expected = call()
            if not any(f"wanlink {op} #" in where for where in ran[before:]):
                outcomes[name] = f"not on the express path: {ran[before:]}"
            elif not all(torch.equal(a, b) for a, b in zip(got, expected, strict=True)):
                outcomes[name] = f"differs from gloo: {[a.flatten()[:6] for a in got]} != " \
                                 f"{[b.flatten()[:6] for b in expected]}"
            else:
                outcomes[name] = None
        except Exception:  # noqa: BLE001 - reported per check
            outcomes[name] = traceback.format_exc(limit=6)

    def all_reduce(dtype, op):
        def call():
            tensor, expected = make(rank, numel, dtype), make(rank, numel, dtype)
            dist.all_reduce(expected, op=R.SUM if op == R.AVG else op, group=gloo)
            if op == R.AVG:
                expected = (expected / size).to(dtype)
            dist.all_reduce(tensor, op=op)
            return [tensor], [expected]
        return call

    for dtype, op in [(torch.float32, R.SUM), (torch.float32, R.AVG), (torch.float64, R.MAX),
                      (torch.int64, R.SUM), (torch.int32, R.MIN), (torch.bool, R.MAX), (torch.bool, R.SUM)]:
        check(f"all_reduce {dtype} {op}", "all_reduce", all_reduce(dtype, op))

    def broadcast():
        got, expected = [], []
        for root in range(size):
            tensor, reference = make(rank, numel, seed=root), make(rank, numel, seed=root)
            dist.broadcast(reference, src=root, group=gloo)
            dist.broadcast(tensor, src=root)
            got.append(tensor)
            expected.append(reference)
        return got, expected

    def all_gather():
        block = numel // size
        lists = [[torch.empty(block) for _ in range(size)] for _ in range(2)]
        dist.all_gather(lists[0], make(rank, block))
        dist.all_gather(lists[1], make(rank, block), group=gloo)
        return lists

    def all_gather_into_tensor():
        block = numel // size
        outputs = [torch.empty(block * size) for _ in range(2)]
        dist.all_gather_into_tensor(outputs[0], make(rank, block))
        dist.all_gather_into_tensor(outputs[1], make(rank, block), group=gloo)
        return [outputs[0]], [outputs[1]]

    def reduce_scatter():
        block = numel // size
        inputs = [make(rank, block, seed=k) for k in range(size)]
        outputs = [torch.empty(block) for _ in range(2)]
        dist.reduce_scatter(outputs[0], list(inputs))
        dist.reduce_scatter(outputs[1], list(inputs), group=gloo)
        return [outputs[0]], [outputs[1]]

    def reduce_scatter_tensor():
        block = numel // size
        outputs = [torch.empty(block) for _ in range(2)]
        dist.reduce_scatter_tensor(outputs[0], make(rank, block * size), op=R.MAX)
        dist.reduce_scatter_tensor(outputs[1], make(rank, block * size), op=R.MAX, group=gloo)
        return [outputs[0]], [outputs[1]]

    def reduce():  # (at the direct size: larger reduces take the ring, on the I/O loop)
        got, expected = [], []
        for root in range(size):
            tensor, reference = make(rank, DIRECT, seed=root), make(rank, DIRECT, seed=root)
            dist.reduce(tensor, dst=root)
            dist.reduce(reference, dst=root, group=gloo)
            if rank == root:
                got.append(tensor)
                expected.append(reference)
        return got, expected

    def gather():
        root = size - 1
        lists = [[torch.empty(DIRECT) for _ in range(size)] if rank == root else None for _ in range(2)]
        dist.gather(make(rank, DIRECT), lists[0], dst=root)
        dist.gather(make(rank, DIRECT), lists[1], dst=root, group=gloo)
        return (lists[0], lists[1]) if rank == root else ([], [])

    def scatter():
        root = size - 1
        pieces = [make(rank, DIRECT, seed=k) for k in range(size)] if rank == root else None
        outputs = [torch.empty(DIRECT) for _ in range(2)]
        dist.scatter(outputs[0], pieces, src=root)
        dist.scatter(outputs[1], pieces, src=root, group=gloo)
        return [outputs[0]], [outputs[1]]

    def all_to_all():
        inputs = [make(rank, DIRECT, seed=k) for k in range(size)]  # block k goes to rank k
        outputs = [[torch.empty(DIRECT) for _ in range(size)] for _ in range(2)]
        dist.all_to_all(outputs[0], inputs)
        dist.all_to_all(outputs[1], inputs, group=gloo)
        return outputs

    def all_to_all_single():
        outputs = [torch.empty(DIRECT * size) for _ in range(2)]
        dist.all_to_all_single(outputs[0], make(rank, DIRECT * size))
        dist.all_to_all_single(outputs[1], make(rank, DIRECT * size), group=gloo)
        return [outputs[0]], [outputs[1]]

    def barrier():
        dist.barrier()
        return [], []

    for call in [broadcast, all_gather, all_gather_into_tensor, reduce_scatter, reduce_scatter_tensor, reduce,
                 gather, scatter, all_to_all, all_to_all_single, barrier]:
        check(call.__name__, call.__name__, call)
    return outcomes


def interleaved_async_and_blocking(rank: int, size: int, ran: list[str]) -> str | None:
    """Async ops queued between blocking ones: a blocking op returns after every op issued before it."""
    before = len(ran)
    issued = []  # (work or None, tensor, expected)
    for step in range(12):
        tensor = torch.full((DIRECT,), float(rank + step))
        expected = torch.full((DIRECT,), float(sum(range(size)) + size * step))
        if step % 3 == 2:
            dist.all_reduce(tensor)  # blocking: runs after the async ones before it
            unfinished = [k for k, (work, _, _) in enumerate(issued) if work is not None and not work.is_completed()]
            if unfinished:
                return f"blocking op {step} returned before async op(s) {unfinished}"
            issued.append((None, tensor, expected))
        else:
            issued.append((dist.all_reduce(tensor, async_op=True), tensor, expected))
    for work, _, _ in reversed(issued):
        if work is not None:
            work.wait()
    wrong = [step for step, (_, tensor, expected) in enumerate(issued) if not torch.equal(tensor, expected)]
    if wrong:
        return f"wrong results at steps {wrong}"
    if len(ran) - before != len(issued):
        return f"{len(ran) - before} of {len(issued)} ran on the express path"
    return None


def crossing_groups(rank: int, size: int) -> str:
    """Rank 0 issues an async op on group A then a blocking one on B; rank 1 issues B then A. Were the
    async op run on the caller's thread, rank 0 would wait in A while rank 1 waits in B."""
    groups = {"A": dist.new_group([0, 1]), "B": dist.new_group([0, 1])}
    ran = {name: record_express(group) for name, group in groups.items()}
    tensors = {name: torch.full((DIRECT,), float(rank + 1)) for name in groups}
    if rank == 0:
        work = dist.all_reduce(tensors["A"], group=groups["A"], async_op=True)
        dist.all_reduce(tensors["B"], group=groups["B"])
        work.wait()
    else:
        dist.all_reduce(tensors["B"], group=groups["B"])
        dist.all_reduce(tensors["A"], group=groups["A"])
    assert all(torch.equal(tensor, torch.full((DIRECT,), 3.0)) for tensor in tensors.values()), tensors
    assert all(len(where) == 1 for where in ran.values()), ran
    return "done"


def mismatched_sizes(rank: int, size: int) -> tuple[str, bool]:
    """Ranks pass tensors of different sizes: an error on each (not a hang); then the group works."""
    try:
        dist.all_reduce(torch.ones(4 + 4 * rank))
        message = "no error"
    except Exception as error:  # noqa: BLE001 - returned
        message = f"{type(error).__name__}: {error}"
    tensor = torch.full((DIRECT,), float(rank))
    dist.all_reduce(tensor)
    return message, torch.equal(tensor, torch.full((DIRECT,), float(sum(range(size)))))


def aborted(rank: int, size: int) -> tuple | None:
    """Rank 0's async collective, which rank 1 never issues, fails at once when rank 0 aborts the group
    (ProcessGroup.abort), not after the group's timeout."""
    gloo = dist.new_group(backend="gloo")
    pair = dist.new_group([0, 1], timeout=timedelta(seconds=300))
    dist.all_reduce(torch.ones(4), group=pair)  # the sockets made
    result = None
    if rank == 0:
        work = dist.all_reduce(torch.ones(4), group=pair, async_op=True)
        time.sleep(0.2)  # (on the group's thread, waiting for rank 1, most likely)
        started = time.monotonic()
        pair.abort()
        result = outcome_of(work.wait), time.monotonic() - started
    dist.barrier(group=gloo)
    return result


def two_ranks(rank: int, size: int) -> dict:
    group = dist.distributed_c10d._get_default_group()
    ran = record_express(group)
    dist.all_reduce(torch.ones(4))  # the first express collective opens the sockets
    others = [peer for peer in range(size) if peer != rank]
    results = {"sockets": all(group.express.sockets.has(peer) for peer in others),
               "ran": list(ran)}
    results["gloo"] = compare_with_gloo(rank, size, DIRECT, ran)
    results["interleaved"] = interleaved_async_and_blocking(rank, size, ran)
    results["mismatched"] = mismatched_sizes(rank, size)
    results["crossing"] = crossing_groups(rank, size)
    results["aborted"] = aborted(rank, size)
    return results


def test_abort_fails_a_pending_express_collective_at_once():
    outcome, seconds = results("2")[0]["aborted"]
    assert outcome.startswith("PeerLost") and "aborted the group" in outcome, outcome
    assert seconds < 150, f"abort left the collective to its 300 s timeout ({seconds:.0f} s)"


WORLDS = {  # name: how to spawn it (the rank bodies are defined beside the tests that read them)
    "2": lambda: run_world(2, two_ranks, timeout=240),
    "express off": lambda: run_world(2, express_off, env={"WANLINK_EXPRESS": "0"}, timeout=120),
    "express off on one rank": lambda: run_world(2, express_off, rank_env=[{}, {"WANLINK_EXPRESS": "0"}], timeout=120),
    "4 detail": lambda: run_world(4, four_ranks, env={"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}, timeout=300),
    "3 failures": lambda: run_world(3, failures, init_timeout=120, timeout=240, allow_errors=True),
    "4 one dies": lambda: run_world(4, one_of_four_dies, init_timeout=120, timeout=240, allow_errors=True),
}


@functools.lru_cache(maxsize=None)
def world(name: str):
    """Each world spawned once for the tests that read it; its failure is remembered as well."""
    try:
        return WORLDS[name](), None
    except Exception as error:  # noqa: BLE001 - reported by every test of that world
        return None, error


def results(name: str) -> list:
    outcomes, error = world(name)
    if error is not None:
        raise error
    return outcomes


def test_a_one_host_group_takes_the_express_path():
    for rank, result in enumerate(results("2")):
        assert result["sockets"], f"rank {rank}: no express socket to its peer"
        assert len(result["ran"]) == 1 and "wanlink all_reduce #0 (group '0'" in result["ran"][0], result["ran"]


def express_off(rank: int, size: int) -> tuple[bool, bool]:
    group = dist.distributed_c10d._get_default_group()
    tensor = torch.ones(4)
    dist.all_reduce(tensor)
    return group.express is None, torch.equal(tensor, torch.full((4,), 2.0))


def test_wanlink_express_0_keeps_every_collective_on_the_loop():
    assert results("express off") == [(True, True), (True, True)]


def test_a_member_with_express_off_keeps_the_whole_group_on_the_loop():
    """Every member must route a collective alike: one that publishes no express listener rules the path out."""
    assert results("express off on one rank") == [(True, True), (True, True)]


@pytest.mark.parametrize("world_name", ["2", "4 detail"])
def test_results_equal_gloo_on_the_express_path(world_name):
    failures = [f"rank {rank} {name}: {outcome}" for rank, result in enumerate(results(world_name))
                for size_name, outcomes in result.items() if size_name.startswith("gloo")
                for name, outcome in outcomes.items() if outcome is not None]
    assert not failures, "\n".join(failures)


def test_async_ops_interleaved_with_blocking_ones_complete_in_order():
    for rank, result in enumerate(results("2")):
        assert result["interleaved"] is None, f"rank {rank}: {result['interleaved']}"


def test_async_op_on_one_group_does_not_block_a_blocking_op_on_another():
    assert [result["crossing"] for result in results("2")] == ["done", "done"]


def test_mismatched_sizes_are_an_error_and_the_group_works_afterwards():
    for rank, result in enumerate(results("2")):
        message, next_ok = result["mismatched"]
        assert "all_reduce #" in message and "different sizes" in message and f"rank {1 - rank}" in message, message
        assert next_ok, f"rank {rank}: the collective after the mismatch gave a wrong result"


def four_ranks(rank: int, size: int) -> dict:
    """Under TORCH_DISTRIBUTED_DEBUG=DETAIL: every collective's fingerprint is checked on the express path."""
    from wanlink.collectives import halving

    group = dist.distributed_c10d._get_default_group()
    ran = record_express(group)
    results = {"halving": group.algorithms.allreduce_algorithm(size, group.piece_bytes, torch.empty(HALVING))
               is halving.allreduce,
               "gloo direct": compare_with_gloo(rank, size, DIRECT, ran),
               "gloo halving": compare_with_gloo(rank, size, HALVING, ran)}
    before = len(ran)
    try:  # rank 0 and its neighbours (1 and 3) see the fingerprints differ; rank 2 passes its check
        if rank == 0:
            dist.broadcast(torch.ones(4), src=0)
        else:
            dist.all_reduce(torch.ones(4))
        results["desync"] = "no error"
    except Exception as error:  # noqa: BLE001 - returned
        results["desync"] = f"{type(error).__name__}: {error}"
    results["desync on express"] = len(ran) - before == 1
    tensor = torch.ones(4)  # (its messages end rank 2's wait: an error, not a hang)
    dist.all_reduce(tensor)
    results["after desync"] = torch.equal(tensor, torch.full((4,), float(size)))
    return results


def test_detail_debug_checks_fingerprints_on_the_express_path():
    for rank, result in enumerate(results("4 detail")):
        assert result["halving"], "the halving size does not pick halving"
        assert result["desync on express"], rank
        message = result["desync"]
        if rank == 2:  # its neighbours agree with it: it learns when the others move on to the next collective
            assert message.startswith("ProtocolError") and "all_reduce #" in message and \
                "the ranks issued different collectives" in message, message
        else:
            assert message.startswith("DesyncError"), message
            assert "broadcast(dtype float32, 4 elements, root 0)" in message, message
            assert "all_reduce(dtype float32, 4 elements)" in message, message
        assert result["after desync"], f"rank {rank}: the group failed after the desync"


def failures(rank: int, size: int) -> dict:
    """Timeouts on the express path, recovery after a late rank, and a peer that dies mid-op."""
    from wanlink.errors import DeadlineExceeded, PeerLost

    group = dist.distributed_c10d._get_default_group()
    gloo = dist.new_group(backend="gloo")  # (orders the ranks without touching the group under test)
    ran = record_express(group)
    results = {}
    dist.all_reduce(torch.ones(4))  # #0: sockets made

    zero = dist.AllreduceOptions()
    zero.timeout = timedelta(0)
    with pytest.raises(DeadlineExceeded) as caught:  # #1: every rank expires at once, sends nothing
        group.allreduce([torch.ones(4)], zero).wait()
    results["zero"] = str(caught.value)

    late = 50_000  # elements (200 KiB): a direct exchange whose stale bytes outlast a scratch slice
    dist.barrier(group=gloo)  # (ranks 0 and 1 enter #2 together, however loaded the host)
    if rank < size - 1:  # #2: the last rank comes only after the others gave up
        two = dist.AllreduceOptions()
        two.timeout = timedelta(seconds=2)
        with pytest.raises(DeadlineExceeded) as caught:
            group.allreduce([torch.ones(late)], two).wait()
        results["absent"] = str(caught.value)
        dist.barrier(group=gloo)
    else:
        dist.barrier(group=gloo)
        results["absent"] = None
        try:  # it finds its peers' messages of #2 waiting (theirs go stale on them)
            dist.all_reduce(torch.ones(late))
        except DeadlineExceeded:
            pass
    tensor = torch.full((late,), float(rank))  # #3: stale bytes of #2 dropped, the group works again
    dist.all_reduce(tensor)
    results["recovered"] = torch.equal(tensor, torch.full((late,), float(sum(range(size)))))
    results["on express"] = len(ran) == 4

    dist.barrier(group=gloo)
    if rank == size - 1:
        time.sleep(0.5)  # the others are inside #4 by now, most likely
        os._exit(17)
    with pytest.raises(PeerLost) as caught:
        dist.all_reduce(torch.ones(DIRECT))
    results["dead"] = str(caught.value)
    return results


def test_an_explicit_zero_timeout_expires_at_once_on_the_express_path():
    for rank, (status, result) in enumerate(results("3 failures")[:2]):
        assert status == "ok", result
        message = result["zero"]
        assert "timed out after 0 s" in message and "all_reduce #1" in message, message
        assert f"group '0', rank {rank} of 3" in message and "waiting for rank(s) [" in message, message


def test_a_rank_that_does_not_call_is_named_and_the_group_recovers_once_it_catches_up():
    outcomes = results("3 failures")
    for rank, (status, result) in enumerate(outcomes[:2]):
        assert status == "ok", result
        message = result["absent"]
        assert "all_reduce #2" in message and "timed out after 2 s waiting for rank(s) [2]" in message, message
        assert result["recovered"], f"rank {rank}: the collective after the timeout gave a wrong result"
        assert result["on express"], rank


def test_a_peer_that_dies_mid_op_is_peer_lost_naming_it():
    outcomes = results("3 failures")
    for status, result in outcomes[:2]:
        assert status == "ok", result
        assert "all_reduce #4" in result["dead"] and "rank 2" in result["dead"], result["dead"]
    assert "exit code 17" in outcomes[2][1], outcomes[2]


def outcome_of(call) -> str:
    try:
        call()
        return "no error"
    except Exception as error:  # noqa: BLE001 - returned
        return f"{type(error).__name__}: {error}"


def one_of_four_dies(rank: int, size: int) -> dict:
    """Rank 3 dies before a halving all_reduce. Rank 0 waits on rank 1 only (its partners are 2, then
    1), and rank 1 fails at its first step (its partner is 3), so never sends what rank 0 waits for:
    rank 0 must learn of the death from the group's links, not from its own sockets or its timeout.
    Then rank 0 starts the first collective of a group it shares with the dead rank, whose socket
    rank 3 was to open (the higher rank dials): the same."""
    gloo = dist.new_group(backend="gloo")
    pair = dist.new_group([0, size - 1])
    dist.all_reduce(torch.ones(HALVING))  # sockets made
    dist.barrier(group=gloo)
    if rank == size - 1:
        os._exit(17)
    options = dist.AllreduceOptions()
    options.timeout = timedelta(seconds=30)
    started = time.monotonic()
    results = {"halving": outcome_of(lambda: dist.distributed_c10d._get_default_group().allreduce(
        [torch.ones(HALVING)], options).wait())}
    results["halving s"] = time.monotonic() - started
    if rank == 0:
        started = time.monotonic()
        results["first of a pair"] = outcome_of(lambda: pair.allreduce([torch.ones(4)], options).wait())
        results["first of a pair s"] = time.monotonic() - started
    store = dist.distributed_c10d._get_default_store()  # the survivors stay until all three are done (a
    store.add("finished", 1)  # survivor that exits closes its sockets, which would tell the others)
    deadline = time.monotonic() + 60
    while store.add("finished", 0) < size - 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    return results


def test_a_dead_member_fails_a_halving_on_every_survivor_even_one_waiting_on_another():
    outcomes = results("4 one dies")
    assert "exit code 17" in outcomes[3][1], outcomes[3]
    for rank, (status, result) in enumerate(outcomes[:3]):
        assert status == "ok", result
        message = result["halving"]
        assert message.startswith("PeerLost") and "rank 3" in message, \
            f"rank {rank} after {result['halving s']:.1f} s: {message}"


def test_a_dead_member_fails_the_first_collective_of_a_group_waiting_for_its_socket():
    status, result = results("4 one dies")[0]
    assert status == "ok", result
    message = result["first of a pair"]
    assert message.startswith("PeerLost") and "rank 3" in message, \
        f"after {result['first of a pair s']:.1f} s: {message}"
