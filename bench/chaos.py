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
* peers killed / frozen: a 4-rank torch world (wanlink backend, one process per rank) runs an
  all_reduce loop; at a random point one random rank gets SIGKILL or SIGSTOP. Time from the
  signal to the error on every survivor, and whether the message names the victim rank.
  Survivors stay up after their error (as until a launcher tears them down), so no survivor's exit
  tells the others what the victim's death should have.
* 1 % loss: on an emulated 40 ms, 2 Gbit/s path with 1 % loss (bench/wanem, needs root and
  iperf3), wanlink-iperf with its probed stream count (plain and secure) vs iperf3 -P N with the
  same N, and iperf3 -P 8.
* soak: a 4-rank world runs 2,000 random collectives (op, size, dtype, root, reduce op), each
  once on the wanlink default group and once on a gloo group of the same processes: results
  compared exactly (inputs are small integers, so every sum is exact in every dtype).

Server, attacker and clients of the first five rows share this process's event loop (uvloop): an
attacker here also competes with the server for CPU, which a remote one would not.

    python3 dev.py bench bench/chaos.py [--kills 100] [--frames 20000] [--idle 1000] [--connects 20]
        [--peer-trials 8] [--soak 2000] [--only peers soak ...]

``--only`` runs some row groups (mutated, kills, replays, lockout, tamper, peers, loss, soak) and
keeps the other groups' rows from the JSON already in the output directory (each row carries the
date and load it was measured at), so the table can be filled by several calls.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import resource
import select
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import wanlink
from bench.reporting import Run, add_output_options, child_env, new_figure, print_table
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


# -- peers killed or frozen, and the soak: torch worlds of one process per rank --------------------
WORLD = 4
SOAK_OPS = ("all_reduce", "broadcast", "all_gather", "reduce", "gather", "scatter", "reduce_scatter",
            "all_to_all_single")


def _rank_process(kind: str, rank: int, store: str, extra: list[str]) -> subprocess.Popen:
    argv = [sys.executable, str(Path(__file__).resolve()), "--rank-worker", kind, "--rank", str(rank),
            "--store", store, *extra]
    env = child_env()
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def _next_line(proc: subprocess.Popen, timeout: float) -> str:
    """The rank process's next line on stdout; RuntimeError if it exits or stays silent first."""
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    got = proc.stdout.readline() if ready else ""
    if not got:
        raise RuntimeError(f"rank process exited (rc={proc.poll()}): {proc.stderr.read()[-500:]}"
                           if proc.poll() is not None else f"rank process silent for {timeout:g} s")
    return got.strip()


