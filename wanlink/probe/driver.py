"""Probing a wanlink peer over real Links, driven by the pure ``StreamRamp``.

For each stream count the ramp proposes, open a Link of that many streams, let TCP leave slow
start, then time acknowledged sends on ``PROBE_DISCARD_TAG`` (the peer's transport receives,
acknowledges and drops them; the peer application sees only a Link whose ``peer_meta`` has
``"wanlink_probe": 1``). The RTT is the fastest acknowledged one-byte message on the first Link.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from wanlink.errors import ConfigError
from wanlink.probe.chunk import choose_chunk_size
from wanlink.io.link import PROBE_DISCARD_TAG, PROBE_META_KEY
from wanlink.probe.ramp import MAX_STREAMS, ProbeResult, StreamRamp

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


async def _rtt(link, samples: int = 5) -> float:
    best = float("inf")
    one = b"\0"
    for _ in range(samples):
        t0 = time.perf_counter()
        await link.send(one, tag=PROBE_DISCARD_TAG)
        best = min(best, time.perf_counter() - t0)
    return best


async def measure_rate(link, timing: StepTiming, *, inflight_bytes: int) -> float:
    """Acknowledged bytes/s on ``link`` over ``timing.measure_s``, after ``timing.warmup_s``.

    Sends one-chunk messages, keeping about ``inflight_bytes`` (and at least two per stream)
    unacknowledged. The rate is the bytes TCP saw acknowledged during the measurement window
    (TCP_INFO), which a slow peer application cannot bunch; without TCP_INFO, the wanlink
    acknowledgements that land inside the window. Times are read next to the counters
    (``time.perf_counter``), not from ``loop.time()``, which uvloop caches per loop iteration: on
    a busy loop that skew overstated rates (2.02 Gbit/s measured on a 1.93 Gbit/s path).
    """
    message = bytes(link.chunk_size)
    depth = max(2 * link.streams, -(-inflight_bytes // len(message)))
    loop = asyncio.get_running_loop()
    completions: list[float] = []

    async def sender():
        while True:
            await link.send(message, tag=PROBE_DISCARD_TAG)
            completions.append(time.perf_counter())

    tasks = [loop.create_task(sender()) for _ in range(depth)]
    try:
        for measuring, phase in ((False, timing.warmup_s), (True, timing.measure_s)):
            if measuring:
                begin, kernel_begin = time.perf_counter(), link.kernel_bytes_acked()
            done, _ = await asyncio.wait(tasks, timeout=phase, return_when=asyncio.FIRST_EXCEPTION)
            for task in done:
                task.result()  # a failed send (PeerLost) ends the probe with that error
        end, kernel_end = time.perf_counter(), link.kernel_bytes_acked()
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    elapsed = max(end - begin, 1e-9)
    if kernel_begin is not None and kernel_end is not None:
        # TCP's own acks: a peer whose event loop falls behind cannot bunch them into the window
        return (kernel_end - kernel_begin) / elapsed
    acked = sum(1 for t in completions if begin <= t <= end)
    return acked * len(message) / elapsed


async def choose_streams(host: str, port: int, *, secret: bytes | str | None = None, meta: dict | None = None,
                         max_streams: int = MAX_STREAMS, min_gain: float = 0.05, patience: int = 1,
                         congestion: str | None = None, sock_buffer: int | None = None,
                         measure_s: float | None = None, timeout: float = 30.0,
                         inflight_bytes: int = MIN_INFLIGHT_BYTES) -> ProbeResult:
    """Probe ``host:port`` (a wanlink server) and choose the stream count and chunk size for it.

    Opens Links of 1, 2, 4, ... streams (up to ``max_streams``) and stops once doubling gains
    less than ``min_gain``; returns the smallest count within ``min_gain`` of the best rate.
    """
    import wanlink

    if max_streams < 1:
        raise ConfigError(f"max_streams must be >= 1, got {max_streams}")
    ramp = StreamRamp(max_streams=max_streams, min_gain=min_gain, patience=patience)
    probe_meta = {**(meta or {}), PROBE_META_KEY: 1}
    rtt = None
    timing = None
    while (count := ramp.next_streams()) is not None:
        link = await wanlink.connect(host, port, streams=count, secret=secret, meta=probe_meta, timeout=timeout,
                                     congestion=congestion, sock_buffer=sock_buffer)
        try:
            if rtt is None:
                rtt = await _rtt(link)
                timing = StepTiming.for_rtt(rtt, measure_s=measure_s)
            best = ramp.best
            inflight = inflight_bytes_for(count, rate=best.rate if best else 0.0, rtt_s=rtt, floor=inflight_bytes)
            rate = await measure_rate(link, timing, inflight_bytes=inflight)
        finally:
            await link.close()
        ramp.record(count, rate)
    chosen = ramp.choice()
    chosen_rate = ramp.rate_of(chosen) or 0.0
    return ProbeResult(streams=chosen, rtt_s=rtt or 0.0, rate=chosen_rate,
                       chunk_size=choose_chunk_size(chosen_rate, chosen, rtt or 0.0),
                       samples=tuple(ramp.steps), reason=ramp.reason)
