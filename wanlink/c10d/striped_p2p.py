"""Cell-striped point-to-point over a mesh's links: relays on the wanlink-io loop thread.

A large send from site A to site B (``wanlink.sched.stripes.striped``) crosses the WAN on every
member of A at once: the source asks its cell's leader (LocalDPRank 0, which runs the cell's
:class:`~wanlink.sched.cells.CellScheduler`) for a turn; the grant lists one share per live
member; each share goes source -> carrier (local network) -> partner in B (the carrier's WAN
link) -> destination (B's local network) as pieces, each with a header saying where it lands, and
the destination receives every piece straight into the posted tensor. The source deals the pieces
as the routes drain (``wanlink.sched.stripes.Dealer``): a carrier is fed its next piece when it
reports one written into its WAN link, so it holds at most FEED_DEPTH, and a route that drains its
share first takes the tail of another's. Two transfers of one cell take turns, handed over link by
link: the next is granted when the source has dealt the last piece of the current one, and each
member's WAN link starts the next transfer's share as soon as its last piece of the current one has
left the host (:class:`WanQueue`), so no WAN link carries two transfers at once and none idles between them.

Relaying needs no call from the members' training code: every rank's :class:`StripedP2P`
reads the control messages of all its links on the loop thread and relays what it is asked to.
Its messages use the links' control channel and, for data, tags of a group slot reserved under
the name ``RESERVED_GROUP`` (``Mesh.claim_slot`` refuses a group whose name collides), so they
never meet user tags or collectives.

The destination learns a striped message from an 8-byte descriptor (the transfer's serial) that
the source sends on the user's own tag, so messages keep their per-tag order and a receive from
any source works. A member that dies while a striped transfer needs it fails that transfer, on
the source and on the destination, with a :class:`~wanlink.errors.PeerLost` naming it (striped
transfers do not finish over the survivors; later ones are split over the live members only).
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import time
from typing import Awaitable, Callable, Sequence

import torch

from wanlink.c10d.link_comm import LinkComm, as_buffer
from wanlink.c10d.mesh import Mesh
from wanlink.c10d.tags import relay_tag
from wanlink.collectives.base import gather_all
from wanlink.errors import ConfigError, PeerLost
from wanlink.sched.cells import CellScheduler, SendShare, TransferFailed, TransferFinished
from wanlink.sched.stripes import (
    HEADER_BYTES, MAX_ROUTES, Dealer, InOrder, Route, piece_header, read_piece_header, routes, striped,
)

logger = logging.getLogger(__name__)

RESERVED_GROUP = "wanlink/striped-p2p"
"""Group name whose tag slot the striped transfers' data travels on."""
RELAY_WINDOW = 4
"""Pieces a relay holds at once per share (received and not yet written onward into the kernel)."""
FEED_DEPTH = 4
"""Pieces of a route dealt and not yet written into its WAN link (the rest stay with the source,
for whichever route drains first). Fewer left the links idle between pieces: "written" waits until
at most 1 MiB of a piece is unacknowledged, and a carrier's next piece first crosses the local network."""
HANDOVER_POLL_S = 0.002
"""How often a route with its last piece queued asks whether all of it left the host (``hand_over``)."""
END = piece_header(0, 0)
"""The header that ends a route."""
NOMINAL_RATE = 100e6
"""Initial WAN rate of every member (bytes/s): equal shares until finished shares measure them."""
SERIALS = 1 << 22

def serve(mesh: Mesh, min_bytes: int, piece_bytes: int) -> None:
    """Start striping and relaying on ``mesh`` (once per mesh; any non-loop thread)."""
    if mesh.striping is not None or not StripedP2P.useful(mesh.sites, min_bytes):
        return
    mesh.striping = StripedP2P(mesh, min_bytes, piece_bytes)
    mesh.runtime.run(mesh.striping.start(), mesh.timeout.total_seconds())


