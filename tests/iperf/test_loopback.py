"""wanlink-iperf client against wanlink-iperf server over loopback: JSON, modes, errors."""
import asyncio
import io
import json
import socket
import struct

import pytest

from tests.support.iperf import LIMIT, Server, client, client_json, run
from tests.support.ports import refused_port
from wanlink.iperf.protocol import State, make_cookie

SECRET = "loopback-secret"


@pytest.fixture(autouse=True)
def secret(monkeypatch):
    monkeypatch.setenv("WANLINK_SECRET", SECRET)
    monkeypatch.delenv("WANLINK_STREAMS", raising=False)


def bps(section):
    return section["bits_per_second"]


@pytest.mark.asyncio
async def test_wanlink_test_with_fixed_streams_reports_iperf3_json():
    async with Server() as srv:
        doc = await client_json("127.0.0.1", "-p", str(srv.port), "-P", "2", "-t", "0.6", "-i", "0.2")
    assert srv.rc == 0
    assert set(doc) >= {"start", "intervals", "end", "wanlink"}
    end = doc["end"]
    assert bps(end["sum_sent"]) > 0 and bps(end["sum_received"]) > 0
    assert end["sum_received"]["bytes"] <= end["sum_sent"]["bytes"]
    assert len(end["streams"]) == 2 and all(set(s) == {"sender", "receiver"} for s in end["streams"])
    assert doc["intervals"] and all(len(i["streams"]) == 2 and "sum" in i for i in doc["intervals"])
    wl = doc["wanlink"]
    assert wl["mode"] == "wanlink" and wl["streams"] == 2 and not wl["streams_auto"]
    assert wl["rtt_ms"] > 0 and wl["chunk_size"] > 0 and wl["authenticated"] is True
    assert doc["start"]["test_start"]["num_streams"] == 2 and doc["start"]["connecting_to"]["port"] == srv.port
    assert "Accepted connection from 127.0.0.1" in srv.out.getvalue()


@pytest.mark.asyncio
async def test_automatic_stream_count_is_probed():
    async with Server() as srv:
        doc = await client_json("127.0.0.1", "-p", str(srv.port), "-t", "0.4", "--max-streams", "2", "-i", "0")
    wl = doc["wanlink"]
    assert wl["streams_auto"] and wl["probe"]["streams"] == wl["streams"]
    assert [s["streams"] for s in wl["probe"]["samples"]][:1] == [1]
    assert wl["streams"] in (1, 2) and len(doc["end"]["streams"]) == wl["streams"]


@pytest.mark.asyncio
async def test_streams_from_environment_skip_probing(monkeypatch):
    monkeypatch.setenv("WANLINK_STREAMS", "3")
    async with Server() as srv:
        doc = await client_json("127.0.0.1", "-p", str(srv.port), "-t", "0.3", "-i", "0")
    assert doc["wanlink"]["streams"] == 3 and not doc["wanlink"]["streams_auto"]


@pytest.mark.asyncio
async def test_byte_count_is_exact_when_sending():
    async with Server() as srv:
        doc = await client_json("127.0.0.1", "-p", str(srv.port), "-P", "2", "-n", "8M", "-i", "0")
        raw = await client_json("127.0.0.1", "-p", str(srv.port), "-P", "2", "-n", "3M", "--no-wanlink", "-i", "0")
    assert doc["end"]["sum_sent"]["bytes"] == 8 << 20
    assert raw["end"]["sum_sent"]["bytes"] == 3 << 20 and raw["wanlink"]["mode"] == "iperf3"


@pytest.mark.asyncio
async def test_reverse_mode_server_sends():
    async with Server() as srv:
        doc = await client_json("127.0.0.1", "-p", str(srv.port), "-P", "2", "-R", "-n", "6M", "-i", "0")
    end = doc["end"]
    assert end["sum_received"]["bytes"] >= 6 << 20 and end["sum_sent"]["bytes"] >= end["sum_received"]["bytes"]
    assert end["sum_sent"]["sender"] is False  # as iperf3: the local side was not the sender
    assert doc["start"]["test_start"]["reverse"] == 1


