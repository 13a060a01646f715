"""DP-cell temporal sharing of a site's WAN egress (Atlas, section 4.3-4.4), sans-I/O.

A cell is the ranks of one site; each member has its own capped WAN link, so the site's WAN
bandwidth is the sum of its members' rates. Instead of every pipeline sending over its own
member's link at once (spatial sharing: each gets one member's rate), the pipelines of a cell
take turns: the transfer whose turn it is is split into one share per live member, proportional
to the member's measured rate, so it owns the cell's aggregate bandwidth and all shares end
together. The next transfer starts only when the last share of the current one is delivered, so
no two transfers' WAN phases overlap; or, where the caller deals a turn out piece by piece and
says when its last piece is dealt (:meth:`CellScheduler.dealt`), at that moment, each member
sending its share of the next after what it holds of the current one (per-link hand-over: no
member's link carries two transfers at once, and none idles while the slowest finishes the turn).
Turns go round the pipelines by LocalDPRank (the rank after the last owner that has a transfer
queued), FIFO within one pipeline.

A member's share of its own pipeline's transfer goes straight onto its WAN link; a share it
carries for another member first crosses the local network, so its WAN hop starts a local phase
later. Each member therefore has a WAN rate, measured on its own shares, and a *lag*, the local
phase its relayed shares took beyond their bytes at that rate; a transfer is split so that every
share ends at the same time T: the source's share is rate x T, a carrier's rate x (T - lag)
(none where its lag exceeds T), whatever the transfer's size. Until a member's own shares were
measured, its relayed ones measure its rate (lag 0). A first measurement replaces the initial
estimate; later ones are smoothed into it.

The scheduler does no I/O and reads no clock of its own: the caller feeds it events
(:meth:`CellScheduler.submit`, :meth:`~CellScheduler.progress`, :meth:`~CellScheduler.member_lost`)
and carries out the actions each returns (:class:`SendShare`, :class:`TransferFinished`,
:class:`TransferFailed`). Member rates are re-measured from every finished share with the
injected clock. A caller that deals a turn's shares out piece by piece as members drain
(:class:`~wanlink.sched.stripes.Dealer`) reports bytes it gave one member from another's share
with :meth:`CellScheduler.move`.

A member that dies mid-turn: the part of its share not yet delivered is re-split over the live
members, and the transfer finishes over them. A transfer fails (:class:`TransferFailed` carrying a
:class:`~wanlink.errors.PeerLost` that names the rank) only when its source dies, since the
source holds the bytes; its queued transfers fail with it.
"""
from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Callable, Hashable, Sequence

from wanlink.errors import ConfigError, PeerLost

DEFAULT_GRANULE = 1024 * 1024
"""Shares are whole multiples of this many bytes (but the transfer's last byte): 1 MiB, one chunk."""


@dataclasses.dataclass(frozen=True, slots=True)
class SendShare:
    """``rank`` is to send bytes [offset, offset+length) of transfer ``key`` over its WAN link.

    A member sends its shares in the order given and reports delivered bytes with
    :meth:`CellScheduler.progress`.
    """

    key: Hashable
    rank: int
    offset: int
    length: int


@dataclasses.dataclass(frozen=True, slots=True)
class TransferFinished:
    """Every byte of transfer ``key`` was delivered; its WAN phase was [started, finished]."""

    key: Hashable
    nbytes: int
    started: float
    finished: float


@dataclasses.dataclass(frozen=True, slots=True)
class TransferFailed:
    """Transfer ``key`` cannot finish (its source died): drop any of its shares still being sent."""

    key: Hashable
    error: PeerLost


Action = SendShare | TransferFinished | TransferFailed


