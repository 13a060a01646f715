"""Online estimate of a link's delivered bandwidth (pure; the caller supplies timestamps).

Feed every delivery as ``on_delivery(nbytes, t)``. The estimator forms rate samples over sliding
windows of ``window_s`` (bytes delivered after the window's first delivery, divided by its span),
keeps the samples of the last ``horizon_s`` and reports a low percentile of them. It therefore errs
low: a drop shows as soon as a ``percentile`` share of the horizon has seen it (a fraction of a
second), a rise only once most of the horizon has (about ``horizon_s``).

Idle time is not capacity: call ``on_idle(t)`` when the sender ran out of data; the next delivery
starts a fresh window, so gaps caused by the application never count as a slow link. Without such
calls, a gap longer than ``idle_gap_s`` between deliveries has the same effect.
"""
from __future__ import annotations

import math
from collections import deque

from wanlink.errors import ConfigError


def percentile(values, pct: float) -> float:
    """The ``pct`` percentile of non-empty ``values``, linearly interpolated between ranks."""
    ranked = sorted(values)
    pos = (len(ranked) - 1) * pct / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(ranked) - 1)
    return ranked[lo] + (ranked[hi] - ranked[lo]) * (pos - lo)


class DeliveryRateEstimator:
    """Windowed delivery-rate samples, summarised by a low percentile (bytes/s)."""

    def __init__(self, *, window_s: float = 0.5, horizon_s: float = 3.0, percentile: float = 10.0,
                 idle_gap_s: float | None = 1.0):
        if not (0 < window_s < horizon_s and 0 <= percentile <= 100):
            raise ConfigError(f"need 0 < window_s < horizon_s and 0 <= percentile <= 100 "
                              f"(got {window_s}, {horizon_s}, {percentile})")
        if idle_gap_s is not None and idle_gap_s <= 0:
            raise ConfigError(f"idle_gap_s must be > 0 or None, got {idle_gap_s}")
        self.window_s, self.horizon_s, self.percentile = float(window_s), float(horizon_s), float(percentile)
        self.idle_gap_s = idle_gap_s
        self._grain = window_s / 32  # deliveries closer than this are merged (bounds memory)
        self._spacing = window_s / 8  # at most one sample per spacing (bounds memory)
        self._run: deque[tuple[float, int]] = deque()  # (t, cumulative bytes) of the current busy run
        self._cum = 0
        self._samples: deque[tuple[float, float]] = deque()  # (t, bytes/s)
        self._last_t: float | None = None
        self.total_bytes = 0

    def on_delivery(self, nbytes: int, t: float) -> None:
        """``nbytes`` were delivered (acked) at time ``t`` (seconds, non-decreasing)."""
        if nbytes < 0 or not math.isfinite(t):
            raise ConfigError(f"need nbytes >= 0 and a finite time (got {nbytes}, {t})")
        if self._last_t is not None and t < self._last_t:
            raise ConfigError(f"delivery time went backwards: {t} < {self._last_t}")
        if self._last_t is not None and self.idle_gap_s is not None and t - self._last_t > self.idle_gap_s:
            self._run.clear()
        self._last_t = t
        self._cum += nbytes
        self.total_bytes += nbytes
        run = self._run
        if len(run) >= 2 and t - run[-2][0] < self._grain:
            run[-1] = (t, self._cum)  # merge into the newest entry
        else:
            run.append((t, self._cum))
        # keep exactly one entry at least a window old: the start of the newest full window
        while len(run) >= 2 and t - run[1][0] >= self.window_s:
            run.popleft()
        t0, c0 = run[0]
        if t - t0 >= self.window_s and (not self._samples or t - self._samples[-1][0] >= self._spacing):
            self._samples.append((t, (self._cum - c0) / (t - t0)))
        while self._samples and self._samples[0][0] < t - self.horizon_s:
            self._samples.popleft()

    def on_idle(self, t: float) -> None:
        """The sender had nothing left to send at ``t``: do not measure across the coming gap."""
        self._run.clear()

    def estimate(self) -> float | None:
        """Low-percentile delivered rate in bytes/s over the horizon; None before the first window."""
        if not self._samples:
            return None
        return percentile([rate for _, rate in self._samples], self.percentile)

    @property
    def samples(self) -> int:
        return len(self._samples)

    def age(self, now: float) -> float | None:
        """Seconds since the newest sample (how stale ``estimate`` is); None without samples."""
        return None if not self._samples else max(0.0, now - self._samples[-1][0])



