"""The fine model: a discrete-event simulation of training iterations (Li et al., Algorithm 1,
for Sync-SGD with per-bucket collectives; pure and deterministic).

Every rank runs forward, then backward, during which each gradient bucket becomes ready (from the
profile; the sparse hook's sparsify time is spent on the backward path); a bucket's collective
starts once every rank has it ready and runs as a chain of ``Transfer`` phases
(``wanlink.plan.topology``). Transfers share the network by progressive filling: transfers of one
group (collectives over the same links) are served in priority order, FCFS (launch order) or EDF
(deadline (iteration, -bucket): the first layers' bucket first), each taking what the ones before
it leave; different groups share max-min fairly; no edge exceeds its ``streams x window / RTT``.
Compute that overlaps communication runs at the profile's ``comm_slowdown`` (measured CPU
contention). A rank steps once its backward is done and the exchange of iteration
``i - staleness`` has ended. The reported iteration time is the mean period of the second half of
the simulated iterations, at least what the sites' ``cores`` allow (``choice.cpu_bound_s``).
"""
from __future__ import annotations

import heapq
import itertools
import math
from collections import Counter, defaultdict
from dataclasses import dataclass, field

from wanlink.errors import ConfigError
from wanlink.plan.choice import Choice, bucket_phases, cpu_bound_s, rank_profiles, sparsify_seconds
from wanlink.plan.cluster import Cluster
from wanlink.plan.profile import Profile
from wanlink.plan.topology import WINDOW, Transfer

TIMELINE_RANKS = 16  # ranks whose compute segments are kept for the timeline


@dataclass
class Prediction:
    model: str
    choice: Choice
    iteration_s: float
    breakdown: dict  # seconds per iteration: forward, backward, hook, wait, step (mean over ranks)
    wan_bytes: float = 0.0  # per iteration, all WAN paths together
    comm_s: float = 0.0  # mean time from a bucket's launch to the end of its collective
    segments: list = field(default_factory=list)  # (rank or "comm", kind, iteration, start, end)

    def to_json(self, timeline: bool = False) -> dict:
        doc = {"model": self.model, "choice": self.choice.__dict__, "iteration_s": self.iteration_s,
               "breakdown": self.breakdown, "wan_bytes": self.wan_bytes, "comm_s": self.comm_s}
        if timeline:
            doc["segments"] = self.segments
        return doc


class _Flow:
    __slots__ = ("transfer", "key", "remaining", "rate", "done", "free")

    def __init__(self, transfer: Transfer, key: tuple, done):
        self.transfer, self.key, self.remaining, self.rate, self.done = transfer, key, transfer.edge_bytes, 0.0, done
        self.free = transfer.free_bytes  # bytes that leave at line rate: its first windows, on an idle link

    @property
    def capped_at(self) -> float:
        """Remaining bytes below which the window cap binds (the first windows leave at line rate)."""
        return self.transfer.edge_bytes - self.free

    @property
    def windowed(self) -> bool:
        """Its first windows are out: the window caps (its own and its link's) bind."""
        return self.remaining <= self.capped_at

    @property
    def cap(self) -> float:
        return self.transfer.cap if self.windowed else math.inf

    @property
    def usage(self) -> dict:
        """Resources it loads now: the link's shared window only once its first windows are out."""
        if self.windowed:
            return self.transfer.usage
        return {r: n for r, n in self.transfer.usage.items() if r[0] != WINDOW}

    def next_change(self, now: float) -> tuple[float, float]:
        """(when, remaining bytes then): this flow ends or its window cap starts to bind, at its current rate."""
        if self.rate <= 0:
            return math.inf, self.remaining
        target = self.capped_at if self.remaining > self.capped_at > 0 else 0.0
        return now + (self.remaining - target) / self.rate, target


