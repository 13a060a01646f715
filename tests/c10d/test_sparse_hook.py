"""The block-sparse DDP comm hook on 2-rank wanlink worlds over loopback."""
import threading
import warnings

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from tests.support.worlds import run_world
from wanlink.errors import ConfigError, ProtocolError

STEPS = 6  # enough for the stale result buffers (two per bucket) to be reused after the bucket rebuild


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 96), torch.nn.ReLU(), torch.nn.Linear(96, 64), torch.nn.ReLU(),
                               torch.nn.Linear(64, 10))


def _batches(rank):
    g = torch.Generator().manual_seed(100 + rank)
    return [(torch.randn(16, 32, generator=g), torch.randint(0, 10, (16,), generator=g)) for _ in range(STEPS)]


def _train(rank, size, hook_options, lr=0.1, optimizer_name="sgd", results=None, momentum=0.0):
    """Trains STEPS steps; returns final flat params and the gradient seen by the optimizer per step."""
    from wanlink.c10d.sparse_hook import BlockSparseState, block_sparse_hook
    from wanlink.optim import SparseSGD

    model = _model()
    ddp = DDP(model, bucket_cap_mb=0.005)  # several buckets
    state = None
    if hook_options is not None:
        state = BlockSparseState(**hook_options)

        def hook(state, bucket):
            step = state.iteration
            future = block_sparse_hook(state, bucket)
            if results is not None:
                results.append((step, bucket.index(), future))
            return future

        ddp.register_comm_hook(state, hook)
    if optimizer_name == "adamw":
        optimizer = torch.optim.AdamW(ddp.parameters(), lr=lr, betas=(momentum, 0.999))
    else:
        optimizer = (SparseSGD if optimizer_name == "sparse" else torch.optim.SGD)(ddp.parameters(), lr=lr,
                                                                                   momentum=momentum)
    grads = []
    for x, y in _batches(rank):
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        grads.append(torch.cat([p.grad.reshape(-1).clone() for p in model.parameters()]))
        if state is not None and state.sparse_optimizer:
            optimizer.step(sparse_grads=state.sparse_grads())
        else:
            optimizer.step()
    flushed = state.flush() if state is not None else False
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]), grads, flushed


def _dense_vs_full_density(rank, size):
    dense, dense_grads, _ = _train(rank, size, None)
    full, full_grads, _ = _train(rank, size, {"density": 1.0})
    return dense, full, dense_grads, full_grads


def test_full_density_equals_dense_ddp():
    for dense, full, dense_grads, full_grads in run_world(2, _dense_vs_full_density):
        for a, b in zip(dense_grads, full_grads):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(dense, full, rtol=1e-6, atol=1e-7)


def _sparse_ranks_agree(rank, size):
    params, grads, _ = _train(rank, size, {"density": 0.05})
    nonzero = [int((g != 0).sum()) for g in grads]
    return params, nonzero, sum(p.numel() for p in _model().parameters())


def test_sparse_steps_keep_ranks_identical_and_gradients_sparse():
    (p0, nz0, numel), (p1, nz1, _) = run_world(2, _sparse_ranks_agree)
    assert torch.equal(p0, p1)  # every rank applied the same averaged sparse update
    for nonzero in nz0:
        assert 0 < nonzero <= 2 * 0.05 * numel + 2 * 16 * 6  # at most both ranks' blocks (plus 1 per tensor)
    assert nz0 == nz1


def _sparse_params_and_site_awareness(rank, size):
    from wanlink.c10d import site_map

    params, _grads, _ = _train(rank, size, {"density": 0.05})
    return params, site_map()["site_aware"]


def test_sparse_exchange_across_sites_gives_the_flat_result():
    """2 sites x 2 ranks: the hook's all-gather runs site-aware and every rank ends as in a flat world."""
    rings = {"WANLINK_DIRECT_MAX_BYTES": "0", "WANLINK_PIECE_BYTES": "4096"}  # never direct exchange
    flat = run_world(4, _sparse_params_and_site_awareness, env=rings)
    sites = run_world(4, _sparse_params_and_site_awareness, env=rings,
                      rank_env=[{"WANLINK_SITE": site} for site in "aabb"])
    assert [aware for _p, aware in flat] == [False] * 4 and [aware for _p, aware in sites] == [True] * 4
    assert all(torch.equal(params, flat[0][0]) for params, _aware in flat + sites)


