"""``wanlink-iperf -s``: one listening socket for stock iperf3 clients and wanlink-iperf clients alike.

Each connection's first bytes decide: ``WLK1`` is a wanlink handshake, handed to the wanlink
server; anything else is an iperf3 cookie: a new test when idle, a data stream of the running
test when the cookie matches, ACCESS_DENIED otherwise.
"""
from __future__ import annotations

import asyncio
import os
import socket
import struct

from wanlink.errors import ConfigError, ProtocolError, WanlinkError
from wanlink.io.link import DEFAULT_TIMEOUT
from wanlink.io.server import Server
from wanlink.io.sockets import recv_exactly
from wanlink.iperf.channels import check_congestion
from wanlink.iperf.options import Options
from wanlink.iperf.output import CliError, Output, secret_bytes
from wanlink.iperf.protocol import COOKIE_SIZE, WANLINK_MAGIC, State, StateChange, check_cookie, is_wanlink_prefix
from wanlink.iperf.session import Session
from wanlink.proto.limits import DEFAULT_LIMITS
from wanlink.sched.chunking import chunk_size_from
from wanlink.settings import Settings

SNIFF_TIMEOUT_S = 10.0


class IperfServer:
    """``-s``: owns the listening socket and dispatches each connection by its first bytes."""

    def __init__(self, opts: Options, out: Output, stop: asyncio.Event, settings: Settings, on_listening=None):
        self.opts, self.out, self.stop, self.settings = opts, out, stop, settings
        self.on_listening = on_listening
        self.session: Session | None = None
        self.session_task: asyncio.Task | None = None
        self.handlers: set[asyncio.Task] = set()
        self.wanlink = None
        self.chunk_size = None
        self.listener: socket.socket | None = None
        self._seq = 0
        self._changed = asyncio.Event()  # a session started: the accept loop must watch it

    def _listen(self) -> socket.socket:
        o = self.opts
        host = o.bind or ""
        try:
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            listener = socket.create_server((host, o.port), family=family, backlog=128)
        except OSError as exc:
            reason = os.strerror(exc.errno) if exc.errno else str(exc)
            raise CliError(f"unable to start listener for connections on port {o.port}: {reason}") from None
        listener.setblocking(False)
        return listener

    def _wanlink_server(self, listener: socket.socket) -> Server:
        secret = secret_bytes(self.settings.secret, self.out)
        self.chunk_size = chunk_size_from(self.settings.chunk_size)
        options = {"chunk_size": self.chunk_size, "congestion": self.opts.congestion,
                   "sock_buffer": self.opts.window, "compress": False, "checksum": False}
        # wanlink.serve() always listens itself; the iperf server needs handshakes on its own socket,
        # so it builds the Server around its listener and never starts its accept loop.
        return Server(listener, secret=secret, on_link=self._on_link, limits=DEFAULT_LIMITS,
                      timeout=DEFAULT_TIMEOUT, link_options=options)

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        try:
            check_congestion(self.opts.congestion)
        except ConfigError as exc:
            raise CliError(str(exc)) from None
        self.listener = self._listen()
        port = self.listener.getsockname()[1]
        self.wanlink = self._wanlink_server(self.listener)
        self.out.line("-----------------------------------------------------------")
        self.out.line(f"Server listening on {port} (wanlink-iperf)")
        self.out.line("-----------------------------------------------------------")
        if self.on_listening is not None:
            self.on_listening(port)
        accept = None
        stop_wait = asyncio.ensure_future(self.stop.wait())
        try:
            while True:
                if accept is None:
                    accept = asyncio.ensure_future(loop.sock_accept(self.listener))
                changed = asyncio.ensure_future(self._changed.wait())
                waiters = {accept, stop_wait, changed}
                if self.session_task is not None:
                    waiters.add(self.session_task)
                done, _ = await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
                changed.cancel()
                self._changed.clear()
                if stop_wait in done:
                    if self.session is not None:
                        try:
                            await self.session.ctrl.send(StateChange(State.SERVER_TERMINATE))
                        except (OSError, WanlinkError):
                            pass
                    return 0
                if self.session_task is not None and self.session_task.done():
                    self.session_task, self.session = None, None
                    if self.opts.one_off:
                        return 0
                    self.out.line("-----------------------------------------------------------")
                    self.out.line(f"Server listening on {port} (wanlink-iperf)")
                    self.out.line("-----------------------------------------------------------")
                if accept in done:
                    done_accept, accept = accept, None
                    try:
                        sock, _addr = done_accept.result()
                    except OSError as exc:
                        self.out.warn(f"accept failed: {exc}")
                        await asyncio.sleep(0.1)
                        continue
                    self._seq += 1
                    task = loop.create_task(self._dispatch(sock, self._seq))
                    self.handlers.add(task)
                    task.add_done_callback(self.handlers.discard)
        finally:
            stop_wait.cancel()
            if accept is not None:
                accept.cancel()
            await self._shutdown()

    async def _shutdown(self) -> None:
        tasks = list(self.handlers) + ([self.session_task] if self.session_task else [])
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self.wanlink is not None:
            self.wanlink.close()
            await self.wanlink.wait_closed()
        elif self.listener is not None:
            self.listener.close()

    async def _dispatch(self, sock: socket.socket, seq: int) -> None:
        loop = asyncio.get_running_loop()
        sock.setblocking(False)
        try:
            peer = sock.getpeername()
            peer_name = f"{peer[0]}:{peer[1]}"
            async with asyncio.timeout(SNIFF_TIMEOUT_S):
                prefix = await recv_exactly(loop, sock, len(WANLINK_MAGIC))
                if is_wanlink_prefix(prefix):
                    handoff = True
                else:
                    handoff = False
                    cookie = prefix + await recv_exactly(loop, sock, COOKIE_SIZE - len(prefix))
        except (TimeoutError, OSError, WanlinkError):
            sock.close()
            return
        if handoff:
            await self.wanlink.accept_socket(sock, prefix)
            return
        session = self.session
        if session is not None and session.wants_stream(cookie):
            session.add_stream(seq, sock)
            return
        if session is None or (session.finishing and not self.opts.one_off):
            try:
                check_cookie(cookie)
            except ProtocolError:
                sock.close()
                return
            if session is not None:  # the previous test is only waiting for IPERF_DONE
                self.handlers.add(self.session_task)
                self.session_task.add_done_callback(self.handlers.discard)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.session = Session(sock, cookie, peer_name, opts=self.opts, out=self.out, chunk_size=self.chunk_size)
            self.session_task = loop.create_task(self.session.run())
            self._changed.set()
            return
        try:  # busy: as iperf3, answer ACCESS_DENIED without reading further
            await loop.sock_sendall(sock, struct.pack("b", State.ACCESS_DENIED))
        except OSError:
            pass
        sock.close()

    async def _on_link(self, link) -> None:
        session = self.session
        if session is not None and session.wants_link(link):
            session.add_link(link)
            return
        self.out.warn(f"closing a wanlink link from {link.peer} that belongs to no test")
        await link.close()
