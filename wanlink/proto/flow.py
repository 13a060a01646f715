"""Receiver-driven flow control, sender side (sans-I/O; the receiver side lives in reassembly.py).

A message of at most ``window`` bytes is sent eagerly. A larger one sends its first ``window``
bytes eagerly and the rest only once the receiver grants the message, which it does when the
receive is posted (a GRANT frame naming (tag, seq); a receive posted before the message is sent
grants it ahead). Eager bytes are paid for with link-wide credit: the receiver advertises
``Limits.max_unexpected_bytes`` when the link starts and returns credit as eager bytes leave its
staging. A CREDIT frame carries the total ever granted, so a frame repeated after a stream died,
or overtaken by a later one, changes nothing (GRANT and ANNOUNCE are idempotent too). So whatever
the two applications do, the receiver stages at most that many bytes for receives nobody posted
yet. A late receiver therefore costs the sender time (its send waits for the grant), never the link.

``eager_window`` sizes the window from the path: one bandwidth-delay product hides the grant's
round trip when the receive is posted as the send starts.
"""
from __future__ import annotations

import collections
import dataclasses
from typing import Any

from wanlink.errors import RemoteProtocolError
from wanlink.proto.limits import MiB

MIN_EAGER_WINDOW = 8 * MiB
"""Messages up to this size never wait for a grant: on loopback and LAN paths (tiny bandwidth-delay
products) every collective piece is eager, so flow control adds no round trip there."""
MAX_CREDIT = 2**48  # more credit than any receiver could stage: a peer sending it is broken
CREDIT_BATCH_DIVISOR = 16
"""A receiver returns eager credit once 1/16 of its budget is due, in one CREDIT frame, rather than
after every eager chunk (a frame, a write and a wake-up each side per small message). The sender so
holds at most that much less credit than it could; nothing waits for it: a posted receive grants its
message whatever the credit, and a message held for credit is announced (``wait_message_started``)."""


def credit_batch(budget: int) -> int:
    """Eager bytes a receiver with staging ``budget`` lets come due before returning their credit."""
    return budget // CREDIT_BATCH_DIVISOR


