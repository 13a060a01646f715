"""``wanlink-iperf -c``: one iperf3 test, over a wanlink Link against wanlink-iperf, plain iperf3 streams otherwise."""
from __future__ import annotations

import asyncio
import os
import socket
from dataclasses import dataclass, field

from wanlink.endpoints import choose_streams, connect
from wanlink.errors import AuthenticationError, DeadlineExceeded, PeerLost, ProtocolError, WanlinkError
from wanlink.io.sockets import congestion_of, tcp_info
from wanlink.iperf.channels import (
    Control, LinkCounters, Progress, RawChannel, check_congestion, iperf_ids, link_channels, link_sender, open_tcp,
)
from wanlink.iperf.measure import (
    CpuClock, Meter, connected_json, connected_line, cpu_json, local_results, pair_totals, start_json,
)
from wanlink.iperf.messages import IPERF_ERRORS, TestParameters, TestResults
from wanlink.iperf.options import Options
from wanlink.iperf.output import VERSION, CliError, Output, secret_bytes
from wanlink.iperf.protocol import (
    COOKIE_META_KEY, ConnectionClosed, Cookie, Parameters, Results, Role, ServerError, State, StateChange,
    WanlinkAccept, make_cookie,
)
from wanlink.iperf.report import end_json, format_bits, header, summary_lines
from wanlink.probe.rate import DeliveryRateEstimator
from wanlink.sched.chunking import chunk_size_from
from wanlink.settings import Settings


@dataclass
class WanlinkInfo:
    """What the ``wanlink`` section of ``-J`` reports."""

    mode: str = "iperf3"  # "wanlink" when the data went over a wanlink Link
    streams: int = 0
    streams_auto: bool = False
    rtt_s: float | None = None
    chunk_size: int | None = None
    probe: dict | None = None
    congestion: str | None = None
    sock_buffer: int | None = None
    authenticated: bool | None = None
    estimate_bps: float | None = None
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        return {"mode": self.mode, "streams": self.streams, "streams_auto": self.streams_auto,
                "rtt_ms": None if self.rtt_s is None else self.rtt_s * 1e3, "chunk_size": self.chunk_size,
                "estimate_bits_per_second": self.estimate_bps, "congestion": self.congestion,
                "sock_buffer": self.sock_buffer, "authenticated": self.authenticated, "probe": self.probe,
                "notes": self.notes}

    def line(self) -> str:
        parts = [f"{self.streams} stream{'s' if self.streams != 1 else ''}"
                 + (" (probed)" if self.streams_auto else "")]
        if self.rtt_s is not None:
            parts.append(f"RTT {self.rtt_s * 1e3:.2f} ms")
        if self.chunk_size:
            parts.append(f"chunk {self.chunk_size // 1024} KiB")
        if self.estimate_bps:
            parts.append(f"estimate {format_bits(self.estimate_bps)}")
        return f"wanlink: {', '.join(parts)}"


