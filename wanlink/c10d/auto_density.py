"""``BlockSparseState(density="auto")``: a DensityController per rank, rank 0's decision for every rank.

What the hook measures (the probe bursts are its only extra messages):

- a step begins at its first bucket's hook call and lasts until the next step begins;
- its exposed wait: how long after its last bucket's hook call the exchange DDP waits for at the
  end of the backward pass (the step's own with staleness 0, the previous step's with staleness 1)
  completed; compute = step time - exposed wait (the hook's own sparsifying stays in: it is on
  the critical path whatever the density);
- bandwidth, by default from the links (``LinkDeliveryRate``): per step, the highest of three
  lower bounds (``wanlink.probe.rate``): the bytes the peer acknowledged over the time the link
  had data unacknowledged, less one round trip (the kernel's minimum RTT) per busy period, as
  every burst sent after an idle gap pays one before its rate shows (``SendingTime``); the bytes
  of the messages finished over their time on the wire, each from its send to the peer's kernel
  acknowledging its last byte less one round trip, overlapping ones sharing their time
  (``WireTime``, ``KernelAcks``: the gaps between a step's buckets, which a busy period spans,
  drop out); and probe bursts sent while nothing of the hook's is in flight and the steps fit,
  one round trip's worth at twice the rate seen, spread over the streams (``ProbeSchedule``):
  a step's messages at a low density cross a fast path in less time than acknowledging them
  takes, and never ask the congestion windows for more than they allow. Time this rank spent computing
  or waiting for the peer with nothing in flight is not counted, unlike the exchange times,
  which count a late peer or a busy CPU as a slow link. For a group whose links the hook cannot
  see (another backend) it falls back to those: the bytes a step sent over the summed durations
  (launch to completion) of its exchanges, less all but one latency (the shortest recent
  exchange's duration stands for it). ``bandwidth=`` replaces them all with a source of the
  caller's (a simulated schedule in tests);
- how long each step waited for its exchange: steps that wait in a row make the controller drop
  its bandwidth samples (``DensityController.observe_wait``) and the meters their held ones.

Agreement: every rank appends its proposal (a float64) to each bucket message of the all-gather it
sends anyway; every rank reads rank 0's from the gathered buffer and uses it from ``LAG`` steps
later, when every rank has it whatever the staleness. So every rank switches at the same step.
"""
from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable

from wanlink.errors import ConfigError
from wanlink.probe.rate import BurstRateMeter, ProbeSchedule
from wanlink.proto.reassembly import PROBE_DISCARD_TAG
from wanlink.sched.density import DensityController, DensityDecision

logger = logging.getLogger(__name__)

PROPOSAL_BYTES = 8  # float64 after each bucket's frames
LAG = 2  # a proposal made at step t applies from step t + LAG
WIRE_MIN_S = 0.02  # wire time a sample of the messages' meter needs (a step at 0.1 % has a few ms)
PROBE_MIN_S = 0.001  # every probe that completed is a sample
HOLD_S = 1.5  # a meter's latest sample stands this long (a probe's until the next is due, ProbeSchedule.every_s)


