"""Measure a ``Profile`` of a real torch model on this machine (hooks; warm-up iterations first).

    from wanlink.plan.profiler import profile_model
    profile = profile_model(model, (inputs, labels), iterations=10, density=0.01)

Forward time of every leaf module comes from forward pre/post hooks, the moment each gradient is
ready from ``register_post_accumulate_grad_hook``; gradients are grouped into buckets the way DDP
groups them (in the order they become ready, a small first bucket, then ``bucket_cap_mb``), and each
bucket is ready when its last gradient is. Medians over the timed iterations. With ``density`` the
cost of sparsifying each bucket (``wanlink.compress.BlockSparsifier``) is measured as well.

Given a ``process_group`` (typically a group of this rank alone, so that nothing crosses a
network), the step is profiled as training runs it instead: the model wrapped in DDP over that
group, with ``comm_hook`` (``(state, hook)``, e.g. the sparse hook) or DDP's all-reduce. The
buckets are then DDP's own (after its rebuild), each ready when DDP hands it to the hook, and a
sparse hook's time is what the hook itself spent per bucket (momentum, sparsifying, encoding;
for a one-rank group its exchange ends at once, so decoding too), taken out of the backward and
of the later buckets' readiness, where the models put it back.
"""
from __future__ import annotations

import statistics
import time

from wanlink.errors import ConfigError
from wanlink.plan.profile import Bucket, Layer, Profile

FIRST_BUCKET_BYTES = 1024 * 1024  # torch.distributed._DEFAULT_FIRST_BUCKET_BYTES
DEFAULT_BUCKET_CAP_MB = 25


def assign_buckets(sizes: list[int], cap_bytes: int, first_bytes: int = FIRST_BUCKET_BYTES) -> list[list[int]]:
    """DDP's assignment of gradients (given in ready order, sizes in bytes) to buckets: a bucket
    closes once it holds at least its limit; the first limit is ``first_bytes``, then ``cap_bytes``."""
    buckets, current, filled, limit = [], [], 0, first_bytes
    for index, size in enumerate(sizes):
        current.append(index)
        filled += size
        if filled >= limit:
            buckets.append(current)
            current, filled, limit = [], 0, cap_bytes
    if current:
        buckets.append(current)
    return buckets


def default_loss(output, batch):
    """Cross-entropy for (inputs, integer labels), mean squared error for float targets, else mean of squares."""
    import torch

    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        target = batch[1]
        if not target.is_floating_point():
            return torch.nn.functional.cross_entropy(output, target)
        return torch.nn.functional.mse_loss(output, target)
    return output.float().square().mean()


def _inputs(batch):
    return batch[0] if isinstance(batch, (tuple, list)) else batch


def _batch_size(batch) -> int:
    return int(_inputs(batch).shape[0])


