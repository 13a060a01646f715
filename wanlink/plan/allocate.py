"""Unequal local batches for unequal ranks (Poplar's batch allocation with StellaTrain's f_i) (pure).

A rank's throughput at local batch x is ``f(x) = min(beta / alpha x, beta)`` samples/s (it saturates
at batch ``alpha``), so one step takes ``t(x) = x / f(x) = max(alpha / beta, x / beta)``.

    samples, largest = probe_batch_sizes(measure)          # doubling, then binary search to the memory limit
    model = fit_throughput(samples, max_batch=largest)     # alpha, beta from (batch, seconds) pairs
    plan = allocate_batches(512, [model_rank0, model_rank1, ...])
    loss = loss * loss_weight(plan.batches[rank], 512, world_size)   # DDP then averages correctly

``allocate_batches`` minimises the slowest rank's step time with the batches summing to the
global batch. DDP divides the sum of the ranks' gradients by the world size; with unequal batches
each rank's mean gradient must count in proportion to its batch, which ``loss_weight`` does by
scaling the local loss (mean over the local batch) by ``local x world / global``.
"""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

from wanlink.errors import ConfigError


@dataclass(frozen=True)
class Throughput:
    """f(x) = min(beta / alpha x, beta): ``alpha`` samples saturate the rank, ``beta`` samples/s then."""

    alpha: float
    beta: float
    max_batch: int | None = None  # the largest batch that fits in memory; None = no limit

    def __post_init__(self):
        if not (self.alpha >= 0 and self.beta > 0 and math.isfinite(self.alpha) and math.isfinite(self.beta)):
            raise ConfigError(f"need alpha >= 0 and beta > 0, got alpha={self.alpha!r} beta={self.beta!r}")
        if self.max_batch is not None and self.max_batch < 1:
            raise ConfigError(f"max_batch must be >= 1, got {self.max_batch!r}")

    def seconds(self, batch: float) -> float:
        """One step at this local batch (0 for an empty batch)."""
        return 0.0 if batch <= 0 else max(self.alpha / self.beta, batch / self.beta)

    def most_within(self, seconds: float) -> int:
        """The largest batch this rank finishes within ``seconds``."""
        if seconds < self.alpha / self.beta:
            return 0
        most = math.floor(seconds * self.beta * (1 + 1e-12))
        return most if self.max_batch is None else min(most, self.max_batch)


def fit_throughput(samples: list[tuple[int, float]], max_batch: int | None = None) -> Throughput:
    """Least-squares fit of ``t(x) = max(c, x / beta)`` to (batch, seconds) samples; alpha = c x beta.

    Tries every split of the sorted samples into a flat part (mean) and a linear part through the
    origin, and keeps the best."""
    points = sorted((float(x), float(t)) for x, t in samples)
    if len(points) < 1 or any(x <= 0 or t <= 0 or not math.isfinite(t) for x, t in points):
        raise ConfigError(f"need (batch > 0, seconds > 0) samples, got {samples!r}")
    best = None
    for split in range(len(points)):
        flat, linear = points[:split], points[split:]
        c = sum(t for _x, t in flat) / len(flat) if flat else 0.0
        beta = sum(x * x for x, _t in linear) / sum(x * t for x, t in linear)
        error = sum((max(c, x / beta) - t) ** 2 for x, t in points)
        if best is None or error < best[0] - 1e-15:
            best = (error, c, beta)
    _error, c, beta = best
    return Throughput(alpha=c * beta, beta=beta, max_batch=max_batch)


def _out_of_memory(error: BaseException) -> bool:
    return isinstance(error, MemoryError) or "out of memory" in str(error).lower() or "can't allocate" in str(error)


def probe_batch_sizes(measure, start: int = 1, limit: int = 1 << 16, is_oom=_out_of_memory):
    """Poplar's search: double the batch until ``measure(batch)`` (seconds per step) runs out of
    memory or reaches ``limit``, then binary-search the largest batch that fits.

    Returns ``(samples, max_batch)``: the (batch, seconds) pairs measured and the largest batch that
    ran. Errors other than running out of memory propagate."""
    if start < 1 or limit < start:
        raise ConfigError(f"need 1 <= start <= limit, got start={start} limit={limit}")
    samples, good, bad = [], None, None

    def fits(batch: int) -> bool:
        try:
            samples.append((batch, measure(batch)))
        except Exception as error:
            if not is_oom(error):
                raise
            return False
        return True

    batch = start
    while batch <= limit:
        if not fits(batch):
            bad = batch
            break
        good = batch
        batch *= 2
    if good is None:
        raise ConfigError(f"even a batch of {start} runs out of memory")
    if bad is not None:
        while bad - good > 1:
            middle = (good + bad) // 2
            if fits(middle):
                good = middle
            else:
                bad = middle
    return samples, good


@dataclass(frozen=True)
class Allocation:
    batches: tuple[int, ...]
    seconds: tuple[float, ...]  # predicted step time per rank

    @property
    def makespan(self) -> float:
        return max(self.seconds)


def equal_split(global_batch: int, world: int) -> tuple[int, ...]:
    return tuple(global_batch // world + (1 if r < global_batch % world else 0) for r in range(world))


def allocate_batches(global_batch: int, ranks: list[Throughput], min_batch: int = 1) -> Allocation:
    """Local batches summing to ``global_batch`` that minimise the slowest rank's step time."""
    world = len(ranks)
    if world < 1:
        raise ConfigError("allocate_batches needs at least one rank")
    if not isinstance(global_batch, int) or global_batch < world * min_batch:
        raise ConfigError(f"global batch {global_batch!r} is smaller than {world} ranks x min_batch {min_batch}")
    capacity = sum(r.max_batch if r.max_batch is not None else global_batch for r in ranks)
    if capacity < global_batch:
        raise ConfigError(f"global batch {global_batch} exceeds the ranks' memory limits (together {capacity})")
    for rank, model in enumerate(ranks):
        if model.max_batch is not None and model.max_batch < min_batch:
            raise ConfigError(f"rank {rank}: max_batch {model.max_batch} < min_batch {min_batch}")

    def fits(seconds: float) -> int:
        return sum(max(min_batch, r.most_within(seconds)) for r in ranks)

    low, high = 0.0, max(r.seconds(global_batch) for r in ranks)
    for _ in range(200):  # bisection on the makespan
        middle = (low + high) / 2
        if fits(middle) >= global_batch:
            high = middle
        else:
            low = middle
    batches = [max(min_batch, r.most_within(high)) for r in ranks]
    heap = [(-r.seconds(b), i) for i, (r, b) in enumerate(zip(ranks, batches))]
    heapq.heapify(heap)
    surplus = sum(batches) - global_batch
    while surplus > 0:  # take the surplus from whichever rank is slowest now
        _neg, i = heapq.heappop(heap)
        if batches[i] > min_batch:
            batches[i] -= 1
            surplus -= 1
        heapq.heappush(heap, (-ranks[i].seconds(batches[i]) if batches[i] > min_batch else math.inf, i))
    return Allocation(tuple(batches), tuple(r.seconds(b) for r, b in zip(ranks, batches)))


def loss_weight(local_batch: int, global_batch: int, world_size: int) -> float:
    """Factor for a rank's mean-over-its-batch loss so that DDP's average over ranks equals the mean
    over the global batch: ``local_batch x world_size / global_batch``."""
    if not (0 <= local_batch <= global_batch and global_batch > 0 and world_size >= 1):
        raise ConfigError(f"need 0 <= local_batch <= global_batch and world_size >= 1, got "
                          f"{local_batch}, {global_batch}, {world_size}")
    return local_batch * world_size / global_batch