def allocate(flows: list, capacity: dict) -> None:
    """Set every flow's rate: progressive filling, priority order within a group, fair across groups."""
    groups: dict = defaultdict(list)
    for flow in sorted(flows, key=lambda f: f.key):
        groups[flow.transfer.group].append(flow)
    left = dict(capacity)
    position = {group: 0 for group in groups}
    for flow in flows:
        flow.rate = 0.0
    for _round in range(len(flows) + len(capacity) + 1):  # each round saturates a flow or a resource
        heads = []
        for group, members in groups.items():
            while position[group] < len(members):
                head = members[position[group]]
                if head.rate >= head.cap * (1 - 1e-9) or any(
                        left[r] <= capacity[r] * 1e-9 for r, n in head.usage.items() if n):
                    position[group] += 1  # saturated: the next one in the group gets what is left
                    continue
                heads.append(head)
                break
        if not heads:
            return
        load: Counter = Counter()
        for head in heads:
            for resource, count in head.usage.items():
                load[resource] += count
        step = max(0.0, min([h.cap - h.rate for h in heads] + [left[r] / n for r, n in load.items() if n]))
        if math.isinf(step):  # nothing limits these flows (no shared resource): a very large rate
            step = 1e18
        for head in heads:
            head.rate += step
        for resource, count in load.items():
            left[resource] -= count * step


class _Simulation:
    def __init__(self, cluster: Cluster, profile: Profile, choice: Choice, iterations: int):
        self.profiles = rank_profiles(cluster, profile, choice)
        self.net, self.phases = bucket_phases(cluster, profile, choice)
        self.hook = sparsify_seconds(profile, choice)
        self.choice, self.iterations = choice, iterations
        self.world = len(self.profiles)
        self.events: list = []
        self.sequence = itertools.count()
        self.now = 0.0
        self.flows: list[_Flow] = []
        self.launch_max: dict = defaultdict(float)
        self.launch_count: Counter = Counter()
        self.buckets_done: Counter = Counter()
        self.comm_done_at: dict = {}
        self.waiting: dict = defaultdict(list)  # iteration -> ranks waiting for its exchange
        self.ends = [[0.0] * iterations for _ in range(self.world)]
        self.phase_totals: list[Counter] = [Counter() for _ in range(iterations)]
        self.comm_spans: list[float] = []
        self.segments: list = []
        self.wan_bytes = sum(t.wan_bytes for phases in self.phases for phase in phases for t in phase)

    def at(self, time: float, action, *args) -> None:
        heapq.heappush(self.events, (time, next(self.sequence), action, args))

    # -- ranks --------------------------------------------------------------------------------
    def start_iteration(self, rank: int, iteration: int) -> None:
        prof, t0 = self.profiles[rank], self.now
        hook_before = 0.0
        for b, bucket in enumerate(prof.buckets):
            hook_before += self.hook[b]
            ready = t0 + prof.forward_s + bucket.ready_s + hook_before
            key = (iteration, b)
            self.launch_max[key] = max(self.launch_max[key], ready)
            self.launch_count[key] += 1
            if self.launch_count[key] == self.world:
                self.at(self.launch_max[key], self.launch, iteration, b)
        backward_end = t0 + prof.forward_s + prof.backward_s + sum(self.hook)
        totals = self.phase_totals[iteration]
        totals["forward_s"] += prof.forward_s
        totals["backward_s"] += prof.backward_s
        totals["hook_s"] += sum(self.hook)
        if rank < TIMELINE_RANKS:
            self.segments += [(rank, "forward", iteration, t0, t0 + prof.forward_s),
                              (rank, "backward", iteration, t0 + prof.forward_s, backward_end)]
        self.at(backward_end, self.backward_done, rank, iteration)

    def backward_done(self, rank: int, iteration: int) -> None:
        needed = iteration - self.choice.staleness
        if needed < 0 or needed in self.comm_done_at:
            self.step(rank, iteration, self.now)
        else:
            self.waiting[needed].append((rank, iteration, self.now))

    def step(self, rank: int, iteration: int, backward_end: float) -> None:
        prof = self.profiles[rank]
        totals = self.phase_totals[iteration]
        totals["wait_s"] += self.now - backward_end
        totals["step_s"] += prof.step_s
        end = self.now + prof.step_s
        self.ends[rank][iteration] = end
        if rank < TIMELINE_RANKS:
            if self.now > backward_end:
                self.segments.append((rank, "wait", iteration, backward_end, self.now))
            self.segments.append((rank, "step", iteration, self.now, end))
        if iteration + 1 < self.iterations:
            self.at(end, self.start_iteration, rank, iteration + 1)

    # -- collectives --------------------------------------------------------------------------
    def launch(self, iteration: int, bucket: int) -> None:
        self.start_phase(iteration, bucket, 0, self.now)

    def start_phase(self, iteration: int, bucket: int, index: int, launched: float) -> None:
        phases = self.phases[bucket]
        if index == len(phases):
            self.collective_done(iteration, bucket, launched)
            return
        pending = [len(phases[index])]

        def transfer_done():
            pending[0] -= 1
            if pending[0] == 0:
                self.start_phase(iteration, bucket, index + 1, launched)

        for transfer in phases[index]:
            key = ((iteration, -bucket) if self.choice.order == "edf" else ()) + (next(self.sequence),)
            self.add_flow(_Flow(transfer, key, transfer_done))

    def collective_done(self, iteration: int, bucket: int, launched: float) -> None:
        self.comm_spans.append(self.now - launched)
        self.segments.append(("comm", f"bucket {bucket}", iteration, launched, self.now))
        self.buckets_done[iteration] += 1
        if self.buckets_done[iteration] == len(self.phases):
            self.comm_done_at[iteration] = self.now
            for rank, it, backward_end in self.waiting.pop(iteration, []):
                self.step(rank, it, backward_end)

    def add_flow(self, flow: _Flow) -> None:
        if flow.remaining <= 0:
            self.at(self.now + flow.transfer.latency_s, flow.done)
            return
        links = {r for r in flow.transfer.usage if r[0] == WINDOW}
        if any(links.intersection(other.transfer.usage) for other in self.flows):
            flow.free = 0.0  # the link's windows are in use: no burst at line rate, it waits its turn in them
        self.flows.append(flow)
        allocate(self.flows, self.net.capacity)

    def advance(self, until: float) -> None:
        elapsed = until - self.now
        if elapsed > 0:
            for flow in self.flows:
                flow.remaining -= flow.rate * elapsed
        self.now = until

    def run(self) -> None:
        for rank in range(self.world):
            self.start_iteration(rank, 0)
        while self.events or self.flows:
            changes = [f.next_change(self.now) for f in self.flows]
            next_flow = min((when for when, _target in changes), default=math.inf)
            next_event = self.events[0][0] if self.events else math.inf
            if math.isinf(next_flow) and math.isinf(next_event):
                raise ConfigError("simulation stalled: a transfer has no capacity (a zero-rate resource?)")
            if next_flow <= next_event:
                self.advance(next_flow)
                for flow, (when, target) in zip(self.flows, changes):
                    if when <= next_flow:  # exactly at its change: no rounding left over
                        flow.remaining = target
                finished = [f for f in self.flows if f.remaining <= 0]
                self.flows = [f for f in self.flows if f not in finished]
                for flow in finished:
                    self.at(self.now + flow.transfer.latency_s, flow.done)
                allocate(self.flows, self.net.capacity)
            else:
                time, _seq, action, args = heapq.heappop(self.events)
                self.advance(time)
                action(*args)