def _end(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        for pipe in (proc.stdout, proc.stderr):
            pipe.close()


def _peer_trial(how: str, rng: random.Random, timeout_s: float) -> dict:
    """One world of WORLD ranks in an all_reduce loop; one random rank gets SIGKILL or SIGSTOP."""
    victim = rng.randrange(WORLD)
    with tempfile.TemporaryDirectory(prefix="wanlink-chaos-") as work:
        store = os.path.join(work, "store")
        options = ["--timeout", str(timeout_s), "--seed", str(rng.randrange(1 << 30))]  # one seed: the same sizes
        procs = [_rank_process("peer", rank, store, options) for rank in range(WORLD)]
        try:
            for proc in procs:
                if _next_line(proc, 120) != "looping":
                    raise RuntimeError("a rank process did not start its loop")
            time.sleep(rng.uniform(0.2, 1.5))  # a random point of the loop
            os.kill(procs[victim].pid, signal.SIGKILL if how == "kill" else signal.SIGSTOP)
            signalled = time.time()
            survivors = []
            for rank, proc in enumerate(procs):
                if rank == victim:
                    continue
                try:  # survivors stay up after their error, so none of them disturbs the others
                    report = json.loads(_next_line(proc, max(1.0, signalled + timeout_s + 60 - time.time())))
                except (RuntimeError, ValueError):
                    report = {"rank": rank, "error": "no error reported (hung or crashed)", "t": None}
                report["after_s"] = None if report.get("t") is None else report["t"] - signalled
                survivors.append(report)
        finally:
            _end(procs)
    singled_out = re.compile(rf"rank {victim}\b(?! of )|rank\(s\) \[{victim}\]")  # not "rank 2 of 4" (itself)
    for report in survivors:
        report["names_victim"] = bool(singled_out.search(report.get("message", "")))
    return {"victim": victim, "survivors": survivors}


def peers(how: str, trials: int, timeout_s: float) -> dict:
    rng = random.Random(3 if how == "kill" else 4)
    results = [_peer_trial(how, rng, timeout_s) for _ in range(trials)]
    reports = [r for trial in results for r in trial["survivors"]]
    raised = [r for r in reports if r.get("type")]
    named = sum(r["names_victim"] for r in reports)
    kinds = sorted({r["type"] for r in raised})
    times = [r["after_s"] for r in raised if r["after_s"] is not None]
    example = next((r["message"] for r in raised if r["names_victim"]), raised[0]["message"] if raised else "")
    signal_name = "SIGKILL" if how == "kill" else "SIGSTOP"
    return {"scenario": f"peer {'killed' if how == 'kill' else 'frozen'} ({signal_name}) in an all_reduce loop, "
                        f"{WORLD} ranks, timeout {timeout_s:g} s",
            "trials": trials,
            "outcome": f"{len(raised)}/{len(reports)} survivors raised ({', '.join(kinds)}); "
                       f"{named}/{len(reports)} messages name the victim rank",
            "figure": (f"time to error median {statistics.median(times):.2f} s, max {max(times):.2f} s"
                       if times else ""),
            "example": example[:400], "times_s": times, "trials_detail": results,
            "ok": len(raised) == len(reports) and all(t <= timeout_s + 10 for t in times)}


def peer_worker(rank: int, store: str, timeout_s: float, seed: int) -> None:
    """A rank of the kill/freeze trial: all_reduce until an error; print when and what it said."""
    import datetime

    import torch
    import torch.distributed as dist

    import wanlink  # noqa: F401 - registers the backend

    dist.init_process_group("wanlink", store=dist.FileStore(store, WORLD), rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=timeout_s))
    rng = random.Random(seed)  # the same sizes on every rank
    print("looping", flush=True)
    done = 0
    report = {"rank": rank, "type": None, "message": "loop ended without an error", "t": None}
    try:
        while done < 1_000_000:
            dist.all_reduce(torch.ones(rng.choice((16, 4096, 1 << 16, 1 << 20))))
            done += 1
    except Exception as exc:  # noqa: BLE001 - what the survivor sees is the measurement
        report = {"rank": rank, "type": type(exc).__name__, "message": str(exc), "t": time.time()}
    report["ops"] = done
    print(json.dumps(report), flush=True)
    time.sleep(3600)  # keep the links up until the parent ends every rank: an exit would look like a death


# -- 1 % loss on the emulated WAN ------------------------------------------------------------------
def loss(seconds: float, rate_mbit: float, loss_rate: float) -> list[dict]:
    from bench.wan_throughput import run_iperf3, run_wanlink
    from bench.wanem.netns import WanPath, check_environment

    check_environment(programs=("iperf3",))
    label = f"40 ms, {rate_mbit / 1000:g} Gbit/s, {100 * loss_rate:g} % loss"
    with WanPath(rtt_ms=40.0, rate_mbit=rate_mbit, loss=loss_rate) as path:
        plain = run_wanlink(path, None, seconds, None)
        n = plain["streams"]
        same_n = run_iperf3(path, n, seconds, None)
        p8 = run_iperf3(path, 8, seconds, None) if n != 8 else same_n
        secure = run_wanlink(path, None, seconds, None, secure=True)
    figures = {"wanlink": plain, f"iperf3 -P {n}": same_n, "iperf3 -P 8": p8, "wanlink secure": secure}
    return [{"scenario": f"{label}: wanlink (probed N={n}) vs iperf3 -P {n}", "trials": 1,
             "outcome": f"wanlink {plain['gbps']:.2f}, secure {secure['gbps']:.2f} (N={secure['streams']}), "
                        f"iperf3 -P {n} {same_n['gbps']:.2f}, iperf3 -P 8 {p8['gbps']:.2f} Gbit/s",
             "figure": f"wanlink / iperf3 -P {n} = {plain['gbps'] / same_n['gbps']:.2f}, "
                       f"secure / plain = {secure['gbps'] / plain['gbps']:.2f}",
             "gbps": {name: row["gbps"] for name, row in figures.items()},
             "ok": plain["gbps"] >= 0.9 * same_n["gbps"]}]


