"""The coarse model: closed-form iteration times (Li et al., TPDS'22, section 3.1) (pure).

Ring all-reduce (their eq. 11, with per-bucket overlap): every bucket's collective sends for
``c_b = bytes_per_edge / rate`` alone on the network at the rate of the streams its own sends
keep busy (``2(K-1)/K x M_b`` per edge for a ring all-reduce, ``(K-1) x m_b`` for a sparse ring
all-gather, ``M_b`` or ``m_b`` for a direct exchange), and for ``l_b`` at the rate its links give
all collectives in flight together (every stream's window: several buckets' sends share them).
The link serves the buckets in turn, each from when it is ready (``r_b``, seconds after backward
starts, plus the sparse hook's time so far), and none ends before its own ``c_b``; its delays
(``L_b``: hops x one-way delay; a send ends once written, no acknowledgement) follow::

    g_b = max(r_b, g_{b-1}) + l_b,   f_b = max(f_{b-1}, g_b + L_b, r_b + c_b + L_b)
    T   = T_F + max(T_B + H, f_last) + T_S              (staleness 0)
    T   = max(T_F + T_B + H + T_S, sum_b l_b, (T_F + f_last + T_S) / 2)   (staleness 1)

With staleness 1 the step of iteration i+1 waits for iteration i's exchange, which starts during
i's backward, so iteration i+2's exchange starts ``T_F + f_last + L + T_S`` after iteration i's:
two iterations per exchange chain, two exchanges in flight (the fine model's rhythm); the link
still carries one iteration's bytes per period. Where one bucket's streams fill the link
(``l_b = c_b``) the buckets' sends run one after another, as in their model.

Parameter server (their eq. 10, hybrid of the PS and FCFS sharing models, maximal overlap)::

    T = max(K M / B, T_F) + max((K + 1) M / (2 B), T_B) + T_S

with ``B`` the rate one worker gets to the server alone. Compute times are the slowest rank's.
"""
from __future__ import annotations

from wanlink.errors import ConfigError
from wanlink.plan.choice import (Choice, bucket_message_bytes, bucket_phases, cpu_bound_s, rank_profiles,
                                 sparsify_seconds)
from wanlink.plan.cluster import Cluster
from wanlink.plan.profile import Profile
from wanlink.plan.simulate import Prediction
from wanlink.plan.topology import WINDOW, Network

ARCHITECTURES = ("ring", "ps")


def collective_seconds(net: Network, phases) -> float:
    """A bucket's collective alone on the network: its phases one after another, each as long as
    its slowest transfer, or as its busiest resource needs for the bytes all its transfers put on
    it (the cells of a site collective share the WAN path), plus the phase's delays."""
    total = 0.0
    for phase in phases:
        load: dict = {}
        for t in phase:
            for resource, count in t.usage.items():
                if resource[0] != WINDOW:  # one bucket's collective at a time: its own cap covers the link's
                    load[resource] = load.get(resource, 0.0) + count * t.edge_bytes
        shared = max((nbytes / net.capacity[r] for r, nbytes in load.items() if nbytes), default=0.0)
        total += max(max(t.duration_alone(net.capacity) for t in phase),
                     shared + max(t.latency_s for t in phase))
    return total


def link_seconds(net: Network, phases) -> float:
    """A bucket's sending time at the rate its links give all collectives in flight together (every
    stream's window, the paths' and hosts' rates), not only the streams its own sends keep busy:
    the most its resources need for the bytes its transfers put on them, phase after phase."""
    total = 0.0
    for phase in phases:
        load: dict = {}
        for t in phase:
            for resource, count in t.usage.items():
                load[resource] = load.get(resource, 0.0) + count * t.edge_bytes
        total += max((nbytes / net.capacity[r] for r, nbytes in load.items() if nbytes), default=0.0)
    return total


def collective_latency(phases) -> float:
    """The part of a collective's time that is waiting on delays, not sending."""
    return sum(max(t.latency_s for t in phase) for phase in phases)


def server_rate(net: Network) -> float:
    """B of the parameter-server model: the rate the slowest worker gets to a server on rank 0's site alone."""
    server = net.rank_site[0]
    rates = [net.capacity[("lan", server)]] + [net.capacity[key] for key in (("host_out", 0), ("host_in", 0))
                                               if key in net.capacity]
    for site in set(net.rank_site) - {server}:
        rates += [net.capacity[("wan", server, site)], net.edge_cap(server, site)]
    return min(rates)


def coarse(cluster: Cluster, profile: Profile, choice: Choice = Choice(), architecture: str = "ring") -> Prediction:
    if architecture not in ARCHITECTURES:
        raise ConfigError(f"architecture must be one of {ARCHITECTURES}, got {architecture!r}")
    choice.check(cluster.world_size)
    profiles = rank_profiles(cluster, profile, choice)
    slowest = max(profiles, key=lambda p: p.compute_s)
    forward, backward, step = slowest.forward_s, slowest.backward_s, slowest.step_s
    hooks = sparsify_seconds(profile, choice)
    hook = sum(hooks)
    net, phases = bucket_phases(cluster, profile, choice)
    wan_bytes = sum(t.wan_bytes for bucket in phases for phase in bucket for t in phase)
    if architecture == "ps":
        total = float(sum(bucket_message_bytes(profile, choice)))
        k = cluster.world_size
        rate = server_rate(net)
        down, up = (k * total / rate, (k + 1) * total / (2 * rate)) if k > 1 else (0.0, 0.0)
        iteration = max(down, forward) + max(up, backward + hook) + step
        comm = down + up
    else:
        latencies = [collective_latency(bucket) for bucket in phases]
        sends = [collective_seconds(net, bucket) - latency for bucket, latency in zip(phases, latencies)]
        # a bucket alone sends no slower than the link serves it (its first windows leave at line rate)
        links = [min(link_seconds(net, bucket), send) for bucket, send in zip(phases, sends)]
        finish, link_free, hook_so_far = 0.0, 0.0, 0.0
        for bucket, send, link, latency, bucket_hook in zip(slowest.buckets, sends, links, latencies, hooks):
            hook_so_far += bucket_hook
            ready = bucket.ready_s + hook_so_far
            link_free = max(ready, link_free) + link  # the link serves the buckets in turn at its full rate
            finish = max(finish, link_free + latency, ready + send + latency)  # and none beats its own cap
        comm = sum(links) + (latencies[-1] if latencies else 0.0)
        if choice.staleness:  # two steps' exchanges may be in flight: the link's bytes, or half the chain
            iteration = max(forward + backward + hook + step, sum(links), (forward + finish + step) / 2)
        else:
            iteration = forward + max(backward + hook, finish) + step
    iteration = max(iteration, cpu_bound_s(cluster, profile, choice))
    breakdown = {"forward_s": forward, "backward_s": backward, "hook_s": hook, "step_s": step,
                 "wait_s": max(0.0, iteration - forward - backward - hook - step)}
    return Prediction("coarse", choice, iteration, breakdown, wan_bytes, comm)
