"""One test on ``wanlink-iperf -s``: its control connection, then its plain iperf3 streams or its wanlink Link."""
from __future__ import annotations

import asyncio
import socket

from wanlink.errors import ConfigError, ProtocolError, UnsupportedError, WanlinkError
from wanlink.io.sockets import congestion_of, set_buffer_sizes, set_congestion
from wanlink.iperf.channels import Control, LinkCounters, Progress, RawChannel, iperf_ids, link_channels, link_sender
from wanlink.iperf.measure import (
    CpuClock, Meter, connected_json, connected_line, cpu_json, local_results, pair_totals,
)
from wanlink.iperf.messages import IE_PROTOCOL, IE_RECVPARAMS, IE_STREAMACCEPT, TestParameters, TestResults
from wanlink.iperf.options import Options
from wanlink.iperf.output import CliError, Output
from wanlink.iperf.protocol import (
    COOKIE_META_KEY, ConnectionClosed, Parameters, Results, Role, ServerError, State, StateChange, WanlinkAccept,
    check_cookie,
)
from wanlink.iperf.report import end_json, header, stream_line, sum_line, sum_samples
from wanlink.probe.rate import DeliveryRateEstimator

STREAM_WAIT_S = 30.0  # how long CREATE_STREAMS may take (raw streams)
LINK_WAIT_S = 180.0  # how long the client may probe before its test link arrives