@pytest.mark.asyncio
async def test_bidirectional_mode():
    async with Server() as srv:
        doc = await client_json("127.0.0.1", "-p", str(srv.port), "-P", "1", "--bidir", "-t", "0.5", "-i", "0")
    end = doc["end"]
    assert bps(end["sum_sent"]) > 0 and bps(end["sum_sent_bidir_reverse"]) > 0
    assert bps(end["sum_received_bidir_reverse"]) > 0


@pytest.mark.asyncio
async def test_plain_streams_with_window_and_congestion():
    async with Server() as srv:
        doc = await client_json("127.0.0.1", "-p", str(srv.port), "-P", "2", "-t", "0.4", "--no-wanlink",
                                "-w", "256K", "-C", "cubic", "-i", "0")
    assert doc["wanlink"]["mode"] == "iperf3" and doc["wanlink"]["congestion"] == "cubic"
    assert doc["start"]["sock_bufsize"] == 256 << 10 and len(doc["start"]["connected"]) == 2
    assert bps(doc["end"]["sum_received"]) > 0


@pytest.mark.asyncio
async def test_text_output_has_the_iperf3_table():
    async with Server() as srv:
        rc, out, err = await client("127.0.0.1", "-p", str(srv.port), "-P", "2", "-t", "0.5", "-i", "0.25")
    assert rc == 0, err
    assert "[ ID] Interval           Transfer     Bitrate" in out
    assert out.count("[SUM]") >= 3 and "sender" in out and "receiver" in out
    assert "wanlink: 2 streams" in out and out.rstrip().endswith("iperf Done.")


@pytest.mark.asyncio
async def test_wrong_secret_is_refused_clearly(monkeypatch):
    async with Server() as srv:
        monkeypatch.setenv("WANLINK_SECRET", "not-the-secret")
        rc, out, err = await client("127.0.0.1", "-p", str(srv.port), "-P", "2", "-t", "0.3")
        monkeypatch.setenv("WANLINK_SECRET", SECRET)
        ok, _, err2 = await client("127.0.0.1", "-p", str(srv.port), "-P", "1", "-t", "0.2", "-i", "0")
    assert rc == 1 and "authentication failed" in err and "WANLINK_SECRET" in err
    assert ok == 0, err2  # the server survived and serves the next client


@pytest.mark.asyncio
async def test_without_secret_it_runs_unauthenticated_and_says_so(monkeypatch):
    monkeypatch.delenv("WANLINK_SECRET")
    async with Server() as srv:
        rc, out, err = await client("127.0.0.1", "-p", str(srv.port), "-P", "1", "-t", "0.2", "-J")
    assert rc == 0, err
    assert "WANLINK_SECRET is not set" in err and "unauthenticated" in err
    assert "unauthenticated" in srv.err.getvalue()
    assert json.loads(out)["wanlink"]["authenticated"] is False


@pytest.mark.asyncio
async def test_unreachable_server():
    with refused_port() as port:
        rc, out, err = await client("127.0.0.1", "-p", str(port), "-t", "1")
        assert rc == 1 and "unable to connect to server 127.0.0.1" in err and "refused" in err
        rc, out, _ = await client("127.0.0.1", "-p", str(port), "-t", "1", "-J")
    assert rc == 1 and "unable to connect" in json.loads(out)["error"]


@pytest.mark.asyncio
async def test_port_in_use():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        err = io.StringIO()
        rc = await asyncio.wait_for(run(["-s", "-p", str(port), "-B", "127.0.0.1"], stdout=io.StringIO(),
                                        stderr=err, stop=asyncio.Event()), 10)
    assert rc == 1 and "unable to start listener" in err.getvalue() and "in use" in err.getvalue()