# -- soak: random collectives, wanlink vs gloo -------------------------------------------------------
def soak(count: int, timeout_s: float) -> dict:
    with tempfile.TemporaryDirectory(prefix="wanlink-chaos-") as work:
        store = os.path.join(work, "store")
        procs = [_rank_process("soak", rank, store, ["--count", str(count), "--timeout", str(timeout_s)])
                 for rank in range(WORLD)]
        reports = []
        try:
            for rank, proc in enumerate(procs):
                out, err = proc.communicate(timeout=600)
                try:
                    reports.append(json.loads(out.strip().splitlines()[-1]))
                except (ValueError, IndexError):
                    reports.append({"rank": rank, "error": f"rc={proc.returncode}: {err[-500:]}"})
        finally:
            _end(procs)
    errors = [r for r in reports if "error" in r]
    mismatches = sum(r.get("mismatches", 0) for r in reports)
    done = min((r.get("done", 0) for r in reports), default=0)
    by_op: dict[str, int] = {}
    for op in reports[0].get("ops", []) if reports else []:
        by_op[op] = by_op.get(op, 0) + 1
    wanlink_s = max((r.get("wanlink_s", 0.0) for r in reports), default=0.0)
    gloo_s = max((r.get("gloo_s", 0.0) for r in reports), default=0.0)
    return {"scenario": f"soak: {count} random collectives, {WORLD} ranks, wanlink vs gloo", "trials": count,
            "outcome": f"{done}/{count} ran on every rank; {mismatches} mismatches; {len(errors)} ranks failed"
                       + (f" ({errors[0]['error'][:200]})" if errors else ""),
            "figure": f"wanlink {wanlink_s:.1f} s, gloo {gloo_s:.1f} s in all; "
                      + ", ".join(f"{op} {n}" for op, n in sorted(by_op.items())),
            "first_mismatches": [m for r in reports for m in r.get("first_mismatches", [])][:10],
            "ok": not errors and mismatches == 0 and done == count}


def _soak_case(rng: random.Random) -> dict:
    import torch

    op = rng.choice(SOAK_OPS)
    numel = rng.choice((1, 3, 17, 1000, 4099, 65536, 262147, 1 << 20)) if rng.random() < 0.97 else 4 << 20
    dtype = rng.choice((torch.float32, torch.float64, torch.int32, torch.int64, torch.float16, torch.bfloat16))
    reduce_op = rng.choice(("SUM", "MAX", "MIN", "PRODUCT"))
    if reduce_op == "PRODUCT" or dtype in (torch.float16, torch.bfloat16):
        low, high = -2, 3  # products and half-precision sums of WORLD values stay exact
    else:
        low, high = -100, 101
    return {"op": op, "numel": numel, "dtype": dtype, "reduce_op": reduce_op, "root": rng.randrange(WORLD),
            "range": (low, high), "seed": rng.randrange(1 << 30)}


def _soak_run(case: dict, rank: int, group) -> list:
    """Run one case on ``group``; the tensors it produced."""
    import torch
    import torch.distributed as dist

    op, numel, dtype, root = case["op"], case["numel"], case["dtype"], case["root"]
    generator = torch.Generator().manual_seed(case["seed"] * WORLD + rank)
    low, high = case["range"]

    def fresh(n: int) -> torch.Tensor:
        return torch.randint(low, high, (n,), generator=generator).to(dtype)

    reduce_op = getattr(dist.ReduceOp, case["reduce_op"])
    if op == "all_reduce":
        tensor = fresh(numel)
        dist.all_reduce(tensor, reduce_op, group=group)
        return [tensor]
    if op == "broadcast":
        tensor = fresh(numel)
        dist.broadcast(tensor, dist.get_global_rank(group, root), group=group)
        return [tensor]
    if op == "reduce":
        tensor = fresh(numel)
        dist.reduce(tensor, dist.get_global_rank(group, root), reduce_op, group=group)
        return [tensor] if rank == root else []
    if op == "all_gather":
        outputs = [torch.empty(numel, dtype=dtype) for _ in range(WORLD)]
        dist.all_gather(outputs, fresh(numel), group=group)
        return outputs
    if op == "gather":
        outputs = [torch.empty(numel, dtype=dtype) for _ in range(WORLD)] if rank == root else None
        dist.gather(fresh(numel), outputs, dist.get_global_rank(group, root), group=group)
        return outputs or []
    if op == "scatter":
        inputs = [fresh(numel) for _ in range(WORLD)] if rank == root else None
        output = torch.empty(numel, dtype=dtype)
        dist.scatter(output, inputs, dist.get_global_rank(group, root), group=group)
        return [output]
    if op == "reduce_scatter":
        output = torch.empty(numel, dtype=dtype)
        dist.reduce_scatter(output, [fresh(numel) for _ in range(WORLD)], reduce_op, group=group)
        return [output]
    base = numel // (2 * WORLD)
    splits = [base + k for k in range(WORLD)]  # uneven (rank 0 may get none): what this rank sends each rank
    source = fresh(sum(splits))
    incoming = [base + rank] * WORLD  # what every rank sends this one
    output = torch.empty(sum(incoming), dtype=dtype)
    dist.all_to_all_single(output, source, incoming, splits, group=group)
    return [output]