def _stale_vs_fresh(rank, size):
    _, fresh, _ = _train(rank, size, {"density": 0.1}, lr=0.0)
    _, stale, flushed = _train(rank, size, {"density": 0.1, "staleness": 1}, lr=0.0)
    return fresh, stale, flushed


def test_staleness_applies_the_previous_steps_update():
    for fresh, stale, flushed in run_world(2, _stale_vs_fresh):
        assert flushed
        assert torch.count_nonzero(stale[0]) == 0  # the first step has no aggregate yet
        for t in range(1, STEPS):  # lr 0: both runs see the same gradients, so stale[t] == fresh[t-1]
            torch.testing.assert_close(stale[t], fresh[t - 1], rtol=0, atol=0)


def _sparse_optimizer_matches_dense_sgd(rank, size):
    dense_params, _, _ = _train(rank, size, {"density": 0.1})
    sparse_params, _, _ = _train(rank, size, {"density": 0.1, "sparse_optimizer": True}, optimizer_name="sparse")
    return dense_params, sparse_params


def test_sparse_optimizer_path_matches_densified_sgd():
    for dense_params, sparse_params in run_world(2, _sparse_optimizer_matches_dense_sgd):
        torch.testing.assert_close(sparse_params, dense_params, rtol=1e-5, atol=1e-6)


def _stale_sparse_optimizer_vs_dense(rank, size):
    options = {"density": 0.1, "staleness": 1, "warmup_steps": 2}
    dense_params, _, _ = _train(rank, size, options)
    sparse_params, _, flushed = _train(rank, size, {**options, "sparse_optimizer": True}, optimizer_name="sparse")
    return dense_params, sparse_params, flushed


def test_stale_sparse_optimizer_applies_the_previous_step_like_the_dense_path():
    # warm-up steps are dense (sparse_grads() is None: SparseSGD steps on .grad), then each step
    # applies the previous step's blocks, exactly as the densified stale path does with SGD
    for dense_params, sparse_params, flushed in run_world(2, _stale_sparse_optimizer_vs_dense):
        assert flushed
        torch.testing.assert_close(sparse_params, dense_params, rtol=1e-5, atol=1e-6)


def _stale_result_storages(rank, size):
    results = []
    _train(rank, size, {"density": 0.1, "staleness": 1}, results=results)
    storages = {}
    for step, index, future in results:
        if step >= 2:  # from the second step of the rebuilt buckets on, each returns the previous one's result
            storages.setdefault(index, set()).add(future.wait().untyped_storage().data_ptr())
    return storages


def test_stale_results_reuse_two_buffers_per_bucket():
    for storages in run_world(2, _stale_result_storages):
        assert storages and all(len(pointers) == 2 for pointers in storages.values())


def _checkpoint_rules(rank, size):
    from wanlink.c10d.sparse_hook import BlockSparseState, block_sparse_hook

    model = _model()
    ddp = DDP(model)
    state = BlockSparseState(density=0.1, staleness=1, momentum=0.9)
    ddp.register_comm_hook(state, block_sparse_hook)
    (x, y), *_ = _batches(rank)
    torch.nn.functional.cross_entropy(ddp(x), y).backward()
    try:
        state.state_dict()
        refused = False
    except ConfigError:
        refused = True
    state.flush()
    saved = state.state_dict()
    restored = BlockSparseState(density=0.1, staleness=1, momentum=0.9)
    restored.load_state_dict(saved)
    residuals = [s.residual for codec in state._codecs.values() for s in codec.sparsifiers]
    restored_residuals = [s.residual for codec in restored._codecs.values() for s in codec.sparsifiers]
    residuals += state.velocities()
    restored_residuals += restored._loaded_velocities  # handed to the parameters as the hook meets them
    same = len(residuals) == len(restored_residuals) and all(torch.equal(a, b)
                                                              for a, b in zip(residuals, restored_residuals))
    return refused, same, len(state.velocities())


def test_state_dict_needs_a_flush_and_round_trips_error_feedback():
    for refused, same, count in run_world(2, _checkpoint_rules):
        assert refused and same and count > 0