async def control_by_hand(port: int) -> socket.socket:
    """A control connection opened as an iperf3 client would, up to the server's PARAM_EXCHANGE."""
    loop = asyncio.get_running_loop()
    sock = socket.socket()
    sock.setblocking(False)
    try:
        await loop.sock_connect(sock, ("127.0.0.1", port))
        await loop.sock_sendall(sock, make_cookie())
        assert await asyncio.wait_for(loop.sock_recv(sock, 1), 10) == struct.pack("b", State.PARAM_EXCHANGE)
    except BaseException:
        sock.close()
        raise
    return sock


@pytest.mark.asyncio
async def test_busy_server_answers_access_denied():
    async with Server() as srv:
        first = await control_by_hand(srv.port)
        try:
            rc, _, err = await client("127.0.0.1", "-p", str(srv.port), "-t", "1")
        finally:
            first.close()
    assert rc == 1 and "busy" in err


@pytest.mark.asyncio
async def test_garbage_connection_does_not_disturb_the_server():
    async with Server() as srv:
        loop = asyncio.get_running_loop()
        junk = socket.socket()
        junk.setblocking(False)
        await loop.sock_connect(junk, ("127.0.0.1", srv.port))
        await loop.sock_sendall(junk, b"\x00" * 37)  # not a cookie
        assert await asyncio.wait_for(loop.sock_recv(junk, 1), 10) == b""  # closed without an answer
        junk.close()
        rc, _, err = await client("127.0.0.1", "-p", str(srv.port), "-P", "1", "-t", "0.2", "-i", "0")
    assert rc == 0, err


@pytest.mark.asyncio
async def test_one_off_server_exits_after_one_test():
    async with Server("-1") as srv:
        rc, _, err = await client("127.0.0.1", "-p", str(srv.port), "-P", "1", "-t", "0.2", "-i", "0")
        assert rc == 0, err
        await asyncio.wait_for(asyncio.shield(srv.task), 10)
    assert srv.rc == 0


@pytest.mark.asyncio
async def test_unknown_congestion_control_fails_before_connecting():
    with refused_port() as port:
        rc, out, err = await client("127.0.0.1", "-p", str(port), "-t", "1", "-C", "no-such-cc")
    assert rc == 1 and "no-such-cc" in err and "Connecting" not in out


@pytest.mark.asyncio
async def test_client_vanishing_mid_negotiation_leaves_the_server_serving():
    async with Server() as srv:
        loop = asyncio.get_running_loop()
        sock = await control_by_hand(srv.port)
        try:
            body = json.dumps({"tcp": True, "time": 1, "parallel": 1}).encode()
            await loop.sock_sendall(sock, struct.pack("!I", len(body)) + body)
            assert await asyncio.wait_for(loop.sock_recv(sock, 1), 10) == b"\x0a"  # CREATE_STREAMS
        finally:
            sock.close()  # gone before opening any stream
        rc, _, err = await client("127.0.0.1", "-p", str(srv.port), "-P", "1", "-t", "0.2", "-i", "0")
    assert rc == 0, err
    assert "unexpectedly closed" in srv.err.getvalue() or "stopped before its streams" in srv.err.getvalue()


SENDER_TCP_KEYS = ("max_snd_cwnd", "max_snd_wnd", "max_rtt", "min_rtt", "mean_rtt")


def kernel_reports_snd_wnd() -> bool:
    from wanlink.io.sockets import tcp_info

    with socket.create_server(("127.0.0.1", 0)) as listener, socket.create_connection(listener.getsockname()) as c:
        info = tcp_info(c)
    return info is not None and info.snd_wnd is not None


