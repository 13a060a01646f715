"""Profiling the step as training runs it: through DDP over a one-rank group, with a comm hook."""
import socket

import pytest

HOOK_S = 0.02  # what the test's hook spends per bucket, on the profile's clock
TICK_S = 1e-6  # what every other reading of that clock adds: no step's figure depends on the machine's load


class SteppingClock:
    """A wall clock that moves TICK_S per reading, and as much as the hook says it spent."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        self.now += TICK_S
        return self.now

    def spend(self, seconds: float) -> None:
        self.now += seconds


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _profile_through_ddp(port, queue):
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    from wanlink.plan.profiler import profile_model

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, 1, is_master=True)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    group = dist.new_group([0])

    clock = SteppingClock()

    def slow_hook(state, bucket):  # stands for the sparse hook's work: HOOK_S per bucket
        clock.spend(HOOK_S)
        return allreduce_hook(state, bucket)

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512))
    batch = (torch.randn(16, 256), torch.randn(16, 512))
    results = {}
    for name, hook, density in (("hooked", (group, slow_hook), 0.01), ("plain", None, None)):
        profile = profile_model(model, batch, warmup=2, iterations=3, bucket_cap_mb=0.5, density=density,
                                process_group=group, comm_hook=hook, clock=clock)
        results[name] = ([(b.bytes, b.ready_s, b.sparsify_s) for b in profile.buckets], profile.backward_s)
    queue.put(results)
    dist.destroy_process_group()


@pytest.mark.slow
def test_profile_through_ddp_takes_buckets_and_hook_time_from_ddp():
    pytest.importorskip("torch")
    import torch.multiprocessing as mp

    context = mp.get_context("spawn")
    queue = context.Queue()
    process = context.Process(target=_profile_through_ddp, args=(_free_port(), queue))
    process.start()
    results = queue.get(timeout=120)
    process.join(timeout=60)
    hooked, backward = results["hooked"]
    # DDP's buckets (0.5 MB cap; its first bucket after the rebuild holds the last layer's 1 MB weight)
    assert sum(nbytes for nbytes, _r, _h in hooked) == (256 * 512 + 512 + 512 * 512 + 512) * 4
    assert len(hooked) >= 2
    # each bucket's hook time is the hook's own, and it is out of the backward and of the readiness
    for _nbytes, _ready, hook in hooked:
        assert HOOK_S < hook < HOOK_S + 100 * TICK_S
    assert backward < HOOK_S
    assert all(ready < HOOK_S for _nbytes, ready, _h in hooked)
    plain, _backward = results["plain"]
    assert [h for _n, _r, h in plain] == [0.0] * len(plain)  # dense: no hook time, DDP's all-reduce stays in backward


def test_comm_hook_needs_a_group_and_ddp_needs_warmup():
    torch = pytest.importorskip("torch")
    from wanlink.errors import ConfigError
    from wanlink.plan.profiler import profile_model

    model, batch = torch.nn.Linear(4, 2), (torch.randn(2, 4), torch.randint(0, 2, (2,)))
    with pytest.raises(ConfigError, match="comm_hook needs a process_group"):
        profile_model(model, batch, comm_hook=(None, None))
    with pytest.raises(ConfigError, match="warmup >= 2"):
        profile_model(model, batch, warmup=1, process_group=object())