def _send_order(rank, size):
    """Launch one step's bucket exchanges while the I/O loop is held, then record the wire order."""
    from wanlink.c10d.sparse_hook import BlockSparseState, block_sparse_hook
    from wanlink.io.runtime import get_runtime

    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(6)])
    ddp = DDP(model, bucket_cap_mb=0.2)  # (about) one bucket per layer
    state = BlockSparseState(density=0.5, staleness=1)  # the hook returns last step's (finished) result
    ddp.register_comm_hook(state, block_sparse_hook)
    x = torch.randn(8, 256)

    def step():
        ddp(x).sum().backward()

    step()
    step()  # DDP rebuilds its buckets after the first iteration
    state.flush()
    backend = dist.distributed_c10d._get_default_group()  # the ProcessGroupWanlink itself
    link = backend.mesh.cached(1 - rank)
    runtime = get_runtime()
    hold, held = threading.Event(), threading.Event()
    runtime.loop.call_soon_threadsafe(lambda: (held.set(), hold.wait()))
    held.wait()
    log = link.record_send_order()
    step()  # every bucket's all-gather is launched while the loop cannot send anything
    buckets = len({id(future) for future, _offset, _numel in state._results[max(state._results)].values()})
    hold.set()
    state.flush()
    first_seen = []
    for tag, _seq, _offset in log:
        if tag not in first_seen:
            first_seen.append(tag)
    return first_seen, buckets


def test_buckets_of_the_first_layers_leave_first():
    # (EDF orders the links: the loop path; on the express path a one-host group's collectives run in issue order)
    for first_seen, buckets in run_world(2, _send_order, env={"WANLINK_EXPRESS": "0"}):
        assert buckets >= 3 and len(first_seen) == buckets
        # tags grow with launch order; DDP launches the last layers' bucket first, and EDF must send
        # the first layers' bucket (launched last) first
        assert first_seen == sorted(first_seen, reverse=True)


def _hook_momentum_vs_optimizer_momentum(rank, size):
    dense, _, _ = _train(rank, size, None, momentum=0.9)
    hooked, _, _ = _train(rank, size, {"density": 1.0, "momentum": 0.9, "warmup_steps": 2})
    return dense, hooked


def test_momentum_in_the_hook_at_full_density_equals_momentum_sgd():
    # dense warm-up steps average the velocities; density-1 steps send every block and mask nothing
    for dense, hooked in run_world(2, _hook_momentum_vs_optimizer_momentum):
        torch.testing.assert_close(hooked, dense, rtol=1e-5, atol=1e-6)


def _velocities_after_sparse_steps(rank, size):
    params_of = {}

    def remember(bucket_index, bucket_params):
        params_of[bucket_index] = bucket_params

    from wanlink.c10d.sparse_hook import BlockSparseState, block_sparse_hook

    model = _model()
    ddp = DDP(model, bucket_cap_mb=0.005)
    state = BlockSparseState(density=0.05, momentum=0.9)

    def hook(state, bucket):
        remember(bucket.index(), list(bucket.parameters()))
        return block_sparse_hook(state, bucket)

    ddp.register_comm_hook(state, hook)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for x, y in _batches(rank):
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        optimizer.step()
    checked = kept = 0
    for index, codec in state._codecs.items():
        for sparsifier, param in zip(codec.sparsifiers, params_of[index]):
            velocity = state._velocity[param]
            assert velocity.shape == sparsifier.residual.shape
            whole = velocity.numel() // 16 * 16
            sent = (sparsifier.residual[:whole].view(-1, 16) == 0).all(1)  # error feedback empties sent blocks
            held = velocity[:whole].view(-1, 16)
            assert torch.count_nonzero(held[sent]) == 0  # momentum factor masking
            kept += int(torch.count_nonzero(held[~sent]))  # the others keep their velocity
            checked += 1
    return checked, kept


def test_sent_blocks_restart_their_velocity():
    assert all(checked >= 4 and kept > 0 for checked, kept in run_world(2, _velocities_after_sparse_steps))


def _refusals(rank, size):
    messages = []
    for options, optimizer_name in (({"density": 0.1, "staleness": 1}, "sgd"), ({"density": 0.1}, "sgd"),
                                    ({"density": 0.1, "momentum": 0.9}, "sgd"),
                                    ({"density": 0.1, "staleness": 1}, "sparse"),
                                    ({"density": 0.1, "staleness": 1}, "adamw"),
                                    ({"density": 0.1, "momentum": 0.9}, "adamw")):
        try:
            _train(rank, size, options, momentum=0.9, optimizer_name=optimizer_name, lr=0.01)
            messages.append(None)
        except ConfigError as error:
            messages.append(str(error))
    allowed = [_train(rank, size, {"density": 1.0}, momentum=0.9)[0],  # dense: nothing delayed
               _train(rank, size, {"density": 0.1, "momentum": 0.9}, momentum=0.0, optimizer_name="adamw", lr=0.01)[0]]
    return messages, all(bool(torch.isfinite(params).all()) for params in allowed)


