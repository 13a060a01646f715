"""Interoperation with the real iperf3 binary, both directions (skipped without iperf3)."""
import asyncio
import json

import pytest

from tests.support.iperf import IPERF3, LIMIT, Server, client, client_json
from tests.support.ports import unused_port

pytestmark = pytest.mark.skipif(IPERF3 is None, reason="iperf3 is not on PATH (apt-get install iperf3)")


@pytest.fixture(autouse=True)
def secret(monkeypatch):
    monkeypatch.setenv("WANLINK_SECRET", "interop")
    monkeypatch.delenv("WANLINK_STREAMS", raising=False)


async def stock_server(port: int):
    proc = await asyncio.create_subprocess_exec(
        IPERF3, "-s", "-1", "-B", "127.0.0.1", "-p", str(port), "-J",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    await asyncio.sleep(0.3)  # iperf3 prints nothing before listening in -J mode; retry below covers slowness
    return proc


async def run_against_stock(*args):
    """Our client against ``iperf3 -s -1``; returns (our JSON, iperf3's JSON)."""
    port = unused_port()
    proc = await stock_server(port)
    try:
        for _attempt in range(20):
            rc, out, err = await client("127.0.0.1", "-p", str(port), "-J", *args)
            if rc == 0 or "unable to connect" not in err:
                break
            await asyncio.sleep(0.2)
        assert rc == 0, err
        server_out, _ = await asyncio.wait_for(proc.communicate(), LIMIT)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    return json.loads(out), json.loads(server_out)


@pytest.mark.asyncio
async def test_our_client_against_stock_server():
    ours, theirs = await run_against_stock("-t", "1", "-P", "2", "-i", "0")
    assert ours["wanlink"]["mode"] == "iperf3"
    assert ours["end"]["sum_sent"]["bytes"] > 0 and ours["end"]["sum_received"]["bytes"] > 0
    assert theirs["end"]["sum_received"]["bytes"] == ours["end"]["sum_received"]["bytes"]
    assert theirs["start"]["test_start"]["num_streams"] == 2


@pytest.mark.asyncio
async def test_our_client_reverse_and_bytes_against_stock_server():
    ours, theirs = await run_against_stock("-R", "-n", "4M", "-P", "1", "-i", "0")
    assert ours["end"]["sum_received"]["bytes"] >= 4 << 20
    assert theirs["start"]["test_start"]["reverse"] == 1


@pytest.mark.asyncio
async def test_our_client_bidir_against_stock_server():
    ours, _ = await run_against_stock("--bidir", "-t", "1", "-P", "1", "-i", "0")
    assert ours["end"]["sum_sent"]["bytes"] > 0 and ours["end"]["sum_sent_bidir_reverse"]["bytes"] > 0


async def stock_client(port: int, *args: str) -> dict:
    proc = await asyncio.create_subprocess_exec(
        IPERF3, "-c", "127.0.0.1", "-p", str(port), "-J", *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        out, err = await asyncio.wait_for(proc.communicate(), LIMIT)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    doc = json.loads(out)
    assert proc.returncode == 0 and "error" not in doc, (doc.get("error"), err)
    return doc


@pytest.mark.asyncio
@pytest.mark.parametrize("args", [("-t", "1", "-P", "2"), ("-t", "1", "-R"), ("-t", "1", "--bidir"),
                                  ("-n", "3M", "-P", "3")])
async def test_stock_client_against_our_server(args):
    async with Server() as srv:
        doc = await stock_client(srv.port, *args)
        # the server stays usable for the next client
        again = await stock_client(srv.port, "-t", "1")
    end = doc["end"]
    assert end["sum_sent"]["bits_per_second"] > 0 and end["sum_received"]["bits_per_second"] > 0
    assert end["sum_received"]["bytes"] <= end["sum_sent"]["bytes"]
    if "-n" in args:
        assert end["sum_sent"]["bytes"] >= 3 << 20
    assert again["end"]["sum_received"]["bytes"] > 0
    text = srv.out.getvalue()
    assert text.count("Accepted connection from 127.0.0.1") == 2 and "receiver" in text


@pytest.mark.asyncio
async def test_our_json_has_the_keys_stock_iperf3_writes():
    """Scripts that read ``iperf3 -J`` find the same keys in ours (wanlink mode, both against our server)."""
    async with Server() as srv:
        stock = await stock_client(srv.port, "-t", "1", "-i", "0.5")
        ours = await client_json("127.0.0.1", "-p", str(srv.port), "-P", "1", "-t", "1", "-i", "0.5")

    def shapes(doc):
        return {"connected": set(doc["start"]["connected"][0]), "interval": set(doc["intervals"][0]["streams"][0]),
                "sender": set(doc["end"]["streams"][0]["sender"]),
                "receiver": set(doc["end"]["streams"][0]["receiver"])}

    assert ours["wanlink"]["mode"] == "wanlink"
    assert shapes(ours) == shapes(stock)
    assert {"snd_wnd", "snd_cwnd", "rtt"} <= shapes(ours)["interval"]
    assert {"max_snd_cwnd", "max_snd_wnd", "max_rtt", "min_rtt", "mean_rtt"} <= shapes(ours)["sender"]
