"""Server memory after abuse: RSS of a wanlink server (zero links open) after a barrage of bad peers.

The barrage: 20,000 connections that send garbage and hang up, 3,000 handshakes with one HELLO byte
mutated, 30 links that each send one malformed frame after authenticating, then one legitimate
64 MiB message. The server runs in its own process on the asyncio or the uvloop event loop; it
reports its RSS before, after the barrage, and after ``gc.collect()`` (what a cycle-collector pass
would still have freed).

    python3 dev.py bench bench/barrage_rss.py [--loops asyncio uvloop] [--garbage 20000] [--handshakes 3000]
        [--name barrage_rss] [--out DIR | --publish]

Writes barrage_rss.{json,png} (bench/results/ with --publish).
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import multiprocessing as mp
import os
import random
import struct
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.reporting import Run, add_output_options, new_figure, print_table

SECRET = b"barrage"
MiB = 1 << 20
LEGIT_BYTES = 64 * MiB
HEADER = struct.Struct("<BBHqIQQIII")  # the 44-byte frame header (wanlink/proto/frames.py)


def _rss_mib() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _server(loop_kind: str, ready, commands) -> None:
    """Child: serve until told to stop; answer "rss" with (RSS now, RSS after gc.collect())."""
    if loop_kind == "uvloop":
        import uvloop

        loop = uvloop.new_event_loop()
    else:
        loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    import wanlink

    async def on_link(link) -> None:
        if link.peer_meta.get("legit"):
            buffer = bytearray(LEGIT_BYTES)
            await link.recv_into(buffer, tag=1)
            await link.send(b"ok", tag=2)
        # malformed links fail by themselves; nothing here keeps a reference

    async def main() -> None:
        server = await wanlink.serve("127.0.0.1", 0, secret=SECRET, on_link=on_link)
        ready.send((server.port, _rss_mib()))
        while True:
            command = await loop.run_in_executor(None, commands.recv)
            if command == "stop":
                break
            await asyncio.sleep(1.0)  # let failed links finish saying goodbye
            before_gc = _rss_mib()
            gc.collect()
            commands.send((before_gc, _rss_mib(), len(wanlink.stats())))
        server.close()

    loop.run_until_complete(main())
    os._exit(0)


async def _garbage(port: int, count: int, rng: random.Random) -> None:
    limit = asyncio.Semaphore(64)

    async def one() -> None:
        async with limit:
            try:
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.write(rng.randbytes(rng.randrange(1, 200)))
                await writer.drain()
                writer.close()
                await writer.wait_closed()
            except OSError:
                pass

    await asyncio.gather(*(one() for _ in range(count)))


async def _mutated_handshakes(port: int, count: int, rng: random.Random) -> None:
    from wanlink.proto.handshake import ClientHandshake

    limit = asyncio.Semaphore(64)

    async def one() -> None:
        hello = bytearray(ClientHandshake(SECRET, os.urandom(16), 0, 1, {"x": 1}).hello())
        hello[rng.randrange(len(hello))] ^= 1 << rng.randrange(8)
        async with limit:
            try:
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.write(bytes(hello))
                await writer.drain()
                await asyncio.wait_for(reader.read(4096), 5)
                writer.close()
                await writer.wait_closed()
            except (OSError, asyncio.TimeoutError):
                pass

    await asyncio.gather(*(one() for _ in range(count)))


def _malformed_frames(rng: random.Random) -> list[bytes]:
    """30 frames a server must refuse: unknown types, bad flags, oversize lengths, chunks outside their message."""
    frames = []
    for case in range(30):
        kind = case % 5
        if kind == 0:
            frames.append(HEADER.pack(200 + case, 0, 0, 1, 0, 10, 0, 10, 10, 0))  # unknown type
        elif kind == 1:
            frames.append(HEADER.pack(1, 0x80, 0, 1, 0, 10, 0, 10, 10, 0))  # unknown flag
        elif kind == 2:
            frames.append(HEADER.pack(1, 0, 0, 1, 0, 1 << 40, 0, 1 << 31, 1 << 31, 0))  # oversize chunk
        elif kind == 3:
            frames.append(HEADER.pack(1, 0, 0, 1, 0, 10, 8, 4, 4, 0) + bytes(4))  # chunk outside its message
        else:
            frames.append(HEADER.pack(3, 0, 0, 0, 0, 0, 0, 1 << 20, 1 << 20, 0))  # oversize control message
    rng.shuffle(frames)
    return frames


async def _malformed_links(port: int, rng: random.Random) -> None:
    import wanlink

    for frame in _malformed_frames(rng):
        link = await wanlink.connect("127.0.0.1", port, streams=2, secret=SECRET)
        sock = link.stream_sockets()[0]
        await asyncio.get_running_loop().sock_sendall(sock, frame)
        try:
            await asyncio.wait_for(link.recv_into(bytearray(1), tag=9), 10)
        except Exception:  # noqa: BLE001 - the server drops the link: expected
            pass
        await link.close()


async def _legit(port: int) -> None:
    import wanlink

    link = await wanlink.connect("127.0.0.1", port, streams=4, secret=SECRET, meta={"legit": True})
    await link.send(bytes(LEGIT_BYTES), tag=1)
    reply = bytearray(2)
    await link.recv_into(reply, tag=2)
    await link.close()


def run(loop_kind: str, garbage: int, handshakes: int) -> dict:
    context = mp.get_context("spawn")
    ready_parent, ready_child = context.Pipe()
    commands_parent, commands_child = context.Pipe()
    server = context.Process(target=_server, args=(loop_kind, ready_child, commands_child))
    server.start()
    port, start_rss = ready_parent.recv()
    rng = random.Random(14)

    async def barrage() -> None:
        await _garbage(port, garbage, rng)
        await _mutated_handshakes(port, handshakes, rng)
        await _malformed_links(port, rng)
        await _legit(port)

    asyncio.run(barrage())
    commands_parent.send("rss")
    after, after_gc, links_open = commands_parent.recv()
    commands_parent.send("stop")
    server.join(30)
    return {"loop": loop_kind, "start_rss_mib": start_rss, "after_rss_mib": after, "after_gc_rss_mib": after_gc,
            "links_open": links_open}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--loops", nargs="+", default=["asyncio", "uvloop"], choices=["asyncio", "uvloop"])
    parser.add_argument("--garbage", type=int, default=20_000)
    parser.add_argument("--handshakes", type=int, default=3_000)
    parser.add_argument("--name", default="barrage_rss")
    add_output_options(parser)
    args = parser.parse_args(argv)
    bench_run = Run(args)
    rows = [run(loop, args.garbage, args.handshakes) for loop in args.loops]
    header = bench_run.header()
    print(f"load average before {header['load_before'][0]:.2f}, after {header['load_after'][0]:.2f}")
    print_table(rows, [("loop", "loop", ""), ("start_rss_mib", "RSS at start (MiB)", ".0f"),
                       ("after_rss_mib", "after barrage (MiB)", ".0f"),
                       ("after_gc_rss_mib", "after gc.collect() (MiB)", ".0f"), ("links_open", "links open", "d")])
    print("wrote", bench_run.save_json(args.name, {"garbage": args.garbage, "handshakes": args.handshakes,
                                                   "malformed": 30, "legit_bytes": LEGIT_BYTES, "rows": rows}))
    figure, axis = new_figure(figsize=(6, 3.5))
    for offset, (key, label) in enumerate((("start_rss_mib", "start"), ("after_rss_mib", "after barrage"),
                                           ("after_gc_rss_mib", "after gc.collect()"))):
        axis.bar([i + (offset - 1) * 0.27 for i in range(len(rows))], [row[key] for row in rows], 0.27, label=label)
    axis.set_xticks(range(len(rows)), [row["loop"] for row in rows])
    axis.set_ylabel("server RSS (MiB)")
    axis.legend()
    print("wrote", bench_run.save_figure(figure, args.name))
    return 0


if __name__ == "__main__":
    sys.exit(main())