def test_momentum_optimizers_behind_sparse_updates_are_refused():
    for (stale, fresh, twice, sparse_sgd_dense, adam, adam_twice), allowed in run_world(2, _refusals):
        for message in (stale, fresh, sparse_sgd_dense):
            assert message and "BlockSparseState(..., momentum=0.9)" in message and "SparseSGD" in message
        assert "SGD(momentum=0.9)" in stale and "SparseSGD(momentum=0.9)" in sparse_sgd_dense
        assert twice and "momentum twice" in twice
        assert adam and "AdamW(betas=(0.9, 0.999))" in adam and "AdamW(betas=(0.0, 0.999))" in adam
        assert "BlockSparseState(..., momentum=0.9)" in adam
        assert adam_twice and "momentum twice" in adam_twice and "betas=(0.0, 0.999)" in adam_twice
        assert allowed  # AdamW(betas=(0, beta2)) with the momentum in the hook is accepted


def _sparse_sgd_with_the_hook_momentum(rank, size):
    sparse = {"density": 0.1, "sparse_optimizer": True}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        in_hook, _, _ = _train(rank, size, {**sparse, "staleness": 1, "momentum": 0.9}, optimizer_name="sparse")
        quiet = [str(w.message) for w in caught]
        _train(rank, size, {**sparse, "staleness": 1}, momentum=0.9, optimizer_name="sparse")
        stale = [str(w.message) for w in caught][len(quiet):]
        _train(rank, size, sparse, momentum=0.9, optimizer_name="sparse")
        fresh = [str(w.message) for w in caught][len(quiet) + len(stale):]
    try:
        _train(rank, size, {**sparse, "momentum": 0.9}, momentum=0.9, optimizer_name="sparse")
        twice = None
    except ConfigError as error:
        twice = str(error)
    return bool(torch.isfinite(in_hook).all()), twice, quiet, stale, fresh


def test_sparse_sgd_takes_the_hook_momentum_but_not_both():
    for in_hook_finite, twice, quiet, stale, fresh in run_world(2, _sparse_sgd_with_the_hook_momentum):
        assert in_hook_finite
        assert twice and "momentum twice" in twice
        # its own momentum with staleness 1 warns, naming momentum correction; the hook's momentum does not
        assert not [m for m in quiet if "SparseSGD" in m] and not [m for m in fresh if "SparseSGD" in m]
        assert [m for m in stale if "SparseSGD(momentum=0.9) on stale" in m and "momentum=0.9)" in m
                and "SparseSGD(momentum=0)" in m]


def test_hook_options_are_validated():
    from wanlink.c10d.sparse_hook import BlockSparseState

    for bad in ({"density": 0.0}, {"density": 1.5}, {"staleness": 2}, {"warmup_steps": -1}, {"momentum": 1.0},
                {"momentum": -0.1}, {"momentum": True}):
        with pytest.raises(ConfigError):
            BlockSparseState(**bad)
    with pytest.raises(ConfigError, match="sparse_optimizer"):
        BlockSparseState().sparse_grads()


# -- the bucket codec alone (no world): one kernel call per bucket, frames as decode_blocks reads them ----
CODEC_NUMELS = [10, 640, 64, 4096, 5, 2048]  # a DDP bucket's order: ragged tails in the middle of the buffer


