"""Collectives as flows over a cluster's resources (pure): who sends how much over which link.

A collective phase is one ``Transfer``: every edge (sender -> receiver) carries ``edge_bytes``, all
edges advance at one common rate (a pipelined ring moves at its slowest edge; a direct exchange
ends with its slowest edge), and ``usage`` counts how many of its edges load each resource. The
resources are the WAN path of each ordered site pair (line rate x efficiency), each site's
per-host WAN cap (counted on the busiest host) and each site's per-host LAN. ``cap`` is the most
one edge can carry: ``streams x window / RTT`` (a striped link of window-limited TCP flows).
The streams of a link are shared too: every transfer of one group in flight on a site pair
counts against that link's ``streams x window / RTT`` (resource ``(WINDOW, group, i, j)``) once its
first windows are out. ``latency_s`` is what the collective's chain of hops adds on top (one one-way delay per
sequential step, no acknowledgement: a send ends once written), charged after its bytes.

Algorithms follow wanlink's (``wanlink.collectives.choice``): direct exchange up to
``DIRECT_MAX_BYTES`` per member, and in a flat group also where a ring would carry one piece (it
could not pipeline): a two-member all-reduce of at most ``PIECE_BYTES``, an all-gather of messages
of at most ``PIECE_BYTES`` each; pipelined rings above (a flat all-reduce of more than two members
whose segments are one piece each runs recursive halving in wanlink, modelled as the ring);
dense buckets all-reduce, sparse ones all-gather block-COO frames. ``site``
collectives reduce inside each site, cross the WAN in ``cells``
parallel exchanges of one host per site, and spread the result inside each site (wanlink's
``collectives/hierarchical.py`` with every member of a site in use is ``cells`` = ranks per site).
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

from wanlink.plan.cluster import Cluster

WINDOW = "window"  # resource kind: one link's streams x window / RTT (a key (WINDOW, group, site, site))
DIRECT_MAX_BYTES = 256 * 1024  # wanlink.c10d.process_group.DIRECT_MAX_BYTES
PIECE_BYTES = 4 * 1024 * 1024  # wanlink.c10d.process_group.PIECE_BYTES: the ring's pipelining unit
BLOCK = 16  # elements per block of the sparse hook
SPARSE_HEADER = 32
SPARSE_ALIGN = 64


def sparse_message_bytes(numels, density: float, block: int = BLOCK) -> int:
    """Bytes of the sparse hook's message for one bucket: one block-COO frame per gradient
    (``wanlink.compress.encoded_size`` of ceil(density x blocks) blocks)."""
    total = 0
    for numel in numels:
        blocks = -(-numel // block)
        product = density * blocks
        count = min(blocks, round(product) if abs(product - round(product)) <= 1e-9 * max(1.0, product)
                    else math.ceil(product))
        total += -(-(SPARSE_HEADER + 4 * count) // SPARSE_ALIGN) * SPARSE_ALIGN + 4 * count * block
    return total


@dataclass
class Transfer:
    edge_bytes: float
    usage: dict  # resource -> edges of this transfer on it
    cap: float  # bytes/s one edge may carry once its first windows are out
    latency_s: float
    group: tuple = ("flat",)  # transfers of one group share links in priority order; groups share fairly
    label: str = ""
    wan_bytes: float = 0.0  # bytes this transfer puts on WAN paths, all edges together
    free_bytes: float = 0.0  # bytes per edge that leave before the window cap binds (one window per stream used)

    def duration_alone(self, capacity: dict) -> float:
        """Seconds this transfer takes on an otherwise idle cluster (bytes, then the hops' latency)."""
        line = alone_rate(self, capacity, capped=False)
        free = min(self.edge_bytes, self.free_bytes)
        return free / line + (self.edge_bytes - free) / alone_rate(self, capacity) + self.latency_s


@dataclass
class Network:
    """Capacities (bytes/s) of every resource of a cluster, and which site each rank is in."""

    cluster: Cluster
    streams: int
    capacity: dict = field(default_factory=dict)
    rank_site: list = field(default_factory=list)

    @classmethod
    def of(cls, cluster: Cluster, streams: int | None = None) -> "Network":
        net = cls(cluster, streams or cluster.streams)
        net.rank_site = cluster.site_of_rank()
        for rank, site in enumerate(net.rank_site):
            cap = cluster.sites[site].host_cap
            if cap is not None:
                net.capacity[("host_out", rank)] = net.capacity[("host_in", rank)] = cap * cluster.efficiency
        for i, a in enumerate(cluster.sites):
            net.capacity[("lan", i)] = a.lan_rate
            for j, b in enumerate(cluster.sites):
                if i != j:
                    net.capacity[("wan", i, j)] = cluster.path(a.name, b.name).rate * cluster.efficiency
        return net

    def delay(self, i: int, j: int) -> float:
        """One-way delay of a send step between sites i and j (plus the cluster's measured send
        overhead over the WAN)."""
        if i == j:
            return self.cluster.lan_rtt_s / 2
        path = self.cluster.path(self.cluster.sites[i].name, self.cluster.sites[j].name)
        return path.rtt_s / 2 + self.cluster.send_overhead_s

    def streams_used(self, message_bytes: float) -> int:
        """Streams a message keeps busy: one chunk per stream, so at most one per chunk."""
        if math.isinf(message_bytes):
            return self.streams
        return max(1, min(self.streams, math.ceil(message_bytes / self.cluster.chunk)))

    def edge_cap(self, i: int, j: int, message_bytes: float = math.inf) -> float:
        return self.cluster.flow_cap(self.cluster.sites[i].name, self.cluster.sites[j].name,
                                     self.streams_used(message_bytes))

    def transfer(self, edges: Counter, lan_per_host: Counter, wan_out: Counter, wan_in: Counter, edge_bytes: float,
                 steps: int, group: tuple, label: str, message_bytes: float) -> Transfer:
        """A Transfer from its edge counts per (site, site), the busiest host's LAN edges per site, and
        each rank's WAN edges out and in; ``message_bytes`` is one send (it sets the streams used)."""
        usage: dict = {("lan", site): count for site, count in lan_per_host.items()}
        cap, slowest, total_delay = math.inf, 0.0, 0.0
        wan_edges = 0
        for (i, j), count in edges.items():
            cap = min(cap, self.edge_cap(i, j, message_bytes))
            slowest = max(slowest, self.delay(i, j))
            total_delay += count * self.delay(i, j)
            if i != j:
                usage[("wan", i, j)] = count
                wan_edges += count
                # the link's streams and their windows, shared by every transfer of this group in flight
                window = (WINDOW, group, i, j)
                self.capacity.setdefault(window, self.edge_cap(i, j))
                if math.isfinite(self.capacity[window]):
                    usage[window] = 1
        for kind, counts in (("host_out", wan_out), ("host_in", wan_in)):
            for rank, count in counts.items():
                if (kind, rank) in self.capacity:
                    usage[(kind, rank)] = count
        # a ring's data passes its edges in turn (a step costs the mean edge delay), one hop costs the
        # slowest. No acknowledgement is waited for: wanlink's send ends once its bytes are written
        # to the socket, and a member's part ends when its peers' bytes have arrived (traced:
        # docs/plan.md "Delivery and phase offset")
        hop = total_delay / sum(edges.values()) if steps > 1 else slowest
        free = self.streams_used(message_bytes) * self.cluster.window if math.isfinite(cap) else 0.0
        return Transfer(edge_bytes, usage, cap, steps * hop, group, label,
                        wan_bytes=wan_edges * edge_bytes, free_bytes=free)


def alone_rate(transfer: Transfer, capacity: dict, capped: bool = True) -> float:
    """The common edge rate of a transfer alone on the network (bytes/s); ``capped=False``: before
    the window cap binds."""
    rate = transfer.cap if capped else math.inf
    for resource, count in transfer.usage.items():
        if count and (capped or resource[0] != WINDOW):
            rate = min(rate, capacity[resource] / count)
    return rate


def ring(net: Network, members: list[int], edge_bytes: float, steps: int, group: tuple, label: str) -> Transfer:
    """Every member sends ``edge_bytes`` to the next (in the given order), ``steps`` hops deep, in
    sends of ``edge_bytes / steps`` (at most one ``PIECE_BYTES`` piece)."""
    edges, lan, wan_out, wan_in = Counter(), Counter(), Counter(), Counter()
    for index, rank in enumerate(members):
        after = members[(index + 1) % len(members)]
        a, b = net.rank_site[rank], net.rank_site[after]
        edges[(a, b)] += 1
        if a == b:
            lan[a] = 1
        else:
            wan_out[rank] += 1
            wan_in[after] += 1
    return net.transfer(edges, lan, wan_out, wan_in, edge_bytes, steps, group, label,
                        min(edge_bytes / steps, PIECE_BYTES))


def all_pairs(net: Network, members: list[int], edge_bytes: float, group: tuple, label: str) -> Transfer:
    """Every member sends ``edge_bytes`` to every other member (one hop)."""
    per_site = Counter(net.rank_site[r] for r in members)
    edges, lan, wan = Counter(), Counter(), Counter()
    for a, n_a in per_site.items():
        for b, n_b in per_site.items():
            count = n_a * (n_b - 1) if a == b else n_a * n_b
            if count:
                edges[(a, b)] += count
        if per_site[a] > 1:
            lan[a] = per_site[a] - 1
    for rank in members:
        remote = len(members) - per_site[net.rank_site[rank]]
        if remote:
            wan[rank] = remote
    return net.transfer(edges, lan, wan, wan, edge_bytes, 1, group, label, edge_bytes)


Phases = list  # list of phases, each a list of Transfers that run at once; a phase starts when the previous ends


def flat_collective(net: Network, nbytes: int, sparse: bool, label: str) -> Phases:
    """wanlink's collective for one bucket over all ranks: all-reduce of ``nbytes`` (dense) or
    all-gather of an ``nbytes`` message per rank (sparse)."""
    members = list(range(len(net.rank_site)))
    k = len(members)
    if k == 1:
        return []
    one_piece = nbytes <= PIECE_BYTES and (sparse or k == 2)  # the ring would not pipeline: wanlink goes direct
    if nbytes <= DIRECT_MAX_BYTES or one_piece:
        return [[all_pairs(net, members, nbytes, ("flat",), label)]]
    if sparse:  # ring all-gather: k-1 steps of one message each
        return [[ring(net, members, (k - 1) * nbytes, k - 1, ("flat",), label)]]
    return [[ring(net, members, 2 * (k - 1) / k * nbytes, 2 * (k - 1), ("flat",), label)]]


def site_collective(net: Network, nbytes: int, sparse: bool, cells: int, label: str) -> Phases:
    """Hierarchical: inside each site, then ``cells`` cross-site exchanges (one host per site in
    each, carrying 1/cells of the data: a direct swap of partial sums for dense buckets, a ring of
    the sites' bundles of messages for sparse ones), then inside each site again. Phases run one
    after another."""
    sites = sorted(set(net.rank_site))
    members_of = {s: [r for r, site in enumerate(net.rank_site) if site == s] for s in sites}
    cells = max(1, min(cells, min(len(m) for m in members_of.values())))
    local_in, wan, local_out = [], [], []
    for s, members in members_of.items():
        n = len(members)
        if n > 1:
            if sparse:  # gather the site's messages, later hand every rank the other sites' messages
                local_in.append(ring(net, members, (n - 1) * nbytes, n - 1, ("lan", s), label))
                local_out.append(ring(net, members, (len(net.rank_site) - n) * nbytes, n - 1, ("lan", s), label))
            else:  # reduce-scatter, later all-gather, of the site's sum
                local_in.append(ring(net, members, (n - 1) / n * nbytes, n - 1, ("lan", s), label))
                local_out.append(ring(net, members, (n - 1) / n * nbytes, n - 1, ("lan", s), label))
    if len(sites) > 1:
        s_count = len(sites)
        for cell in range(cells):
            members = [members_of[s][cell] for s in sites]
            if sparse:
                bundle = len(net.rank_site) / s_count * nbytes / cells
                wan.append(ring(net, members, (s_count - 1) * bundle, s_count - 1, ("cell", cell), label))
            else:  # as collectives/hierarchical.py: each member swaps its part with its peers in the other sites
                wan.append(all_pairs(net, members, nbytes / cells, ("cell", cell), label))
    return [phase for phase in (local_in, wan, local_out) if phase]
