"""Express sockets: blocking-free Unix stream sockets between the members of a same-host group, moved
by whichever thread waits on them (no event loop), for wanlink/c10d/express.py.

:class:`ExpressListener` is a process's abstract Unix socket for them: an accepting thread checks
each newcomer's hello (wanlink/proto/express.py) and files the socket under its group and rank until
that group's thread takes it. :func:`dial` opens one towards a peer's listener. :class:`ExpressSockets`
holds one group's sockets with their :class:`~wanlink.proto.express.Outgoing` and
:class:`~wanlink.proto.express.Incoming` and moves bytes on them (``progress``).
"""
from __future__ import annotations

import logging
import select
import socket
import threading
import time

from wanlink.errors import PeerLost, ProtocolError
from wanlink.io.sockets import close_quietly, configure_stream_socket, unix_address, unix_listener
from wanlink.proto.express import HELLO, Incoming, Outgoing, hello, read_hello

log = logging.getLogger("wanlink.io")

HELLO_TIMEOUT_S = 2.0
"""Longest the accepting thread waits for a newcomer's hello (a silent stranger delays the next one)."""


class ExpressListener:
    """A process's abstract Unix socket for express sockets, with the thread that accepts them."""

    def __init__(self, secret: bytes, world: str):
        self._secret, self._world = secret, world
        self._listener, self.name = unix_listener(backlog=64)
        self._listener.setblocking(True)
        self._arrived: dict[tuple[int, int], socket.socket] = {}
        self._changed = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._accept_all, name="wanlink-express-accept", daemon=True)
        self._thread.start()

    def _accept_all(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except OSError:  # closed
                return
            try:
                sock.settimeout(HELLO_TIMEOUT_S)
                data = b""
                while len(data) < HELLO.size:
                    more = sock.recv(HELLO.size - len(data))
                    if not more:
                        raise ProtocolError("closed before its hello")
                    data += more
                key = read_hello(data, self._secret, self._world)
            except (OSError, ProtocolError) as error:
                log.warning("express listener %s refused a connection: %s", self.name, error)
                close_quietly(sock)
                continue
            configure_stream_socket(sock)  # (non-blocking, a Unix socket's 4 MiB of send buffer)
            with self._changed:
                if self._closed:
                    close_quietly(sock)
                    return
                stale = self._arrived.pop(key, None)  # (a member that dialled again: the newer socket counts)
                if stale is not None:
                    close_quietly(stale)
                self._arrived[key] = sock
                self._changed.notify_all()

    def take(self, slot: int, rank: int, deadline: float) -> socket.socket | None:
        """The socket world rank ``rank`` opened for group ``slot``, waiting until ``deadline``
        (``time.monotonic()``); None if it did not come."""
        with self._changed:
            while (slot, rank) not in self._arrived:
                left = deadline - time.monotonic()
                if left <= 0 or self._closed:
                    return None
                self._changed.wait(left)
            return self._arrived.pop((slot, rank))

    def close(self) -> None:
        with self._changed:
            self._closed = True
            arrived, self._arrived = list(self._arrived.values()), {}
            self._changed.notify_all()
        try:
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept
        except OSError:
            pass
        close_quietly(self._listener)
        for sock in arrived:
            close_quietly(sock)


def dial(name: str, secret: bytes, world: str, slot: int, rank: int) -> socket.socket:
    """An express socket to the listener ``name``, opened for group ``slot`` by world rank ``rank``."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(HELLO_TIMEOUT_S)
        sock.connect(unix_address(name))
        sock.sendall(hello(secret, world, slot, rank))
    except OSError:
        close_quietly(sock)
        raise
    configure_stream_socket(sock)
    return sock


class _Peer:
    __slots__ = ("sock", "outgoing", "incoming", "name")

    def __init__(self, sock: socket.socket, name: str):
        self.sock, self.name = sock, name
        self.outgoing, self.incoming = Outgoing(), Incoming(name)


class ExpressSockets:
    """One group's express sockets (peer -> socket), moved by ``progress`` on the calling thread."""

    def __init__(self) -> None:
        self._peers: dict[int, _Peer] = {}
        self._poll = select.poll()
        self._watched: dict[int, int] = {}  # fd -> poll mask
        self._shut = False  # this rank shut its sockets (``shut``): not the peers' doing

    def add(self, peer: int, sock: socket.socket, name: str) -> None:
        """Use ``sock`` for ``peer`` (called ``name`` in errors, e.g. "rank 2")."""
        self._peers[peer] = _Peer(sock, name)

    def has(self, peer: int) -> bool:
        return peer in self._peers

    def outgoing(self, peer: int) -> Outgoing:
        return self._peers[peer].outgoing

    def incoming(self, peer: int) -> Incoming:
        return self._peers[peer].incoming

    def progress(self, deadline: float) -> bool:
        """Write and read what every socket takes now; if none moved, wait for one until ``deadline``
        (``time.monotonic()``). False when the deadline passed with nothing moved. PeerLost when a
        peer's socket closed, ProtocolError when its bytes break the protocol."""
        if self.move():
            return True
        for peer in self._peers.values():
            mask = (select.POLLOUT if peer.outgoing.queue else 0) | (select.POLLIN if peer.incoming.unfilled else 0)
            fd = peer.sock.fileno()
            if self._watched.get(fd, 0) != mask:
                if mask:
                    self._poll.register(fd, mask)
                    self._watched[fd] = mask
                else:
                    self._poll.unregister(fd)
                    del self._watched[fd]
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        if not self._poll.poll(max(1, int(left * 1000) + 1)):
            return time.monotonic() < deadline
        self.move()
        return True

    def move(self) -> bool:
        """Write and read what every socket takes now, without waiting; whether any byte moved."""
        moved = False
        for peer in self._peers.values():
            if peer.outgoing.queue:
                try:
                    peer.outgoing.advance(peer.sock.sendmsg(peer.outgoing.buffers()))
                    moved = True
                except BlockingIOError:
                    pass
                except OSError as error:
                    raise self._lost(peer, f"closed its express socket ({error})") from error
            while peer.incoming.unfilled:
                try:
                    count = peer.sock.recv_into(peer.incoming.view())
                except BlockingIOError:
                    break
                except OSError as error:
                    raise self._lost(peer, f"'s express socket failed ({error})") from error
                if not count:
                    raise self._lost(peer, "closed its express socket")
                peer.incoming.advance(count)
                moved = True
        return moved

    def _lost(self, peer: _Peer, what: str) -> PeerLost:
        if self._shut:
            return PeerLost(f"this rank aborted the group (its express sockets are shut); {peer.name} not heard")
        separator = "" if what.startswith("'") else " "
        return PeerLost(f"{peer.name}{separator}{what}: its process exited or gave up on the group")

    def shut(self) -> None:
        """Shut every socket down (a thread moving bytes on one sees it closed at once; fds stay open)."""
        self._shut = True
        for peer in self._peers.values():
            try:
                peer.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self) -> None:
        for peer in self._peers.values():
            close_quietly(peer.sock)
        self._peers.clear()
