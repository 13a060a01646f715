"""Chaos bench: wanlink under a hostile or flaky network, on loopback, one table.

Rows (each a scenario with its trial count and outcome):

* stream kills: a 4-stream link through a fault proxy; one stream is cut in the middle of a
  32 MiB transfer, per trial. Bytes identical? Back to 4 streams (re-opened) before the next trial?
* mutated input at a live port: random blobs and valid HELLOs with one byte changed, sent to a
  live server by unauthenticated connections; then the same with authenticated streams that send
  random or mutated frames. Server still serving? Peak RSS growth, and a legitimate 64 MiB
  transfer afterwards.
* replayed handshakes: a recorded client HELLO + PROOF replayed to the server: accepted?
* lock-out: N idle sockets held and reopened by an attacker task; legitimate 4-stream connects
  meanwhile: how many succeed and how long each takes.
* on-path tamper: a proxy flips one byte after a marker, secure off and on: detected?

Server, attacker and clients share this process's event loop (uvloop): an attacker here also
competes with the server for CPU, which a remote one would not.

    python3 dev.py bench bench/chaos.py [--kills 100] [--frames 20000] [--idle 1000] [--connects 20]
"""
from __future__ import annotations

import argparse
import asyncio
import os
import random
import resource
import socket
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import wanlink
from bench.reporting import Run, add_output_options, new_figure, print_table
from tests.support.faultproxy import FaultProxy
from wanlink.io.runtime import new_event_loop
from wanlink.proto.frames import HEADER_SIZE, data_header
from wanlink.proto.handshake import ClientHandshake

SECRET = b"chaos-bench-secret"
MiB = 1024 * 1024
MARKER = b"CHAOS-MARKER-0123456789abcdef"


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


async def _serve(**options):
    links: asyncio.Queue = asyncio.Queue()
    server = await wanlink.serve("127.0.0.1", 0, secret=SECRET, on_link=links.put_nowait, timeout=10, **options)
    return server, links


async def _transfer(client, accepted, size: int, seed: int, tag: int = 1) -> bool:
    data = random.Random(seed).randbytes(size)
    out = bytearray(size)
    await asyncio.wait_for(asyncio.gather(client.send(data, tag=tag), accepted.recv_into(out, tag=tag)), 120)
    return out == data


async def _until(condition, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.01)
    return True


# -- stream kills ----------------------------------------------------------------------------------
async def stream_kills(trials: int) -> dict:
    server, links = await _serve()
    proxy = await FaultProxy(server.port).start()
    client = await wanlink.connect("127.0.0.1", proxy.port, streams=4, secret=SECRET, timeout=10)
    accepted = await links.get()
    identical = back = 0
    recovery = []
    cut: set[int] = set()
    rng = random.Random(1)
    try:
        for trial in range(trials):
            transfer = asyncio.ensure_future(_transfer(client, accepted, 32 * MiB, trial))
            await asyncio.sleep(rng.uniform(0.0, 0.02))
            victim = rng.choice([i for i in range(len(proxy.pipes)) if i not in cut])
            cut.add(victim)
            proxy.cut(victim)
            start = time.monotonic()
            identical += await transfer
            if await _until(lambda: client.streams_alive == 4 == accepted.streams_alive, 30):
                back += 1
                recovery.append(time.monotonic() - start)
    finally:
        await client.close()
        await accepted.close()
        await proxy.close()
        server.close()
        await server.wait_closed()
    return {"scenario": "stream kills (4 streams, 32 MiB each)", "trials": trials,
            "outcome": f"{identical}/{trials} identical bytes; {back}/{trials} back to 4 streams; "
                       f"{client.reconnects} reconnects",
            "figure": f"median {1e3 * statistics.median(recovery):.0f} ms to 4 streams" if recovery else "",
            "ok": identical == trials == back}


# -- mutated input ---------------------------------------------------------------------------------
def _mutations(rng: random.Random, count: int):
    hello = ClientHandshake(SECRET, os.urandom(16), 0, 1, {"rank": 1}).hello()
    for i in range(count):
        if i % 2:
            yield rng.randbytes(rng.randint(1, 512))
        else:
            mutated = bytearray(hello)
            mutated[rng.randrange(len(mutated))] ^= 1 << rng.randrange(8)
            yield bytes(mutated) + rng.randbytes(rng.randint(0, 64))


async def _authenticated_socket(port: int) -> socket.socket:
    loop = asyncio.get_running_loop()
    sock = socket.socket()
    sock.setblocking(False)
    await loop.sock_connect(sock, ("127.0.0.1", port))
    handshake = ClientHandshake(SECRET, os.urandom(16), 0, 1)
    await loop.sock_sendall(sock, handshake.hello())
    while handshake.bytes_wanted():
        wanted, data = handshake.bytes_wanted(), b""
        while len(data) < wanted:
            more = await loop.sock_recv(sock, wanted - len(data))
            if not more:
                raise ConnectionError("server closed during the handshake")
            data += more
        reply = handshake.receive(data)
        if reply:
            await loop.sock_sendall(sock, reply)
    return sock