async def send(comm: LinkComm, peer: int, buffer: torch.Tensor) -> None:
    """``comm.send``, striped over this rank's cell when it pays (docs/sites.md)."""
    service = comm.mesh.striping
    if service is None or not service.applies(comm.mesh.rank, comm.mesh_rank(peer), buffer):
        return await comm.send(peer, buffer)
    await service.send(comm, peer, buffer)


async def recv(comm: LinkComm, peer: int, buffer: torch.Tensor) -> None:
    """``comm.recv`` of a message that may come striped."""
    service = comm.mesh.striping
    if service is None or not service.applies(comm.mesh_rank(peer), comm.mesh.rank, buffer):
        return await comm.recv(peer, buffer)
    descriptor = torch.empty(1, dtype=torch.int64)
    await comm.recv(peer, descriptor)
    await service.receive(comm.mesh_rank(peer), int(descriptor), buffer)


async def recv_any(comm: LinkComm, peers: Sequence[int], buffer: torch.Tensor) -> int:
    """``comm.recv_any`` of a message that may come striped; returns the sending group rank."""
    service = comm.mesh.striping
    if service is None:
        return await comm.recv_any(peers, buffer)
    descriptor = torch.empty(1, dtype=torch.int64)

    def landing(peer: int) -> torch.Tensor:
        return descriptor if service.applies(comm.mesh_rank(peer), comm.mesh.rank, buffer) else buffer

    source = await comm.recv_any(peers, buffer, landing=landing)
    if service.applies(comm.mesh_rank(source), comm.mesh.rank, buffer):
        await service.receive(comm.mesh_rank(source), int(descriptor), buffer)
    return source


class WanQueue:
    """The striped routes one rank sends over its WAN link, one after another in the order they joined
    (per-link hand-over): a route's first piece goes onto the link only once every route ahead of it
    has left the host (:func:`hand_over`: all its bytes in the kernel and sent, none waiting in a
    socket buffer), so the next transfer's bytes queue behind the current one's at the bottleneck
    and the link carries one transfer at a time without draining between them. Both neighbours were
    traced worse at 500 Mbit/s and 40 ms: a link's streams share it, so bytes of the next transfer in
    the kernel beside the current one's unsent tail slow that tail down (started when the route ahead
    had its end queued, the first transfer's last piece landed 0.26 s late; when it had its end in the
    kernel, about 0.1 s late); started once the route ahead had its last piece written (``until=
    "written"``: at most 1 MiB unacknowledged), the link ran without bytes for about a round trip
    less 1 MiB's time (~20 ms). Loop thread only."""

    def __init__(self):
        self._open: list[asyncio.Future] = []  # a future per route that joined and has not left, in order
        self.log: list[tuple[int, int, float, float]] = []  # (origin, serial, first piece queued, last piece
        # written) of every route that went through, in order

    def join(self, origin: int, serial: int) -> WanPlace:
        """Place a route of ``origin``'s transfer ``serial`` in line now (before its first piece arrives)."""
        return WanPlace(self, origin, serial)


class WanPlace:
    """One route's place in a :class:`WanQueue`."""

    def __init__(self, queue: WanQueue, origin: int, serial: int):
        self._queue, self._key = queue, (origin, serial)
        self._ahead = list(queue._open)
        self._left = asyncio.get_running_loop().create_future()
        queue._open.append(self._left)
        self._left.add_done_callback(queue._open.remove)
        self.started: float | None = None

    async def turn(self) -> None:
        """Return once every route ahead has left (at once after the first time). A cancelled waiter
        leaves the routes ahead alone (their futures are shielded)."""
        while self._ahead:
            await asyncio.shield(self._ahead[0])
            self._ahead.pop(0)
        if self.started is None:
            self.started = time.monotonic()

    def leave(self) -> None:
        """This route's last piece is written, or it gave up: the next route may start."""
        if not self._left.done():
            self._left.set_result(None)
            if self.started is not None:
                self._queue.log.append((*self._key, self.started, time.monotonic()))


