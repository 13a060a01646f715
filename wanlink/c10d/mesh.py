"""The links of one process to the other members of a world, set up through the torch Store.

Every member runs one wanlink server and publishes ``host:port`` under ``wanlink/addr/<rank>``,
and under ``wanlink/local/<rank>`` its host key and abstract Unix socket: members of one host (and
network namespace) link over Unix sockets instead of TCP loopback (``WANLINK_UNIX=0`` turns that off),
and, after it, the abstract socket of its express listener (wanlink/c10d/express.py; empty with
``WANLINK_EXPRESS=0`` or ``WANLINK_SECURE=1``, whose frames all go encrypted through the links).
Under ``wanlink/site/<rank>`` it publishes its site (``WANLINK_SITE``, else its host): the world's
:class:`~wanlink.sched.sites.SiteMap` (docs/sites.md).
Links are made at start-up (and re-requested lazily), one per pair of members, and shared by
every process group of that world: the member with the higher rank connects, the lower one accepts. The shared secret is
``WANLINK_SECRET`` when set, otherwise made by rank 0 and handed out through the Store (see
docs/c10d.md for what that means for trust).

The world group's Mesh is also the process's *world mesh*: groups made later on a subset of its
ranks share it (:func:`world_mesh`) until it closes. Settings come from the caller (the backend's
edge reads the environment); this module reads none.
"""
from __future__ import annotations

import asyncio
import ipaddress
import logging
import secrets
import socket
import threading
from datetime import timedelta

import torch.distributed as dist

from wanlink.c10d.tags import group_slot
from wanlink.errors import ConfigError, DeadlineExceeded, PeerLost
from wanlink.endpoints import connect, serve
from wanlink.io.express import ExpressListener
from wanlink.io.runtime import get_runtime
from wanlink.io.sockets import same_host_key
from wanlink.sched.sites import SiteMap, site_name
from wanlink.settings import Settings

logger = logging.getLogger(__name__)

ADDRESS_KEY = "wanlink/addr/{rank}"
LOCAL_KEY = "wanlink/local/{rank}"
SITE_KEY = "wanlink/site/{rank}"
SECRET_KEY = "wanlink/secret"
WORLD_KEY = "wanlink/world"
SIZE_KEY = "wanlink/size/{rank}"  # the world size each rank was started with


def _root_store(store: dist.Store) -> dist.Store:
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return store


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        return False


