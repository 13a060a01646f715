"""SparseSGD against torch.optim.SGD: dense steps, and lazy block steps against per-block SGD."""
import copy

import numpy as np
import pytest
import torch

from wanlink.compress import BlockSparsifier
from wanlink.errors import ConfigError, UnsupportedError
from wanlink.optim import SparseSGD

HYPERPARAMETERS = [
    dict(lr=0.1),
    dict(lr=0.05, momentum=0.9),
    dict(lr=0.05, momentum=0.9, dampening=0.3),
    dict(lr=0.01, momentum=0.8, weight_decay=0.01),
    dict(lr=0.01, momentum=0.9, nesterov=True, weight_decay=0.001),
    dict(lr=0.02, weight_decay=0.1),
]


class PerBlockSGD:
    """The lazy semantics spelled out with torch itself: one torch.optim.SGD per block, stepped only when kept."""

    def __init__(self, initial: torch.Tensor, block: int, **hyper):
        self.block = block
        self.pieces = [torch.nn.Parameter(initial[start: start + block].clone())
                       for start in range(0, initial.numel(), block)]
        self.optimizers = [torch.optim.SGD([piece], **hyper) for piece in self.pieces]

    def step(self, indices, values):
        for i, b in enumerate(indices.tolist()):
            piece = self.pieces[b]
            piece.grad = values[i, : piece.numel()].clone()
            self.optimizers[b].step()

    def param(self):
        return torch.cat([piece.detach() for piece in self.pieces])

    def momentum(self):
        buffers = [opt.state[piece].get("momentum_buffer") for opt, piece in zip(self.optimizers, self.pieces)]
        return torch.cat([torch.zeros_like(p) if b is None else b for b, p in zip(buffers, self.pieces)])