def profile_model(model, batch, *, loss_fn=None, optimizer=None, warmup: int = 3, iterations: int = 10,
                  bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB, density: float | None = None,
                  name: str | None = None, background=None, process_group=None, comm_hook=None,
                  clock=time.perf_counter) -> Profile:
    """Time ``iterations`` training steps of ``model`` on ``batch`` (after ``warmup`` untimed ones).

    ``process_group``: profile through DDP over that group (and ``comm_hook``, ``(state, hook)``),
    see the module docs; needs ``warmup >= 2`` (DDP rebuilds its buckets after the first step).

    ``background``: called as each step begins, it starts work that runs beside the step (e.g.
    the training's exchanges, launched asynchronously) and returns a function that waits for that
    work, called once the step's compute has been timed; the profile then shows what compute costs
    while the link is busy (``Profile.while_exchanging``).

    ``clock``: the wall clock the steps, layers, readiness and hooks are timed with (seconds).
    """
    import torch

    if warmup < 0 or iterations < 1:
        raise ConfigError(f"need warmup >= 0 and iterations >= 1, got {warmup} and {iterations}")
    if comm_hook is not None and process_group is None:
        raise ConfigError("comm_hook needs a process_group (DDP runs the hook)")
    if process_group is not None and warmup < 2:
        raise ConfigError(f"profiling through DDP needs warmup >= 2 (its buckets are rebuilt after one step), "
                          f"got {warmup}")
    hooks = _DDPHooks(model, process_group, comm_hook, bucket_cap_mb, clock) if process_group is not None else None
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not params:
        raise ConfigError("the model has no parameters that require gradients")
    loss_fn = loss_fn or default_loss
    optimizer = optimizer or torch.optim.SGD([p for _n, p in params], lr=1e-3, momentum=0.9)
    leaves = [(n, m) for n, m in model.named_modules() if not list(m.children())]
    starts: dict[str, float] = {}
    forward: dict[str, list[float]] = {n: [] for n, _m in leaves}
    ready: dict[str, float] = {}
    handles = []
    for module_name, module in leaves:
        handles.append(module.register_forward_pre_hook(
            lambda _m, _i, key=module_name: starts.__setitem__(key, clock())))
        handles.append(module.register_forward_hook(
            lambda _m, _i, _o, key=module_name: forward[key].append(clock() - starts[key])))
    for param_name, param in params:
        handles.append(param.register_post_accumulate_grad_hook(
            lambda _p, key=param_name: ready.__setitem__(key, clock())))
    totals = {"forward_s": [], "backward_s": [], "step_s": [], "cpu_s": []}
    ready_offsets: dict[str, list[float]] = {n: [] for n, _p in params}
    try:
        for iteration in range(warmup + iterations):
            timed = iteration >= warmup
            if not timed:
                for values in forward.values():
                    values.clear()
            ready.clear()
            optimizer.zero_grad(set_to_none=False)
            finish_background = background() if background is not None else None
            if hooks is not None:
                hooks.calls.clear()
            cpu = time.thread_time()
            begin = clock()
            loss = loss_fn((hooks.ddp if hooks is not None else model)(_inputs(batch)), batch)
            forward_end = clock()
            loss.backward()
            backward_end = clock()
            optimizer.step()
            end = clock()
            cpu = time.thread_time() - cpu
            if finish_background is not None:
                finish_background()
            if timed:
                totals["forward_s"].append(forward_end - begin)
                totals["backward_s"].append(backward_end - forward_end)
                totals["step_s"].append(end - backward_end)
                totals["cpu_s"].append(cpu)
                for key, moment in ready.items():
                    ready_offsets[key].append(moment - forward_end)
                if hooks is not None:
                    hooks.record(forward_end, totals["backward_s"], sparse=density is not None)
    finally:
        for handle in handles:
            handle.remove()
    median_ready = {n: statistics.median(v) if v else 0.0 for n, v in ready_offsets.items()}
    if hooks is not None:
        buckets = hooks.buckets()
    else:
        order = sorted(params, key=lambda item: median_ready[item[0]])
        sizes = [p.numel() * p.element_size() for _n, p in order]
        buckets = []
        for members in assign_buckets(sizes, int(bucket_cap_mb * 1024 * 1024)):
            numels = tuple(order[i][1].numel() for i in members)
            buckets.append(Bucket(bytes=sum(sizes[i] for i in members),
                                  ready_s=max(median_ready[order[i][0]] for i in members), numels=numels,
                                  sparsify_s=_sparsify_seconds(numels, density) if density else 0.0))
    layers = _layers(leaves, forward, params, median_ready)
    cpu_s = statistics.median(totals["cpu_s"])
    if hooks is None and density is not None:  # the sparsifier was timed apart: its CPU joins the step's
        cpu_s += sum(b.sparsify_s for b in buckets)
    return Profile(model=name or type(model).__name__, batch_size=_batch_size(batch),
                   forward_s=statistics.median(totals["forward_s"]),
                   backward_s=statistics.median(totals["backward_s"]), step_s=statistics.median(totals["step_s"]),
                   cpu_s=cpu_s,
                   buckets=tuple(buckets), layers=tuple(layers), density=density, threads=torch.get_num_threads(),
                   iterations=iterations, meta={"torch": torch.__version__, "warmup": warmup,
                                                "bucket_cap_mb": bucket_cap_mb})


