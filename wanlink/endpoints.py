"""The public entry points: ``wanlink.connect`` (probe the path, then open a Link) and ``wanlink.serve``.

These are the transport's edges. They fill what the caller left out from the settings
(``wanlink.settings``: WANLINK_SECRET, WANLINK_STREAMS, WANLINK_CHUNK_SIZE), choose the stream
count and chunk size (probing the path where needed) and hand resolved values to the I/O layer
(``wanlink.io``), which reads no environment and never probes.

Probing (``choose_streams``): for each stream count the pure ``StreamRamp`` proposes, open a Link
of that many streams, let TCP leave slow start, then time acknowledged sends on
``PROBE_DISCARD_TAG`` (the peer's transport receives, acknowledges and drops them; a server keeps
links whose ``peer_meta`` has ``PROBE_META_KEY`` from its application). The RTT is the fastest
acknowledged one-byte message on the first Link.
"""
from __future__ import annotations

import asyncio
import socket
import time

from wanlink.errors import ConfigError
from wanlink.io.dial import check_stream_count, open_link
from wanlink.io.link import DEFAULT_TIMEOUT, Link
from wanlink.io.server import AUTH_TIMEOUT, Server, start_server
from wanlink.io.sockets import is_loopback, log
from wanlink.probe.chunk import choose_chunk_size
from wanlink.probe.ramp import MAX_STREAMS, ProbeResult, StreamRamp
from wanlink.probe.step import MIN_INFLIGHT_BYTES, StepTiming, inflight_bytes_for
from wanlink.proto.handshake import PROBE_META_KEY, normalize_secret
from wanlink.proto.limits import Limits
from wanlink.proto.reassembly import PROBE_DISCARD_TAG
from wanlink.sched.chunking import chunk_size_from
from wanlink.settings import Settings, from_env, limits_from

DEFAULT_STREAMS = 4
"""Streams towards loopback and Unix sockets, where no window-limited path needs probing."""


def resolve_secret(secret: bytes | str | None, settings: Settings) -> bytes:
    """``secret``, else WANLINK_SECRET; ConfigError naming both when neither is given."""
    if secret is None:
        secret = settings.secret
    if secret is None:
        raise ConfigError("no shared secret: pass secret= or set WANLINK_SECRET (\"\" for unauthenticated)")
    return normalize_secret(secret)


async def connect(host: str, port: int, *, streams: int | None = None, secret: bytes | str | None = None,
                  meta: dict | None = None, timeout: float = DEFAULT_TIMEOUT, chunk_size: int | None = None,
                  congestion: str | None = None, sock_buffer: int | None = None, compress: bool = False,
                  checksum: bool = False, limits: Limits | None = None, unix_name: str | None = None,
                  secure: bool | None = None, chunk_order: str | None = None,
                  settings: Settings | None = None) -> Link:
    """Open a Link of ``streams`` TCP streams to a wanlink server and authenticate each one.

    ``streams`` defaults to WANLINK_STREAMS, else to a count probed on the path (1, 2, 4, ... up to
    64 streams until doubling gains under 5 %; ``WANLINK_STREAMS=auto`` probes even towards
    loopback, where the default is 4 without probing). ``secret`` defaults to WANLINK_SECRET and
    ``chunk_size`` to WANLINK_CHUNK_SIZE, else the probe's choice (4 MiB over loopback).
    ``congestion`` defaults to WANLINK_CONGESTION, else bbr towards a remote peer where the kernel
    has it (``wanlink.io.sockets.configure_stream_socket``).
    ``timeout`` bounds the connection set-up and is the link's silence timeout afterwards.
    ``unix_name``: the server's abstract Unix socket (``Server.unix_name``, same host and network
    namespace only); the streams are Unix sockets, not probed (default 4). ``limits`` default to
    the protocol's, with WANLINK_STAGING_BYTES. ``secure`` (default WANLINK_SECURE): every frame
    encrypted and authenticated, keys derived from the secret and each stream's handshake
    (docs/security.md). ``chunk_order`` defaults to WANLINK_CHUNK_ORDER: "edf" sends chunks
    earliest deadline first, "fcfs" in arrival order. ``settings`` replaces the environment
    (default ``wanlink.settings.from_env()``).
    """
    settings = from_env() if settings is None else settings
    limits = limits_from(settings) if limits is None else limits
    if streams is not None:
        check_stream_count(streams)
    key = resolve_secret(secret, settings)
    secure = settings.secure if secure is None else secure
    chunk_size = settings.chunk_size if chunk_size is None else chunk_size
    chunk_size_from(chunk_size)  # a bad size fails before probing
    congestion = settings.congestion if congestion is None else congestion
    count = streams
    if count is None and isinstance(settings.streams, int):
        count = settings.streams
    if count is None and unix_name is not None:
        count = DEFAULT_STREAMS
    if count is None:
        count, probed_chunk = await _probe_stream_count(host, port, key, congestion, sock_buffer, timeout, settings,
                                                        secure)
        if chunk_size is None:
            chunk_size = probed_chunk
    return await open_link(host, port, streams=count, secret=key, meta=meta, timeout=timeout, chunk_size=chunk_size,
                           congestion=congestion, sock_buffer=sock_buffer, compress=compress, checksum=checksum,
                           limits=limits, unix_name=unix_name, secure=secure,
                           chunk_order=settings.chunk_order if chunk_order is None else chunk_order)


