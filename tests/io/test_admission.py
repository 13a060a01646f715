"""No lock-out by idle sockets: the handshake table evicts instead of refusing, clients retry BUSY,
refusals are logged as rate-limited summaries, and on_link callbacks hold no handshake slot."""
import asyncio
import contextlib
import logging
import socket

import pytest

import wanlink
from wanlink.errors import DeadlineExceeded, ServerBusy
from wanlink.io.admission import HandshakeTable, RejectionLog
from wanlink.proto.handshake import CHALLENGE, ClientHandshake, ServerHandshake, Status
from wanlink.proto.limits import Limits
from tests.support.links import SECRET

MiB = 1024 * 1024


# -- the table, without sockets ------------------------------------------------------------------
def test_table_admits_until_full_then_evicts_the_oldest_of_the_busiest_host():
    table = HandshakeTable(max_total=3, max_per_host=3)
    assert table.add("a1", "A") == [] and table.add("b1", "B") == [] and table.add("a2", "A") == []
    assert table.add("c1", "C") == ["a1"]  # A holds most: its oldest goes, B's only one stays
    assert table.entries() == ["b1", "a2", "c1"] and len(table) == 3


def test_table_a_host_above_its_share_evicts_its_own_oldest():
    table = HandshakeTable(max_total=10, max_per_host=2)
    table.add("b1", "B")
    table.add("a1", "A")
    table.add("a2", "A")
    assert table.add("a3", "A") == ["a1"]
    assert table.count("A") == 2 and table.count("B") == 1


def test_table_evicts_silent_entries_before_those_that_sent_hello():
    table = HandshakeTable(max_total=3, max_per_host=3)
    for entry in ("legit", "idle1", "idle2"):
        table.add(entry, "A")
    table.spoke("legit")
    assert table.add("idle3", "A") == ["idle1"]
    assert table.add("idle4", "A") == ["idle2"]
    table.spoke("idle3")
    table.spoke("idle4")
    assert table.add("x", "B") == ["legit"]  # nobody idle: the oldest of the busiest host


def test_table_remove_is_idempotent_and_forgets_empty_hosts():
    table = HandshakeTable(max_total=2, max_per_host=2)
    table.add("a1", "A")
    table.remove("a1")
    table.remove("a1")
    assert len(table) == 0 and table.count("A") == 0 and table.add("b1", "B") == []


def test_handshake_busy_reply_fits_what_the_client_reads_next():
    server = ServerHandshake(SECRET)
    before = server.busy_reply()  # before the server's CHALLENGE: a CHALLENGE carrying BUSY
    client = ClientHandshake(SECRET, bytes(16), 0, 1)
    with pytest.raises(ServerBusy):
        client.receive(before)
    server = ServerHandshake(SECRET)
    client = ClientHandshake(SECRET, bytes(16), 0, 1)
    client_proof = client.receive(server.receive(client.hello()))
    assert len(client_proof) == 32
    after = server.busy_reply()  # CHALLENGE sent: the RESULT byte
    assert after == bytes([Status.BUSY])
    with pytest.raises(ServerBusy):
        client.receive(after)


# -- over loopback ---------------------------------------------------------------------------------
@contextlib.asynccontextmanager
async def serving(**options):
    links: asyncio.Queue = asyncio.Queue()
    server = await wanlink.serve("127.0.0.1", 0, secret=SECRET, on_link=options.pop("on_link", links.put_nowait),
                                 **options)
    try:
        yield server, links
    finally:
        server.close()
        await server.wait_closed()


async def _idle_connection(port: int, source: str = "127.0.0.1") -> socket.socket:
    loop = asyncio.get_running_loop()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setblocking(False)
    sock.bind((source, 0))
    await loop.sock_connect(sock, ("127.0.0.1", port))
    return sock


class Attacker:
    """Holds ``count`` idle connections to ``port`` and reopens each one the server drops."""

    def __init__(self, port: int, count: int, source: str = "127.0.0.1"):
        self.port, self.count, self.source = port, count, source
        self.opened = 0
        self._tasks: list[asyncio.Task] = []

    async def _hold(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                sock = await _idle_connection(self.port, self.source)
            except OSError:
                await asyncio.sleep(0.01)
                continue
            self.opened += 1
            try:
                while await loop.sock_recv(sock, 4096):  # never says a word; wait until dropped
                    pass
            except OSError:
                pass
            finally:
                sock.close()

    async def __aenter__(self):
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._hold()) for _ in range(self.count)]
        while self.opened < self.count:  # every slot taken before the legitimate client comes
            await asyncio.sleep(0.01)
        return self

    async def __aexit__(self, *exc_info):
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


@pytest.mark.asyncio
async def test_legitimate_connects_succeed_while_idle_sockets_are_held_and_reopened():
    # 48 idle sockets against an 8-slot table (the 1,000-socket case: bench/chaos.py)
    async with serving(limits=Limits(max_handshakes=8, max_handshakes_per_host=8)) as (server, links):
        async with Attacker(server.port, 48) as attacker:
            for round_ in range(5):
                link = await wanlink.connect("127.0.0.1", server.port, streams=4, secret=SECRET, timeout=60)
                accepted = await asyncio.wait_for(links.get(), 60)
                out = bytearray(MiB)
                await asyncio.wait_for(asyncio.gather(link.send(bytes([round_]) * MiB, tag=1),
                                                      accepted.recv_into(out, tag=1)), 60)
                assert out == bytes([round_]) * MiB
                await link.close()
                await accepted.close()
            assert attacker.opened > 48 and server.rejected_streams > 0  # it was evicted and came back
            assert len(server.handshakes) <= 8


