"""Loopback demo of one striped transfer: prints per-stream chunk counts and throughput.

    python -m wanlink.cli.demo --transfer [--streams 4] [--size-mib 512] [--repeat 3]
"""
from __future__ import annotations

import argparse
import asyncio
import os
import time

import wanlink
from wanlink.io.runtime import new_event_loop

MiB = 1024 * 1024


async def run_transfer(streams: int, size: int, repeat: int) -> tuple[int, list[dict]]:
    """The link's chunk size and, per round, seconds, Gbit/s and chunks each stream sent."""
    secret = os.urandom(16)
    accepted: asyncio.Queue = asyncio.Queue()
    server = await wanlink.serve("127.0.0.1", 0, secret=secret, on_link=accepted.put_nowait)
    client = await wanlink.connect("127.0.0.1", server.port, streams=streams, secret=secret)
    receiver = await accepted.get()
    payload = os.urandom(MiB) * (size // MiB)
    target = bytearray(len(payload))
    rounds = []
    try:
        for round_index in range(repeat):
            before = list(client.stats()["chunks_sent_per_stream"])
            start = time.perf_counter()
            await asyncio.gather(client.send(payload, tag=round_index), receiver.recv_into(target, tag=round_index))
            elapsed = time.perf_counter() - start
            if target != payload:
                raise RuntimeError("received bytes differ from the bytes sent")
            after = client.stats()["chunks_sent_per_stream"]
            rounds.append({"seconds": elapsed, "gbit_per_s": 8 * len(payload) / elapsed / 1e9,
                           "chunks_per_stream": [a - b for a, b in zip(after, before)]})
    finally:
        await client.close()
        await receiver.close()
        server.close()
        await server.wait_closed()
    return client.chunk_size, rounds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="wanlink-demo --transfer", description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--size-mib", type=int, default=512)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args(argv)
    size = args.size_mib * MiB
    loop = new_event_loop()
    try:
        chunk_size, rounds = loop.run_until_complete(run_transfer(args.streams, size, args.repeat))
    finally:
        loop.close()
    print(f"striped transfer over loopback: {args.size_mib} MiB, {args.streams} streams, "
          f"chunk size {chunk_size // 1024} KiB")
    print(f"{'round':>5} {'seconds':>8} {'Gbit/s':>8}  chunks per stream")
    for index, row in enumerate(rounds):
        print(f"{index:>5} {row['seconds']:>8.3f} {row['gbit_per_s']:>8.2f}  {row['chunks_per_stream']}")
    best = max(row["gbit_per_s"] for row in rounds)
    print(f"best: {best:.2f} Gbit/s ({best / 8:.2f} GB/s); sender and receiver share one event loop in this demo")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
