"""One configuration to predict (streams, density, staleness, collective, cells, order, batch split)
and what the models derive from it: each rank's compute and each bucket's collective (pure)."""
from __future__ import annotations

from dataclasses import dataclass, replace

from wanlink.errors import ConfigError
from wanlink.plan.cluster import Cluster
from wanlink.plan.profile import Profile
from wanlink.plan.topology import Network, Phases, flat_collective, site_collective, sparse_message_bytes

ORDERS = ("fcfs", "edf")
COLLECTIVES = ("flat", "site")


@dataclass(frozen=True)
class Choice:
    streams: int | None = None  # None: the cluster's default
    density: float | None = None  # None: dense all-reduce; else block-sparse all-gather at this density
    staleness: int = 0  # 0: the step waits for this iteration's exchange; 1: for the previous one's
    collective: str = "flat"  # "flat": one collective over all ranks; "site": reduce in sites, then across
    cells: int = 1  # site collectives: parallel cross-site rings
    order: str = "fcfs"  # chunk order on a link: "fcfs" (launch order) or "edf" (first layers first)
    batches: tuple[int, ...] | None = None  # local batch of every rank; None: the profile's everywhere
    rank_speeds: tuple[float, ...] | None = None  # per-rank compute speed; None: each rank's site speed

    def check(self, world: int) -> None:
        if self.streams is not None and (not isinstance(self.streams, int) or self.streams < 1):
            raise ConfigError(f"streams must be an integer >= 1, got {self.streams!r}")
        if self.density is not None and not (0 < self.density <= 1):
            raise ConfigError(f"density must be in (0, 1] (or None for dense), got {self.density!r}")
        if self.staleness not in (0, 1):
            raise ConfigError(f"staleness must be 0 or 1, got {self.staleness!r}")
        if self.collective not in COLLECTIVES:
            raise ConfigError(f"collective must be one of {COLLECTIVES}, got {self.collective!r}")
        if not isinstance(self.cells, int) or self.cells < 1:
            raise ConfigError(f"cells must be an integer >= 1, got {self.cells!r}")
        if self.order not in ORDERS:
            raise ConfigError(f"order must be one of {ORDERS}, got {self.order!r}")
        for name in ("batches", "rank_speeds"):
            values = getattr(self, name)
            if values is not None and len(values) != world:
                raise ConfigError(f"{name} has {len(values)} entries for {world} ranks")
        if self.batches is not None and any(not isinstance(b, int) or b < 0 for b in self.batches):
            raise ConfigError(f"batches must be integers >= 0, got {self.batches!r}")
        if self.rank_speeds is not None and any(not s > 0 for s in self.rank_speeds):
            raise ConfigError(f"rank_speeds must be > 0, got {self.rank_speeds!r}")

    def describe(self) -> str:
        parts = [f"streams={self.streams or 'default'}",
                 "dense" if self.density is None else f"density={self.density:g}",
                 f"staleness={self.staleness}", self.collective]
        if self.collective == "site":
            parts.append(f"cells={self.cells}")
        parts.append(self.order)
        return " ".join(parts)


def rank_profiles(cluster: Cluster, profile: Profile, choice: Choice, contended: bool = True) -> list[Profile]:
    """Each rank's profile: scaled by its speed and local batch, its compute that overlaps
    exchanges slowed by the profile's ``comm_slowdown`` (``while_exchanging``) unless not ``contended``."""
    site_of = cluster.site_of_rank()
    if contended:
        profile = while_exchanging(profile, choice)
    speeds = choice.rank_speeds or tuple(cluster.sites[s].speed for s in site_of)
    batches = choice.batches or (profile.batch_size,) * len(site_of)
    cache: dict = {}
    out = []
    for speed, batch in zip(speeds, batches):
        key = (speed, batch)
        if key not in cache:
            cache[key] = profile.scaled(speed, max(batch, 0)) if batch else _idle(profile, speed)
        out.append(cache[key])
    return out


def while_exchanging(profile: Profile, choice: Choice) -> Profile:
    """The compute that runs while exchanges are in flight, at ``comm_slowdown`` (measured CPU
    contention): the backward always (earlier buckets' collectives run beside it), the forward too
    with staleness 1 (the previous step's exchange runs beside it); the step never (it waits for them).
    The sparse hook's time is scaled with the backward (``sparsify_seconds``)."""
    factor = profile.comm_slowdown
    if factor == 1.0:
        return profile
    return replace(profile, forward_s=profile.forward_s * (factor if choice.staleness else 1.0),
                   backward_s=profile.backward_s * factor,
                   buckets=tuple(replace(b, ready_s=b.ready_s * factor, sparsify_s=b.sparsify_s * factor)
                                 for b in profile.buckets), comm_slowdown=1.0)


def _idle(profile: Profile, speed: float) -> Profile:
    """A rank with no samples still takes part in every collective (and still steps)."""
    scaled = profile.scaled(speed)
    return replace(scaled, forward_s=0.0, backward_s=0.0, layers=(),
                   buckets=tuple(replace(b, ready_s=0.0) for b in scaled.buckets))


def bucket_message_bytes(profile: Profile, choice: Choice) -> list[int]:
    """What each bucket's collective carries per rank: the dense bucket or the sparse message."""
    if choice.density is None:
        return [b.bytes for b in profile.buckets]
    return [sparse_message_bytes(b.numels, choice.density) for b in profile.buckets]


def bucket_phases(cluster: Cluster, profile: Profile, choice: Choice) -> tuple[Network, list[Phases]]:
    net = Network.of(cluster, choice.streams)
    sparse = choice.density is not None
    phases = []
    for index, nbytes in enumerate(bucket_message_bytes(profile, choice)):
        label = f"bucket {index}"
        if choice.collective == "site":
            phases.append(site_collective(net, nbytes, sparse, choice.cells, label))
        else:
            phases.append(flat_collective(net, nbytes, sparse, label))
    return net, phases


def sparsify_seconds(profile: Profile, choice: Choice) -> list[float]:
    """Per bucket, the sparse hook's CPU time on the backward path (0 for dense), as profiled: the
    scoring scan over every element dominates it, and that does not depend on the density. It runs
    beside earlier buckets' exchanges, so at the profile's ``comm_slowdown``."""
    if choice.density is None:
        return [0.0] * len(profile.buckets)
    return [b.sparsify_s * profile.comm_slowdown for b in profile.buckets]


def cpu_bound_s(cluster: Cluster, profile: Profile, choice: Choice) -> float:
    """The shortest iteration the sites' cores allow (0 where no site gives ``cores``): a site's
    ranks spend, per step, their compute's CPU time (``Profile.cpu_s``, which holds the sparse
    hook's where the profile was taken with a density; else its wall time ``compute_s`` and the
    hook's) and the CPU their transport threads spend on the step's exchanges
    (``Profile.transport_cpu_s``), all of it on the site's cores."""
    demand = [0.0] * len(cluster.sites)
    hook = sum(b.sparsify_s for b in profile.buckets) if choice.density is not None else 0.0
    for site, rank in zip(cluster.site_of_rank(), rank_profiles(cluster, profile, choice, contended=False)):
        compute = rank.cpu_s + (hook if profile.density is None else 0.0) if rank.cpu_s else rank.compute_s + hook
        demand[site] += compute + profile.transport_cpu_s
    return max((need / site.cores for need, site in zip(demand, cluster.sites) if site.cores), default=0.0)