class LinkDeliveryRate:
    """The default bandwidth source: the group's links' busy periods, messages and probes (see the module).

    Called once per step (any thread): reads each link's ``sending``, ``wire`` and ``probe_wire``
    counters and the kernel's minimum RTT of its streams, and returns a sample in bytes/s or None
    (the highest of the meters' latest samples, each standing ``HOLD_S``); ``probe`` sends the
    links a probe burst when one is due. That RTT is also the
    controller's ``latency_s``: a step's exchanges pay one round trip on top of their transfer. ``available`` says
    whether the group had links at the last call (False for a group of another backend: the hook
    then falls back to its exchange times).
    """

    def __init__(self, links: Callable[[], list], *, probes: ProbeSchedule | None = None, **meter_options):
        self.links = links
        self.meter = BurstRateMeter(**meter_options)  # busy periods, one RTT off each
        self.wire_meter = BurstRateMeter(min_busy_s=WIRE_MIN_S)  # messages' time on the wire (RTT off already)
        self.probe_meter = BurstRateMeter(min_busy_s=PROBE_MIN_S)  # the probes' time on the wire
        self.probes = probes if probes is not None else ProbeSchedule()
        self.latest: dict[str, float] = {}  # each meter's latest sample, while under HOLD_S old
        self._taken: dict[str, float] = {}  # when each was taken
        self.available = False
        self.rtt_s = 0.0  # the links' minimum RTT at the last call: the controller's latency

    def __call__(self, now: float) -> float | None:
        links = self.links()
        self.available = bool(links)
        if not links:
            return None
        rtts = [link.min_rtt_s() for link in links]
        self.rtt_s = min((rtt for rtt in rtts if rtt is not None), default=0.0)
        busy = self.meter.update([(id(link), *link.sending.reading()) for link in links], self.rtt_s)
        wire = self.wire_meter.update([(id(link), *link.wire.reading(rtt or self.rtt_s, _open(link, False, now)))
                                       for link, rtt in zip(links, rtts)], 0.0)
        probe = self.probe_meter.update([(id(link), *link.probe_wire.reading(rtt or self.rtt_s, _open(link, True, now)))
                                         for link, rtt in zip(links, rtts)], 0.0)
        for name, rate in (("busy", busy), ("wire", wire), ("probe", probe)):
            if rate is not None:
                self.latest[name], self._taken[name] = rate, now
            elif now - self._taken.get(name, now) > HOLD_S:  # a lower bound of the path as it was then
                self.latest.pop(name, None)
        if busy is None and wire is None and probe is None:
            return None
        # all err low (see wanlink.probe.rate.WireTime, ProbeSchedule): the highest is the nearest
        return max(self.latest.values())

    def forget(self) -> None:
        """Drop the meters' held samples (the path changed under them): the next call's stand alone."""
        self.latest.clear()
        self._taken.clear()

    def probe(self, now: float) -> None:
        """The links are idle (any thread): send each a probe burst if one is due (``ProbeSchedule``),
        on ``PROBE_DISCARD_TAG`` (the peer's transport drops it) with the latest EDF deadline."""
        links = self.links()
        size = self.probes.due(now, max(self.latest.values(), default=None), self.rtt_s) if links else None
        if size is None:
            return
        payload = _probe_payload(self.probes.max_bytes)
        for link in links:
            link.loop.call_soon_threadsafe(_send_probe, link, [payload[:part] for part in
                                                               self.probes.parts(size, link.streams_alive)])


def _open(link, probes: bool, now: float) -> float | None:
    """When ``link``'s earliest message (probe) still awaiting its acks was sent, unless over HOLD_S
    ago (a message nobody receives must not hold the meter's readings back for ever)."""
    since = link.open_since(probes)
    return since if since is not None and now - since <= HOLD_S else None


_PROBE_PAYLOADS: dict[int, memoryview] = {}


def _probe_payload(nbytes: int) -> memoryview:
    """A zero buffer of ``nbytes`` (allocated once per size), which probes only read."""
    if nbytes not in _PROBE_PAYLOADS:
        _PROBE_PAYLOADS[nbytes] = memoryview(bytes(nbytes))
    return _PROBE_PAYLOADS[nbytes]


def _send_probe(link, parts: list) -> None:
    """On ``link``'s loop: send the probe's parts as messages, each queued one loop iteration after
    the one before, so that each starts on the next stream in turn (a stream takes all it is given
    while its kernel buffer has room); a failure is the link's, reported by its next operation."""
    if link.closed or not parts:
        return
    task = link.loop.create_task(link.send(parts[0], tag=PROBE_DISCARD_TAG, deadline=math.inf))
    task.add_done_callback(lambda done: done.cancelled() or done.exception())
    link.loop.call_soon(_send_probe, link, parts[1:])


