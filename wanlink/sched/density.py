"""Density controller: how much of each gradient to send so the exchange hides behind compute (sans-I/O).

StellaTrain's bandwidth constraint (SIGCOMM'24, eq. 6) says a step's gradient exchange fits in its
compute time when the kept share of the gradient, the density ``d``, satisfies

    latency + d x full_bytes / bandwidth <= margin x overlap window

where ``full_bytes`` is what one step would put on the bottleneck at density 1 and the overlap
window is the compute time of a step (staleness 1: the exchange overlaps the whole next step) or
its backward share (staleness 0). The controller turns that into a density from live inputs:

- bandwidth samples (bytes/s), summarised by a low percentile of the last ``window_s`` seconds:
  a drop shows once that share of the window has seen it, a rise only once most of it has, and
  a lone high outlier never raises the estimate (over-estimating the link costs iteration time,
  under-estimating it costs only a little compression). A sustained drop shows sooner: once
  every sample of the last ``drop_s`` seconds (at least ``drop_samples`` of them) is below that
  percentile, the estimate is their highest (the percentile alone slides down over the whole
  window as the lower samples fill it; one low sample among them still moves nothing);
- compute-time samples (seconds per step, without waiting for the network), summarised by their
  median, so one slow step does not move it;
- how long each step waited for its exchange after its compute: once ``overrun_steps`` of the last
  ``overrun_steps + 1`` steps waited more than ``overrun_share`` of the compute time (with staleness
  1 a step that waited leaves the next one more time: late steps alternate), the exchange no longer fits the path
  the bandwidth samples describe (the path slowed down, or a raise overshot), and the samples taken
  before are dropped: the next ones stand alone (the rules above would take a second or more of
  lower samples, at up to twice the compute time a step);

and quantises the answer onto a geometric grid below ``max_density`` with hysteresis: it lowers
the density at once when the current one no longer fits, and raises it only when a density at
least ``raise_ratio`` higher has fitted throughout the last ``hold_s`` seconds. It never leaves
``[min_density, max_density]``. The clock is the caller's: every input carries its time ``now``.
"""
from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass

from wanlink.errors import ConfigError
from wanlink.probe.rate import percentile


@dataclass(frozen=True)
class DensityDecision:
    """What ``DensityController.decide`` chose, and why."""

    density: float
    changed: bool  # differs from the previous decision
    bandwidth_Bps: float | None  # the filtered bandwidth estimate it used (None: none yet)
    compute_s: float | None  # the filtered compute time per step it used
    comm_s: float | None  # predicted exchange time per step at ``density``
    budget_s: float | None  # margin x overlap window: what ``comm_s`` must stay under
    staleness_needed: bool  # at ``density``, staleness 0 (overlap with backward only) would not hide it

    @property
    def hidden(self) -> bool:
        """The exchange is predicted to fit behind compute (False at the floor on a too-slow link)."""
        return self.comm_s is not None and self.budget_s is not None and self.comm_s <= self.budget_s


