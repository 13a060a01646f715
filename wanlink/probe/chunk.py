"""Chunk size for a link, from its rate, stream count and RTT (pure).

Two forces: every chunk costs a fixed amount of event-loop time (header, ack, bookkeeping), so
chunks must be large enough that this stays a small fraction at the link's rate; and a stream
cannot preempt a chunk it is sending, so chunks must be small enough that an urgent (earlier
deadline) chunk waits only a fraction of an RTT. When the two disagree the CPU bound wins:
an event loop that cannot keep up loses more than coarse preemption.
"""
from __future__ import annotations

import math

from wanlink.errors import ConfigError
from wanlink.sched.chunking import MAX_CHUNK_SIZE as MAX_CHUNK, MIN_CHUNK_SIZE as MIN_CHUNK  # the transport's bounds


def _pow2_round(n: float) -> int:
    return 1 << max(0, round(math.log2(max(n, 1.0))))


# Measured: bench/loopback_throughput.py --chunk-kib 256 1024 --loops uvloop costs 0.418 and 0.224
# sender CPU s/GiB, i.e. about 60 us per chunk; with 20 us assumed, the probe chose 256 KiB chunks
# on fast paths and those links ran at 60 % of the same stream count with 1 MiB chunks
# (bench/results/wan_throughput.json, 80 ms: 0.857 vs 1.447 Gbit/s with 16 streams).
PER_CHUNK_COST_S = 60e-6


def choose_chunk_size(rate: float, streams: int, rtt_s: float, *, per_chunk_cost_s: float = PER_CHUNK_COST_S,
                      max_overhead: float = 0.02, preempt_fraction: float = 0.25,
                      min_chunk: int = MIN_CHUNK, max_chunk: int = MAX_CHUNK) -> int:
    """Chunk size in bytes (a power of two in ``[min_chunk, max_chunk]``).

    ``rate`` is the link's delivered rate in bytes/s, ``streams`` its stream count, ``rtt_s`` its
    round-trip time.
    """
    if not (math.isfinite(rate) and rate >= 0 and streams >= 1 and math.isfinite(rtt_s) and rtt_s >= 0):
        raise ConfigError(f"need rate >= 0, streams >= 1, rtt >= 0 (got {rate}, {streams}, {rtt_s})")
    if not (0 < max_overhead <= 1 and 0 < preempt_fraction and min_chunk <= max_chunk):
        raise ConfigError("need 0 < max_overhead <= 1, preempt_fraction > 0 and min_chunk <= max_chunk")
    cpu_floor = rate * per_chunk_cost_s / max_overhead  # chunks/s * cost <= max_overhead
    # time for one stream to send one chunk <= preempt_fraction * RTT (at least 1 ms)
    latency_cap = (rate / streams) * max(preempt_fraction * rtt_s, 1e-3)
    size = max(cpu_floor, latency_cap)  # the largest chunk preemption allows, never below the CPU floor
    return int(min(max(_pow2_round(size), min_chunk), max_chunk))
