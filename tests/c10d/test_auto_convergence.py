"""density="auto" under a changing (simulated) bandwidth reaches dense accuracy on a real data set.

2 ranks over loopback, scikit-learn's digits (bench/convergence.py's split and model), same seeds:
dense DDP on gloo with momentum SGD, and wanlink's block-sparse hook with density="auto",
staleness 1 and SparseSGD, its controller fed a bandwidth schedule that moves every 60 steps and a
simulated clock (10 ms of compute a step, whatever the machine's load), so the density changes many
times during training and the same way on every run.
"""
import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from tests.support.worlds import run_world

EPOCHS = 30
BATCH = 32
# bytes/s, one per 60 steps, cycled: with this ~85k-parameter model the controller's choice spans
# its bounds at compute times from ~1 ms to ~50 ms a step
SCHEDULE_BPS = (2e6, 2e5, 8e6, 5e5)
STEPS_PER_RATE = 60
SIMULATED_STEP_S = 0.01


def _train(rank, size, auto: bool):
    from bench.convergence import load_split, make_model
    from wanlink.c10d.sparse_hook import BlockSparseState, block_sparse_hook
    from wanlink.optim import SparseSGD

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = make_model()
    ddp = DDP(model)
    state = None
    if auto:
        state = BlockSparseState(
            density="auto", min_density=0.002, max_density=0.1, staleness=1, sparse_optimizer=True, warmup_steps=20,
            bandwidth=lambda _now: SCHEDULE_BPS[(state.iteration // STEPS_PER_RATE) % len(SCHEDULE_BPS)],
            controller_options={"window_s": 0.2, "hold_s": 0.1,
                                "clock": lambda: state.iteration * SIMULATED_STEP_S})
        ddp.register_comm_hook(state, block_sparse_hook)
        optimizer = SparseSGD(ddp.parameters(), lr=0.05, momentum=0.9)
    else:
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    train_x, train_y, test_x, test_y = load_split()
    mean, std = train_x.mean(0), train_x.std(0) + 1e-6
    train_x, test_x = (train_x - mean) / std, (test_x - mean) / std
    shard_x, shard_y = train_x[rank::size], train_y[rank::size]
    densities = []
    for epoch in range(EPOCHS):
        order = torch.randperm(len(shard_y), generator=torch.Generator().manual_seed(1000 * epoch + rank))
        for step in range(len(shard_y) // BATCH):
            index = order[step * BATCH:(step + 1) * BATCH]
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(ddp(shard_x[index]), shard_y[index]).backward()
            if state is not None:
                densities.append(state.density)
                optimizer.step(sparse_grads=state.sparse_grads())
            else:
                optimizer.step()
    if state is not None and state.flush():
        optimizer.step(sparse_grads=state.sparse_grads())
    with torch.no_grad():
        accuracy = (model(test_x).argmax(1) == test_y).float().mean().item()
    return accuracy, densities, state.density_stats() if state else None


@pytest.mark.slow
def test_auto_density_under_a_changing_bandwidth_reaches_dense_accuracy_within_one_point():
    dense = run_world(2, _train, False, backend="gloo", timeout=600)[0][0]
    (accuracy, densities, stats), (_, other_densities, _) = run_world(2, _train, True, timeout=600)
    assert dense > 0.9, f"dense baseline did not learn: {dense:.4f}"
    assert densities == other_densities  # every rank used the same density at every step
    assert len(stats["changes"]) >= 4 and len(set(densities)) >= 3, stats["changes"]
    assert accuracy >= dense - 0.01, f"auto density: {accuracy:.4f} vs dense {dense:.4f}; changes {stats['changes']}"