@pytest.mark.asyncio
async def test_an_evicted_connection_is_told_busy():
    async with serving(limits=Limits(max_handshakes=1)) as (server, _links):
        loop = asyncio.get_running_loop()
        idle = await _idle_connection(server.port)
        try:
            while len(server.handshakes) < 1:
                await asyncio.sleep(0.01)
            link = await wanlink.connect("127.0.0.1", server.port, streams=1, secret=SECRET, timeout=30)
            answer = await asyncio.wait_for(loop.sock_recv(idle, 4096), 10)
            assert len(answer) == CHALLENGE.size and answer[4 + 2] == Status.BUSY
            await link.close()
        finally:
            idle.close()


@pytest.mark.asyncio
async def test_one_source_address_holds_at_most_its_share():
    async with serving(limits=Limits(max_handshakes=32, max_handshakes_per_host=4)) as (server, links):
        async with Attacker(server.port, 12, source="127.0.0.2"):
            assert server.handshakes.count("127.0.0.2") <= 4
            link = await wanlink.connect("127.0.0.1", server.port, streams=2, secret=SECRET, timeout=60)
            await link.close()
            assert server.handshakes.count("127.0.0.2") <= 4


@pytest.mark.asyncio
async def test_silent_connections_are_dropped_after_auth_timeout():
    async with serving(auth_timeout=0.3) as (server, _links):
        loop = asyncio.get_running_loop()
        idle = await _idle_connection(server.port)
        try:
            assert await asyncio.wait_for(loop.sock_recv(idle, 4096), 20) == b""  # closed, not held for 30 s
        except ConnectionResetError:
            pass
        finally:
            idle.close()
        assert server.rejected_streams == 1 and len(server.handshakes) == 0


async def _half_open_link(port: int):
    """A socket holding one authenticated stream of a 2-stream link whose sibling never comes."""
    loop = asyncio.get_running_loop()
    half = await _idle_connection(port)
    handshake = ClientHandshake(SECRET, b"h" * 16, 0, 2)
    await loop.sock_sendall(half, handshake.hello())
    while handshake.bytes_wanted():
        reply = handshake.receive(await _recv_exactly(half, handshake.bytes_wanted()))
        await loop.sock_sendall(half, reply)
    assert handshake.accepted
    return half


@pytest.mark.asyncio
async def test_connect_retries_busy_until_the_server_has_room():
    """The server's half-open link table is full (one authenticated stream of a 2-stream link
    waits for its sibling); the connect retries BUSY until that link expires."""
    async with serving(limits=Limits(max_pending_links=1), timeout=1.0) as (server, links):
        half = await _half_open_link(server.port)
        try:
            link = await wanlink.connect("127.0.0.1", server.port, streams=1, secret=SECRET, timeout=30)
            assert server.rejected_streams >= 1  # it was refused BUSY at least once, then got in
            await link.close()
        finally:
            half.close()


@pytest.mark.asyncio
async def test_connect_that_stays_busy_fails_at_its_timeout_saying_so():
    async with serving(limits=Limits(max_pending_links=1), timeout=30) as (server, _links):
        half = await _half_open_link(server.port)
        try:
            with pytest.raises(DeadlineExceeded, match="answered BUSY"):
                await wanlink.connect("127.0.0.1", server.port, streams=1, secret=SECRET, timeout=1.0)
        finally:
            half.close()


async def _recv_exactly(sock, n):
    loop = asyncio.get_running_loop()
    data = b""
    while len(data) < n:
        more = await asyncio.wait_for(loop.sock_recv(sock, n - len(data)), 10)
        assert more, "server closed"
        data += more
    return data


@pytest.mark.asyncio
async def test_an_async_on_link_callback_holds_no_handshake_slot():
    release = asyncio.Event()
    accepted = []

    async def on_link(link):
        accepted.append(link)
        await release.wait()  # runs as long as the application likes

    async with serving(on_link=on_link, limits=Limits(max_handshakes=1)) as (server, _links):
        first = await wanlink.connect("127.0.0.1", server.port, streams=1, secret=SECRET, timeout=30)
        second = await wanlink.connect("127.0.0.1", server.port, streams=1, secret=SECRET, timeout=30)
        assert len(accepted) == 2 and server.rejected_streams == 0
        release.set()
        for link in (first, second, *accepted):
            await link.close()


@pytest.mark.asyncio
async def test_refusals_are_logged_as_one_summary_per_interval(caplog):
    caplog.set_level(logging.WARNING, logger="wanlink.io")
    async with serving(limits=Limits(max_handshakes=2)) as (server, _links):
        server.rejections.interval = 3600  # the first refusal is logged; the rest wait for the interval
        async with Attacker(server.port, 20) as attacker:
            while attacker.opened < 100:
                await asyncio.sleep(0.01)
        lines = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
        assert server.rejected_streams >= 80 and len(lines) == 1
        server.rejections._flush()  # the interval's end: one line with the counts so far
        lines = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
        assert len(lines) == 2 and "evicted: handshake table full" in lines[1] and "127.0.0.1" in lines[1]


@pytest.mark.asyncio
async def test_rejection_log_counts_reasons_and_shows_the_latest_example(caplog):
    caplog.set_level(logging.WARNING, logger="wanlink.io")
    log = RejectionLog(port=1, interval=3600)
    try:
        log.record("AuthenticationError", "10.0.0.1", example="bad proof")
        log.record("AuthenticationError", "10.0.0.1", example="bad proof again")
        log.record("RemoteProtocolError", "10.0.0.2", example="magic b'GET '")
        log._flush()
    finally:
        log.close()
    first, summary = [r.getMessage() for r in caplog.records]
    assert "refused 1 connection:" in first
    assert "refused 2 connections" in summary and "10.0.0.2 (1)" in summary
    assert "1 AuthenticationError (latest: bad proof again)" in summary  # the first was logged at once
    assert log.total == 3

