"""How one ramp step is measured: how long it runs and how many bytes it keeps unacknowledged (pure)."""
from __future__ import annotations

from dataclasses import dataclass

MiB = 1024 * 1024
# Unacknowledged bytes one stream can hold: TCP's window in flight (a 4 MiB socket buffer
# advertises ~2.7 MB), the peer's unread receive buffer, the chunk it is sending and the one
# behind it. Fewer starved streams on long or lossy paths: 40 ms, 1 % loss, -w 4M, 8 streams moved
# 1.42 Gbit/s with 32 MiB unacknowledged and 1.68 with 128 MiB (iperf3 -P 8: 1.68).
STREAM_INFLIGHT_BYTES = 8 * MiB
MIN_INFLIGHT_BYTES = 32 * MiB


def inflight_bytes_for(streams: int, *, rate: float = 0.0, rtt_s: float = 0.0,
                       floor: int = MIN_INFLIGHT_BYTES) -> int:
    """Unacknowledged bytes that keep ``streams`` streams busy at ``rate`` bytes/s over ``rtt_s``."""
    return max(floor, int(2 * rate * rtt_s), streams * STREAM_INFLIGHT_BYTES)


@dataclass(frozen=True)
class StepTiming:
    """How long one ramp step runs: slow-start warm-up, then measurement (both scale with RTT)."""

    warmup_s: float
    measure_s: float

    @classmethod
    def for_rtt(cls, rtt_s: float, *, measure_s: float | None = None) -> "StepTiming":
        warmup = min(max(0.25, 10 * rtt_s), 2.0)
        measure = measure_s if measure_s is not None else min(max(0.4, 12 * rtt_s), 2.0)
        return cls(warmup, measure)