def simulate(cluster: Cluster, profile: Profile, choice: Choice = Choice(), iterations: int = 6) -> Prediction:
    """Predict the iteration time of ``choice`` on ``cluster`` by simulating ``iterations`` steps."""
    if iterations < 2:
        raise ConfigError(f"iterations must be >= 2 (the first half is a warm-up), got {iterations}")
    choice.check(cluster.world_size)
    sim = _Simulation(cluster, profile, choice, iterations)
    sim.run()
    settled = iterations // 2  # staleness 1 needs an iteration or two to reach its steady rhythm
    last = max(ends[-1] for ends in sim.ends)
    first = max(ends[settled - 1] for ends in sim.ends)
    period = (last - first) / (iterations - settled)
    steady = sim.phase_totals[settled:]
    breakdown = {key: sum(t[key] for t in steady) / (len(steady) * sim.world)
                 for key in ("forward_s", "backward_s", "hook_s", "wait_s", "step_s")}
    cpu = cpu_bound_s(cluster, profile, choice)
    if cpu > period:  # the cores cannot keep up: every rank waits for its share of them
        breakdown["wait_s"] += cpu - period
        period = cpu
    comm = sum(sim.comm_spans) / len(sim.comm_spans) if sim.comm_spans else 0.0
    return Prediction("fine", choice, period, breakdown, sim.wan_bytes, comm, sim.segments)