async def serve(host: str, port: int, *, on_link, secret: bytes | str | None = None,
                timeout: float = DEFAULT_TIMEOUT, limits: Limits | None = None, backlog: int = 128,
                chunk_size: int | None = None, congestion: str | None = None, sock_buffer: int | None = None,
                compress: bool = False, checksum: bool = False, unix: bool = False,
                auth_timeout: float = AUTH_TIMEOUT, secure: bool | None = None, chunk_order: str | None = None,
                settings: Settings | None = None) -> Server:
    """Listen on host:port; call ``on_link(link)`` (plain or async) for each authenticated peer.

    ``secret`` defaults to WANLINK_SECRET, ``chunk_size`` to WANLINK_CHUNK_SIZE, ``congestion`` to
    WANLINK_CONGESTION, ``chunk_order`` to WANLINK_CHUNK_ORDER and ``limits`` to the
    protocol's with WANLINK_STAGING_BYTES (``settings`` replaces the environment). ``unix=True``
    also listens on an abstract Unix socket (``server.unix_name``) for processes of the same host
    and network namespace: the same
    handshake; sending costs a third less CPU per byte than over TCP loopback
    (bench/loopback_throughput.py --paths tcp unix). An accepted connection must authenticate
    within ``auth_timeout`` seconds; when ``limits.max_handshakes`` connections are authenticating,
    the oldest is evicted (told BUSY; ``connect`` retries), so idle sockets cannot lock clients out.
    ``secure`` (default WANLINK_SECURE): refuse clients that do not encrypt (docs/security.md).
    """
    settings = from_env() if settings is None else settings
    return await start_server(host, port, on_link=on_link, secret=resolve_secret(secret, settings),
                              timeout=timeout, limits=limits_from(settings) if limits is None else limits,
                              backlog=backlog,
                              chunk_size=settings.chunk_size if chunk_size is None else chunk_size,
                              congestion=settings.congestion if congestion is None else congestion,
                              sock_buffer=sock_buffer, compress=compress, checksum=checksum, unix=unix,
                              auth_timeout=auth_timeout,
                              secure=settings.secure if secure is None else secure,
                              chunk_order=settings.chunk_order if chunk_order is None else chunk_order)


async def _probe_stream_count(host: str, port: int, secret: bytes, congestion, sock_buffer, timeout: float,
                              settings: Settings, secure: bool) -> tuple[int, int | None]:
    """N (and a chunk size) for a path: probed, except towards loopback unless WANLINK_STREAMS=auto."""
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    if settings.streams != "auto" and all(is_loopback(info[4][0]) for info in infos):
        return DEFAULT_STREAMS, None  # no window-limited path to measure
    result = await choose_streams(host, port, secret=secret, congestion=congestion, sock_buffer=sock_buffer,
                                  timeout=timeout, secure=secure, settings=settings)
    log.info("probed %s:%s: %d streams, %.0f Mbit/s, RTT %.1f ms, chunk %d KiB (%s)", host, port,
             result.streams, 8 * result.rate / 1e6, 1e3 * result.rtt_s, result.chunk_size // 1024, result.reason)
    return result.streams, result.chunk_size


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
                         inflight_bytes: int = MIN_INFLIGHT_BYTES, secure: bool | None = None,
                         settings: Settings | None = None) -> ProbeResult:
    """Probe ``host:port`` (a wanlink server) and choose the stream count and chunk size for it.

    Opens Links of 1, 2, 4, ... streams (up to ``max_streams``) and stops once doubling gains
    less than ``min_gain``; returns the smallest count within ``min_gain`` of the best rate.
    ``secret`` and the probe links' chunk size come from ``settings`` (default: the environment)
    when not given, and so does ``secure`` (WANLINK_SECURE: a secure server refuses plaintext probes).
    """
    settings = from_env() if settings is None else settings
    key = resolve_secret(secret, settings)
    secure = settings.secure if secure is None else secure
    if max_streams < 1:
        raise ConfigError(f"max_streams must be >= 1, got {max_streams}")
    ramp = StreamRamp(max_streams=max_streams, min_gain=min_gain, patience=patience)
    probe_meta = {**(meta or {}), PROBE_META_KEY: 1}
    rtt = None
    timing = None
    while (count := ramp.next_streams()) is not None:
        link = await open_link(host, port, streams=count, secret=key, meta=probe_meta, timeout=timeout,
                               chunk_size=settings.chunk_size, congestion=congestion, sock_buffer=sock_buffer,
                               secure=secure, reopen=False)  # a server keeps no probe link to re-attach to
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