def _positive(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{name} must be a positive finite number, got {value!r}")
    return float(value)


class DensityController:
    """Chooses a step's density from bandwidth and compute-time samples; see the module docs."""

    def __init__(self, *, full_bytes: int, min_density: float, max_density: float, staleness: int = 0,
                 initial: float | None = None, margin: float = 0.8, backward_share: float = 0.6,
                 latency_s: float = 0.0, window_s: float = 8.0, percentile: float = 20.0,
                 raise_ratio: float = 1.7, hold_s: float = 3.0, levels_per_octave: int = 4,
                 compute_samples: int = 9, drop_s: float = 1.0, drop_samples: int = 3,
                 overrun_share: float = 0.5, overrun_steps: int = 2):
        self.full_bytes = _positive("full_bytes", full_bytes)
        self.max_density = _positive("max_density", max_density)
        self.min_density = _positive("min_density", min_density)
        if not self.min_density <= self.max_density <= 1.0:
            raise ConfigError(f"need 0 < min_density <= max_density <= 1, got min_density={min_density!r}, "
                              f"max_density={max_density!r}")
        if staleness not in (0, 1):
            raise ConfigError(f"staleness must be 0 or 1, got {staleness!r}")
        if not 0.0 < margin <= 1.0 or not 0.0 < backward_share <= 1.0:
            raise ConfigError(f"margin and backward_share must be in (0, 1], got {margin!r}, {backward_share!r}")
        if latency_s < 0 or not 0.0 <= percentile <= 100.0 or raise_ratio < 1.0 or hold_s < 0:
            raise ConfigError(f"need latency_s >= 0, 0 <= percentile <= 100, raise_ratio >= 1, hold_s >= 0 "
                              f"(got {latency_s!r}, {percentile!r}, {raise_ratio!r}, {hold_s!r})")
        if any(not isinstance(value, int) or value < 1
               for value in (levels_per_octave, compute_samples, drop_samples, overrun_steps)):
            raise ConfigError(f"levels_per_octave, compute_samples, drop_samples and overrun_steps must be ints "
                              f">= 1 (got {levels_per_octave!r}, {compute_samples!r}, {drop_samples!r}, "
                              f"{overrun_steps!r})")
        self.staleness = staleness
        self.margin, self.backward_share, self.latency_s = float(margin), float(backward_share), float(latency_s)
        self.window_s = _positive("window_s", window_s)
        self.drop_s, self.drop_samples = _positive("drop_s", drop_s), drop_samples
        self.percentile, self.raise_ratio, self.hold_s = float(percentile), float(raise_ratio), float(hold_s)
        self.levels_per_octave = levels_per_octave
        self.overrun_share, self.overrun_steps = _positive("overrun_share", overrun_share), overrun_steps
        self.overruns = 0  # times the bandwidth samples were dropped (observe_wait)
        self._late: deque[bool] = deque(maxlen=overrun_steps + 1)  # the last steps: waited > overrun_share?
        self._bandwidth: deque[tuple[float, float]] = deque()  # (t, bytes/s)
        self._compute: deque[float] = deque(maxlen=compute_samples)
        self._last_t: float | None = None
        self._rise_since: float | None = None
        self.density = self._clamp(self.min_density if initial is None else _positive("initial", initial))

    # -- inputs ------------------------------------------------------------------------------------
    def observe_bandwidth(self, rate_Bps: float, now: float) -> None:
        """A delivery-rate sample of the bottleneck, in bytes/s, taken at ``now`` (seconds)."""
        rate = _positive("a bandwidth sample", rate_Bps)
        self._tick(now)
        self._bandwidth.append((now, rate))

    def observe_compute(self, seconds: float, now: float) -> None:
        """One step's compute time (forward + backward + optimizer, not waiting for the network)."""
        sample = _positive("a compute-time sample", seconds)
        self._tick(now)
        self._compute.append(sample)

    def observe_wait(self, seconds: float, now: float) -> bool:
        """How long a step waited for its exchange after its compute (0: hidden). True when this made
        ``overrun_steps`` late steps of the last ``overrun_steps + 1``: the bandwidth samples so far were
        dropped (and the count starts again)."""
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not seconds >= 0:
            raise ConfigError(f"a wait must be a number >= 0, got {seconds!r}")
        self._tick(now)
        self._late.append(bool(self._compute) and seconds > self.overrun_share * statistics.median(self._compute))
        if sum(self._late) < self.overrun_steps:
            return False
        self._late.clear()
        self._bandwidth.clear()
        self.overruns += 1
        return True

    # -- output ------------------------------------------------------------------------------------
    def bandwidth_estimate(self, now: float) -> float | None:
        """The low percentile of the bandwidth samples of the last ``window_s`` seconds (bytes/s),
        or the highest of the last ``drop_s`` seconds' where all of those are lower (a drop)."""
        self._tick(now)
        while self._bandwidth and self._bandwidth[0][0] < now - self.window_s:
            self._bandwidth.popleft()
        if not self._bandwidth:
            return None
        low = percentile([rate for _, rate in self._bandwidth], self.percentile)
        recent = [rate for t, rate in self._bandwidth if t > now - self.drop_s]
        if len(recent) >= self.drop_samples and self._bandwidth[0][0] <= now - self.drop_s:
            return min(low, max(recent))
        return low

    def comm_s(self, density: float, bandwidth_Bps: float) -> float:
        """Predicted exchange time of one step at ``density`` over ``bandwidth_Bps``."""
        return self.latency_s + density * self.full_bytes / bandwidth_Bps

    def fitting_density(self, bandwidth_Bps: float, window_s: float) -> float:
        """The largest density whose exchange takes at most ``margin x window_s`` (may leave the bounds)."""
        return max(0.0, self.margin * window_s - self.latency_s) * bandwidth_Bps / self.full_bytes

    def decide(self, now: float) -> DensityDecision:
        """The density for the next step(s); call once per step, after feeding that step's samples."""
        bandwidth = self.bandwidth_estimate(now)
        compute = statistics.median(self._compute) if self._compute else None
        previous = self.density
        if bandwidth is None or compute is None:
            self._rise_since = None
            return DensityDecision(previous, False, bandwidth, compute, None, None, False)
        window = compute if self.staleness else compute * self.backward_share
        target = self._level_at_most(self.fitting_density(bandwidth, window))
        if target < previous:
            self.density, self._rise_since = target, None  # it no longer fits: lower at once
        elif target >= previous * self.raise_ratio:
            if self._rise_since is None:
                self._rise_since = now
            if now - self._rise_since >= self.hold_s:
                self.density, self._rise_since = target, None
        else:
            self._rise_since = None
        comm = self.comm_s(self.density, bandwidth)
        staleness_needed = comm > self.margin * compute * self.backward_share
        return DensityDecision(self.density, self.density != previous, bandwidth, compute, comm,
                               self.margin * window, staleness_needed)

    # -- internals ---------------------------------------------------------------------------------
    def _tick(self, now: float) -> None:
        if not isinstance(now, (int, float)) or not math.isfinite(now):
            raise ConfigError(f"time must be a finite number, got {now!r}")
        if self._last_t is not None and now < self._last_t:
            raise ConfigError(f"time went backwards: {now} < {self._last_t}")
        self._last_t = now

    def _clamp(self, density: float) -> float:
        return min(self.max_density, max(self.min_density, density))

    def _level_at_most(self, density: float) -> float:
        """The largest grid level (max_density / step**n) not above ``density``, within the bounds."""
        if density >= self.max_density:
            return self.max_density
        if density <= self.min_density:
            return self.min_density
        n = math.ceil(self.levels_per_octave * math.log2(self.max_density / density) - 1e-9)
        level = self.max_density * 2.0 ** (-n / self.levels_per_octave)
        if level > density:  # rounding at a level's edge
            level = self.max_density * 2.0 ** (-(n + 1) / self.levels_per_octave)
        return self._clamp(level)