@pytest.mark.asyncio
async def test_json_names_the_link_sockets_and_their_tcp_info():
    async with Server() as srv:
        doc = await client_json("127.0.0.1", "-p", str(srv.port), "-P", "2", "-t", "0.5", "-i", "0.25")
        rev = await client_json("127.0.0.1", "-p", str(srv.port), "-P", "2", "-R", "-n", "4M", "-i", "0")
    connected = doc["start"]["connected"]
    assert len(connected) == 2 and all(c["remote_port"] == srv.port for c in connected)
    assert {s["socket"] for i in doc["intervals"] for s in i["streams"]} == {c["socket"] for c in connected}
    rows = [s for i in doc["intervals"] for s in i["streams"] if "retransmits" in s]
    assert rows and all(s["snd_cwnd"] > 0 and s["rtt"] >= 0 for s in rows)
    assert all(("snd_wnd" in s) == kernel_reports_snd_wnd() for s in rows)
    for stream in doc["end"]["streams"]:  # this side sent: its TCP_INFO over the test
        sender = stream["sender"]
        assert sender["max_snd_cwnd"] > 0 and sender["min_rtt"] <= sender["mean_rtt"] <= sender["max_rtt"]
        assert sender["max_snd_wnd"] >= max(s.get("snd_wnd", 0) for s in rows if s["socket"] == sender["socket"])
    assert len(rev["start"]["connected"]) == 2
    for stream in rev["end"]["streams"]:  # the server sent: zeros, as iperf3 writes them
        if "retransmits" in stream["sender"]:
            assert [stream["sender"][key] for key in SENDER_TCP_KEYS] == [0] * 5


@pytest.mark.asyncio
async def test_rate_format_sets_the_bitrate_unit_on_both_sides():
    def rows_of(text: str) -> list[str]:
        return [line for line in text.splitlines() if line.startswith("[") and " sec " in line]

    async with Server("-f", "t") as srv:
        rc, out, err = await client("127.0.0.1", "-p", str(srv.port), "-P", "2", "-t", "0.4", "-i", "0.2", "-f", "K")
        async with asyncio.timeout(LIMIT):  # the server's report may come after the client has finished
            while not rows_of(srv.out.getvalue()):
                await asyncio.sleep(0.05)
    assert rc == 0, err
    rows = rows_of(out)
    assert rows and all("KBytes/sec" in line for line in rows)
    server_rows = rows_of(srv.out.getvalue())
    assert server_rows and all("Tbits/sec" in line for line in server_rows)


@pytest.mark.asyncio
@pytest.mark.parametrize("mode", [("-P", "2"), ("-P", "1", "--no-wanlink")])
async def test_interrupted_test_leaves_no_sampling_behind(mode):
    out, err = io.StringIO(), io.StringIO()
    stop = asyncio.Event()
    async with Server() as srv:
        task = asyncio.ensure_future(run(["-c", "127.0.0.1", "-p", str(srv.port), "-t", "60", "-i", "0.1", *mode],
                                         stdout=out, stderr=err, stop=stop))
        async with asyncio.timeout(LIMIT):
            while " sec " not in out.getvalue():  # the test is running
                await asyncio.sleep(0.02)
        stop.set()
        rc = await asyncio.wait_for(task, LIMIT)
    assert rc == 1 and "interrupt" in err.getvalue()
    for _ in range(3):
        await asyncio.sleep(0)  # let cancelled tasks finish
    samplers = [t for t in asyncio.all_tasks() if t.get_coro().__qualname__.startswith("Meter.")]
    assert samplers == []


@pytest.mark.asyncio
async def test_malformed_setting_is_an_error_naming_the_variable(monkeypatch):
    monkeypatch.setenv("WANLINK_STREAMS", "lots")
    with refused_port() as port:
        rc, out, err = await client("127.0.0.1", "-p", str(port), "-t", "1", "-J")
    assert rc == 1 and "WANLINK_STREAMS" in err and "WANLINK_STREAMS" in json.loads(out)["error"]
    err = io.StringIO()
    rc = await asyncio.wait_for(run(["-s", "-p", "0", "-B", "127.0.0.1"], stdout=io.StringIO(), stderr=err,
                                    stop=asyncio.Event()), LIMIT)
    assert rc == 1 and "WANLINK_STREAMS" in err.getvalue()