def _route_address(towards: str) -> str:
    """The local address the kernel would use to reach ``towards`` (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((towards, 9))
        return probe.getsockname()[0]


def advertised_address(store: dist.Store, settings: Settings) -> tuple[str, str]:
    """(bind host, advertised host): ``WANLINK_ADDR``/``WANLINK_BIND`` or derived from the Store.

    A loopback or file-backed Store means a single-host world: bind and advertise 127.0.0.1.
    Otherwise advertise the address that routes to the Store's host and bind all interfaces.
    """
    advertised = settings.addr
    if not advertised:
        root = _root_store(store)
        store_host = getattr(root, "host", None) if isinstance(root, dist.TCPStore) else None
        if not store_host or _is_loopback(store_host):
            advertised = "127.0.0.1"
        else:
            try:
                advertised = _route_address(socket.gethostbyname(store_host))
            except OSError:
                advertised = socket.gethostname()
    default_bind = "127.0.0.1" if _is_loopback(advertised) else "0.0.0.0"
    return settings.bind or default_bind, advertised


def shared_secret(store: dist.Store, rank: int, timeout: timedelta, configured: str | None) -> bytes:
    """``configured`` (``WANLINK_SECRET``) if set; else rank 0 makes a random one and publishes it in the Store."""
    if configured:
        return configured.encode()
    if rank == 0:
        made = secrets.token_hex(32).encode()
        store.set(SECRET_KEY, made)
        return made
    return _store_get(store, SECRET_KEY, timeout)


def _store_get(store: dist.Store, key: str, timeout: timedelta, waiting_for: str = "") -> bytes:
    what = f"{waiting_for} (key {key!r})" if waiting_for else f"key {key!r}"
    try:
        store.wait([key], timeout)
    except dist.DistNetworkError as error:  # the Store's server is gone: waiting longer cannot help
        raise PeerLost(f"wanlink rendezvous lost the torch Store (its server, rank 0's unless MASTER_ADDR says "
                       f"otherwise, is unreachable) while waiting for {what}: {error}") from error
    except RuntimeError as error:  # torch reports store timeouts as RuntimeError/DistStoreError
        raise DeadlineExceeded(f"wanlink rendezvous timed out after {timeout.total_seconds():g} s "
                               f"waiting for {what}") from error
    return store.get(key)


class Mesh:
    """One server plus lazily made links to the other ``size`` - 1 members of a world.

    A rendezvous that fails in any way (a timeout, a refused or failed link, a bad Store entry)
    closes the server and every link made so far before the error propagates.
    """

    def __init__(self, store: dist.Store, rank: int, size: int, timeout: timedelta, settings: Settings):
        self.rank, self.size, self.timeout = rank, size, timeout
        store.set(SIZE_KEY.format(rank=rank), str(size))  # first: a rank that disagrees fails at once
        self.settings = settings  # streams, chunk size, compression (lz4 per chunk where it shrinks), ...
        self.runtime = get_runtime()
        self.secret = shared_secret(store, rank, timeout, settings.secret)
        if rank == 0:
            store.set(WORLD_KEY, secrets.token_hex(8))
        self.world = _store_get(store, WORLD_KEY, timeout).decode()
        self._links: dict[int, asyncio.Future] = {}
        self._slots: dict[int, str] = {}
        self._closed = False
        self.striping = None  # this mesh's wanlink.c10d.striped_p2p.StripedP2P, once serve() made one
        self.server = None
        self.addresses: dict[int, tuple[str, int]] = {}
        self.unix_names: dict[int, str] = {}  # peers of this host: their abstract socket
        self.express: ExpressListener | None = None
        self.express_names: dict[int, str] = {}  # peers of this host: their express listener
        self.site = site_name(settings.site, same_host_key(), socket.gethostname())
        bind, advertised = advertised_address(store, settings)
        host_key = same_host_key() if settings.unix else ""
        self.server = self.runtime.run(
            serve(bind, 0, secret=self.secret, on_link=self._on_link, compress=settings.compress,
                  unix=bool(host_key), settings=settings),
            timeout.total_seconds())
        try:
            if host_key and settings.express and not settings.secure:
                self.express = ExpressListener(self.secret, self.world)
            self._rendezvous(store, advertised, host_key)
        except BaseException:
            self.close()
            raise

    def _rendezvous(self, store: dist.Store, advertised: str, host_key: str) -> None:
        """Publish this member's addresses, read everyone's, and make every link."""
        rank, timeout = self.rank, self.timeout
        store.set(ADDRESS_KEY.format(rank=rank), f"{advertised}:{self.server.port}")
        express_name = self.express.name if self.express is not None else ""
        store.set(LOCAL_KEY.format(rank=rank), f"{host_key} {self.server.unix_name or ''} {express_name}")
        store.set(SITE_KEY.format(rank=rank), self.site)
        for peer in range(self.size):
            joined = f"rank {peer} of {self.size} to join"
            theirs = _store_get(store, SIZE_KEY.format(rank=peer), timeout, joined).decode()
            if theirs != str(self.size):
                raise ConfigError(f"wanlink rendezvous: world size mismatch: rank {rank} was started with "
                                  f"world size {self.size}, rank {peer} with {theirs}")
            address = _store_get(store, ADDRESS_KEY.format(rank=peer), timeout, joined).decode()
            host, _, port = address.rpartition(":")
            if not host or not port.isdigit():
                raise ConfigError(f"wanlink rendezvous: rank {peer} published a malformed address {address!r} "
                                  f"under {ADDRESS_KEY.format(rank=peer)!r}")
            self.addresses[peer] = (host, int(port))
            peer_key, unix_name, peer_express = (_store_get(store, LOCAL_KEY.format(rank=peer), timeout).decode()
                                                 .split(" ") + ["", ""])[:3]
            if host_key and peer_key == host_key and unix_name:
                self.unix_names[peer] = unix_name
            if host_key and peer_key == host_key and peer_express and self.express is not None:
                self.express_names[peer] = peer_express
        self.sites = SiteMap([_store_get(store, SITE_KEY.format(rank=peer), timeout).decode()
                              for peer in range(self.size)])
        try:
            self.runtime.run(self._link_all(), timeout.total_seconds())
        except DeadlineExceeded:
            missing = sorted(peer for peer, slot in self._links.items() if not slot.done())
            raise DeadlineExceeded(f"wanlink rendezvous timed out after {timeout.total_seconds():g} s: "
                                   f"rank {rank} has no link to rank(s) {missing}") from None

    async def _link_all(self) -> None:
        """Make every link now, so a peer that is missing or dies later is noticed by its link."""
        peers = [peer for peer in range(self.size) if peer != self.rank]
        for peer, link in zip(peers, await asyncio.gather(*(self.link(peer) for peer in peers))):
            # wanlink.stats() says which rank and site each link leads to
            link.labels.update(peer_rank=peer, peer_site=self.sites.site(peer), site=self.site)

    def claim_slot(self, group_name: str) -> int:
        """The tag slot of a group on this mesh; two groups whose names collide are refused."""
        slot = group_slot(group_name)
        owner = self._slots.setdefault(slot, group_name)
        if owner != group_name:
            raise ConfigError(f"wanlink: groups {owner!r} and {group_name!r} hash to the same tag slot {slot}; "
                              f"give one of them another group_desc/name")
        return slot

    # -- loop-thread side ------------------------------------------------------------------
    def _slot(self, peer: int) -> asyncio.Future:
        slot = self._links.get(peer)
        if slot is None:
            slot = self._links[peer] = asyncio.get_running_loop().create_future()
            if peer < self.rank:
                asyncio.ensure_future(self._connect(peer, slot))
        return slot

    async def _connect(self, peer: int, slot: asyncio.Future) -> None:
        host, port = self.addresses[peer]
        try:
            link = await connect(host, port, secret=self.secret, meta={"rank": self.rank, "world": self.world},
                                 timeout=self.timeout.total_seconds(), compress=self.settings.compress,
                                 unix_name=self.unix_names.get(peer), settings=self.settings)
        except BaseException as error:  # noqa: BLE001 - handed to every waiter
            if not slot.done():
                slot.set_exception(PeerLost(f"wanlink: cannot connect rank {self.rank} -> rank {peer} "
                                            f"at {host}:{port}: {error!r}"))
            return
        if slot.done():
            await link.close()
        else:
            self._hold(peer, slot, link)

    async def _on_link(self, link) -> None:
        meta = link.peer_meta or {}
        peer = meta.get("rank")
        if meta.get("world") != self.world or not isinstance(peer, int) or not self.rank < peer < self.size:
            logger.warning("refusing link from %s with meta %r (world %s, rank %d)",
                           link.peer, meta, self.world, self.rank)
            await link.close()
            return
        slot = self._slot(peer)
        if slot.done():
            logger.warning("duplicate link from rank %d ignored", peer)
            await link.close()
            return
        self._hold(peer, slot, link)

    def _hold(self, peer: int, slot: asyncio.Future, link) -> None:
        """Hand out ``link`` for ``peer`` until it fails; then drop it (freeing what it staged) and
        answer later requests with the reason."""
        host, port = self.addresses.get(peer, ("?", 0))
        link.labels.update(peer_rank=peer, peer_address=f"{host}:{port}")  # errors and stats name the rank
        slot.set_result(link)
        link.add_failure_callback(lambda failed: self._drop(peer, failed))

    def _drop(self, peer: int, link) -> None:
        slot = self._links.get(peer)
        if slot is None or not slot.done() or slot.cancelled() or slot.exception() is not None:
            return
        if slot.result() is not link:
            return
        failed = link.loop.create_future()
        host, port = self.addresses.get(peer, ("?", 0))
        failed.set_exception(PeerLost(f"wanlink: the link rank {self.rank} <-> rank {peer} failed "
                                      f"(rank {peer} at {host}:{port}): {link.error}"))
        failed.exception()  # retrieved: nobody need ask
        self._links[peer] = failed

    def lost(self, peer: int) -> BaseException | None:
        """Why the link to ``peer`` failed, if it did (loop thread); None for itself and live or pending links."""
        slot = self._links.get(peer)
        if slot is not None and slot.done() and not slot.cancelled():
            return slot.exception()
        return None

    def first_lost(self, peers) -> BaseException | None:
        """Why the link to the first of ``peers`` whose link failed did, or None (see ``lost``)."""
        return next(filter(None, (self.lost(peer) for peer in peers)), None)

    def cached(self, peer: int):
        """The link to ``peer`` if it is already up, else None (loop thread)."""
        slot = self._links.get(peer)
        if slot is not None and slot.done() and not slot.cancelled() and slot.exception() is None:
            return slot.result()
        return None

    async def link(self, peer: int):
        """The link to ``peer``, made on first use (loop thread)."""
        if self._closed:
            raise PeerLost(f"wanlink: the mesh of rank {self.rank} is shut down")
        if not 0 <= peer < self.size or peer == self.rank:
            raise ConfigError(f"wanlink: no link from rank {self.rank} to rank {peer} (world of {self.size})")
        return await asyncio.shield(self._slot(peer))

    async def _close(self) -> None:
        self._closed = True
        if self.server is not None:
            self.server.close()
        links = [slot.result() for slot in self._links.values()
                 if slot.done() and not slot.cancelled() and slot.exception() is None]
        for slot in self._links.values():
            if not slot.done():
                slot.set_exception(PeerLost("wanlink: mesh shut down"))
            elif not slot.cancelled():
                slot.exception()  # mark retrieved
        await asyncio.gather(*(link.close() for link in links), return_exceptions=True)
        if self.server is not None:
            await asyncio.gather(self.server.wait_closed(), return_exceptions=True)

    def close(self) -> None:
        """Close the server and every link, and stop being the world mesh (idempotent; any non-loop thread)."""
        _forget_world_mesh(self)
        if self.express is not None:
            self.express.close()
        if self._closed or not self.runtime.running:
            return
        try:
            self.runtime.run(self._close(), timeout=10.0)
        except Exception as error:  # noqa: BLE001 - shutting down; nothing to recover
            logger.debug("mesh close: %r", error)


_world_lock = threading.Lock()
_world_mesh: Mesh | None = None


def world_mesh(store: dist.Store, rank: int, size: int, timeout: timedelta, settings: Settings) -> Mesh:
    """A new Mesh for a world group, which later groups of this world share until it closes."""
    global _world_mesh
    with _world_lock:
        _world_mesh = Mesh(store, rank, size, timeout, settings)
        return _world_mesh


def shared_world_mesh(global_ranks: list[int], group_rank: int) -> Mesh | None:
    """The world mesh if it covers ``global_ranks`` and this process is ``global_ranks[group_rank]``."""
    with _world_lock:
        shared = _world_mesh
    if shared is not None and max(global_ranks) < shared.size and global_ranks[group_rank] == shared.rank:
        return shared
    return None


def _forget_world_mesh(mesh: Mesh) -> None:
    global _world_mesh
    with _world_lock:
        if _world_mesh is mesh:
            _world_mesh = None
