"""When to re-send a stalled stream's chunks over an idle stream of the same link (sans-I/O).

A TCP stream that needs a retransmission timeout (RTO) to recover from a loss acknowledges nothing
for the timeout (at least 200 ms on Linux, plus the round trip) and then restarts from a window of
a few segments. If the last chunks of a message are on it, the whole message waits while the
link's other streams idle. ``Link`` then sends a copy of those chunks on an idle stream: whichever
copy the peer receives first counts, the other is dropped as a duplicate (see docs/transport.md).
"""
from __future__ import annotations

HEDGE_RTTS = 4
"""A stream holding unacknowledged bytes whose peer's kernel acknowledged nothing new for this many
of the link's round trips is stalled. A stream that is only slow (a small window, fast recovery
after a loss) still gets a cumulative ack every round trip; 4 leaves room for delayed acks and a
queue that makes the round trip longer than the link's smallest one, and stays below a Linux
timeout's silence (200 ms + the round trip) on paths up to about 70 ms."""
HEDGE_FLOOR_S = 0.1
"""Never call a stream stalled sooner than this (LAN and loopback round trips are microseconds; a
loaded host's event loop can leave a stream unread for tens of milliseconds)."""


HEDGE_ROUNDS = 4
"""A stream whose bytes in its kernel need more than this many round trips at its congestion window
is behind: traced on the emulator (250 Mbit/s, 40 ms, 1 % loss), a stream cut to a window of 100-200
segments by losses held the last MiB of a message for 6-7 round trips while the link's other
streams, at windows of 400-1100 segments, idled. A stream sending at its window holds its window
in flight and up to a window or two not sent yet: 1-3 round trips."""


def behind(outstanding: int, cwnd_bytes: int) -> bool:
    """Whether ``outstanding`` bytes (in flight and not sent yet) need more than HEDGE_ROUNDS round
    trips at a window of ``cwnd_bytes``."""
    return outstanding > HEDGE_ROUNDS * cwnd_bytes


def stall_after(rtt_s: float | None) -> float:
    """Seconds without ack progress after which a stream is stalled, for a link of ``rtt_s`` (None: unknown)."""
    return max(HEDGE_RTTS * (rtt_s or 0.0), HEDGE_FLOOR_S)


class StallWatch:
    """Per stream, since when its peer's kernel acknowledged nothing new while bytes were outstanding.

    Fed by samples (``stalled_for``) of each stream's kernel counters: bytes acknowledged so far, and
    bytes given to the kernel but not acknowledged yet.
    """

    def __init__(self):
        self._last: dict[int, tuple[int, float]] = {}  # stream index -> (bytes acknowledged, since)

    def stalled_for(self, index: int, acked: int, outstanding: int, now: float) -> float:
        """Seconds stream ``index`` has made no progress (0 when it just did, or holds nothing)."""
        last = self._last.get(index)
        if last is None or last[0] != acked or outstanding <= 0:
            self._last[index] = (acked, now)
            return 0.0
        return now - last[1]

    def clear(self) -> None:
        """Forget every stream (the samples stopped for a while: the next one starts again)."""
        self._last.clear()

    def forget(self, index: int) -> None:
        """Stream ``index`` was replaced: its counters start again."""
        self._last.pop(index, None)