def eager_window(rate_bytes_per_s: float | None, rtt_s: float | None, budget: int) -> int:
    """Bytes of a message sent before its grant: one bandwidth-delay product, clamped to
    [MIN_EAGER_WINDOW, budget / 2] (half the receiver's budget, so two late messages fit).
    Unknown rate or RTT (a new link): the largest window, half the budget."""
    ceiling = max(budget // 2, 1)
    if not rate_bytes_per_s or not rtt_s:
        return ceiling
    return int(min(max(rate_bytes_per_s * rtt_s, MIN_EAGER_WINDOW), ceiling))


@dataclasses.dataclass(eq=False)
class _Held:
    """Chunks of one message not released yet."""

    tag: int
    seq: int
    total: int
    eager: collections.deque  # (item, size) within the window, waiting for credit
    rest: list  # (item, size) beyond the window, waiting for the grant
    begun: bool = False  # some chunk of it was released


class SendFlow:
    """Decides when each chunk of each outgoing message may go, and whether it goes on credit.

    Chunks are opaque ``items`` with sizes. ``start``, ``on_grant`` and ``on_credit`` return the
    ``(item, eager)`` pairs released by that event, in order; ``eager`` chunks must carry
    ``FLAG_EAGER`` (the receiver charges them against the credit it gave).
    """

    def __init__(self, max_grants: int, credit: int = 0):
        self.credit = credit  # eager bytes the receiver will accept now
        self.budget = credit  # the receiver's staging budget: the first credit it advertised
        self._granted_total = credit  # the receiver's cumulative credit, as last heard
        self._max_grants = max_grants
        self._grants: set[tuple[int, int]] = set()  # granted before this side started sending them
        self._held: dict[tuple[int, int], _Held] = {}
        self._waiting: collections.deque = collections.deque()  # _Held with eager chunks, oldest first

    @property
    def held_messages(self) -> int:
        return len(self._held)

    def start(self, tag: int, seq: int, items: list[tuple[Any, int]], window: int) -> tuple[list, bool]:
        """A new message of ``total`` bytes in chunks ``items`` ((item, size) in offset order); returns the released
        pairs and whether the receiver must be told the message exists (nothing of it released).

        Before the receiver's first credit its budget, and so any window, is unknown (and nothing can
        go eagerly yet): ``window`` is ignored and the message is split when that credit comes."""
        if self._grants and (tag, seq) in self._grants:
            self._grants.remove((tag, seq))
            return [(item, False) for item, _size in items], False
        if self.budget and not self._waiting:  # the common case: all of it fits the window and the credit
            total = items[0][1] if len(items) == 1 else sum(size for _item, size in items)
            if total <= window and total <= self.credit:  # (what _split and _spend would do, without a _Held)
                self.credit -= total
                return [(item, True) for item, _size in items], False
        held = _Held(tag, seq, sum(size for _item, size in items), collections.deque(items), [])
        if self.budget:
            _split(held, window)
        released = [] if self._waiting else self._spend(held)
        if held.eager:
            self._waiting.append(held)
        if held.eager or held.rest:
            self._held[(tag, seq)] = held
        return released, not released

    def on_grant(self, tag: int, seq: int, started: bool) -> list:
        """The receiver posted the receive for (tag, seq); ``started``: ``start`` was called for it."""
        held = self._held.pop((tag, seq), None)
        if held is not None:
            released = [(item, False) for item, _size in (*held.eager, *held.rest)]
            if held.eager:  # it waited for credit: messages queued behind it need not any more
                self._waiting.remove(held)
                held.eager.clear()
            held.rest.clear()
            return released
        if not started:  # posted before we sent it: it goes in full when sent
            if len(self._grants) >= self._max_grants:
                raise RemoteProtocolError(f"peer granted more than {self._max_grants} messages not sent yet "
                                    f"(latest tag={tag} seq={seq})")
            self._grants.add((tag, seq))
        return []  # (a message released in full already, or a receive re-posted after a cancel)

    def on_credit(self, granted_total: int) -> list:
        """The receiver has granted ``granted_total`` eager bytes since the link started."""
        more = granted_total - self._granted_total
        if more <= 0:  # repeated or overtaken
            return []
        if self.credit + more > MAX_CREDIT:
            raise RemoteProtocolError(f"peer granted {more} bytes of credit on top of {self.credit}")
        self._granted_total = granted_total
        self.credit += more
        if not self.budget:  # the first credit: size the messages started before it, as on a new link
            self.budget = more
            for held in self._waiting:
                _split(held, eager_window(None, None, self.budget))
        released = []
        while self._waiting:
            held = self._waiting[0]
            released += self._spend(held)
            if held.eager:
                break
            self._waiting.popleft()
            if not held.rest:
                self._held.pop((held.tag, held.seq), None)
        return released

    def waiting_announced(self) -> list[tuple[int, int, int]]:
        """(tag, seq, total) of every message of which nothing was released yet (to announce again)."""
        return [(h.tag, h.seq, h.total) for h in self._held.values()
                if not h.begun]

    def forget(self) -> None:
        """Drop every held chunk and grant (the link failed)."""
        self._grants.clear()
        self._held.clear()
        self._waiting.clear()

    def _spend(self, held: _Held) -> list:
        released = []
        while held.eager and held.eager[0][1] <= self.credit:
            item, size = held.eager.popleft()
            self.credit -= size
            released.append((item, True))
            held.begun = True
        return released


def _split(held: _Held, window: int) -> None:
    """Keep the first ``window`` bytes of ``held`` (at least one chunk) eager; the rest waits for the grant."""
    items, sent = list(held.eager), 0
    held.eager.clear()
    for item, size in items:
        (held.eager if sent < window or not sent else held.rest).append((item, size))
        sent += size