async def hand_over(place: WanPlace | None, link, tag: int, sends: list[asyncio.Future]) -> None:
    """Wait for a route's ``sends`` on ``link`` (its last queued), letting the route behind it onto
    this rank's WAN link (``place``, if any) as soon as all of them have left the host: every byte
    in the kernel and sent (``link.on_wire``), so the next transfer's bytes queue behind them at the
    bottleneck instead of beside them in the kernel, and the link does not drain between the two.
    Not at "every send written": a piece under 1 MiB is written as soon as it is in the kernel, and
    the last pieces are (TAIL_SHRINK). Where the kernel cannot say, once every send is written; where
    other bytes keep the kernel's buffers from emptying, at most a round trip after that."""
    if place is not None:
        loop = asyncio.get_running_loop()
        pending, patience = {send for send in sends if not send.done()}, None
        while True:
            if pending:
                done, pending = await asyncio.wait(pending, timeout=HANDOVER_POLL_S)
                if any(send.cancelled() or send.exception() for send in done):
                    break
            else:
                await asyncio.sleep(HANDOVER_POLL_S)
            wire = link.on_wire(tag)
            if wire or (not pending and wire is None):
                break
            if not pending:
                patience = patience or loop.time() + (link.min_rtt_s() or 0.0)
                if loop.time() >= patience:
                    break
        place.leave()
    await gather_all(sends)


async def relay_pieces(inbound, outbound, tag: int, place: WanPlace | None, what: str,
                       forwarded: Callable[[int], None]) -> None:
    """Forward one route's pieces on ``tag`` (each behind its header, then its end) from ``inbound``
    to ``outbound`` in order, each as it lands; ``forwarded(length)`` once a piece is written onward.
    At most RELAY_WINDOW pieces are held at once. A carrier's (``place``: its WAN link) go on landing
    while the routes ahead still hold the link, so at its turn it has a window of them to write, not
    just the first (traced: the second piece then crossed the local network only after the turn came,
    and the WAN link ran dry after the first)."""
    window = asyncio.Semaphore(RELAY_WINDOW)
    free: list[memoryview] = []  # piece buffers whose forward was written: reused
    landed: asyncio.Queue = asyncio.Queue()  # (header, buffer, length), in order

    async def land() -> None:
        while True:
            header, buffer = bytearray(HEADER_BYTES), None
            await inbound.recv_into(header, tag=tag)
            _offset, length = read_piece_header(header, inbound.limits.max_transfer_size, what)
            if length:
                await window.acquire()
                buffer = free.pop() if free and len(free[-1]) >= length else memoryview(bytearray(length))
                await inbound.recv_into(buffer[:length], tag=tag)
            landed.put_nowait((header, buffer, length))
            if not length:
                return

    async def forward() -> None:
        if place is not None:
            await place.turn()
        sends = []
        while True:
            header, buffer, length = await landed.get()
            sends.append(asyncio.ensure_future(outbound.send(header, tag=tag, until="written")))
            if not length:
                break
            sent = asyncio.ensure_future(outbound.send(buffer[:length], tag=tag, until="written"))

            def written(sent, buffer=buffer, length=length) -> None:
                free.append(buffer)
                window.release()
                if not sent.cancelled() and sent.exception() is None:
                    forwarded(length)
            sent.add_done_callback(written)
            sends.append(sent)
        await hand_over(place, outbound, tag, sends)

    await gather_all([land(), forward()])


