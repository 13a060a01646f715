"""Error paths: unsupported requests, desynchronised ranks, timeouts and dead peers never hang."""
from __future__ import annotations

import os
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from tests.support.worlds import run_world

# Small collectives of a one-host group take the express path (docs/c10d.md); the loop path is what
# groups across hosts take: the timeout, desync and dead-peer checks run on both.
LOOP = {"WANLINK_EXPRESS": "0"}
PATHS = pytest.mark.parametrize("path", [{}, LOOP], ids=["express", "loop"])


def mixed_dtype_reduce_scatters(size):
    with dist._coalescing_manager():
        dist.reduce_scatter_tensor(torch.empty(1), torch.ones(size))
        dist.reduce_scatter_tensor(torch.empty(1, dtype=torch.int64), torch.ones(size, dtype=torch.int64))


def unsupported_requests(rank, size):
    """Each request must raise UnsupportedError (or ConfigError for a wrong tensor count) naming its
    op, synchronously, on every rank."""
    from wanlink.errors import ConfigError, UnsupportedError

    attempts = {
        "all_reduce": lambda: dist.all_reduce(torch.ones(2, dtype=torch.float8_e4m3fn)),
        "all_reduce BAND": lambda: dist.all_reduce(torch.ones(2), op=dist.ReduceOp.BAND),
        "all_reduce PREMUL_SUM": lambda: dist.all_reduce(torch.ones(2), op=dist._make_nccl_premul_sum(2.0)),
        "recv": lambda: dist.recv(torch.ones(0)),  # from any rank: an empty tensor names no sender
        "reduce_scatter_tensor_coalesced": lambda: mixed_dtype_reduce_scatters(size),
        "reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(torch.ones(2), torch.ones(2 * size).to_sparse()),
    }
    messages = {}
    for name, attempt in attempts.items():
        with pytest.raises(UnsupportedError, match="wanlink") as caught:
            attempt()
        assert caught.type is UnsupportedError or issubclass(caught.type, UnsupportedError), name
        messages[name] = str(caught.value)
    group, one = dist.distributed_c10d._get_default_group(), torch.ones(2)
    miscounted = {  # one tensor where the op needs one per member: every rank refuses before sending
        "all_gather": lambda: group.allgather([[one]], [one]),
        "reduce_scatter": lambda: group.reduce_scatter([one], [[one]]),
        "all_to_all": lambda: group.alltoall([one], [one] * size),
    }
    for name, attempt in miscounted.items():
        with pytest.raises(ConfigError, match=f"wanlink {name}: need {size} (input|output) tensors, got 1"):
            attempt()
    dist.barrier()  # the group still works afterwards
    tensor = torch.ones(3)
    dist.all_reduce(tensor)
    assert torch.equal(tensor, torch.full((3,), float(size)))
    return messages


def test_unsupported_requests_raise_naming_the_op():
    for messages in run_world(2, unsupported_requests, timeout=90):
        for name, message in messages.items():
            op = name.split()[0]
            assert f"wanlink {op}" in message or op.replace("_", " ") in message, (name, message)
        assert "PREMUL_SUM" in messages["all_reduce PREMUL_SUM"]
        assert "float8_e4m3fn" in messages["all_reduce"]


def desynchronised(rank, size):
    from wanlink.errors import DesyncError

    dist.all_reduce(torch.ones(4))  # in step
    with pytest.raises(DesyncError) as caught:
        if rank == 0:
            dist.all_reduce(torch.ones(4))
        else:
            dist.broadcast(torch.ones(4), src=0)
    return str(caught.value)


@PATHS
def test_detail_debug_names_the_mismatch(path):
    messages = run_world(2, desynchronised, env={"TORCH_DISTRIBUTED_DEBUG": "DETAIL", **path}, timeout=90)
    for message in messages:
        assert "#1 all_reduce(dtype float32, 4 elements)" in message, message
        assert "#1 broadcast(dtype float32, 4 elements, root 0)" in message, message


def dtype_desync(rank, size):
    from wanlink.errors import DesyncError

    with pytest.raises(DesyncError) as caught:
        dist.all_reduce(torch.ones(4, dtype=torch.float32 if rank == 0 else torch.float64))
    return str(caught.value)


@PATHS
def test_detail_debug_catches_dtype_mismatch(path):
    for message in run_world(2, dtype_desync, env={"TORCH_DISTRIBUTED_DEBUG": "DETAIL", **path}, timeout=90):
        assert "float32" in message and "float64" in message, message