def soak_worker(rank: int, store: str, count: int, timeout_s: float) -> None:
    """A rank of the soak: every case on the wanlink default group, then on a gloo group; compare."""
    import datetime

    import torch
    import torch.distributed as dist

    import wanlink  # noqa: F401 - registers the backend

    dist.init_process_group("wanlink", store=dist.FileStore(store, WORLD), rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=timeout_s))
    gloo = dist.new_group(backend="gloo")
    rng = random.Random(5)  # the same cases on every rank
    report = {"rank": rank, "mismatches": 0, "done": 0, "first_mismatches": [], "ops": [],
              "wanlink_s": 0.0, "gloo_s": 0.0}
    try:
        for i in range(count):
            case = _soak_case(rng)
            report["ops"].append(case["op"])
            started = time.perf_counter()
            ours = _soak_run(case, rank, dist.group.WORLD)
            middle = time.perf_counter()
            theirs = _soak_run(case, rank, gloo)
            report["wanlink_s"] += middle - started
            report["gloo_s"] += time.perf_counter() - middle
            if len(ours) != len(theirs) or not all(torch.equal(a, b) for a, b in zip(ours, theirs)):
                report["mismatches"] += 1
                if len(report["first_mismatches"]) < 5:
                    report["first_mismatches"].append({"i": i, "rank": rank, **{k: str(v) for k, v in case.items()}})
            report["done"] = i + 1
    except Exception as exc:  # noqa: BLE001 - reported to the parent
        report["error"] = f"{type(exc).__name__}: {exc}"[:600]
    print(json.dumps(report), flush=True)
    os._exit(0)


GROUPS = ("mutated", "kills", "replays", "lockout", "tamper", "peers", "loss", "soak")


async def _in_process(args, group: str) -> list[dict]:
    if group == "mutated":
        return await mutated_input(args.frames, args.frames // 10)
    if group == "kills":
        return [await stream_kills(args.kills)]
    if group == "replays":
        return [await replayed_handshakes(args.replays)]
    if group == "lockout":
        return [await lock_out(args.idle, args.connects)]
    return [await tamper(args.tampers, secure) for secure in (False, True)]


def run_group(args, group: str) -> list[dict]:
    """The rows of one group, each stamped with its group, date and load."""
    started = time.time()
    try:
        if group == "peers":
            rows = [peers(how, args.peer_trials, args.peer_timeout) for how in ("kill", "freeze")]
        elif group == "loss":
            rows = loss(args.seconds, args.rate_mbit, 0.01)
        elif group == "soak":
            rows = [soak(args.soak, args.peer_timeout * 6)]
        else:
            loop = new_event_loop()
            try:
                rows = loop.run_until_complete(_in_process(args, group))
            finally:
                loop.close()
    except Exception as exc:  # noqa: BLE001 - one failed group is a failed row, not a lost table
        rows = [{"scenario": group, "trials": 0, "outcome": f"bench failed: {type(exc).__name__}: {exc}"[:400],
                 "figure": "", "ok": False}]
    when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started))
    for row in rows:
        row.update(group=group, date_utc=when, load=[round(x, 2) for x in os.getloadavg()],
                   seconds=round(time.time() - started, 1))
        print(f"  {row['scenario']}: {row['outcome']} {row['figure']}", flush=True)
    return rows


