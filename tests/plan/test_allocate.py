"""Batch allocation: the throughput model, its fit, the memory search, the allocation, DDP weighting."""
import socket

import pytest

from wanlink.errors import ConfigError
from wanlink.plan.allocate import (
    Throughput, allocate_batches, equal_split, fit_throughput, loss_weight, probe_batch_sizes,
)


def test_throughput_model():
    rank = Throughput(alpha=32, beta=320)  # saturates at 32 samples, then 320 samples/s
    assert rank.seconds(16) == pytest.approx(0.1)  # below alpha: the step costs as much as alpha
    assert rank.seconds(64) == pytest.approx(0.2)
    assert rank.most_within(0.2) == 64
    assert rank.most_within(0.05) == 0
    assert Throughput(32, 320, max_batch=40).most_within(1.0) == 40


def test_fit_recovers_alpha_and_beta():
    truth = Throughput(alpha=24, beta=400)
    samples = [(x, truth.seconds(x)) for x in (1, 2, 4, 8, 16, 32, 64, 128)]
    fitted = fit_throughput(samples, max_batch=128)
    assert fitted.beta == pytest.approx(400, rel=1e-6)
    assert fitted.alpha == pytest.approx(24, rel=1e-6)
    assert fitted.max_batch == 128
    linear = fit_throughput([(8, 0.08), (16, 0.16), (32, 0.32)])
    assert linear.beta == pytest.approx(100) and linear.alpha == pytest.approx(0)
    with pytest.raises(ConfigError):
        fit_throughput([(8, 0.0)])


def test_probe_doubles_then_binary_searches_the_memory_limit():
    calls = []

    def measure(batch):
        calls.append(batch)
        if batch > 45:
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 9 GB")
        return batch / 100

    samples, largest = probe_batch_sizes(measure, start=4)
    assert largest == 45
    assert calls[:5] == [4, 8, 16, 32, 64]
    assert dict(samples)[45] == pytest.approx(0.45)
    with pytest.raises(ValueError, match="boom"):
        probe_batch_sizes(lambda b: (_ for _ in ()).throw(ValueError("boom")))
    with pytest.raises(ConfigError, match="even a batch of 2"):
        probe_batch_sizes(lambda b: (_ for _ in ()).throw(MemoryError()), start=2)


def test_allocation_balances_step_times():
    fast, slow = Throughput(8, 300), Throughput(8, 100)
    plan = allocate_batches(128, [fast, slow])
    assert plan.batches == (96, 32)
    assert plan.makespan == pytest.approx(0.32)
    assert max(fast.seconds(64), slow.seconds(64)) == pytest.approx(0.64)  # the equal split
    assert equal_split(129, 2) == (65, 64)


def test_allocation_respects_memory_and_minimum():
    plan = allocate_batches(100, [Throughput(1, 1000, max_batch=30), Throughput(1, 10)], min_batch=1)
    assert plan.batches == (30, 70)
    assert sum(allocate_batches(7, [Throughput(1, 5)] * 3).batches) == 7
    assert min(allocate_batches(10, [Throughput(0, 1000), Throughput(0, 1)], min_batch=2).batches) == 2
    with pytest.raises(ConfigError, match="exceeds the ranks' memory limits"):
        allocate_batches(100, [Throughput(1, 10, max_batch=10)] * 2)
    with pytest.raises(ConfigError, match="smaller than 3 ranks"):
        allocate_batches(2, [Throughput(1, 10)] * 3)


def test_loss_weight():
    assert loss_weight(96, 128, 2) == pytest.approx(1.5)
    assert loss_weight(32, 128, 2) == pytest.approx(0.5)
    with pytest.raises(ConfigError):
        loss_weight(200, 128, 2)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _ddp_rank(rank, port, batches, queue):
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    torch.manual_seed(0)
    model = torch.nn.Linear(5, 3)
    ddp = DDP(model)
    inputs, targets = _data(sum(batches))
    start = sum(batches[:rank])
    mine = slice(start, start + batches[rank])
    loss = torch.nn.functional.mse_loss(ddp(inputs[mine]), targets[mine])
    (loss * loss_weight(batches[rank], sum(batches), 2)).backward()
    queue.put((rank, model.weight.grad.tolist(), model.bias.grad.tolist()))  # plain lists: no shared memory
    dist.destroy_process_group()


def _data(n):
    import torch

    generator = torch.Generator().manual_seed(1)
    return torch.randn(n, 5, generator=generator), torch.randn(n, 3, generator=generator)


@pytest.mark.slow
def test_weighted_ddp_matches_single_process_reference():
    torch = pytest.importorskip("torch")
    import torch.multiprocessing as mp

    batches = (3, 9)
    context = mp.get_context("spawn")
    queue = context.Queue()
    port = _free_port()
    procs = [context.Process(target=_ddp_rank, args=(rank, port, batches, queue)) for rank in range(2)]
    for proc in procs:
        proc.start()
    results = sorted(queue.get(timeout=120) for _ in procs)
    for proc in procs:
        proc.join(timeout=60)
        assert proc.exitcode == 0
    torch.manual_seed(0)
    reference = torch.nn.Linear(5, 3)
    inputs, targets = _data(sum(batches))
    torch.nn.functional.mse_loss(reference(inputs), targets).backward()
    for _rank, weight_grad, bias_grad in results:
        torch.testing.assert_close(torch.tensor(weight_grad), reference.weight.grad)
        torch.testing.assert_close(torch.tensor(bias_grad), reference.bias.grad)