class StripedP2P:
    """One mesh's striping: relays, the cell leader's scheduler, and both ends of striped transfers.

    Ranks here are mesh (world) ranks. Everything but :meth:`useful` and :meth:`applies` runs on
    the loop thread.
    """

    def __init__(self, mesh: Mesh, min_bytes: int, piece_bytes: int):
        self.mesh, self.sites, self.rank = mesh, mesh.sites, mesh.rank
        self.min_bytes, self.piece_bytes = min_bytes, piece_bytes
        self.slot = mesh.claim_slot(RESERVED_GROUP)
        cell = self.sites.cell(self.rank)
        self.leader = cell[0]
        self.scheduler = None
        if self.rank == self.leader and len(cell) > 1:
            self.scheduler = CellScheduler(cell, [NOMINAL_RATE] * len(cell), time.monotonic,
                                           site=self.sites.site(self.rank))
        self._serials = itertools.count()
        self._plans: dict[tuple[int, int], asyncio.Future] = {}
        self._fed: dict[tuple[int, int], asyncio.Semaphore] = {}  # (serial, route): a carrier's room
        self._grants: dict[tuple[int, int], asyncio.Future] = {}
        self._granted: set[tuple[int, int]] = set()
        self._reports: dict[tuple[int, int], InOrder] = {}  # the leader's: each granted transfer's reports, in order
        self.wan = WanQueue()  # the routes this rank sends over its WAN link
        self._tasks: set[asyncio.Task] = set()
        self.finished: list[TransferFinished] = []  # the leader's record of its cell's turns
        self.handed_over = 0  # turns the leader passed on when their last piece was dealt
        self.relayed_bytes = 0  # of other ranks' transfers, forwarded by this rank

    @staticmethod
    def useful(sites, min_bytes: int) -> bool:
        """Whether any send on this world can be striped: sites, a cell of several, the threshold on."""
        return (min_bytes > 0 and sites.spans_sites and sites.world_size < (1 << 16) - 1
                and 1 < max(len(cell) for cell in sites.cells.values()) <= MAX_ROUTES)

    def applies(self, source: int, destination: int, buffer: torch.Tensor) -> bool:
        return striped(self.sites, source, destination, buffer.numel() * buffer.element_size(), self.min_bytes)

    async def start(self) -> None:
        for peer in range(self.mesh.size):
            if peer != self.rank:
                self._spawn(self._read(peer, await self.mesh.link(peer)))

    # -- control messages ----------------------------------------------------------------------
    def _spawn(self, coroutine: Awaitable) -> None:
        task = asyncio.ensure_future(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _read(self, peer: int, link) -> None:
        while True:
            try:
                message = await link.recv_control()
            except PeerLost:
                self._lost(peer)
                return
            try:
                self._dispatch(peer, message)
            except Exception:  # a malformed message must not stop the reader
                logger.exception("striped p2p: rank %d could not handle %r from rank %d",
                                 self.rank, message, peer)

    def _to(self, rank: int, message: list) -> None:
        """Send a control message (to this rank itself: handled on the next loop turn)."""
        if rank == self.rank:
            asyncio.get_running_loop().call_soon(self._dispatch, rank, message)
            return
        link = self.mesh.cached(rank)
        if link is None:
            raise PeerLost(f"wanlink striped p2p: no live link from rank {self.rank} to rank {rank}")
        link.send_control(message)

    def _tell(self, rank: int, message: list) -> None:
        """``_to`` for notices whose loss only matters to a peer that is gone."""
        try:
            self._to(rank, message)
        except PeerLost as error:
            logger.debug("striped p2p notice %r to rank %d not sent: %s", message[0], rank, error)

    def _dispatch(self, peer: int, message) -> None:
        kind, *fields = message if isinstance(message, list) and message else [None]
        if kind == "relay":
            self._spawn(self._relay(peer, *fields))
        elif kind == "plan":
            serial, total, plan = fields
            future = self._future(self._plans, (peer, serial))
            if not future.done():  # (cancelled: its receive gave up)
                future.set_result((total, [Route(*r) for r in plan]))
        elif kind == "fed":
            room = self._fed.get(tuple(fields))
            if room is not None:
                room.release()
        elif kind == "grant":
            serial, shares = fields
            future = self._grants.get((self.rank, serial))
            if future is not None and not future.done():
                future.set_result(shares)
        elif kind in ("request", "moved", "dealt", "done", "cancel") and self.scheduler is not None:
            self._lead(peer, kind, fields)
        else:
            logger.warning("striped p2p: rank %d ignored control message %r from rank %d",
                           self.rank, message, peer)

    @staticmethod
    def _future(table: dict, key) -> asyncio.Future:
        """The future under ``key``, made by whichever of its setter and its waiter comes first."""
        future = table.get(key)
        if future is None:
            future = table[key] = asyncio.get_running_loop().create_future()
        return future

    # -- the cell leader -----------------------------------------------------------------------
    def _lead(self, peer: int, kind: str, fields: list) -> None:
        scheduler = self.scheduler
        if kind == "request":
            serial, nbytes = fields
            actions = scheduler.submit(peer, nbytes, (peer, serial))
        elif kind in ("moved", "dealt", "done"):  # the source's numbered reports: pieces dealt to another
            serial, number, *rest = fields          # route, its last piece dealt (the next turn starts), a route's end
            key = (peer, serial)
            if not scheduler.active(key):  # a cancelled transfer's late report
                return
            actions = []
            order = self._reports.setdefault(key, InOrder(f"rank {peer}'s striped transfer {serial} (its reports)"))
            try:
                due = order.add(number, (kind, rest))
            except ConfigError:  # a report far ahead or twice: the transfer's books cannot close; give its turn up
                self._reports.pop(key, None)
                self._carry_out(scheduler.cancel(key))
                raise
            for report, values in due:
                if not scheduler.active(key):
                    break
                if report == "moved":
                    scheduler.move(key, *values)
                elif report == "done":
                    actions += scheduler.progress(*values)
                else:
                    actions += scheduler.dealt(key)
                    self.handed_over += 1
        else:
            origin, serial = fields
            self._granted.discard((origin, serial))
            self._reports.pop((origin, serial), None)
            actions = scheduler.cancel((origin, serial))
        self._carry_out(actions)

    def _carry_out(self, actions: list) -> None:
        grants: dict[tuple[int, int], list] = {}
        for action in actions:
            if isinstance(action, SendShare) and action.key not in self._granted:
                grants.setdefault(action.key, []).append([action.rank, action.offset, action.length])
            elif isinstance(action, (TransferFinished, TransferFailed)):
                self._granted.discard(action.key)
                self._reports.pop(action.key, None)
                if isinstance(action, TransferFinished):
                    self.finished.append(action)
        for (origin, serial), shares in grants.items():
            self._granted.add((origin, serial))
            self._tell(origin, ["grant", serial, shares])

    def _lost(self, peer: int) -> None:
        if self.scheduler is None or peer not in self.sites.cell(self.rank):
            return
        actions = self.scheduler.member_lost(peer)
        # The scheduler re-splits the lost member's undelivered share over the survivors, but its
        # bytes are gone with it (a striped transfer does not finish over the survivors): the
        # transfer's ends fail naming it, and its turn ends here so the next can start.
        broken = {a.key for a in actions if isinstance(a, SendShare) and a.key in self._granted}
        for key in broken:
            self._granted.discard(key)
            actions = [a for a in actions if a.key != key] + self.scheduler.cancel(key)
        self._carry_out(actions)

    # -- both ends and the relays --------------------------------------------------------------
    async def _watching(self, ranks, awaitable: Awaitable, what: str, role: str):
        """``awaitable``'s result, or PeerLost naming the first of ``ranks`` whose link fails first."""
        work = asyncio.ensure_future(awaitable)
        watches = {asyncio.ensure_future(self._watch(rank)): rank for rank in set(ranks) - {self.rank}}
        try:
            done, _ = await asyncio.wait([work, *watches], return_when=asyncio.FIRST_COMPLETED)
            if work in done:
                return work.result()
            lost = next(task for task in done if task is not work)
            rank = watches[lost]
            raise PeerLost(f"{what}: {role} rank {rank} (site {self.sites.site(rank)!r}, LocalDPRank "
                           f"{self.sites.local_rank(rank)}) was lost, so the transfer failed (a striped transfer "
                           f"does not finish over the surviving members): {lost.exception()}") from lost.exception()
        finally:
            for task in [work, *watches]:
                task.cancel()
            await asyncio.gather(work, *watches, return_exceptions=True)

    async def _watch(self, rank: int) -> None:
        """Returns (with PeerLost as its exception) only when the link to ``rank`` fails."""
        link = await self.mesh.link(rank)
        await link.wait_message_started(relay_tag(self.slot, 0, 0, MAX_ROUTES))  # never sent on

    async def send(self, comm: LinkComm, peer: int, buffer: torch.Tensor) -> None:
        destination = comm.mesh_rank(peer)
        serial = next(self._serials) % SERIALS
        nbytes = buffer.numel() * buffer.element_size()
        what = (f"wanlink striped send of {nbytes} bytes from rank {self.rank} (site {self.sites.site(self.rank)!r}) "
                f"to rank {destination} (site {self.sites.site(destination)!r})")
        data = buffer.reshape(-1).view(torch.uint8)
        descriptor = asyncio.ensure_future(comm.send(peer, torch.tensor([serial], dtype=torch.int64)))
        try:
            grant = self._future(self._grants, (self.rank, serial))
            self._to(self.leader, ["request", serial, nbytes])
            shares = await self._watching([self.leader], grant, what, "cell leader")
            plan = routes(self.sites, self.rank, destination, shares)
            self._to(destination, ["plan", serial, nbytes, [[r.offset, r.length, r.carrier, r.partner] for r in plan]])
            dealer = Dealer([(r.carrier, r.offset, r.length) for r in plan], self.piece_bytes, FEED_DEPTH)
            reports = itertools.count()  # numbers the reports to the leader (see InOrder)
            jobs = [descriptor] + [self._feed(serial, index, route, destination, dealer, as_buffer(data), reports)
                                   for index, route in enumerate(plan)]
            await self._watching([r.carrier for r in plan] + [destination], gather_all(jobs), what, "relay")
        except BaseException:
            descriptor.cancel()
            self._tell(self.leader, ["cancel", self.rank, serial])
            raise
        finally:
            self._grants.pop((self.rank, serial), None)

    @staticmethod
    def _abandon(link, tag: int) -> None:
        """End a route the source gave up on before its end: its carrier stops waiting for pieces
        (and lets the routes behind it onto its WAN link)."""
        try:
            link.start_send(END, tag=tag, until="written").add_done_callback(
                lambda sent: sent.cancelled() or sent.exception())
        except PeerLost:
            pass

    async def _feed(self, serial: int, index: int, route: Route, destination: int, dealer: Dealer, data,
                    reports: itertools.count) -> None:
        """Deal route ``index`` its pieces as it drains, each behind its header, then its end.

        The source's own route goes straight to ``destination`` once the routes ahead of it on this
        rank's WAN link are queued, a piece dealt whenever one of the FEED_DEPTH in flight is written
        into the kernel; a carrier is sent its pieces over the local network, the next whenever it
        reports one written into its WAN link ("fed"). Bytes moved to this route from another's share,
        the last piece dealt, and the route's end (all of it written) are told to the leader.
        """
        carrier, tag = route.carrier, relay_tag(self.slot, self.rank, serial, index)
        room = asyncio.Semaphore(FEED_DEPTH)
        relayed = carrier != self.rank
        place = None if relayed else self.wan.join(self.rank, serial)
        if relayed:
            self._fed[(serial, index)] = room
            self._to(carrier, ["relay", self.rank, serial, index, destination, route.partner])
        sends, link, ended = [], None, False
        try:
            link = await self.mesh.link(carrier if relayed else destination)
            if place is not None:
                await place.turn()
            while True:
                await room.acquire()
                moves, undealt = len(dealer.moves), dealer.undealt()
                piece = dealer.next(carrier)
                for giver, taker, nbytes in dealer.moves[moves:]:  # (this call's: it took another's piece)
                    self._to(self.leader, ["moved", serial, next(reports), giver, taker, nbytes])
                if undealt and not dealer.undealt():  # this call dealt the last piece: the next turn may start
                    self._to(self.leader, ["dealt", serial, next(reports)])
                if piece is None:
                    break
                offset, length = piece
                sends.append(asyncio.ensure_future(link.send(piece_header(offset, length), tag=tag, until="written")))
                sends.append(asyncio.ensure_future(link.send(data[offset:offset + length], tag=tag, until="written")))
                if not relayed:
                    sends[-1].add_done_callback(lambda _sent: room.release())
            sends.append(asyncio.ensure_future(link.send(END, tag=tag, until="written")))
            ended = True
            await hand_over(place, link, tag, sends)
            for _ in range(FEED_DEPTH - 1):  # every piece written into the WAN link (a carrier: reported)
                await room.acquire()
        finally:
            self._fed.pop((serial, index), None)
            if place is not None:
                place.leave()
            if relayed and link is not None and not ended:
                self._abandon(link, tag)
        self._tell(self.leader, ["done", serial, next(reports), carrier, dealer.dealt[carrier]])

    async def receive(self, source: int, serial: int, buffer: torch.Tensor) -> None:
        """Receive striped transfer ``serial`` of ``source`` into ``buffer``."""
        nbytes = buffer.numel() * buffer.element_size()
        what = (f"wanlink striped recv of {nbytes} bytes at rank {self.rank} from rank {source} "
                f"(site {self.sites.site(source)!r})")
        try:
            total, plan = await self._watching([source], self._future(self._plans, (source, serial)), what, "source")
        finally:
            self._plans.pop((source, serial), None)
        if total != nbytes:
            raise ConfigError(f"{what}: rank {source} sent {total} bytes on this tag, but the receive "
                              f"posted a tensor of {nbytes} bytes")
        view, landed = as_buffer(buffer.reshape(-1)), []
        jobs = [self._land(await self.mesh.link(route.last_hop(self.rank)), relay_tag(self.slot, source, serial, index),
                           view, what, landed) for index, route in enumerate(plan)]
        members = [source] + [rank for route in plan for rank in (route.carrier, route.partner)]
        await self._watching(members, gather_all(jobs), what, "relay")
        if sum(landed) != nbytes:
            raise ConfigError(f"{what}: rank {source}'s routes brought {sum(landed)} of its {nbytes} bytes")

    @staticmethod
    async def _land(link, tag: int, view, what: str, landed: list[int]) -> None:
        """Receive one route's pieces, each where its header says, until its end; appends their bytes to ``landed``."""
        header, count = bytearray(HEADER_BYTES), 0
        while True:
            await link.recv_into(header, tag=tag)
            offset, length = read_piece_header(header, len(view), what)
            if not length:
                landed.append(count)
                return
            await link.recv_into(view[offset:offset + length], tag=tag)
            count += length

    async def _relay(self, peer: int, origin: int, serial: int, index: int, destination: int, next_hop: int) -> None:
        """Forward a route's pieces from ``peer`` to ``next_hop`` as each arrives (:func:`relay_pieces`);
        a carrier tells the source each piece it wrote into its WAN link, so the source deals it the next."""
        tag = relay_tag(self.slot, origin, serial, index)
        carrying = self.sites.site(self.rank) == self.sites.site(origin)
        what = f"wanlink striped p2p relay at rank {self.rank} of rank {origin}'s transfer {serial}"
        place = self.wan.join(origin, serial) if carrying else None  # (a carrier forwards over its WAN link)
        try:
            inbound, outbound = await self.mesh.link(peer), await self.mesh.link(next_hop)
            if next_hop != destination:
                outbound.send_control(["relay", origin, serial, index, destination, destination])

            def forwarded(length: int) -> None:
                self.relayed_bytes += length
                if carrying:
                    self._tell(origin, ["fed", serial, index])

            await relay_pieces(inbound, outbound, tag, place, what, forwarded)
        except Exception as error:  # noqa: BLE001 - the ends see the lost member on their own links
            logger.warning("striped p2p: rank %d could not relay share %d of rank %d's transfer %d "
                           "to rank %d: %r", self.rank, index, origin, serial, next_hop, error)
            if carrying:
                self._tell(self.leader, ["cancel", origin, serial])
        finally:
            if place is not None:
                place.leave()