def _bad_frame(rng: random.Random) -> bytes:
    if rng.random() < 0.5:
        return rng.randbytes(rng.randint(1, 2 * HEADER_SIZE))
    frame = bytearray(data_header(rng.randrange(-3, 1 << 40), rng.randrange(1 << 32), rng.randrange(1 << 40),
                                  rng.randrange(1 << 40), 64) + rng.randbytes(64))
    frame[rng.randrange(HEADER_SIZE)] ^= 1 << rng.randrange(8)
    return bytes(frame)


async def mutated_input(count: int, authenticated: int) -> list[dict]:
    loop = asyncio.get_running_loop()
    server, links = await _serve(auth_timeout=2)
    rng = random.Random(2)
    rss_before = _rss_mib()
    sent = 0
    for blob in _mutations(rng, count):
        sock = socket.socket()
        sock.setblocking(False)
        try:
            await loop.sock_connect(sock, ("127.0.0.1", server.port))
            await loop.sock_sendall(sock, blob)
            sent += 1
        except OSError:
            pass
        finally:
            sock.close()
    frames_sent = 0
    for _ in range(authenticated):
        try:
            sock = await _authenticated_socket(server.port)
        except OSError:
            continue
        try:
            await loop.sock_sendall(sock, _bad_frame(rng))
            frames_sent += 1
        except OSError:
            pass
        finally:
            sock.close()
    await asyncio.sleep(1)
    rss_growth = _rss_mib() - rss_before
    client = await wanlink.connect("127.0.0.1", server.port, streams=4, secret=SECRET, timeout=30)
    accepted = await asyncio.wait_for(links.get(), 30)
    while accepted.streams != 4:  # the links of the authenticated bad-frame senders came first
        await accepted.close()
        accepted = await asyncio.wait_for(links.get(), 30)
    ok = await _transfer(client, accepted, 64 * MiB, 99)
    for link in (client, accepted):
        await link.close()
    while not links.empty():
        await links.get_nowait().close()
    server.close()
    await server.wait_closed()
    return [{"scenario": "mutated input at a live port (unauthenticated + authenticated)",
             "trials": sent + frames_sent,
             "outcome": f"{sent} random/mutated handshakes, {frames_sent} bad frames after authenticating; "
                        f"server serving: {'yes' if ok else 'NO'}; legit 64 MiB transfer "
                        f"{'identical' if ok else 'FAILED'}",
             "figure": f"peak RSS {rss_before:.0f} -> {rss_before + rss_growth:.0f} MiB", "ok": ok}]


# -- replayed handshakes ---------------------------------------------------------------------------
async def replayed_handshakes(trials: int) -> dict:
    loop = asyncio.get_running_loop()
    server, links = await _serve()
    proxy = await FaultProxy(server.port).start()
    recorded: list[bytes] = []
    proxy.rewrite = lambda upstream, data: (recorded.append(data) if upstream else None) or data
    client = await wanlink.connect("127.0.0.1", proxy.port, streams=1, secret=SECRET, timeout=10)
    await links.get()
    upstream = b"".join(recorded)
    accepted = 0
    for _ in range(trials):
        sock = socket.socket()
        sock.setblocking(False)
        try:
            await loop.sock_connect(sock, ("127.0.0.1", server.port))
            await loop.sock_sendall(sock, upstream)
            answer = b""
            while True:
                more = await asyncio.wait_for(loop.sock_recv(sock, 4096), 10)
                if not more:
                    break
                answer += more
        except (OSError, TimeoutError):
            pass
        finally:
            sock.close()
        accepted += not links.empty()
    await client.close()
    await proxy.close()
    server.close()
    await server.wait_closed()
    return {"scenario": "replayed handshakes (recorded HELLO + PROOF)", "trials": trials,
            "outcome": f"{accepted}/{trials} accepted", "figure": "", "ok": accepted == 0}