def _kept_rows(run: Run, name: str, groups: list[str]) -> list[dict]:
    """Rows of the other groups from the JSON already in the output directory (for ``--only``);
    rows without a group (written before groups existed) are measured again."""
    path = run.path(f"{name}.json")
    if not path.exists():
        return []
    return [row for row in json.loads(path.read_text())["rows"] if row.get("group", groups[0]) not in groups]


def plot(run: Run, rows: list[dict], name: str) -> Path:
    """Legitimate connect times under the lock-out attack; survivors' time to error per peer fault."""
    fig, (ax_lock, ax_peers) = new_figure(1, 2, figsize=(11, 3.8))
    lock = next((r for r in rows if r["scenario"].startswith("lock-out")), None)
    if lock:
        ax_lock.hist([1e3 * t for t in lock["times_s"]], bins=20)
        ax_lock.set_title(lock["scenario"], fontsize=9)
    ax_lock.set_xlabel("legitimate connect time under the lock-out attack (ms)")
    ax_lock.set_ylabel("connects")
    faults = [r for r in rows if r["scenario"].startswith("peer ")]
    for row in faults:
        ax_peers.hist(row["times_s"], bins=20, alpha=0.7, label=row["scenario"].split(" in ")[0])
    if faults:
        ax_peers.legend(fontsize=8, frameon=False)
    ax_peers.set_xlabel("survivor's time from the signal to its error (s)")
    ax_peers.set_ylabel("survivors")
    return run.save_figure(fig, name)


def rank_worker(args) -> None:
    if args.rank_worker == "peer":
        peer_worker(args.rank, args.store, args.timeout, args.seed)
    else:
        soak_worker(args.rank, args.store, args.count, args.timeout)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", choices=GROUPS, default=[],
                        help="row groups to run (default all); the JSON keeps the other groups' rows")
    parser.add_argument("--kills", type=int, default=100, help="stream-kill trials")
    parser.add_argument("--frames", type=int, default=20000, help="mutated handshakes (and a tenth as many bad frames)")
    parser.add_argument("--replays", type=int, default=50)
    parser.add_argument("--idle", type=int, default=1000, help="idle sockets the attacker holds")
    parser.add_argument("--connects", type=int, default=20, help="legitimate connects during the attack")
    parser.add_argument("--tampers", type=int, default=20, help="tamper trials, secure off and on each")
    parser.add_argument("--peer-trials", type=int, default=8, help="worlds per peer fault (kill, freeze)")
    parser.add_argument("--peer-timeout", type=float, default=10.0,
                        help="collective timeout (s) of the kill/freeze worlds (the soak's is 6x)")
    parser.add_argument("--soak", type=int, default=2000, help="random collectives of the soak")
    parser.add_argument("--seconds", type=float, default=8.0, help="duration of each 1 %% loss run")
    parser.add_argument("--rate-mbit", type=float, default=2000.0, help="emulated path rate of the loss row")
    parser.add_argument("--name", default="chaos")
    add_output_options(parser)
    parser.add_argument("--rank-worker", choices=("peer", "soak"), help=argparse.SUPPRESS)
    for hidden in ("--rank", "--seed", "--count"):
        parser.add_argument(hidden, type=int, help=argparse.SUPPRESS)
    parser.add_argument("--store", help=argparse.SUPPRESS)
    parser.add_argument("--timeout", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rank_worker:
        rank_worker(args)
        return 0
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 4 * args.idle + 1024)), hard))
    run = Run(args)
    groups = args.only or list(GROUPS)
    rows = []
    for group in groups:
        rows += run_group(args, group)
    rows = sorted(_kept_rows(run, args.name, groups) + rows, key=lambda r: GROUPS.index(r.get("group", "mutated")))
    print(f"chaos bench; load now {os.getloadavg()[0]:.2f} (each row's own load is in the JSON)")
    print_table(rows, [("scenario", "scenario", ""), ("trials", "trials", "d"), ("outcome", "outcome", ""),
                       ("figure", "figure", ""), ("ok", "ok", "")])
    print("wrote", run.save_json(args.name, {"rows": rows}))
    print("wrote", plot(run, rows, args.name))
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
