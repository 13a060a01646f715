"""Frame decoder micro-bench: frames/s through a stream's read path, per implementation, same run.

A Unix socket pair carries a batch of frames (written whole before the reader starts, so the
reader finds them waiting, as a busy stream does); the reader decodes it the way a stream's
readable callback does, and only the reader is timed. Implementations:

- ``compiled``: ``wanlink._wire.FrameDecoder.receive`` (reads in C, without the GIL);
- ``reference``: the pure-Python decoder through ``wanlink.io.stream.receive_into`` (``os.readv``
  of the expected bytes and the read-ahead area);
- ``before`` (with ``--before CHECKOUT``): that checkout's ``wanlink/proto/frames.py`` decoder read
  as its stream read (one ``recv_into`` of exactly the bytes expected next, until one comes back short).

Workloads: what a small collective's stream receives: header-only frames (acks, grants, credits),
64 KiB DATA frames each followed by an ack, and 1 MiB DATA frames. Columns: frames/s, us per
frame (median round, and the best), socket reads per frame (system calls: recv_into counted, readv
from /proc/self/io). Rounds alternate the implementations.

    python3 dev.py bench bench/frame_decoder.py [--before /path/to/old/checkout] [--rounds 7]
"""
from __future__ import annotations

import argparse
import functools
import importlib.util
import socket
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.reporting import Run, add_output_options, print_table
from wanlink.io.stream import READ_BUDGET_BYTES, receive_into
from wanlink.proto import decoder as decoding
from wanlink.proto.frames import ack_header, credit_frame, data_header, grant_frame

SOCKET_BUFFER = 8 << 20


def workloads() -> dict[str, tuple[bytes, int]]:
    """name -> (one batch of frames, frames in it)."""
    control = (ack_header(1, 0, 65536, 0, 65536) + grant_frame(2, 0) + credit_frame(1 << 20)) * 300
    small = (data_header(1, 0, 65536, 0, 65536) + bytes(65536) + ack_header(1, 0, 65536, 0, 65536)) * 16
    large = (data_header(1, 0, 1 << 20, 0, 1 << 20) + bytes(1 << 20)) * 3
    return {"headers only": (control, 900), "64 KiB + ack": (small, 32), "1 MiB": (large, 3)}


class Placer:
    """Returns a view of one reused buffer per size (placement itself is not what is timed)."""

    def __init__(self):
        self.buffers = {}

    def __call__(self, header):
        buffer = self.buffers.get(header.raw_len)
        if buffer is None:
            buffer = self.buffers[header.raw_len] = memoryview(bytearray(header.raw_len))
        return buffer


def load_before(checkout: Path):
    """The FrameDecoder class of another checkout's wanlink/proto/frames.py."""
    spec = importlib.util.spec_from_file_location("before_frames", checkout / "wanlink" / "proto" / "frames.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (its dataclasses look their module up)
    spec.loader.exec_module(module)
    return module.FrameDecoder


def stream_read_before(decoder, sock: socket.socket) -> tuple[int, int, int]:
    """The old stream read: recv_into exactly the bytes expected next until a read comes back short."""
    total = reads = events = 0
    while True:
        target = decoder.buffer()
        reads += 1
        try:
            n = sock.recv_into(target)
        except BlockingIOError:
            break
        total += n
        events += len(decoder.advance(n))
        if n < len(target):
            break
    return total, reads, events


def read_calls() -> int:
    """read()-type system calls of this process so far (readv included; recv_into's recvfrom is not)."""
    with open("/proc/self/io") as handle:
        return int(next(line for line in handle if line.startswith("syscr:")).split()[1])


def run_batch(name: str, decoder, sock_pair, blob: bytes) -> tuple[float, int]:
    """Decode ``blob`` once through ``name``'s read path; returns (seconds, reads)."""
    reader, writer = sock_pair
    writer.sendall(blob)
    reads = 0
    got = 0
    started = time.perf_counter()
    if name == "before":
        while got < len(blob):
            total, count, _events = stream_read_before(decoder, reader)
            got += total
            reads += count
        elapsed = time.perf_counter() - started
    else:
        receive = getattr(decoder, "receive", None) or functools.partial(receive_into, decoder)
        fd = reader.fileno()
        before = read_calls()
        while got < len(blob):
            total, _events, _ended = receive(fd, READ_BUDGET_BYTES)
            got += total
        elapsed = time.perf_counter() - started
        reads = read_calls() - before  # (reading /proc once more is outside the timed part)
    return elapsed, reads


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", type=Path, help="a checkout whose wanlink/proto/frames.py is 'before'")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--repeat", type=int, default=30, help="batches decoded per round and implementation")
    add_output_options(parser)
    args = parser.parse_args()
    run = Run(args)
    placer = Placer()
    makers = {name: functools.partial(decoding.load(name), placer) for name in decoding.available()}
    if args.before is not None:
        makers["before"] = functools.partial(load_before(args.before), placer)
    reader, writer = socket.socketpair()
    for sock in (reader, writer):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER)
    reader.setblocking(False)
    rows = []
    for workload, (blob, frames) in workloads().items():
        per_round = {name: [] for name in makers}
        reads = {name: 0 for name in makers}
        for _round in range(args.rounds):
            for name, make in makers.items():
                spent = 0.0
                count = 0
                decoder = make()  # one per round, as a stream has one for its life
                for _ in range(args.repeat):
                    seconds, made = run_batch(name, decoder, (reader, writer), blob)
                    spent += seconds
                    count += made
                per_round[name].append(spent / (args.repeat * frames))
                reads[name] = count / (args.repeat * frames)
        for name, times in per_round.items():
            per_frame = statistics.median(times)
            rows.append({"workload": workload, "implementation": name, "us_per_frame": per_frame * 1e6,
                         "frames_per_s": 1 / per_frame, "best_us_per_frame": min(times) * 1e6,
                         "calls_per_frame": reads[name]})
    reader.close()
    writer.close()
    print_table(rows, [("workload", "workload", ""), ("implementation", "implementation", ""),
                       ("frames_per_s", "frames/s", ",.0f"), ("us_per_frame", "us/frame (median)", ".2f"),
                       ("best_us_per_frame", "best", ".2f"), ("calls_per_frame", "read calls/frame", ".2f")])
    print(f"wrote {run.save_json('frame_decoder', {'rows': rows})}")


if __name__ == "__main__":
    main()