@pytest.mark.parametrize("hyper", HYPERPARAMETERS)
@pytest.mark.parametrize("numel", [1, 37, 300])
def test_sparse_steps_match_per_block_sgd(implementation, rng, hyper, numel):
    initial = torch.from_numpy(rng.standard_normal(numel).astype(np.float32))
    param = torch.nn.Parameter(initial.clone())
    optimizer = SparseSGD([param], **hyper)
    reference = PerBlockSGD(initial, 16, **hyper)
    sparsifier = BlockSparsifier(numel, 0.3)
    for _ in range(6):
        grad = torch.from_numpy(rng.standard_normal(numel).astype(np.float32))
        indices, values = sparsifier.compress(grad)
        before = param.detach().clone()
        before_momentum = optimizer.state[param].get("momentum_buffer")
        before_momentum = None if before_momentum is None else before_momentum.clone()
        optimizer.step({param: (indices, values)})
        reference.step(indices, values)
        torch.testing.assert_close(param.detach(), reference.param(), rtol=1e-6, atol=1e-7)
        kept = torch.zeros(-(-numel // 16) * 16, dtype=torch.bool)
        kept.view(-1, 16)[indices.long()] = True
        untouched = ~kept[:numel]
        assert torch.equal(param.detach()[untouched], before[untouched])  # bit for bit
        if hyper.get("momentum"):
            buffer = optimizer.state[param]["momentum_buffer"]
            torch.testing.assert_close(buffer, reference.momentum(), rtol=1e-6, atol=1e-7)
            if before_momentum is not None:
                assert torch.equal(buffer[untouched], before_momentum[untouched])


@pytest.mark.parametrize("hyper", HYPERPARAMETERS)
def test_dense_step_equals_torch_sgd(implementation, rng, hyper):
    shapes = [(7, 5), (33,)]
    initial = [torch.from_numpy(rng.standard_normal(s).astype(np.float32)) for s in shapes]
    ours = [torch.nn.Parameter(t.clone()) for t in initial]
    theirs = [torch.nn.Parameter(t.clone()) for t in initial]
    optimizer, baseline = SparseSGD(ours, **hyper), torch.optim.SGD(theirs, **hyper)
    for _ in range(4):
        for a, b in zip(ours, theirs):
            a.grad = torch.from_numpy(rng.standard_normal(a.shape).astype(np.float32))
            b.grad = a.grad.clone()
        optimizer.step()
        baseline.step()
        for a, b in zip(ours, theirs):
            assert torch.equal(a, b)


@pytest.mark.parametrize("hyper", [HYPERPARAMETERS[2], HYPERPARAMETERS[3]])
def test_sparse_then_dense_then_sparse(implementation, rng, hyper):
    numel = 200
    initial = torch.from_numpy(rng.standard_normal(numel).astype(np.float32))
    param = torch.nn.Parameter(initial.clone())
    optimizer = SparseSGD([param], **hyper)
    reference = PerBlockSGD(initial, 16, **hyper)
    all_blocks = torch.arange(13, dtype=torch.int32)
    for step in range(4):
        grad = torch.from_numpy(rng.standard_normal(numel).astype(np.float32))
        padded = torch.zeros(13 * 16)
        padded[:numel] = grad
        if step == 2:  # dense step: every block steps
            param.grad = grad
            optimizer.step()
            reference.step(all_blocks, padded.view(13, 16))
        else:
            ids = torch.tensor([1, 5, 12], dtype=torch.int32) if step < 2 else torch.tensor([0, 5], dtype=torch.int32)
            optimizer.step({param: (ids, padded.view(13, 16)[ids.long()])})
            reference.step(ids, padded.view(13, 16)[ids.long()])
        torch.testing.assert_close(param.detach(), reference.param(), rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(optimizer.state[param]["momentum_buffer"], reference.momentum(),
                                   rtol=1e-6, atol=1e-7)


def test_state_dict_round_trip(implementation, rng):
    hyper = dict(lr=0.05, momentum=0.9, dampening=0.5)
    param = torch.nn.Parameter(torch.from_numpy(rng.standard_normal(100).astype(np.float32)))
    optimizer = SparseSGD([param], **hyper)
    values = torch.ones(2, 16)
    optimizer.step({param: (torch.tensor([0, 3], dtype=torch.int32), values)})
    clone = torch.nn.Parameter(param.detach().clone())
    restored = SparseSGD([clone], **hyper)
    restored.load_state_dict(copy.deepcopy(optimizer.state_dict()))  # as torch.save/torch.load would
    ids = torch.tensor([3, 5], dtype=torch.int32)  # block 3 continues its momentum, block 5 starts one
    optimizer.step({param: (ids, values)})
    restored.step({clone: (ids, values)})
    assert torch.equal(param, clone)
    assert torch.equal(optimizer.state[param]["momentum_buffer"], restored.state[clone]["momentum_buffer"])


@pytest.mark.parametrize("with_flags", [True, False])
def test_compiled_matches_reference(both_implementations, rng, with_flags):
    compiled, ref = both_implementations
    numel, block, nblocks, count = 100_001, 16, 6251, 3000  # enough blocks for the parallel path
    ids = np.sort(rng.choice(nblocks, count, replace=False)).astype(np.int32)
    ids[-1] = nblocks - 1  # the partial tail block
    values = rng.standard_normal(count * block).astype(np.float32)
    states = []
    for module in (compiled, ref):
        param = np.linspace(-1, 1, numel, dtype=np.float32)
        buffer = np.ones(numel, np.float32)
        flags = (np.arange(nblocks) % 2).astype(np.uint8) if with_flags else None
        started = module.sgd_step_blocks(param, buffer, flags, ids, values, block, 0.1, 0.01, 0.9, 0.2, False, 2)
        states.append((started, param, buffer, flags))
    (started_c, *arrays_c), (started_r, *arrays_r) = states
    assert started_c == started_r == (np.count_nonzero(ids % 2 == 0) if with_flags else 0)
    for a, b in zip(arrays_c, arrays_r):
        np.testing.assert_array_equal(a, b)


def test_start_flags_only_while_needed(implementation):
    param = torch.nn.Parameter(torch.zeros(40))  # 3 blocks
    damped = SparseSGD([param], lr=0.1, momentum=0.9, dampening=0.5)
    damped.step({param: (torch.tensor([0, 2], dtype=torch.int32), torch.ones(2, 16))})
    assert damped.state[param]["initialized_blocks"].tolist() == [1, 0, 1]
    damped.step({param: (torch.tensor([1], dtype=torch.int32), torch.ones(1, 16))})
    assert "initialized_blocks" not in damped.state[param]  # every block has started
    undamped_param = torch.nn.Parameter(torch.zeros(40))
    undamped = SparseSGD([undamped_param], lr=0.1, momentum=0.9)
    undamped.step({undamped_param: (torch.tensor([0], dtype=torch.int32), torch.ones(1, 16))})
    assert "initialized_blocks" not in undamped.state[undamped_param]  # momentum x 0 + g == g


def test_closure_and_none_grads(implementation):
    param = torch.nn.Parameter(torch.ones(20))
    optimizer = SparseSGD([param], lr=0.1)
    assert optimizer.step(closure=lambda: 42.0) == 42.0  # p.grad is None: nothing changes
    assert torch.equal(param, torch.ones(20))
    optimizer.step({})
    assert torch.equal(param, torch.ones(20))


@pytest.mark.parametrize("kwargs", [
    dict(lr=-1.0), dict(lr=0.1, momentum=-0.5), dict(lr=0.1, weight_decay=-1.0),
    dict(lr=0.1, nesterov=True), dict(lr=0.1, momentum=0.9, dampening=0.1, nesterov=True),
    dict(lr=0.1, block=12),
])
def test_bad_hyperparameters(kwargs):
    with pytest.raises(ConfigError):
        SparseSGD([torch.nn.Parameter(torch.zeros(3))], **kwargs)


def test_bad_sparse_grads(implementation):
    param = torch.nn.Parameter(torch.zeros(40))
    optimizer = SparseSGD([param], lr=0.1, momentum=0.9)
    ones = torch.ones(1, 16)
    with pytest.raises(ConfigError, match="not a parameter"):
        optimizer.step({torch.nn.Parameter(torch.zeros(40)): (torch.tensor([0], dtype=torch.int32), ones)})
    with pytest.raises(ConfigError, match="out of"):
        optimizer.step({param: (torch.tensor([3], dtype=torch.int32), ones)})
    with pytest.raises(ConfigError, match="not increasing"):
        optimizer.step({param: (torch.tensor([1, 1], dtype=torch.int32), torch.ones(2, 16))})
    with pytest.raises(ConfigError, match="shape"):
        optimizer.step({param: (torch.tensor([1], dtype=torch.int32), torch.ones(1, 8))})
    with pytest.raises(UnsupportedError):
        optimizer.step({param: (torch.tensor([1], dtype=torch.int64), ones)})
    with pytest.raises(ConfigError, match="pair"):
        optimizer.step({param: torch.ones(3)})
    with pytest.raises(ConfigError, match="map"):
        optimizer.step([(param, ones)])
    other = torch.nn.Parameter(torch.zeros(40))
    optimizer.add_param_group({"params": [other]})
    with pytest.raises(ConfigError, match="out of"):  # the second entry is bad: the first is not applied either
        optimizer.step({other: (torch.tensor([0], dtype=torch.int32), ones),
                        param: (torch.tensor([9], dtype=torch.int32), ones)})
    assert not param.any() and not other.any()  # nothing was applied by the rejected calls
    double = torch.nn.Parameter(torch.zeros(16, dtype=torch.float64))
    with pytest.raises(UnsupportedError):
        SparseSGD([double], lr=0.1).step({double: (torch.tensor([0], dtype=torch.int32), ones)})
