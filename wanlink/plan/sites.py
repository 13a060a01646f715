"""Which sites to train in and how many DP-cells (Atlas, Algorithm 1, for data parallelism) (pure).

Atlas observes that a site is best used whole or not at all, and that the fewest sites that give the
best throughput win: sites are taken in order (most ranks first, unless an order is given), and
for every prefix of that order and every DP-cell count D from 1 to ``max_cells`` the iteration
time is predicted. A DP-cell here is one host per site: a site-aware collective reduces inside
each site, then runs D cross-site rings in parallel (each on 1/D of the data, each on its own
hosts' WAN caps), then spreads the result inside each site. The global batch is split over the
chosen ranks in proportion to their speed (``allocate_batches``), so adding a site shortens
compute and lengthens communication; the choice with the highest samples per second wins (ties:
fewer sites, then fewer cells).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from wanlink.errors import ConfigError
from wanlink.plan.allocate import Throughput, allocate_batches
from wanlink.plan.choice import Choice
from wanlink.plan.cluster import Cluster
from wanlink.plan.coarse import coarse
from wanlink.plan.profile import Profile
from wanlink.plan.simulate import Prediction, simulate


@dataclass
class SiteChoice:
    sites: tuple[str, ...]
    collective: str
    cells: int
    batches: tuple[int, ...]
    fine: Prediction
    coarse_s: float
    global_batch: int

    @property
    def samples_per_s(self) -> float:
        return self.global_batch / self.fine.iteration_s

    def to_json(self) -> dict:
        return {"sites": list(self.sites), "collective": self.collective, "cells": self.cells,
                "ranks": len(self.batches), "batches": list(self.batches), "fine_s": self.fine.iteration_s,
                "coarse_s": self.coarse_s, "samples_per_s": self.samples_per_s, "breakdown": self.fine.breakdown}


def split_batch(cluster: Cluster, profile: Profile, global_batch: int) -> tuple[int, ...]:
    """The global batch split over the cluster's ranks in proportion to their compute speed."""
    per_sample = profile.compute_s / profile.batch_size
    speeds = [cluster.sites[s].speed for s in cluster.site_of_rank()]
    return allocate_batches(global_batch, [Throughput(0.0, speed / per_sample) for speed in speeds]).batches


def choose_sites(cluster: Cluster, profile: Profile, global_batch: int, *, max_cells: int = 4,
                 order: list[str] | None = None, base: Choice = Choice(), iterations: int = 4) -> list[SiteChoice]:
    """Every (sites prefix, collective, cells) choice with its prediction, best first."""
    names = order or [s.name for s in sorted(cluster.sites, key=lambda s: -s.ranks)]
    unknown = set(names) - {s.name for s in cluster.sites}
    if unknown:
        raise ConfigError(f"order names unknown sites: {', '.join(sorted(unknown))}")
    if max_cells < 1:
        raise ConfigError(f"max_cells must be >= 1, got {max_cells}")
    results = []
    for count in range(1, len(names) + 1):
        chosen = cluster.subset(names[:count])
        if chosen.world_size > global_batch:
            break  # every rank needs at least one sample
        batches = split_batch(chosen, profile, global_batch)
        options = [("flat", 1)]
        if count > 1:
            most = min(max_cells, min(s.ranks for s in chosen.sites))
            options += [("site", cells) for cells in range(1, most + 1)]
        for collective, cells in options:
            choice = replace(base, collective=collective, cells=cells, batches=batches)
            fine = simulate(chosen, profile, choice, iterations=iterations)
            results.append(SiteChoice(tuple(names[:count]), collective, cells, batches, fine,
                                      coarse(chosen, profile, choice).iteration_s, global_batch))
    if not results:
        raise ConfigError(f"global batch {global_batch} is smaller than the first site's ranks")
    return sorted(results, key=lambda r: (-round(r.samples_per_s, 9), len(r.sites), r.cells))