def one_rank_skips(rank, size):
    from wanlink.errors import DeadlineExceeded

    if rank == 1:
        time.sleep(8)  # never joins the collective; stays alive past rank 0's timeout
        return "skipped"
    started = time.monotonic()
    stray = dist.irecv(torch.empty(1), tag=5)  # from any rank; nobody sends
    with pytest.raises(DeadlineExceeded) as caught:
        dist.all_reduce(torch.ones(8), async_op=True).wait()
    with pytest.raises(DeadlineExceeded, match="recv any rank tag 5"):
        stray.wait()
    return str(caught.value), time.monotonic() - started


@PATHS
def test_init_process_group_timeout_is_honoured(path):
    results = run_world(2, one_rank_skips, init_timeout=3, timeout=90, env=path)
    message, elapsed = results[0]
    assert "all_reduce" in message and "timed out after 3 s waiting for rank(s) [1]" in message, message
    assert elapsed >= 2.5, f"raised after {elapsed:.1f} s, before the 3 s timeout"


def peer_dies(rank, size, big):
    from wanlink.errors import PeerLost

    if rank == size - 1:
        dist.barrier()
        os._exit(17)  # dies without a word (maybe before acknowledging the barrier's last bytes)
    numel = 1 << 20 if big else 16
    stray = dist.irecv(torch.empty(1), tag=5)  # from any rank; nobody sends
    with pytest.raises(PeerLost):
        dist.barrier()
        for _ in range(50):  # the peer may still be flushing when the first one starts
            dist.all_reduce(torch.ones(numel), async_op=True).wait()
            time.sleep(0.05)
    with pytest.raises(PeerLost):
        stray.wait()
    return "raised"


@pytest.mark.parametrize("big, path", [(False, {}), (False, LOOP), (True, {})],
                         ids=["direct-express", "direct-loop", "ring"])  # (a ring is on the loop either way)
def test_dead_peer_fails_pending_work_before_the_timeout(big, path):
    outcomes = run_world(3, peer_dies, big, init_timeout=120, timeout=90, allow_errors=True, env=path)
    assert outcomes[:2] == [("ok", "raised"), ("ok", "raised")], outcomes
    assert "exit code 17" in outcomes[2][1]


def one_rank_late_for_monitored_barrier(rank, size):
    from wanlink.c10d import monitored_barrier
    from wanlink.errors import DeadlineExceeded

    if rank == size - 1:
        time.sleep(6)
        return "late"
    with pytest.raises(DeadlineExceeded) as caught:
        monitored_barrier(timeout=timedelta(seconds=2), wait_all_ranks=True)
    return str(caught.value)


def test_monitored_barrier_names_the_missing_rank():
    results = run_world(3, one_rank_late_for_monitored_barrier, init_timeout=60, timeout=90)
    assert "rank(s) [2] did not reach the barrier" in results[0], results[0]
    assert "monitored_barrier" in results[1], results[1]


def per_call_timeouts(rank, size):
    """Rank 2 never calls a collective; ranks 0 and 1 time out in several ways."""
    from wanlink.c10d import monitored_barrier
    from wanlink.errors import DeadlineExceeded

    if rank == 2:
        time.sleep(20)
        return None
    group = dist.distributed_c10d._get_default_group()
    messages = {}

    def timed_out(name, call):
        with pytest.raises(DeadlineExceeded) as caught:
            call()
        messages[name] = str(caught.value)

    zero = dist.AllreduceOptions()
    zero.timeout = timedelta(0)
    timed_out("all_reduce zero", lambda: group.allreduce([torch.ones(4)], zero).wait())
    barrier = dist.BarrierOptions()
    barrier.timeout = timedelta(seconds=3)
    timed_out("barrier 3 s", lambda: group.barrier(barrier).wait())
    timed_out("monitored_barrier zero", lambda: monitored_barrier(timeout=timedelta(0), wait_all_ranks=True))
    return messages


@PATHS
def test_every_timeout_is_honoured_zero_included_and_says_timed_out(path):
    results = run_world(3, per_call_timeouts, init_timeout=120, timeout=120, env=path)
    for rank in (0, 1):
        messages = results[rank]
        assert all("timed out after" in message and "group '0'" in message for message in messages.values()), messages
        assert "all_reduce #0" in messages["all_reduce zero"] and "after 0 s" in messages["all_reduce zero"]
        assert "barrier #1" in messages["barrier 3 s"] and "after 3 s waiting for rank(s) [" in messages["barrier 3 s"]
        assert "2]" in messages["barrier 3 s"], messages  # rank 2 never came
        assert "monitored_barrier #2" in messages["monitored_barrier zero"]
    # zero: rank 0 expires at once, naming every rank it had not heard from (rank 1's report may already be
    # there); rank 1 gives up on rank 0 at once
    message = results[0]["monitored_barrier zero"]
    assert "after 0 s: rank(s) [" in message and "2] did not reach the barrier" in message, message
    assert "after 0 s waiting for rank 0" in results[1]["monitored_barrier zero"], results[1]