class SendingTime:
    """How long a sender had data unacknowledged: busy seconds, busy periods and the bytes acked by
    the end of the last period, cumulative (pure; the caller gives the times). A period begins at
    the first send while idle and ends when everything sent is acknowledged (``on_idle``)."""

    def __init__(self):
        self.busy_s = 0.0
        self.periods = 0
        self.acked_bytes = 0  # acknowledged by the end of the last complete period
        self._acked = 0
        self._since: float | None = None

    def on_send(self, t: float) -> None:
        if self._since is None:
            self._since = t

    def on_ack(self, nbytes: int) -> None:
        self._acked += nbytes

    def on_idle(self, t: float) -> None:
        if self._since is not None:
            self.busy_s += max(0.0, t - self._since)
            self.periods += 1
            self.acked_bytes = self._acked
            self._since = None

    def reading(self) -> tuple[int, float, int]:
        """(acked bytes, busy seconds, periods) up to the end of the last complete busy period."""
        return self.acked_bytes, self.busy_s, self.periods


class BurstRateMeter:
    """A link's transfer rate from its ``SendingTime`` counters, net of each burst's round trip.

    A burst of ``B`` bytes sent after an idle gap is acknowledged after about ``rtt + B / rate``:
    its first round trip says nothing about the rate, and at a low density a burst is little else.
    So ``update`` takes, per link, the counters' growth since the last sample (bytes, busy seconds,
    periods) and returns ``bytes / (busy - periods x rtt)``, with the transfer time never taken
    below ``resolution_s`` a period (a burst that took no longer than its round trip shows only
    that the rate is at least that high: the estimate then rises as the bursts grow, it is never
    guessed). ``rtt_s`` should be the path's minimum RTT, which every burst pays, so the transfer
    time errs long and the rate low. Time spent computing or waiting for the peer while nothing
    was in flight is not busy time. None until ``min_busy_s`` of busy time has accumulated (it
    carries over); readings are keyed (per link), and a key's first reading, or one whose
    counters went back, is only a baseline.
    """

    def __init__(self, *, min_busy_s: float = 0.05, resolution_s: float = 0.001):
        if not (min_busy_s > 0 and resolution_s > 0):
            raise ConfigError(f"min_busy_s and resolution_s must be > 0, got {min_busy_s}, {resolution_s}")
        self.min_busy_s, self.resolution_s = float(min_busy_s), float(resolution_s)
        self._base: dict = {}  # key -> (acked bytes, busy s, periods) at the last sample

    def update(self, readings, rtt_s: float) -> float | None:
        """A rate sample in bytes/s from ``(key, acked bytes, busy s, periods)`` readings, or None."""
        current = {key: (acked, busy, periods) for key, acked, busy, periods in readings}
        base, acked, busy, periods = {}, 0.0, 0.0, 0
        for key, now in current.items():
            before = self._base.get(key)
            if before is None or any(n < b for n, b in zip(now, before)):
                base[key] = now  # a new link, or counters that restarted
            else:
                base[key] = before
                acked += now[0] - before[0]
                busy += now[1] - before[1]
                periods += now[2] - before[2]
        if busy < self.min_busy_s or acked <= 0:
            self._base = base
            return None
        self._base = current
        return acked / max(busy - periods * max(rtt_s, 0.0), periods * self.resolution_s)


