"""Loopback throughput: wanlink Links with N = 1, 2, 4, 8 streams against raw asyncio sockets.

Sender (this process) and receiver (a child process) each run one event loop. The raw baseline
is the fastest plain-Python path: ``loop.sock_sendall`` of the whole buffer against
``loop.sock_recv_into`` into a preallocated buffer, then a 1-byte acknowledgement. wanlink's
``send`` returns only once the receiver acknowledged every chunk, so both times cover delivery.

    python3 dev.py bench bench/loopback_throughput.py [--size-mib 1024] [--streams 1 2 4 8] [--repeat 3]
        [--paths tcp unix] [--chunk-kib 1024 4096] [--name loopback_unix] [--out DIR | --publish] [--secure]

``--secure`` also runs every wanlink case with ``secure=True`` (AES-256-GCM over every frame) and
reports its throughput and CPU per GiB next to plaintext's, from the same run.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import socket
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import wanlink
from bench.reporting import Run, add_output_options, colours, legend_outside, new_figure, print_table
from wanlink.io.runtime import new_event_loop

MiB = 1024 * 1024
SECRET = b"bench"
CONGESTION = [None]  # --congestion for the wanlink sender; None = wanlink's default (bbr when offered)


def make_loop(kind: str):
    return asyncio.new_event_loop() if kind == "asyncio" else new_event_loop()


class _cpu_seconds:
    """CPU seconds this process spent inside the timed transfers (receiver: from first byte to last)."""

    total = 0.0


# -- receiver (child process) --------------------------------------------------------------------
def receiver(pipe, mode: str, size: int, repeat: int, loop_kind: str) -> None:
    loop = make_loop(loop_kind)
    receive = _raw_receiver if mode == "raw" else _wanlink_receiver
    loop.run_until_complete(receive(pipe, size, repeat))
    loop.close()
    pipe.send(_cpu_seconds.total)


async def _raw_receiver(pipe, size: int, repeat: int) -> None:
    loop = asyncio.get_running_loop()
    listener = socket.create_server(("127.0.0.1", 0))
    listener.setblocking(False)
    pipe.send((listener.getsockname()[1], None))
    conn, _ = await loop.sock_accept(listener)
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    view = memoryview(bytearray(size))
    for _ in range(repeat):
        filled = 0
        cpu = None
        while filled < size:
            n = await loop.sock_recv_into(conn, view[filled:])
            if n == 0:
                raise ConnectionError("sender went away")
            if cpu is None:
                cpu = time.process_time()
            filled += n
        _cpu_seconds.total += time.process_time() - cpu
        await loop.sock_sendall(conn, b"k")
    conn.close()
    listener.close()


async def _wanlink_receiver(pipe, size: int, repeat: int) -> None:
    links: asyncio.Queue = asyncio.Queue()
    server = await wanlink.serve("127.0.0.1", 0, secret=SECRET, on_link=links.put_nowait, unix=True)
    pipe.send((server.port, server.unix_name))
    link = await links.get()
    target = bytearray(size)
    for round_index in range(repeat):
        cpu = time.process_time()
        await link.recv_into(target, tag=round_index)  # includes the idle wait for the first byte
        _cpu_seconds.total += time.process_time() - cpu
    await link.recv_into(bytearray(1), tag=1 << 40)  # sender is done: close after its goodbye
    await link.close()
    server.close()
    await server.wait_closed()


# -- sender (this process) -----------------------------------------------------------------------
async def _raw_sender(port: int, payload: memoryview, repeat: int) -> list[float]:
    loop = asyncio.get_running_loop()
    sock = socket.socket()
    sock.setblocking(False)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    await loop.sock_connect(sock, ("127.0.0.1", port))
    times = []
    ack = bytearray(1)
    for _ in range(repeat):
        start, cpu = time.perf_counter(), time.process_time()
        await loop.sock_sendall(sock, payload)
        await loop.sock_recv_into(sock, ack)
        times.append(time.perf_counter() - start)
        _cpu_seconds.total += time.process_time() - cpu
    sock.close()
    return times


async def _wanlink_sender(port: int, payload: memoryview, repeat: int, streams: int,
                          chunk_size: int, unix_name: str | None, secure: bool) -> tuple[list[float], list]:
    link = await wanlink.connect("127.0.0.1", port, streams=streams, secret=SECRET, chunk_size=chunk_size,
                                 congestion=CONGESTION[0], unix_name=unix_name, secure=secure)
    times = []
    for round_index in range(repeat):
        start, cpu = time.perf_counter(), time.process_time()
        await link.send(payload, tag=round_index)
        times.append(time.perf_counter() - start)
        _cpu_seconds.total += time.process_time() - cpu
    per_stream = link.stats()["chunks_sent_per_stream"]
    await link.send(b"x", tag=1 << 40)
    await link.close()
    return times, per_stream


def run_case(mode: str, streams: int, payload: memoryview, repeat: int, loop_kind: str,
             chunk_size: int = 1024 * 1024, path: str = "tcp", secure: bool = False) -> dict:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=receiver, args=(child, mode, len(payload), repeat, loop_kind))
    proc.start()
    try:
        port, unix_name = parent.recv()
        _cpu_seconds.total = 0.0
        loop = make_loop(loop_kind)
        try:
            if mode == "raw":
                times, per_stream = loop.run_until_complete(_raw_sender(port, payload, repeat)), [repeat]
            else:
                times, per_stream = loop.run_until_complete(
                    _wanlink_sender(port, payload, repeat, streams, chunk_size, unix_name if path == "unix" else None,
                                    secure))
        finally:
            loop.close()
        receiver_cpu = parent.recv() if parent.poll(60) else float("nan")
        proc.join(60)
    finally:
        if proc.is_alive():
            proc.kill()
    rates = [8 * len(payload) / t / 1e9 for t in times]
    gib = len(payload) * repeat / 2**30
    return {"mode": mode, "secure": secure, "path": path, "streams": streams, "loop": loop_kind,
            "chunk_kib": chunk_size // 1024 if mode != "raw" else "", "best_gbps": max(rates),
            "median_gbps": statistics.median(rates), "seconds": times, "chunks_per_stream": per_stream,
            "sender_cpu_s_per_gib": _cpu_seconds.total / gib, "receiver_cpu_s_per_gib": receiver_cpu / gib}


def plot(run: Run, rows: list[dict], name: str, size_mib: int):
    """Throughput against streams: one colour per wanlink variant, the event loop as the line style."""
    fig, ax = new_figure(figsize=(7, 4))
    variants = list(dict.fromkeys((r.get("path", "tcp"), r["chunk_kib"], r.get("secure", False))
                                  for r in rows if r["mode"] == "wanlink"))
    palette = colours(variants)  # one colour per wanlink variant; the event loop is the line style
    for loop_kind, style in zip(dict.fromkeys(r["loop"] for r in rows), ("-", ":")):
        for variant in variants:
            path, chunk_kib, secure = variant
            mine = [r for r in rows if r["loop"] == loop_kind and r["mode"] == "wanlink" and r["chunk_kib"] == chunk_kib
                    and r.get("path", "tcp") == path and r.get("secure", False) == secure]
            kind = "wanlink secure" if secure else "wanlink"
            ax.plot([r["streams"] for r in mine], [r["median_gbps"] for r in mine], style, marker="o",
                    color=palette[variant], label=f"{kind} over {path}, {chunk_kib} KiB chunks ({loop_kind})")
        raw = next(r for r in rows if r["loop"] == loop_kind and r["mode"] == "raw")
        ax.axhline(raw["median_gbps"], linestyle="--" if style == "-" else "-.", color="black",
                   label=f"raw sock_sendall ({loop_kind})")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("streams per link")
    ax.set_ylabel("Gbit/s (median)")
    ax.set_title(f"loopback, {size_mib} MiB transfers")
    legend_outside(ax, fontsize=8)
    return run.save_figure(fig, name)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--loops", nargs="+", default=["uvloop", "asyncio"], choices=["uvloop", "asyncio"])
    parser.add_argument("--chunk-kib", type=int, nargs="+", default=[1024],
                        help="chunk sizes to compare (the default chunk size was chosen with 256 1024 4096)")
    parser.add_argument("--paths", nargs="+", default=["tcp"], choices=["tcp", "unix"],
                        help="wanlink over TCP loopback and/or an abstract Unix socket (the raw baseline is TCP)")
    parser.add_argument("--congestion", default=None, help="TCP congestion control of wanlink's streams")
    parser.add_argument("--secure", action="store_true",
                        help="also run every wanlink case with secure=True (its cost: same-run ratios)")
    parser.add_argument("--name", default="loopback_throughput")
    parser.add_argument("--replot", type=Path, metavar="JSON", help="only redraw the PNG from a result JSON")
    add_output_options(parser)
    args = parser.parse_args(argv)
    run = Run(args)
    if args.replot:
        saved = json.loads(args.replot.read_text())
        print("wrote", plot(run, saved["rows"], args.name, saved["size_mib"]))
        return 0
    CONGESTION[0] = args.congestion
    payload = memoryview(os.urandom(MiB) * args.size_mib)
    rows = []
    for loop_kind in args.loops:
        baseline = run_case("raw", 1, payload, args.repeat, loop_kind)
        baseline["vs_raw"] = 1.0
        rows.append(baseline)
        for path in args.paths:
            for chunk_kib in args.chunk_kib:
                for streams in args.streams:
                    plain = None
                    for secure in (False, True) if args.secure else (False,):
                        row = run_case("wanlink", streams, payload, args.repeat, loop_kind, chunk_kib * 1024, path,
                                       secure)
                        row["vs_raw"] = row["median_gbps"] / baseline["median_gbps"]
                        plain = plain or row
                        row["vs_plain"] = row["median_gbps"] / plain["median_gbps"]
                        rows.append(row)
    print(f"loopback, {args.size_mib} MiB per transfer, {args.repeat} repetitions; load {os.getloadavg()[0]:.2f}")
    print_table(rows, [("loop", "loop", ""), ("mode", "transport", ""), ("secure", "secure", ""), ("path", "path", ""),
                       ("streams", "streams", "d"), ("chunk_kib", "chunk KiB", ""),
                       ("median_gbps", "median Gb/s", ".2f"), ("best_gbps", "best Gb/s", ".2f"),
                       ("vs_raw", "x raw", ".2f"), ("vs_plain", "x plain", ".2f"),
                       ("sender_cpu_s_per_gib", "send CPU s/GiB", ".3f"),
                       ("receiver_cpu_s_per_gib", "recv CPU s/GiB", ".3f")])
    print("wrote", run.save_json(args.name, {"size_mib": args.size_mib, "repeat": args.repeat, "rows": rows}))
    print("wrote", plot(run, rows, args.name, args.size_mib))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