class _DDPHooks:
    """The model in DDP over ``group``, its comm hook timed: per bucket (DDP's index) the moment DDP
    hands it over and how long the hook itself runs; per timed step, each bucket's readiness and
    hook time relative to the end of forward, the hooks' time taken out of the backward."""

    def __init__(self, model, group, comm_hook, bucket_cap_mb: float, clock):
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
        from torch.nn.parallel import DistributedDataParallel

        self.ddp = DistributedDataParallel(model, process_group=group, bucket_cap_mb=bucket_cap_mb,
                                           gradient_as_bucket_view=True)
        state, hook = comm_hook if comm_hook is not None else (group, allreduce_hook)
        self.calls: list = []  # (bucket index, numels, bytes, entered, left) this step
        self.steps: list = []  # per timed step: {index: (numels, bytes, ready after forward, hook seconds)}

        def timed(hook_state, bucket):
            entered = clock()
            future = hook(hook_state, bucket)
            self.calls.append((bucket.index(), tuple(p.numel() for p in bucket.parameters()),
                               bucket.buffer().numel() * bucket.buffer().element_size(), entered, clock()))
            return future

        self.ddp.register_comm_hook(state, timed)

    def record(self, forward_end: float, backward: list, sparse: bool) -> None:
        """One timed step. A sparse hook's time comes out of the backward and of the later buckets'
        readiness (the models add it back); a dense bucket's (DDP's all-reduce call on a one-rank
        group) stays in them, as the models add none."""
        step, hooks_before = {}, 0.0
        for index, numels, nbytes, entered, left in sorted(self.calls, key=lambda call: call[3]):
            hook = left - entered if sparse else 0.0
            step[index] = (numels, nbytes, entered - forward_end - hooks_before, hook)
            hooks_before += hook
        backward[-1] -= hooks_before
        self.steps.append(step)

    def buckets(self) -> list[Bucket]:
        """Each of DDP's buckets (as in the last step) with its median readiness and hook time."""
        out = []
        for index in sorted(self.steps[-1]):
            numels, nbytes, _ready, _hook = self.steps[-1][index]
            ready = statistics.median(step[index][2] for step in self.steps if index in step)
            hook = statistics.median(step[index][3] for step in self.steps if index in step)
            out.append(Bucket(bytes=nbytes, ready_s=max(ready, 0.0), numels=numels, sparsify_s=hook))
        return out


def _layers(leaves, forward, params, median_ready) -> list[Layer]:
    """Per leaf module: median forward time, and backward as the gap between its gradients being
    ready and the previous gradient being ready (0 for modules without parameters)."""
    owner = {}
    for module_name, module in leaves:
        for param_name, _p in module.named_parameters(recurse=False):
            owner[f"{module_name}.{param_name}" if module_name else param_name] = module_name
    done = sorted({median_ready[n] for n, _p in params})
    layers = []
    for module_name, module in leaves:
        names = [n for n, _p in params if owner.get(n) == module_name]
        grad_bytes = sum(p.numel() * p.element_size() for n, p in params if n in names)
        backward = 0.0
        if names:
            moment = max(median_ready[n] for n in names)
            earlier = [t for t in done if t < min(median_ready[n] for n in names)]
            backward = moment - (earlier[-1] if earlier else 0.0)
        samples = forward[module_name]
        layers.append(Layer(module_name or type(module).__name__, statistics.median(samples) if samples else 0.0,
                            backward, grad_bytes))
    return layers


def _sparsify_seconds(numels: tuple[int, ...], density: float, repeats: int = 3) -> float:
    """Median time to sparsify (with error feedback) and encode one bucket's gradients."""
    import torch

    from wanlink.compress import BlockSparsifier, encode_blocks

    sparsifiers = [BlockSparsifier(n, density) for n in numels]
    grads = [torch.randn(n) for n in numels]
    samples = []
    for _ in range(repeats + 1):
        begin = time.perf_counter()
        for sparsifier, grad in zip(sparsifiers, grads):
            indices, values = sparsifier.compress(grad)
            encode_blocks(indices.numpy(), values.numpy(), sparsifier.numel, block=sparsifier.block)
        samples.append(time.perf_counter() - begin)
    return statistics.median(samples[1:])


def measure_step_seconds(model_fn, batch_fn, batch_size: int, *, loss_fn=None, iterations: int = 3) -> float:
    """Median seconds of one training step at ``batch_size`` (``model_fn()`` makes the model,
    ``batch_fn(n)`` a batch of n); used to profile throughput against batch size."""
    profile = profile_model(model_fn(), batch_fn(batch_size), loss_fn=loss_fn, warmup=1, iterations=iterations)
    return profile.compute_s