# -- lock-out --------------------------------------------------------------------------------------
async def lock_out(idle: int, connects: int) -> dict:
    loop = asyncio.get_running_loop()
    server, links = await _serve()
    opened = 0

    async def hold():
        nonlocal opened
        while True:
            sock = socket.socket()
            sock.setblocking(False)
            try:
                await loop.sock_connect(sock, ("127.0.0.1", server.port))
                opened += 1
                while await loop.sock_recv(sock, 4096):
                    pass
            except OSError:
                await asyncio.sleep(0.01)
            finally:
                sock.close()

    attackers = [loop.create_task(hold()) for _ in range(idle)]
    await _until(lambda: opened >= idle, 60)
    times, succeeded = [], 0
    try:
        for _ in range(connects):
            start = time.monotonic()
            try:
                link = await wanlink.connect("127.0.0.1", server.port, streams=4, secret=SECRET, timeout=30)
            except wanlink.WanlinkError:
                continue
            times.append(time.monotonic() - start)
            succeeded += 1
            await link.close()
            await (await links.get()).close()
    finally:
        for task in attackers:
            task.cancel()
        await asyncio.gather(*attackers, return_exceptions=True)
        server.close()
        await server.wait_closed()
    figure = (f"connect median {1e3 * statistics.median(times):.0f} ms, max {1e3 * max(times):.0f} ms"
              if times else "")
    return {"scenario": f"lock-out: {idle} idle sockets held and reopened", "trials": connects,
            "outcome": f"{succeeded}/{connects} legitimate connects; {opened} attacker connections, "
                       f"{server.rejected_streams} refused", "figure": figure, "times_s": times,
            "ok": succeeded == connects}


# -- on-path tamper --------------------------------------------------------------------------------
async def tamper(trials: int, secure: bool) -> dict:
    detected = silent = 0
    for trial in range(trials):
        server, links = await _serve()
        proxy = await FaultProxy(server.port).start()
        seen = []

        def flip(upstream, data, seen=seen):
            if not upstream or seen:
                return data
            i = data.find(MARKER)
            if i < 0 and secure and len(data) > 200:
                i = 150 - len(MARKER)  # sealed: no marker to find; flip a ciphertext byte instead
            if i < 0:
                return data
            seen.append(i)
            j = i + len(MARKER)
            return data[:j] + bytes([data[j] ^ 0xFF]) + data[j + 1:]

        client = await wanlink.connect("127.0.0.1", proxy.port, streams=1, secret=SECRET, timeout=10, secure=secure)
        accepted = await links.get()
        proxy.rewrite = flip
        payload = MARKER + random.Random(trial).randbytes(4096)
        out = bytearray(len(payload))
        try:
            await asyncio.wait_for(asyncio.gather(client.send(payload, tag=1), accepted.recv_into(out, tag=1)), 30)
            silent += out != payload
        except wanlink.PeerLost:
            detected += 1
        for link in (client, accepted):
            await link.close()
        await proxy.close()
        server.close()
        await server.wait_closed()
    return {"scenario": f"on-path tamper, secure={'on' if secure else 'off'}", "trials": trials,
            "outcome": f"{detected}/{trials} detected (link failed), {silent}/{trials} changed silently",
            "figure": "", "ok": detected == trials if secure else True}


async def main_async(args) -> list[dict]:
    rows = await mutated_input(args.frames, args.frames // 10)  # first: its peak RSS is not the kills' transfers
    rows.append(await stream_kills(args.kills))
    rows.append(await replayed_handshakes(args.replays))
    rows.append(await lock_out(args.idle, args.connects))
    for secure in (False, True):
        rows.append(await tamper(args.tampers, secure))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=100, help="stream-kill trials")
    parser.add_argument("--frames", type=int, default=20000, help="mutated handshakes (and a tenth as many bad frames)")
    parser.add_argument("--replays", type=int, default=50)
    parser.add_argument("--idle", type=int, default=1000, help="idle sockets the attacker holds")
    parser.add_argument("--connects", type=int, default=20, help="legitimate connects during the attack")
    parser.add_argument("--tampers", type=int, default=20, help="tamper trials, secure off and on each")
    parser.add_argument("--name", default="chaos")
    add_output_options(parser)
    args = parser.parse_args(argv)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 4 * args.idle + 1024)), hard))
    run = Run(args)
    loop = new_event_loop()
    try:
        rows = loop.run_until_complete(main_async(args))
    finally:
        loop.close()
    print(f"chaos bench on loopback; load {os.getloadavg()[0]:.2f}")
    print_table(rows, [("scenario", "scenario", ""), ("trials", "trials", "d"), ("outcome", "outcome", ""),
                       ("figure", "figure", ""), ("ok", "ok", "")])
    print("wrote", run.save_json(args.name, {"rows": rows}))
    lock = next(r for r in rows if r["scenario"].startswith("lock-out"))
    fig, ax = new_figure(figsize=(6, 3.5))
    ax.hist([1e3 * t for t in lock["times_s"]], bins=20)
    ax.set_xlabel("legitimate connect time under the lock-out attack (ms)")
    ax.set_ylabel("connects")
    ax.set_title(lock["scenario"])
    print("wrote", run.save_figure(fig, args.name))
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