def _codec_messages(density, steps=3, world=2):
    """Per step, every rank's message from its own codec, and the dense vectors each rank's frames stand for."""
    from wanlink.c10d.sparse_hook import BucketCodec
    from wanlink.compress import decode_blocks

    codecs = [BucketCodec(CODEC_NUMELS, density) for _ in range(world)]
    generator = torch.Generator().manual_seed(7)
    total = sum(CODEC_NUMELS)
    for _ in range(steps):
        messages, sent = [], []
        for codec in codecs:
            message = codec.encode(torch.randn(total, generator=generator) * 3)
            frames = message.numpy()
            dense = []
            for i, numel in enumerate(CODEC_NUMELS):  # each frame is a valid block-COO frame of its gradient
                frame = decode_blocks(frames[codec.frame_offsets[i]:codec.frame_offsets[i + 1]])
                assert frame.numel == numel and frame.indices.shape[0] == codec.sparsifiers[i].k
                padded = torch.zeros(-(-numel // 16) * 16)
                padded.view(-1, 16)[torch.from_numpy(frame.indices).long()] = torch.from_numpy(frame.values)
                dense.append(padded[:numel])
            messages.append(message)
            sent.append(torch.cat(dense))
        yield codecs[0], torch.cat(messages), sent


@pytest.mark.parametrize("density", [0.01, 0.2, 1.0])
def test_bucket_codec_averages_like_the_frames_it_sends(density):
    out = torch.full((sum(CODEC_NUMELS),), 5.0)
    nonzero = None
    for codec, gathered, sent in _codec_messages(density):
        expected = sum(sent) / len(sent)
        nonzero = codec.average_into(gathered, 2, out, nonzero)  # clears only what the last call wrote
        torch.testing.assert_close(out, expected, rtol=0, atol=1e-6)
        offset = 0
        for numel, (ids, values) in zip(CODEC_NUMELS, codec.average_sparse(gathered, 2)):
            union = torch.zeros(-(-numel // 16), dtype=torch.bool)
            for rank_sent in sent:
                padded = torch.zeros(-(-numel // 16) * 16)
                padded[:numel] = rank_sent[offset:offset + numel]
                union |= padded.view(-1, 16).ne(0).any(1)
            assert torch.equal(ids.long(), torch.nonzero(union).flatten())
            padded = torch.zeros(-(-numel // 16) * 16)
            padded[:numel] = expected[offset:offset + numel]
            torch.testing.assert_close(values, padded.view(-1, 16)[ids.long()], rtol=0, atol=1e-6)
            offset += numel


def test_bucket_codec_masks_the_sent_blocks_of_the_velocity():
    from wanlink.c10d.sparse_hook import BucketCodec

    codec = BucketCodec(CODEC_NUMELS, 0.1)
    velocity = torch.randn(sum(CODEC_NUMELS)) + 10
    message = codec.encode(velocity.clone(), mask_sent=velocity)
    sent = codec.average_into(torch.cat([message, message]), 2, torch.zeros_like(velocity))
    assert torch.count_nonzero(velocity[torch.from_numpy(sent)]) == 0
    assert torch.count_nonzero(velocity) == velocity.numel() - sent.size


@pytest.mark.parametrize("corrupt, error", [
    (lambda raw, codec: raw.__setitem__(codec.frame_offsets[1], ord("X")), "not a block frame"),
    (lambda raw, codec: raw.__setitem__(slice(codec.frame_offsets[3] + 32, codec.frame_offsets[3] + 40),
                                        np.array([9, 0, 0, 0, 2, 0, 0, 0], dtype=np.uint8)), "not increasing"),
    (lambda raw, codec: raw[codec.frame_offsets[0]:codec.frame_offsets[1]].view(np.float32).__setitem__(
        slice(-6, None), 1.0), "tail block has non-zero padding"),
])
def test_bucket_codec_rejects_a_malformed_frame(corrupt, error):
    codec, gathered, _ = next(_codec_messages(1.0))
    corrupt(gathered.numpy()[codec.message_size:], codec)  # rank 1's message
    for decode in (codec.average_sparse, lambda g, w: codec.average_into(g, w, torch.zeros(sum(CODEC_NUMELS)))):
        with pytest.raises(ProtocolError, match=error):
            decode(gathered, 2)


def test_bucket_codec_names_a_model_mismatch():
    from wanlink.c10d.sparse_hook import BucketCodec

    codec, gathered, _ = next(_codec_messages(0.2))
    other = BucketCodec(CODEC_NUMELS[:-1] + [2064], 0.2)  # rank 1's last gradient is 16 elements larger
    mine = gathered[:codec.message_size]
    theirs = other.encode(torch.randn(int(other.element_offsets[-1])))
    assert theirs.numel() == mine.numel()  # same k, so the same size: only the frames can tell
    with pytest.raises(ConfigError, match="rank 1 sent a frame .* 2064 elements .* gradient 5 .* 2048"):
        codec.average_sparse(torch.cat([mine, theirs]), 2)