class Session:
    """One test on the server: a control connection and its data streams or Link."""

    def __init__(self, ctrl_sock: socket.socket, cookie_bytes: bytes, peer: str, *, opts: Options, out: Output,
                 chunk_size: int):
        self.out, self.opts = out, opts
        self.chunk_size = chunk_size  # of the wanlink server's Links, told to wanlink clients
        self.ctrl = Control(ctrl_sock, Role.SERVER)
        self.ctrl.conn.receive_data(cookie_bytes)
        self.peer = peer
        self.cookie = check_cookie(cookie_bytes)
        self.params: TestParameters | None = None
        self.wanlink = False
        self.expected = 0
        self.raw_pending: list[tuple[int, socket.socket]] = []
        self.link = None
        self.streams_ready = asyncio.Event()
        self.accepting = False
        self.tasks: list[asyncio.Task] = []
        self.meter: Meter | None = None
        self.estimator = DeliveryRateEstimator()
        self.finishing = False  # results sent: the server may take the next client
        self.connected: list[dict] = []  # iperf3's start.connected

    def wants_stream(self, cookie: bytes) -> bool:
        return (self.accepting and not self.wanlink and cookie == self.cookie
                and len(self.raw_pending) < self.expected)

    def add_stream(self, seq: int, sock: socket.socket) -> None:
        if self.params.window:
            set_buffer_sizes(sock, self.params.window)
        if self.params.congestion:
            try:
                set_congestion(sock, self.params.congestion)
            except ConfigError as exc:
                self.out.warn(str(exc))
        self.raw_pending.append((seq, sock))
        if len(self.raw_pending) == self.expected:
            self.streams_ready.set()

    def wants_link(self, link) -> bool:
        meta = link.peer_meta or {}
        return (self.accepting and self.wanlink and self.link is None
                and meta.get(COOKIE_META_KEY) == self.cookie.rstrip(b"\0").decode())

    def add_link(self, link) -> None:
        self.link = link
        self.streams_ready.set()

    async def run(self) -> None:
        out = self.out
        host, _, port = self.peer.rpartition(":")
        out.line(f"Accepted connection from {host}, port {port}")
        try:
            await self._run()
        except CliError as exc:
            out.error(str(exc))
        except (WanlinkError, OSError) as exc:
            out.error(f"test from {self.peer} failed: {exc}")
        finally:
            await self._cleanup()

    async def _cleanup(self) -> None:
        self.accepting = False
        if self.meter is not None:
            self.meter.cancel()
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        for _seq, sock in self.raw_pending:
            sock.close()
        if self.link is not None:
            await self.link.close()
        self.ctrl.close()

    async def _next(self):
        event = await self.ctrl.next()
        if isinstance(event, ConnectionClosed):
            raise CliError("the client has unexpectedly closed the connection")
        if isinstance(event, StateChange) and event.state in (State.CLIENT_TERMINATE, State.IPERF_DONE):
            raise CliError("the client has terminated")
        return event

    async def _refuse(self, i_errno: int, message: str) -> None:
        try:
            await self.ctrl.send(ServerError(i_errno, 0))
        except OSError:
            pass
        raise CliError(message)

    async def _run(self) -> None:
        o, out, loop = self.opts, self.out, asyncio.get_running_loop()
        self.ctrl.conn.next_event()  # the cookie, already checked
        await self.ctrl.send(StateChange(State.PARAM_EXCHANGE))
        event = await self._next()
        if not isinstance(event, Parameters):
            raise CliError("the client sent no parameters")
        try:
            params = TestParameters.from_json(event.params)
        except UnsupportedError as exc:
            await self._refuse(IE_PROTOCOL, str(exc))
        except ProtocolError as exc:
            await self._refuse(IE_RECVPARAMS, f"bad parameters from {self.peer}: {exc}")
        self.params = params
        self.wanlink = params.wanlink is not None
        if self.wanlink:
            await self.ctrl.send(WanlinkAccept({"version": 1, "chunk_size": self.chunk_size}))
        directions = 2 if params.bidirectional else 1
        self.expected = params.parallel * directions
        self.accepting = True
        await self.ctrl.send(StateChange(State.CREATE_STREAMS))
        wait = asyncio.ensure_future(self.streams_ready.wait())
        control = self.ctrl.next_task()
        done, _ = await asyncio.wait({wait, control}, timeout=LINK_WAIT_S if self.wanlink else STREAM_WAIT_S,
                                     return_when=asyncio.FIRST_COMPLETED)
        wait.cancel()
        if control in done:
            await self._next()
            raise CliError("the client stopped before its streams arrived")
        if not done:
            await self._refuse(IE_STREAMACCEPT, f"the streams of {self.peer} did not arrive in time")
        self.accepting = False
        channels, refresh, cc = self._channels(params)
        await self.ctrl.send(StateChange(State.TEST_START))
        await self.ctrl.send(StateChange(State.TEST_RUNNING))
        roles = {True: "[TX-S]", False: "[RX-S]"} if params.bidirectional else None
        meter = Meter(channels, out, interval=o.interval, refresh=refresh, roles=roles, unit=o.rate_format)
        self.meter = meter
        cpu = CpuClock()
        meter.start()
        progress = Progress(0)
        if self.wanlink:
            if any(c.sender for c in channels):
                self.tasks.append(loop.create_task(link_sender(self.link, progress, self.estimator)))
        else:
            block = memoryview(bytes(params.len))
            rx = [0]
            for c in channels:
                self.tasks.append(loop.create_task(c.pump(progress, block, rx)))
        guard = (params.time + params.omit + 40) if params.time else None
        control = self.ctrl.next_task()
        done, _ = await asyncio.wait({control}, timeout=guard)
        if not done:
            raise CliError(f"the test from {self.peer} ran past its duration; giving up")
        event = await self._next()
        if not (isinstance(event, StateChange) and event.state is State.TEST_END):
            raise CliError(f"unexpected message from the client: {event!r}")
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        self.tasks.clear()
        if self.wanlink:  # freeze the counters (and stop queued chunks) before reporting
            meter.freeze_tcp_info()
            await self.link.close()
        meter.stop()
        for _seq, sock in self.raw_pending:
            sock.close()
        self.raw_pending = []
        await self.ctrl.send(StateChange(State.EXCHANGE_RESULTS))
        theirs = await self._next()
        if not isinstance(theirs, Results):
            raise CliError("the client sent no results")
        peer = TestResults.from_json(theirs.results)
        extra = {}
        if self.wanlink:
            est = self.estimator.estimate()
            extra = {"wanlink": {"mode": "wanlink", "streams": self.link.streams, "chunk_size": self.link.chunk_size,
                                 "estimate_bits_per_second": None if est is None else est * 8.0}}
        mine = local_results(channels, meter.totals(), cpu=cpu.percent(), congestion=cc, extra=extra)
        await self.ctrl.send(Results(mine.to_json()))
        await self.ctrl.send(StateChange(State.DISPLAY_RESULTS))
        self.finishing = True
        try:
            await asyncio.wait_for(self.ctrl.next(), 10.0)  # IPERF_DONE (or the client closing)
        except (asyncio.TimeoutError, ProtocolError, OSError):
            pass
        self._report(meter, channels, peer, mine, params)

    def _channels(self, params: TestParameters) -> tuple[list, object, str | None]:
        """The test's channels (iperf3's order and ids), their counters' refresh and the congestion control used."""
        out = self.out
        if self.wanlink:
            link = self.link
            meta = link.peer_meta or {}
            counters = LinkCounters(link, send_chunk=link.chunk_size,
                                    recv_chunk=int(meta.get("chunk_size") or link.chunk_size))
            # the client's sending direction first, as iperf3's server takes the client-to-server streams first
            directions = [False, True] if params.bidirectional else [params.reverse]
            channels = link_channels(counters, link.streams, directions)
            self.connected = connected_json(link.stream_sockets())
            out.line(f"wanlink: link of {link.streams} streams from {link.peer}")
            for entry in self.connected:
                out.line(connected_line(entry))
            return channels, counters.refresh, next((c for c in link.stats()["congestion"] if c), None)
        socks = [s for _seq, s in sorted(self.raw_pending, key=lambda p: p[0])]
        self.raw_pending = [(0, s) for s in socks]
        channels = []
        firsts = [True, False] if params.bidirectional else [not params.reverse]
        for client_sends in firsts:
            for sid in iperf_ids(params.parallel, first=len(channels)):
                channels.append(RawChannel(socks[len(channels)], sid, sender=not client_sends))
        self.connected = connected_json(socks)
        for entry in self.connected:
            out.line(connected_line(entry))
        return channels, None, congestion_of(channels[0].sock) if channels else None

    def _report(self, meter: Meter, channels, peer: TestResults, mine: TestResults, params) -> None:
        out = self.out
        local = meter.totals()
        forward, reverse = pair_totals(local, channels, peer, meter.sender_tcp)
        if self.opts.json:
            cpu_j = cpu_json(mine, peer)
            items = forward if params.reverse else reverse
            end = end_json(items, local_sender_reverse=(forward if params.bidirectional else None), cpu=cpu_j,
                           sender_congestion=None, receiver_congestion=mine.congestion_used)
            out.document({"start": {"connected": self.connected, "cookie": self.cookie.rstrip(b"\0").decode(),
                                    "accepted_connection": {"host": self.peer.rpartition(":")[0],
                                                            "port": int(self.peer.rpartition(":")[2] or 0)}},
                          "intervals": meter.intervals, "end": end,
                          "wanlink": mine.extra.get("wanlink", {"mode": "iperf3"})})
            return
        retr = hasattr(socket, "TCP_INFO")
        out.line(header(retr=retr and any(c.sender for c in channels), cwnd=False, bidir=params.bidirectional))
        for sender in (True, False):
            group = [s for s in local if s.sender == sender]
            if not group:
                continue
            role = ("[TX-S]" if sender else "[RX-S]") if params.bidirectional else ""
            suffix = "sender" if sender else "receiver"
            for s in group:
                out.line(stream_line(s, role=role, retr=retr, suffix=suffix, unit=self.opts.rate_format))
            if len(group) > 1 or role:
                out.line(sum_line(sum_samples(group, sender), role=role, retr=retr and sender, suffix=suffix,
                                  unit=self.opts.rate_format))