class WireTime:
    """How long a sender's messages spent on the wire, from their send and last-ack times (pure;
    the caller gives the times).

    A message sent at ``start`` whose last byte was acknowledged at ``end`` took ``rtt + bytes /
    rate`` plus any queueing behind other messages and the acks' delays: its transmission lies
    inside ``[start, end - rtt]`` (counted as at least ``resolution_s``: a message acknowledged
    within its round trip shows only that the rate is at least that high). ``reading(rtt)`` folds
    the messages finished since the last reading into cumulative counters: their bytes, and the
    length of the union of their intervals, so messages overlapping on the wire share their time,
    and the gaps between them, while the application computed, do not count. Unlike
    ``SendingTime``'s busy periods, which at a low density span a whole backward pass (a step's
    buckets leave tens of milliseconds apart, each waiting a round trip for its acks); but each
    message also carries both ends' ack delays, which dominate small messages on a loaded machine.
    Both give lower bounds of the rate.
    """

    def __init__(self, resolution_s: float = 0.001):
        if not resolution_s > 0:
            raise ConfigError(f"resolution_s must be > 0, got {resolution_s}")
        self.resolution_s = float(resolution_s)
        self.acked_bytes = 0
        self.wire_s = 0.0
        self.messages = 0
        self._finished: list[tuple[float, float, int]] = []  # (start, end, bytes) since the last reading
        self._covered_until = -math.inf  # the end of the union of the intervals counted so far

    def on_message(self, start: float, end: float, nbytes: int) -> None:
        """A message of ``nbytes`` sent at ``start`` was acknowledged in full at ``end``."""
        self._finished.append((start, end, nbytes))

    def reading(self, rtt_s: float = 0.0, open_since: float | None = None) -> tuple[int, float, int]:
        """(acked bytes, seconds on the wire, messages), cumulative, with the messages finished
        since the last reading placed using the round trip ``rtt_s`` (the path's minimum).
        ``open_since``: when the earliest message still awaiting its acks was sent (None: none is).
        Finished messages overlapping it on the wire wait for it: counted now, their overlap
        would go to this reading and the open message's bytes to a later one over only its own
        tail (parallel parts of a probe read up to 6x the path's rate that way)."""
        finished = sorted(self._finished)
        stops = [max(end - max(rtt_s, 0.0), start + self.resolution_s) for start, end, _ in finished]
        count = len(finished)
        if open_since is not None:  # hold back the group of overlapping messages that reaches it, and later ones
            group_first, group_stop = 0, self._covered_until
            for index, ((start, _end, _n), stop) in enumerate(zip(finished, stops)):
                if start > group_stop:
                    group_first = index
                group_stop = max(group_stop, stop)
                if group_stop >= open_since:
                    count = group_first
                    break
        self._finished = finished[count:]
        for (start, _end, nbytes), stop in zip(finished[:count], stops):
            start = max(start, self._covered_until)
            if stop > start:
                self.wire_s += stop - start
                self._covered_until = stop
            self.acked_bytes += nbytes
            self.messages += 1
        return self.acked_bytes, self.wire_s, self.messages