def group_links(group) -> list:
    """The live links from this rank to the other members of ``group`` (None: the default group);
    [] when it is not a wanlink group."""
    import torch.distributed as dist

    from wanlink.c10d.process_group import ProcessGroupWanlink

    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    if not isinstance(pg, ProcessGroupWanlink):
        return []
    peers = (pg.mesh_ranks[rank] for rank in range(pg.group_size) if rank != pg.group_rank)
    return [link for link in map(pg.mesh.cached, peers) if link is not None]


class AutoDensity:
    """Per-rank measurements, the controller, and the agreed density of each step."""

    def __init__(self, *, min_density: float, max_density: float, staleness: int, initial: float | None = None,
                 bandwidth: Callable[[float], float | None] | None = None,
                 link_rate: LinkDeliveryRate | None = None, clock: Callable[[], float] = time.monotonic,
                 **controller_options):
        for name, value in (("min_density", min_density), ("max_density", max_density)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 < value <= 1.0:
                raise ConfigError(f"density='auto' needs {name} in (0, 1], got {value!r}")
        if min_density > max_density:
            raise ConfigError(f"density='auto' needs min_density <= max_density, got {min_density} > {max_density}")
        self.min_density, self.max_density = float(min_density), float(max_density)
        self.staleness = staleness
        self.density = float(initial) if initial is not None else self.min_density
        if not self.min_density <= self.density <= self.max_density:
            raise ConfigError(f"initial density {initial} is outside [{min_density}, {max_density}]")
        self.bandwidth, self.link_rate, self.clock = bandwidth, link_rate, clock
        self._options = controller_options
        self.controller: DensityController | None = None  # built at the first sparse step (needs the sizes)
        self.last_decision: DensityDecision | None = None
        self.changes: deque[tuple[int, float]] = deque(maxlen=1000)  # (first step, density) per change
        self._lock = threading.Lock()  # exchanges complete on the transport's thread
        self._first: dict[int, float] = {}  # step -> its first hook call
        self._last: dict[int, float] = {}  # step -> its latest hook call
        self._launched: dict[int, int] = {}
        self._done: dict[int, list] = {}  # step -> [exchanges done, bytes, summed durations, last completion]
        self._agreed: dict[int, float] = {}  # step -> rank 0's proposal made at that step
        self._recent_durations: deque[float] = deque(maxlen=64)  # the shortest stands for the latency
        self.exposed_s = 0.0  # how long the last step waited for its exchange after its compute
        self.overrunning = False  # the controller dropped its samples (observe_wait), and no step fitted since

    # -- the hook's calls --------------------------------------------------------------------------
    def begin_step(self, step: int, full_bytes: float) -> float:
        """The first bucket of ``step``: learn from the steps before it, propose, return its density."""
        now = self.clock()
        if self.controller is None:
            self.controller = DensityController(full_bytes=full_bytes, min_density=self.min_density,
                                                max_density=self.max_density, staleness=self.staleness,
                                                initial=self.density, **self._options)
        self.controller.full_bytes = float(full_bytes)  # grows while the first step meets its buckets
        with self._lock:
            self._observe(step, now)
            agreed = self._agreed.pop(step - LAG, None)
            for old in [s for s in self._agreed if s < step - LAG]:
                del self._agreed[old]
        self.last_decision = self.controller.decide(now)
        if agreed is not None and agreed != self.density:
            self._change(step, agreed)
        self._first[step] = self._last[step] = now
        return self.density

    def proposal(self) -> float:
        """What this rank proposes at the current step (only rank 0's counts)."""
        return self.last_decision.density if self.last_decision is not None else self.density

    def bucket_called(self, step: int) -> None:
        self._last[step] = self.clock()

    def exchange_started(self, step: int) -> float:
        with self._lock:
            self._launched[step] = self._launched.get(step, 0) + 1
        return self.clock()

    def exchange_done(self, step: int, started: float, nbytes: int, rank0_proposal: float) -> None:
        """Called as an exchange completes (any thread), with rank 0's proposal read from it."""
        now = self.clock()
        with self._lock:
            done = self._done.setdefault(step, [0, 0, 0.0, now])
            done[0] += 1
            done[1] += nbytes
            duration = max(now - started, 1e-6)
            done[2] += duration
            self._recent_durations.append(duration)
            done[3] = max(done[3], now)
            self._agreed[step] = rank0_proposal
            idle = all(self._done.get(s, (0,))[0] == launched for s, launched in self._launched.items())
        if (idle and not self.overrunning and self.bandwidth is None and self.link_rate is not None
                and self.link_rate.available):
            self.link_rate.probe(now)  # nothing of ours in flight until the next step's first bucket

    # -- internals ---------------------------------------------------------------------------------
    def _observe(self, step: int, now: float) -> None:
        """Feed the controller what the steps before ``step`` showed (caller holds the lock)."""
        previous = step - 1
        source = self.bandwidth or self.link_rate
        if previous in self._first:
            waited_for = self._done.get(previous - self.staleness)
            exposed = max(0.0, waited_for[3] - self._last[previous]) if waited_for else 0.0
            compute = now - self._first[previous] - exposed
            if compute > 0:
                self.controller.observe_compute(compute, now)
            self.exposed_s = exposed
            overran = self.controller.observe_wait(exposed, now)  # dropped its samples
            self.overrunning = overran or (self.overrunning and exposed > 0)
            if overran and self.link_rate is not None:
                self.link_rate.forget()  # and so do the meters: their held ones describe the path before
        sample = source(now) if source is not None else None
        if sample is not None:
            self.controller.observe_bandwidth(sample, now)
        if self.link_rate is not None and source is self.link_rate and self.link_rate.available:
            self.controller.latency_s = self.link_rate.rtt_s
        by_exchanges = self.bandwidth is None and (self.link_rate is None or not self.link_rate.available)
        for finished in sorted(s for s, done in self._done.items() if s < step and done[0] == self._launched.get(s)):
            count, nbytes, durations, _end = self._done[finished]
            if by_exchanges and nbytes > 0:  # >= the longest exchange: each lasts >= the shortest
                transfer = durations - (count - 1) * min(self._recent_durations)
                self.controller.observe_bandwidth(nbytes / transfer, now)
            if finished < previous - self.staleness:  # no longer needed for an exposed wait
                self._forget(finished)
        for old in [s for s in self._first if s < previous]:
            self._first.pop(old, None)
            self._last.pop(old, None)
        for old in [s for s in set(self._done) | set(self._launched) if s < step - LAG - 2]:
            self._forget(old)  # a step whose exchanges never all completed (a failed one)

    def _forget(self, step: int) -> None:
        self._done.pop(step, None)
        self._launched.pop(step, None)

    def _change(self, step: int, density: float) -> None:
        decision = self.last_decision
        self.changes.append((step, density))
        why = ""
        if decision is not None and decision.bandwidth_Bps is not None and decision.compute_s is not None:
            advice = ", staleness 1 needed to hide it" if decision.staleness_needed and not self.staleness else ""
            why = (f" (bandwidth estimate {8 * decision.bandwidth_Bps / 1e6:.3g} Mbit/s, compute "
                   f"{decision.compute_s:.3f} s per step{advice})")
        logger.info("density %.4g -> %.4g from step %d%s", self.density, density, step, why)
        self.density = density

    def stats(self) -> dict:
        """The density in use, the changes so far and the controller's latest reasoning."""
        decision = self.last_decision
        source = ("bandwidth=" if self.bandwidth else "link" if self.link_rate is not None and self.link_rate.available
                  else "exchanges")
        return {"density": self.density, "changes": list(self.changes), "bandwidth_source": source,
                "bandwidth_Bps": None if decision is None else decision.bandwidth_Bps,
                "compute_s": None if decision is None else decision.compute_s,
                "meters_Bps": dict(self.link_rate.latest) if self.link_rate is not None else {},
                "exposed_s": self.exposed_s, "overruns": 0 if self.controller is None else self.controller.overruns,
                "full_bytes": None if self.controller is None else self.controller.full_bytes,
                "staleness_needed": bool(decision and decision.staleness_needed)}
