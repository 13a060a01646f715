"""How many TCP streams a link needs: a pure ramp decision (no I/O, no clock).

A long path limits one TCP flow to about window / RTT; striping over N flows multiplies that until
the bottleneck (or loss) caps it. ``StreamRamp`` proposes 1, 2, 4, ... streams up to
``max_streams``; the caller measures the delivered rate at each count and records it. The ramp
stops once doubling has gained less than ``min_gain`` for more than ``patience`` steps in a row
(so one noisy dip does not end it), and chooses the *smallest* count whose rate is within
``min_gain`` of the best rate seen: fewer streams for (almost) the same rate.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from wanlink.errors import ConfigError

MAX_STREAMS = 64


@dataclass(frozen=True)
class RampStep:
    streams: int
    rate: float  # delivered bytes per second at this stream count


class StreamRamp:
    """Pure decision object: ``next_streams()`` -> count to measure (None when done); ``record(n, rate)``."""

    def __init__(self, *, max_streams: int = MAX_STREAMS, min_gain: float = 0.05, patience: int = 1,
                 start: int = 1, factor: int = 2):
        if not 1 <= start <= max_streams:
            raise ConfigError(f"need 1 <= start ({start}) <= max_streams ({max_streams})")
        if factor < 2:
            raise ConfigError(f"ramp factor must be >= 2, got {factor}")
        if not 0 <= min_gain < 10 or patience < 0:
            raise ConfigError(f"min_gain must be in [0, 10) and patience >= 0 (got {min_gain}, {patience})")
        counts, n = [], start
        while n < max_streams:
            counts.append(n)
            n *= factor
        counts.append(max_streams)
        self._plan = counts
        self.min_gain, self.patience = float(min_gain), int(patience)
        self.steps: list[RampStep] = []
        self._stalls = 0
        self.done = False
        self.reason = ""

    def next_streams(self) -> int | None:
        """The stream count to measure next, or None once the ramp has decided."""
        return None if self.done else self._plan[len(self.steps)]

    def record(self, streams: int, rate: float) -> None:
        """Record the rate (bytes/s) measured with ``streams`` streams (the count just proposed)."""
        expected = self.next_streams()
        if expected is None:
            raise ConfigError("the stream ramp has already decided")
        if streams != expected:
            raise ConfigError(f"recorded {streams} streams but the ramp asked for {expected}")
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not math.isfinite(rate) or rate < 0:
            raise ConfigError(f"rate must be a finite number >= 0, got {rate!r}")
        best_before = max((s.rate for s in self.steps), default=None)
        self.steps.append(RampStep(streams, float(rate)))
        if best_before is not None:
            if self._gain(best_before, rate) >= self.min_gain:
                self._stalls = 0
            else:
                self._stalls += 1
                if self._stalls > self.patience:
                    self.done = True
                    self.reason = (f"doubling gained < {self.min_gain:.0%} for {self._stalls} "
                                   f"step{'s' if self._stalls > 1 else ''}")
        if not self.done and len(self.steps) == len(self._plan):
            self.done = True
            self.reason = f"reached the maximum of {streams} streams"

    @staticmethod
    def _gain(best: float, rate: float) -> float:
        if best <= 0:
            return math.inf if rate > 0 else 0.0
        return rate / best - 1.0

    @property
    def best(self) -> RampStep | None:
        return max(self.steps, key=lambda s: s.rate, default=None)

    def choice(self) -> int:
        """Smallest measured count whose rate is within ``min_gain`` of the best (1 before any data)."""
        best = self.best
        if best is None:
            return 1
        floor = best.rate / (1.0 + self.min_gain)
        return min(s.streams for s in self.steps if s.rate >= floor)

    def rate_of(self, streams: int) -> float | None:
        for step in self.steps:
            if step.streams == streams:
                return step.rate
        return None


@dataclass(frozen=True)
class ProbeResult:
    """What probing a peer decided (rates in bytes/s)."""

    streams: int
    rtt_s: float
    rate: float  # delivered rate measured at the chosen count
    chunk_size: int
    samples: tuple[RampStep, ...] = ()
    reason: str = ""

    @property
    def bits_per_second(self) -> float:
        return self.rate * 8.0

    def to_json(self) -> dict:
        return {"streams": self.streams, "rtt_ms": self.rtt_s * 1e3, "bits_per_second": self.bits_per_second,
                "chunk_size": self.chunk_size, "reason": self.reason,
                "samples": [{"streams": s.streams, "bits_per_second": s.rate * 8.0} for s in self.samples]}
