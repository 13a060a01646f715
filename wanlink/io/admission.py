"""Admission of unauthenticated connections: a bounded table of handshakes in progress and a
rate-limited log of refusals, so that idle or hostile sockets can neither lock a server out nor
flood its log.

When the table is full a new connection is never refused: the oldest silent handshake of the
source address holding the most silent slots is evicted instead (and told BUSY), so a client that
keeps opening idle sockets only evicts its own, and a legitimate handshake, which sends its HELLO
at once and finishes in a few round trips, gets through. A source address above its own share
evicts its own oldest handshake.
"""
from __future__ import annotations

import asyncio
import collections

from wanlink.io.sockets import log

SUMMARY_INTERVAL_S = 10.0
"""At most one summary line of refused connections per this many seconds (the first at once)."""


class HandshakeTable:
    """Handshakes in progress by source host, oldest first; ``add`` returns the entries it evicted.

    Entries that have not sent their HELLO yet (idle) are evicted before those that have: a
    legitimate client sends its HELLO at once, so sockets held open in silence, however fast they
    are reopened, only evict one another.
    """

    def __init__(self, max_total: int, max_per_host: int):
        self.max_total = max_total
        self.max_per_host = max_per_host
        self._hosts: dict[object, str] = {}  # entry -> its source host, in arrival order
        self._by_host: dict[str, dict[object, None]] = {}  # host -> its entries, in arrival order
        self._idle: dict[str, dict[object, None]] = {}  # host -> its entries that sent no HELLO yet

    def __len__(self) -> int:
        return len(self._hosts)

    def count(self, host: str) -> int:
        return len(self._by_host.get(host, ()))

    def add(self, entry, host: str) -> list:
        """Admit ``entry`` from ``host`` (idle); returns the entries evicted to make room (at most one)."""
        victims = []
        if self.count(host) >= self.max_per_host:
            victims.append(self._oldest(host))
        elif len(self._hosts) >= self.max_total:
            if self._idle:
                busiest = max(self._idle, key=lambda h: len(self._idle[h]))
            else:
                busiest = max(self._by_host, key=lambda h: len(self._by_host[h]))
            victims.append(self._oldest(busiest))
        for victim in victims:
            self.remove(victim)
        self._hosts[entry] = host
        self._by_host.setdefault(host, {})[entry] = None
        self._idle.setdefault(host, {})[entry] = None
        return victims

    def spoke(self, entry) -> None:
        """``entry`` sent its HELLO: evicted only once no idle entry is left."""
        host = self._hosts.get(entry)
        if host is not None:
            _discard(self._idle, host, entry)

    def remove(self, entry) -> None:
        host = self._hosts.pop(entry, None)
        if host is not None:
            _discard(self._by_host, host, entry)
            _discard(self._idle, host, entry)

    def entries(self) -> list:
        return list(self._hosts)

    def _oldest(self, host: str):
        idle = self._idle.get(host)
        return next(iter(idle if idle else self._by_host[host]))


def _discard(groups: dict[str, dict[object, None]], host: str, entry) -> None:
    group = groups.get(host)
    if group is not None and entry in group:
        del group[entry]
        if not group:
            del groups[host]


class RejectionLog:
    """Counts refused connections by reason and source host; logs the first at once, then one
    summary line per ``interval`` seconds while refusals continue."""

    def __init__(self, port: int, interval: float = SUMMARY_INTERVAL_S):
        self.port = port
        self.interval = interval
        self.total = 0
        self._reasons: collections.Counter = collections.Counter()
        self._hosts: collections.Counter = collections.Counter()
        self._examples: dict[str, str] = {}  # reason -> the latest message given with it
        self._timer: asyncio.TimerHandle | None = None

    def record(self, reason: str, host: str, example: str = "") -> None:
        """Count one refusal; ``reason`` should not vary per connection (``example`` may: the latest is shown)."""
        self.total += 1
        self._reasons[reason] += 1
        if example:
            self._examples[reason] = example[:200]
        self._hosts[host] += 1
        if self._timer is None:
            self._flush()

    def _flush(self) -> None:
        if not self._reasons:
            self._timer = None
            return
        count = sum(self._reasons.values())
        examples = self._examples
        reasons = "; ".join(f"{n} {reason}" + (f" (latest: {examples[reason]})" if reason in examples else "")
                            for reason, n in self._reasons.most_common())
        sources = ", ".join(f"{host} ({n})" for host, n in self._hosts.most_common(3))
        noun = "connection" if count == 1 else "connections"
        log.warning("port %d refused %d %s: %s; from %s", self.port, count, noun, reasons, sources)
        self._reasons.clear()
        self._hosts.clear()
        self._examples.clear()
        self._timer = asyncio.get_running_loop().call_later(self.interval, self._flush)

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