def split_by_rate(nbytes: int, rates: Sequence[tuple[int, float]], granule: int) -> list[tuple[int, int, int]]:
    """Split [0, nbytes) into contiguous ``(rank, offset, length)`` shares proportional to the rates.

    ``rates`` lists ``(rank, bytes_per_second)`` in the order the shares are laid out. Shares are
    whole granules (largest-remainder rounding; ties go to the earlier member) except the one that
    ends at ``nbytes``; members whose share rounds to nothing are left out.
    """
    if nbytes <= 0:
        return []
    units = -(-nbytes // granule)
    total_rate = sum(rate for _rank, rate in rates)
    ideal = [units * rate / total_rate for _rank, rate in rates]
    counts = [math.floor(x) for x in ideal]
    by_remainder = sorted(range(len(rates)), key=lambda i: (counts[i] - ideal[i], i))
    for i in by_remainder[:units - sum(counts)]:
        counts[i] += 1
    shares, offset = [], 0
    for (rank, _rate), count in zip(rates, counts):
        if count:
            length = min(count * granule, nbytes - offset)
            shares.append((rank, offset, length))
            offset += length
    return shares


@dataclasses.dataclass(slots=True, eq=False)
class _Transfer:
    key: Hashable
    source: int
    nbytes: int
    started: float = 0.0


@dataclasses.dataclass(slots=True)
class _Share:
    transfer: _Transfer
    offset: int
    length: int
    relayed: bool  # carried for another member's transfer (its WAN hop starts after a local phase)
    delivered: int = 0


@dataclasses.dataclass(slots=True)
class _Member:
    rank: int
    local_rank: int
    rate: float  # WAN bytes/s
    lag: float = 0.0  # seconds a relayed share takes beyond its bytes at ``rate`` (its local phase)
    measured: set[str] = dataclasses.field(default_factory=set)  # "rate", "relayed rate", "lag": sampled so far
    relayed_first: tuple[int, float] | None = None  # (bytes, seconds) of a relayed share before the rate was known
    alive: bool = True
    shares: collections.deque[_Share] = dataclasses.field(default_factory=collections.deque)
    busy_since: float = 0.0  # when the share at the head of ``shares`` started being sent


class CellScheduler:
    """Turns over one cell's aggregate WAN bandwidth for the transfers its pipelines queue.

    ``ranks`` are the cell's members in LocalDPRank order and ``rates`` their initial WAN rates
    in bytes/s (a probe's estimate or the cloud's cap); ``clock`` returns seconds. ``smoothing``
    weighs a new rate or lag sample against the old estimate (1: trust the last share only); the first
    sample replaces the initial estimate.
    """

    def __init__(self, ranks: Sequence[int], rates: Sequence[float], clock: Callable[[], float], *,
                 granule: int = DEFAULT_GRANULE, smoothing: float = 0.5, site: str = ""):
        if not ranks:
            raise ConfigError("a cell needs at least one member rank")
        if len(set(ranks)) != len(ranks):
            raise ConfigError(f"cell member ranks repeat: {list(ranks)}")
        if len(rates) != len(ranks):
            raise ConfigError(f"{len(ranks)} cell members but {len(rates)} rates")
        for rank, rate in zip(ranks, rates):
            _check_rate(rank, rate)
        if granule < 1:
            raise ConfigError(f"share granule must be >= 1 byte, got {granule}")
        if not 0 < smoothing <= 1:
            raise ConfigError(f"rate smoothing must be in (0, 1], got {smoothing}")
        self._members = {rank: _Member(rank, i, float(rate)) for i, (rank, rate) in enumerate(zip(ranks, rates))}
        self._clock = clock
        self._granule = granule
        self._smoothing = smoothing
        self._where = f" of site {site!r}" if site else ""
        self._queues: dict[int, collections.deque[_Transfer]] = {rank: collections.deque() for rank in ranks}
        self._keys: set[Hashable] = set()
        self._current: _Transfer | None = None  # the turn's owner, until its bytes are all dealt
        self._active: list[_Transfer] = []  # transfers with bytes still queued at members, in turn order
        self._last_turn = len(ranks) - 1  # the first turn goes to LocalDPRank 0

    # -- what callers may read -------------------------------------------------------------

    @property
    def owner(self) -> Hashable | None:
        """The key of the transfer whose turn it is (granted and not yet :meth:`dealt`), or None."""
        return None if self._current is None else self._current.key

    def active(self, key: Hashable) -> bool:
        """Whether transfer ``key`` has bytes granted and not yet delivered (its progress still counts)."""
        return any(transfer.key == key for transfer in self._active)

    def rates(self) -> dict[int, float]:
        """Each live member's current WAN rate estimate (bytes/s)."""
        return {m.rank: m.rate for m in self._members.values() if m.alive}

    def lags(self) -> dict[int, float]:
        """Each live member's estimated local phase (seconds) before a share it relays is on its way."""
        return {m.rank: m.lag for m in self._members.values() if m.alive}

    def local_rank(self, rank: int) -> int:
        """The LocalDPRank of member ``rank``."""
        return self._member(rank).local_rank

    def queued(self) -> int:
        """Transfers waiting for their turn (not counting the one that owns the cell)."""
        return sum(len(q) for q in self._queues.values())

    def forecast(self) -> list[tuple[Hashable, float, float]]:
        """Expected WAN windows ``(key, start, end)`` of the current and every queued transfer.

        At the current rate estimates and assuming nothing else is queued: what a pipeline
        consults to place its compute so its transfer finds the cell free (Atlas 4.4 step 3).
        """
        now = self._clock()
        windows = []
        for transfer in self._active:  # each member sends its queued shares in order
            end = now + max((self._busy_for(m, transfer) for m in self._members.values()
                             if any(s.transfer is transfer for s in m.shares)), default=0.0)
            windows.append((transfer.key, transfer.started, end))
        now = max((end for _key, _start, end in windows), default=now)
        queues = {rank: list(q) for rank, q in self._queues.items()}
        last = self._last_turn
        while (rank := self._next_source(queues, last)) is not None:
            transfer = queues[rank].pop(0)
            last = self._members[rank].local_rank
            timing = {rank: (rate, lag) for rank, rate, lag in self._live_members(transfer.source, queued=False)}
            end = now + max((timing[r][1] + length / timing[r][0]
                             for r, _o, length in self._split(transfer.source, 0, transfer.nbytes, queued=False)),
                            default=0.0)
            windows.append((transfer.key, now, end))
            now = end
        return windows

    # -- events ----------------------------------------------------------------------------

    def submit(self, source: int, nbytes: int, key: Hashable) -> list[Action]:
        """Queue ``nbytes`` for member ``source``'s pipeline under ``key`` (unique while it lives)."""
        member = self._member(source)
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
            raise ConfigError(f"transfer size must be a non-negative integer, got {nbytes!r}")
        if key in self._keys:
            raise ConfigError(f"transfer key {key!r} is already queued or being sent")
        if not member.alive:
            return [TransferFailed(key, self._lost_error(source, key))]
        self._keys.add(key)
        self._queues[source].append(_Transfer(key, source, nbytes))
        return self._start_turn() if self._current is None else []

    def progress(self, rank: int, nbytes: int) -> list[Action]:
        """``nbytes`` more of member ``rank``'s shares were delivered: acknowledged by the receiver, or
        (what wanlink's striped p2p reports) written into a link that sends them ahead of anything later.

        Reports from a member already declared lost are ignored: its remainder was re-split.
        """
        member = self._member(rank)
        if not member.alive:
            return []
        if nbytes < 0:
            raise ConfigError(f"delivered byte count must be >= 0, got {nbytes}")
        pending = sum(s.length - s.delivered for s in member.shares)
        if nbytes > pending:
            raise ConfigError(f"rank {rank} reported {nbytes} bytes delivered but has only {pending} to send")
        now = self._clock()
        done = 0  # bytes of the shares this report finished: measured together
        while nbytes:
            share = member.shares[0]
            step = min(nbytes, share.length - share.delivered)
            share.delivered += step
            nbytes -= step
            if share.delivered == share.length:
                done += member.shares.popleft().length
        if done:
            self._share_done(member, done, share.relayed, now)
        return self._finish_done(now)

    def member_lost(self, rank: int) -> list[Action]:
        """Member ``rank`` died: fail its own transfers and re-split what it had left to send."""
        member = self._member(rank)
        if not member.alive:
            return []
        member.alive = False
        actions: list[Action] = []
        for transfer in self._queues[rank]:
            self._keys.discard(transfer.key)
            actions.append(TransferFailed(transfer.key, self._lost_error(rank, transfer.key)))
        self._queues[rank].clear()
        undelivered = [(s.transfer, s.offset + s.delivered, s.length - s.delivered) for s in member.shares]
        member.shares.clear()
        now = self._clock()
        for transfer in list(self._active):
            if transfer.source == rank:
                self._drop(transfer)
                actions.append(TransferFailed(transfer.key, self._lost_error(rank, transfer.key)))
        for transfer, offset, length in undelivered:
            if transfer in self._active:
                actions += self._assign(transfer, self._split(transfer.source, offset, length), now)
        return actions + self._finish_done(now)

    def move(self, key: Hashable, giver: int, taker: int, nbytes: int) -> None:
        """The last ``nbytes`` of member ``giver``'s undelivered share of the current transfer ``key``
        went to member ``taker`` instead (its source deals pieces as members drain, and ``taker``
        drained first: :class:`~wanlink.sched.stripes.Dealer`). ``taker`` reports them with its own."""
        if self._current is None or self._current.key != key:
            raise ConfigError(f"transfer {key!r} does not own the cell{self._where}: nothing of it to move")
        source, target = self._member(giver), self._member(taker)
        share = source.shares[-1] if source.shares and source.shares[-1].transfer is self._current else None
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0 or share is None \
                or share.length - share.delivered < nbytes:
            left = 0 if share is None else share.length - share.delivered
            raise ConfigError(f"cannot move {nbytes!r} bytes of transfer {key!r} from rank {giver}, "
                              f"which has {left} undelivered at the end of its share")
        if not target.alive:
            raise ConfigError(f"cannot move bytes of transfer {key!r} to rank {taker}: it was lost")
        share.length -= nbytes
        if not target.shares:
            target.busy_since = self._clock()
        target.shares.append(_Share(self._current, share.offset + share.length, nbytes,
                                    relayed=taker != self._current.source))
        if share.length == share.delivered:  # nothing left of it: done (measured when it had any bytes)
            source.shares.pop()
            if share.length:
                self._share_done(source, share.length, share.relayed, self._clock())

    def cancel(self, key: Hashable) -> list[Action]:
        """Drop transfer ``key`` (its source gave up on it): out of its queue, or, when it owns the
        cell, its turn ends at once. Unknown keys (finished or failed already) are ignored."""
        if key not in self._keys:
            return []
        self._keys.discard(key)
        for queue in self._queues.values():
            for transfer in queue:
                if transfer.key == key:
                    queue.remove(transfer)
                    return []
        self._drop(next(transfer for transfer in self._active if transfer.key == key))
        return self._start_turn()

    def dealt(self, key: Hashable) -> list[Action]:
        """Every byte of transfer ``key``, whose turn it is, now sits with the member that sends it
        (the caller deals its shares piece by piece and gave out the last: nothing more will
        :meth:`move`): the next turn starts now, its shares queued behind what each member still
        holds of ``key`` and split so that they end together (per-link hand-over: no member's WAN link
        carries two transfers at once, and none idles between turns). ``key`` still finishes
        (:class:`TransferFinished`) when its last bytes are delivered."""
        if self._current is None or self._current.key != key:
            raise ConfigError(f"transfer {key!r} does not own the cell{self._where}: it cannot be dealt")
        self._current = None
        return self._start_turn()

    # -- internals -------------------------------------------------------------------------

    def _member(self, rank: int) -> _Member:
        try:
            return self._members[rank]
        except KeyError:
            raise ConfigError(f"rank {rank} is not a member of this cell{self._where} "
                              f"(members: {sorted(self._members)})") from None

    def _lost_error(self, rank: int, key: Hashable) -> PeerLost:
        member = self._members[rank]
        return PeerLost(f"transfer {key!r} cannot finish: its source rank {rank} "
                        f"(LocalDPRank {member.local_rank}{self._where}) died")

    def _live_members(self, source: int, queued: bool = True) -> list[tuple[int, float, float]]:
        """``(rank, rate, delay)`` of the live members, the source first: when each can start sending a
        new share: after the bytes it still has queued (unless ``queued`` is false) and, for a share it
        relays, after the local phase (its lag; the two overlap: the share crosses the local network meanwhile)."""
        members = sorted((m for m in self._members.values() if m.alive), key=lambda m: (m.rank != source, m.local_rank))
        return [(m.rank, m.rate, max(self._busy_for(m) if queued else 0.0, 0.0 if m.rank == source else m.lag))
                for m in members]

    def _busy_for(self, member: _Member, upto: _Transfer | None = None) -> float:
        """Seconds ``member`` still needs, at its rate estimate, for the bytes it has queued (through its
        last share of transfer ``upto``); its head share has been on its way since ``busy_since``."""
        shares = list(member.shares)
        if upto is not None:
            shares = shares[:max(i for i, s in enumerate(shares) if s.transfer is upto) + 1]
        if not shares:
            return 0.0
        queued = sum(s.length - s.delivered for s in shares) / member.rate
        return max(0.0, queued - (self._clock() - member.busy_since))

    def _split(self, source: int, offset: int, length: int, queued: bool = True) -> list[tuple[int, int, int]]:
        members = self._live_members(source, queued)
        active = list(members)
        while True:  # the common end T of the shares; a member whose delay is past T gets nothing
            end = (length + sum(rate * lag for _r, rate, lag in active)) / sum(rate for _r, rate, _l in active)
            keep = [m for m in active if m[2] <= end]  # (the least delayed always stays: T is past its delay)
            if len(keep) == len(active):
                break
            active = keep
        weights = [(rank, rate * (end - lag) if (rank, rate, lag) in active else 0.0) for rank, rate, lag in members]
        return [(rank, offset + o, n) for rank, o, n in split_by_rate(length, weights, self._granule)]

    def _next_source(self, queues, last_turn: int) -> int | None:
        ranks = list(self._members)
        count = len(ranks)
        for step in range(1, count + 1):
            rank = ranks[(last_turn + step) % count]
            if queues[rank]:
                return rank
        return None

    def _start_turn(self) -> list[Action]:
        actions: list[Action] = []
        while self._current is None and (source := self._next_source(self._queues, self._last_turn)) is not None:
            transfer = self._queues[source].popleft()
            self._last_turn = self._members[source].local_rank
            now = self._clock()
            transfer.started = now
            self._current = transfer
            self._active.append(transfer)
            actions += self._assign(transfer, self._split(source, 0, transfer.nbytes), now)
            actions += self._finish_done(now, start_next=False)
        return actions

    def _assign(self, transfer: _Transfer, shares, now: float) -> list[Action]:
        actions = []
        for rank, offset, length in shares:
            member = self._members[rank]
            if not member.shares:
                member.busy_since = now
            member.shares.append(_Share(transfer, offset, length, relayed=rank != transfer.source))
            actions.append(SendShare(transfer.key, rank, offset, length))
        return actions

    def _share_done(self, member: _Member, length: int, relayed: bool, now: float) -> None:
        """``length`` bytes of ``member``'s shares (all its own or all relayed) were delivered by ``now``."""
        elapsed = now - member.busy_since
        if elapsed > 0:
            if not relayed:
                first = "rate" not in member.measured
                self._measure(member, "rate", "rate", length / elapsed)
                if first and member.relayed_first is not None:  # the lag of that earlier relayed share
                    length, seconds = member.relayed_first
                    self._measure(member, "lag", "lag", max(0.0, seconds - length / member.rate))
            elif "rate" in member.measured:
                self._measure(member, "lag", "lag", max(0.0, elapsed - length / member.rate))
            else:  # relayed before any share of its own: it measures the rate for now, the lag taken as 0
                self._measure(member, "relayed rate", "rate", length / elapsed)
                member.relayed_first = member.relayed_first or (length, elapsed)
        member.busy_since = now

    def _measure(self, member: _Member, what: str, field: str, sample: float) -> None:
        """Smooth ``sample`` into ``member.<field>``; the first sample of its kind ``what`` replaces it."""
        weight = self._smoothing if what in member.measured else 1.0
        setattr(member, field, (1 - weight) * getattr(member, field) + weight * sample)
        member.measured.add(what)

    def _drop(self, transfer: _Transfer) -> None:
        """Forget ``transfer``'s undelivered shares (it failed or was cancelled); its turn, if it had it, ends."""
        for member in self._members.values():
            member.shares = collections.deque(s for s in member.shares if s.transfer is not transfer)
        self._active.remove(transfer)
        self._keys.discard(transfer.key)
        if self._current is transfer:
            self._current = None

    def _finish_done(self, now: float, start_next: bool = True) -> list[Action]:
        """Finish the transfers with nothing left to deliver; when the owner was one of them, the next turn starts."""
        queued = {id(s.transfer) for m in self._members.values() for s in m.shares}
        done: list[Action] = []
        for transfer in [t for t in self._active if id(t) not in queued]:
            self._drop(transfer)
            done.append(TransferFinished(transfer.key, transfer.nbytes, transfer.started, now))
        return done + self._start_turn() if start_next else done


def _check_rate(rank: int, rate: float) -> None:
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not math.isfinite(rate) or rate <= 0:
        raise ConfigError(f"WAN rate of rank {rank} must be a positive number of bytes/s, got {rate!r}")