class KernelAcks:
    """When the peer's kernel acknowledged each message's last byte, from polled TCP counters (pure:
    the caller reads the counters and gives the times).

    The peer's application acknowledges a message once its event loop has read it and its ack
    frame has crossed back, queued behind whatever that side is sending (in a gradient exchange,
    its own chunks): tens of milliseconds late on a loaded machine, which ``WireTime`` reads as a
    slow link. The kernel acknowledges data as it arrives. So the sender notes, per stream a
    message's chunk went into, the stream's kernel position after it (``written``: bytes given to
    the kernel), and once every chunk is written (``all_written``) polls the acknowledged bytes of
    the ``awaited`` streams (``poll``): the first poll that finds every position acknowledged ends
    the message. A poll comes after the ack it sees (by up to its interval and the loop's delay), so
    the end errs late and the rate low, never high. ``finish`` (the application's ack came) gives
    the kernel's end, or the caller's time if no poll saw one (a stream died, or no poll ran).
    """

    def __init__(self):
        self._open: dict = {}  # message key -> [{stream: position}, every chunk written, end or None]

    def written(self, key, stream, position: int) -> None:
        """A chunk of message ``key`` is in ``stream``'s kernel buffer, which has been given ``position`` bytes."""
        targets = self._open.setdefault(key, [{}, False, None])[0]
        targets[stream] = max(position, targets.get(stream, 0))

    def all_written(self, key) -> None:
        """Every chunk of ``key`` is in a kernel buffer: polls may end it from now on."""
        if key in self._open:
            self._open[key][1] = True

    def awaited(self) -> set:
        """The streams whose acknowledged bytes the next poll needs (empty: no poll needed)."""
        return {stream for targets, ready, end in self._open.values() if ready and end is None for stream in targets}

    def poll(self, acked: dict, t: float) -> None:
        """``acked``: per stream, the bytes its peer's kernel acknowledged so far (a stream missing,
        or None, has acknowledged nothing more); ends every written message now covered."""
        for entry in self._open.values():
            targets, ready, end = entry
            if ready and end is None and all((acked.get(stream) or 0) >= position
                                             for stream, position in targets.items()):
                entry[2] = t

    def finish(self, key, t: float) -> float:
        """Message ``key`` was acknowledged by the peer's application at ``t``: when its last byte
        was acknowledged by the peer's kernel, as far as the polls saw (else ``t``). Forgets it."""
        entry = self._open.pop(key, None)
        return t if entry is None or entry[2] is None else min(entry[2], t)

    def __len__(self) -> int:
        return len(self._open)


class ProbeSchedule:
    """When a link's sender should send a probe burst, and how large (pure: the caller gives the
    times, the rate it has seen so far and the path's round trip, and sends the probe while its
    link is idle).

    At a low density a step's messages are a few hundred kB on a path that carries megabytes per
    round trip: they cross in a fraction of a millisecond, so their wire time is mostly the delays
    of acknowledging them (a poll's interval, the loops), and every meter reads a rate far below
    the path's. Worse, after the path slowed down and sped up again, the streams' congestion
    windows stay small: a window grows only while the sender has more to send than it allows (TCP
    does not grow it for traffic the application limits), and small messages never do. So a probe
    asks for more than the rate seen, as BBR's bandwidth probing does: ``growth x rate x rtt``
    bytes, one round trip's worth at ``growth`` times that rate, spread over the link's streams by
    the caller. Where the rate seen is what the windows allowed, the probe is window-limited on
    every stream, the windows grow, and it reads up to ``growth`` times the rate; where the path is
    faster still, it crosses in less than a round trip and reads the path. Its rate, a lower bound
    like the others, grows by up to ``growth`` a probe until it meets the path's. At most one probe
    every ``every_s``, of ``min_bytes`` to ``max_bytes`` (``min_bytes`` while nothing was measured
    or the round trip is unknown): on a path that just slowed down, one probe costs at most
    ``max_bytes`` of its time.
    """

    def __init__(self, *, every_s: float = 1.0, growth: float = 2.0, min_bytes: int = 64 * 1024,
                 max_bytes: int = 4 * 1024 * 1024):
        if not (every_s > 0 and growth >= 1 and 0 < min_bytes <= max_bytes):
            raise ConfigError(f"need every_s > 0, growth >= 1 and 0 < min_bytes <= max_bytes (got "
                              f"{every_s}, {growth}, {min_bytes}, {max_bytes})")
        self.every_s, self.growth = float(every_s), float(growth)
        self.min_bytes, self.max_bytes = int(min_bytes), int(max_bytes)
        self._last: float | None = None

    def due(self, now: float, rate_Bps: float | None, rtt_s: float | None) -> int | None:
        """The size of the probe to send now (bytes), or None when the last one was under ``every_s`` ago."""
        if self._last is not None and now - self._last < self.every_s:
            return None
        self._last = now
        size = self.min_bytes if rate_Bps is None or not rtt_s else self.growth * rate_Bps * rtt_s
        return int(min(self.max_bytes, max(self.min_bytes, size)))

    @staticmethod
    def parts(size: int, streams: int) -> list[int]:
        """``size`` bytes cut into one part per stream (as equal as can be), so every window is asked for more."""
        count = max(1, min(streams, size))
        return [size // count + (i < size % count) for i in range(count)]