class Client:
    """``-c HOST``: one test against an iperf3 or wanlink-iperf server."""

    def __init__(self, opts: Options, out: Output, stop: asyncio.Event, settings: Settings):
        self.opts, self.out, self.stop, self.settings = opts, out, stop, settings
        self.ctrl: Control | None = None
        self.link = None
        self.raw: list[RawChannel] = []
        self.tasks: list[asyncio.Task] = []
        self.meter: Meter | None = None
        self.doc: dict = {"start": {}, "intervals": [], "end": {}}
        self.wl = WanlinkInfo()
        self.estimator = DeliveryRateEstimator()

    async def run(self) -> int:
        try:
            return await self._run()
        finally:
            await self._cleanup()

    async def _cleanup(self) -> None:
        if self.meter is not None:
            self.meter.cancel()
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        for c in self.raw:
            c.sock.close()
        if self.link is not None:
            await self.link.close()
        if self.ctrl is not None:
            self.ctrl.close()

    async def _expect(self, *states: State):
        """The next control event, which must be one of ``states`` (or a Results/WanlinkAccept)."""
        stop_task = asyncio.ensure_future(self.stop.wait())
        try:
            done, _ = await asyncio.wait({self.ctrl.next_task(), stop_task}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop_task.cancel()
        if self.ctrl.next_task() not in done:
            await self._terminate()
            raise CliError("interrupt - the client has terminated")
        event = await self.ctrl.next()
        return self._check(event, states)

    def _check(self, event, states):
        if isinstance(event, ServerError):
            reason = IPERF_ERRORS.get(event.i_errno, f"iperf3 error {event.i_errno}")
            extra = f" ({os.strerror(event.errno)})" if event.errno else ""
            raise CliError(f"the server reported an error: {reason}{extra}")
        if isinstance(event, ConnectionClosed):
            raise CliError("the server has unexpectedly closed the connection")
        if isinstance(event, StateChange):
            if event.state is State.ACCESS_DENIED:
                raise CliError("the server is busy running a test. try again later")
            if event.state is State.SERVER_TERMINATE:
                raise CliError("the server has terminated")
            if event.state not in states:
                raise CliError(f"unexpected iperf3 state {event.state.name} from the server")
        return event

    async def _terminate(self) -> None:
        try:
            await self.ctrl.send(StateChange(State.CLIENT_TERMINATE))
        except (OSError, WanlinkError):
            pass

    async def _run(self) -> int:
        o, out = self.opts, self.out
        check_congestion(o.congestion)
        out.line(f"Connecting to host {o.host}, port {o.port}")
        sock = await open_tcp(o.host, o.port, timeout=o.connect_timeout, bind=o.bind)
        self.ctrl = Control(sock, Role.CLIENT)
        cookie = make_cookie()
        await self.ctrl.send(Cookie(cookie))
        await self._expect(State.PARAM_EXCHANGE)
        auto = o.parallel is None
        params = TestParameters(time=int(round(o.time)) if o.time else 0, num=o.bytes,
                                blockcount=o.blockcount, parallel=o.parallel or 1, len=o.length,
                                reverse=o.reverse, bidirectional=o.bidir, window=o.window or 0,
                                congestion=o.congestion, client_version=VERSION,
                                wanlink={"version": 1, "auto": auto} if o.wanlink else None)
        if o.time and abs(o.time - round(o.time)) > 1e-9:
            params.time = max(1, int(o.time + 0.999))  # iperf3 sends whole seconds; the client times itself
        await self.ctrl.send(Parameters(params.to_json()))
        event = await self._expect(State.CREATE_STREAMS, State.WANLINK_ACCEPT)
        wanlink_mode = isinstance(event, StateChange) and event.state is State.WANLINK_ACCEPT
        server_info: dict = {}
        if wanlink_mode:
            server_info = (await self.ctrl.next())
            if not isinstance(server_info, WanlinkAccept):
                self._check(server_info, ())
            server_info = server_info.info
            await self._expect(State.CREATE_STREAMS)
            channels, refresh = await self._open_link(cookie, auto, server_info)
        else:
            if auto:
                why = "the server is a stock iperf3" if o.wanlink else "--no-wanlink"
                self.wl.notes.append(f"{why}: no probing, 1 stream (iperf3's default)")
            channels, refresh = await self._open_raw(cookie, params.parallel)
        connected = connected_json([c.sock for c in self.raw] if self.raw else self.link.stream_sockets())
        for entry in connected:
            out.line(connected_line(entry))
        if wanlink_mode:
            out.line(self.wl.line())
        if o.reverse:
            out.line(f"Reverse mode, remote host {o.host} is sending")
        self.doc["start"] = start_json(control=sock, cookie=cookie, params=params, host=o.host, port=o.port,
                                       connected=connected, window=o.window)
        self.doc["start"]["test_start"]["num_streams"] = self.wl.streams
        await self._expect(State.TEST_START)
        await self._expect(State.TEST_RUNNING)
        return await self._test(channels, refresh, wanlink_mode, params)

    async def _open_raw(self, cookie: bytes, count: int):
        o = self.opts
        directions = [True, False] if o.bidir else [not o.reverse]
        channels = []
        for sender in directions:
            for sid in iperf_ids(count, first=len(channels)):
                sock = await open_tcp(o.host, o.port, timeout=o.connect_timeout, window=o.window,
                                      congestion=o.congestion, bind=o.bind)
                channels.append(RawChannel(sock, sid, sender))
                self.raw.append(channels[-1])
                await asyncio.get_running_loop().sock_sendall(sock, cookie)
        self.wl.streams = count
        self.wl.congestion = congestion_of(channels[0].sock)
        self.wl.sock_buffer = o.window
        return channels, None

    async def _open_link(self, cookie: bytes, auto: bool, server_info: dict):
        o = self.opts
        secret = secret_bytes(self.settings.secret, self.out)
        self.wl.mode, self.wl.authenticated, self.wl.sock_buffer = "wanlink", bool(secret), o.window
        if o.window:
            self.wl.notes.append("-w sets this side's buffers; the server's own -w sets its side of a wanlink link")
        meta = {COOKIE_META_KEY: cookie.rstrip(b"\0").decode()}
        chunk = None
        count = o.parallel
        try:
            if auto:
                if isinstance(self.settings.streams, int):
                    count = self.settings.streams
                else:
                    self.out.line(f"Probing {o.host} port {o.port}: streams 1, 2, 4, ... up to {o.max_streams}")
                    result = await choose_streams(o.host, o.port, secret=secret, meta=meta,
                                                  max_streams=o.max_streams, congestion=o.congestion,
                                                  sock_buffer=o.window, timeout=o.connect_timeout + 20,
                                                  settings=self.settings)
                    count, chunk = result.streams, result.chunk_size
                    self.wl.probe, self.wl.rtt_s, self.wl.streams_auto = result.to_json(), result.rtt_s, True
            chunk = chunk_size_from(chunk if chunk is not None else self.settings.chunk_size)
            meta["chunk_size"] = chunk
            self.link = await connect(o.host, o.port, streams=count, secret=secret, meta=meta,
                                      timeout=o.connect_timeout + 20, chunk_size=chunk, congestion=o.congestion,
                                      sock_buffer=o.window, settings=self.settings)
        except AuthenticationError as exc:
            await self._terminate()
            raise CliError(f"authentication failed - {exc}; WANLINK_SECRET must be the same on both sides") from None
        except (PeerLost, DeadlineExceeded, ProtocolError) as exc:
            await self._terminate()
            raise CliError(f"cannot open a wanlink link to {o.host} port {o.port}: {exc}") from None
        link = self.link
        if self.wl.rtt_s is None:  # not probed: the kernel's smoothed RTT of the control connection
            info = tcp_info(self.ctrl.sock)
            self.wl.rtt_s = info.rtt / 1e6 if info else None
        self.wl.streams, self.wl.chunk_size = link.streams, link.chunk_size
        self.wl.congestion = next((c for c in link.stats()["congestion"] if c), None)
        counters = LinkCounters(link, send_chunk=link.chunk_size,
                                recv_chunk=int(server_info.get("chunk_size") or link.chunk_size))
        senders = [True, False] if o.bidir else [not o.reverse]
        return link_channels(counters, link.streams, senders), counters.refresh

    async def _test(self, channels, refresh, wanlink_mode: bool, params: TestParameters) -> int:
        o, out, loop = self.opts, self.out, asyncio.get_running_loop()
        budget = o.bytes or o.blockcount * o.length
        progress = Progress(budget)
        roles = {True: "[TX-C]", False: "[RX-C]"} if o.bidir else None
        meter = Meter(channels, out, interval=o.interval, refresh=refresh, roles=roles, unit=o.rate_format)
        self.meter = meter
        cpu = CpuClock()
        meter.start()
        rx_total = [0]
        if wanlink_mode:
            if any(c.sender for c in channels):
                self.tasks.append(loop.create_task(link_sender(self.link, progress, self.estimator)))
            if any(not c.sender for c in channels):
                self.tasks.append(loop.create_task(self._watch_link_rx(channels, progress, refresh)))
        else:
            block = memoryview(bytes(o.length))
            for c in channels:
                self.tasks.append(loop.create_task(c.pump(progress, block, rx_total)))
            self.tasks.append(loop.create_task(self._watch_raw(channels)))
        waiters = {asyncio.ensure_future(progress.done.wait()), asyncio.ensure_future(self.stop.wait()),
                   self.ctrl.next_task()}
        for task in self.tasks:
            waiters.add(task)
        try:
            done, _ = await asyncio.wait(waiters, timeout=o.time if o.time else None,
                                         return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waiters:
                if w is not self.ctrl.next_task() and w not in self.tasks:
                    w.cancel()
        for task in self.tasks:
            if task in done and task.exception() is not None:
                raise CliError(f"data transfer failed: {task.exception()}")
        if self.stop.is_set():
            await self._terminate()
            raise CliError("interrupt - the client has terminated")
        if self.ctrl.next_task() in done:
            self._check(await self.ctrl.next(), ())
        # stop sending; keep receiving (draining) until the server answers
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        self.tasks.clear()
        if wanlink_mode:  # freeze the counters: queued chunks would otherwise keep flowing
            meter.freeze_tcp_info()
            await self.link.close()
        drain = [loop.create_task(c.pump(Progress(0), memoryview(b""), [0]))
                 for c in channels if isinstance(c, RawChannel) and not c.sender]
        self.tasks += drain
        meter.stop()
        await self.ctrl.send(StateChange(State.TEST_END))
        await self._expect(State.EXCHANGE_RESULTS)
        extra = {"wanlink": self._finish_wanlink()} if wanlink_mode else {}
        mine = local_results(channels, meter.totals(), cpu=cpu.percent(), congestion=self.wl.congestion,
                             extra=extra)
        await self.ctrl.send(Results(mine.to_json()))
        theirs = await self.ctrl.next()
        if not isinstance(theirs, Results):
            self._check(theirs, ())
            raise CliError("the server sent no results")
        peer = TestResults.from_json(theirs.results)
        await self._expect(State.DISPLAY_RESULTS)
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        self.tasks.clear()
        for c in self.raw:
            c.sock.close()
        self.raw = []
        if self.link is not None:
            await self.link.close()
            self.link = None
        try:
            await self.ctrl.send(StateChange(State.IPERF_DONE))
        except OSError:
            pass
        self._report(meter, channels, peer, mine, wanlink_mode)
        return 0

    def _finish_wanlink(self) -> dict:
        est = self.estimator.estimate()
        self.wl.estimate_bps = None if est is None else est * 8.0
        return self.wl.to_json()

    async def _watch_link_rx(self, channels, progress: Progress, refresh) -> None:
        """Receiver side of a wanlink test: poll the link's counters (for -n and the estimate)."""
        loop = asyncio.get_running_loop()
        receivers = [c for c in channels if not c.sender]
        last = 0
        while True:
            await asyncio.sleep(0.1)
            refresh()
            total = sum(c.bytes for c in receivers)
            self.estimator.on_delivery(total - last, loop.time())
            last = total
            progress.check_received(total)

    async def _watch_raw(self, channels) -> None:
        """Feed the estimator from plain streams (received bytes when receiving, else bytes sent)."""
        loop = asyncio.get_running_loop()
        chosen = [c for c in channels if not c.sender] or channels
        last = 0
        while True:
            await asyncio.sleep(0.1)
            total = sum(c.bytes for c in chosen)
            self.estimator.on_delivery(total - last, loop.time())
            last = total

    def _report(self, meter: Meter, channels, peer: TestResults, mine: TestResults, wanlink_mode: bool) -> None:
        o, out = self.opts, self.out
        local = meter.totals()
        forward, reverse = pair_totals(local, channels, peer, meter.sender_tcp)
        if not wanlink_mode:
            est = self.estimator.estimate()
            self.wl.estimate_bps = None if est is None else est * 8.0
        cpu_j = cpu_json(mine, peer)
        local_cc, remote_cc = self.wl.congestion, peer.congestion_used
        if o.bidir:
            end = end_json(forward, local_sender_reverse=reverse, cpu=cpu_j, sender_congestion=local_cc,
                           receiver_congestion=remote_cc)
        elif o.reverse:
            end = end_json(reverse, cpu=cpu_j, sender_congestion=remote_cc, receiver_congestion=local_cc)
        else:
            end = end_json(forward, cpu=cpu_j, sender_congestion=local_cc, receiver_congestion=remote_cc)
        self.doc["intervals"] = meter.intervals
        self.doc["end"] = end
        self.doc["wanlink"] = self.wl.to_json()
        if o.json:
            out.document(self.doc)
            return
        retr = hasattr(socket, "TCP_INFO")
        out.line(header(retr=retr, cwnd=False, bidir=o.bidir))
        if o.bidir:
            for line in summary_lines(forward, retr=retr, role="[TX-C]", unit=o.rate_format):
                out.line(line)
            for line in summary_lines(reverse, retr=retr, role="[RX-C]", unit=o.rate_format):
                out.line(line)
        else:
            for line in summary_lines(reverse if o.reverse else forward, retr=retr, unit=o.rate_format):
                out.line(line)
        out.line(self.wl.line() if wanlink_mode else
                 f"wanlink: plain iperf3 streams ({self.wl.streams}); " + "; ".join(self.wl.notes or ["no probing"]))
        out.line()
        out.line("iperf Done.")
