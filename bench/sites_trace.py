"""Trace of cell-striped transfers for bench/sites.py ``--trace``: what every rank's striping did, when.

Installed in each rank before its process group starts, it wraps the striping service's steps and
every message send/receive of 1 MiB or more on a link, recording ``(wall seconds, event, fields)``
(sends and receives with their start and end). :func:`summary` turns the ranks' events into a
timeline per transfer: request, grant, each member's WAN hop (first byte in, last ack), each hop's
local phase, the turn's hand-off gap and completion, all in seconds from the run's first event.
"""
from __future__ import annotations

import functools
import threading
import time

from wanlink.c10d import striped_p2p
from wanlink.io import link as link_module

MIN_TRACED = 1 << 20
CPU_SAMPLE_S = 0.1
EVENTS: list[tuple] = []


def _record(*event) -> None:
    EVENTS.append((time.time(), *event))


def install() -> None:
    """Wrap the striping service and the links' sends and receives (once per process)."""
    service = striped_p2p.StripedP2P
    original_dispatch, original_carry_out = service._dispatch, service._carry_out

    def dispatch(self, peer, message):
        if isinstance(message, list) and message:
            _record("control", peer, message[0], message[1:4] if message[0] != "grant" else message[1:])
        return original_dispatch(self, peer, message)

    def carry_out(self, actions):
        _record("actions", [type(a).__name__ + repr(getattr(a, "key", "")) for a in actions])
        return original_carry_out(self, actions)

    service._dispatch, service._carry_out = dispatch, carry_out
    threading.Thread(target=_sample_cpu, daemon=True).start()
    link_class = link_module.Link
    for name in ("send", "recv_into"):
        setattr(link_class, name, _timed(getattr(link_class, name), name))


def record_links() -> None:
    """Every link's stream count and chunk size (the probe chose them when the link opened)."""
    import wanlink

    _record("links", {key: (link["streams"], link["chunk_size"] >> 10) for key, link in wanlink.stats().items()})


def _sample_cpu() -> None:
    """Every CPU_SAMPLE_S: this process's CPU seconds and the machine's busy and total jiffies."""
    while True:
        with open("/proc/stat") as stat:
            fields = [int(x) for x in stat.readline().split()[1:]]
        EVENTS.append((time.time(), "cpu", time.process_time(), sum(fields) - fields[3] - fields[4], sum(fields)))
        time.sleep(CPU_SAMPLE_S)


def _timed(method, name: str):
    @functools.wraps(method)
    async def wrapper(self, buffer, *args, **kwargs):
        size = memoryview(buffer).nbytes
        if size < MIN_TRACED:
            return await method(self, buffer, *args, **kwargs)
        started = time.time()
        try:
            return await method(self, buffer, *args, **kwargs)
        finally:
            peer = self.labels.get("peer_rank", self.peer)
            EVENTS.append((started, name, peer, kwargs.get("tag"), size, time.time()))
    return wrapper


def summary(per_rank: list[list[tuple]], hosts: tuple[str, ...]) -> str:
    """The ranks' events in time order, one a line, peers named by host: the striping service's
    control messages and actions, and per (rank, send or receive, peer, tag) the first start, the
    last end, how many messages and MiB; then the CPU samples."""
    origin = min(event[0] for events in per_rank for event in events)
    transfers: dict[tuple, list] = {}
    lines = []
    for rank, events in enumerate(per_rank):
        for event in events:
            if event[1] in ("send", "recv_into") and event[3] is not None and event[3] >= 0:
                started, kind, peer, tag, size, ended = event
                key = (hosts[rank], kind, hosts[peer] if isinstance(peer, int) else peer, tag)
                entry = transfers.setdefault(key, [started, ended, 0, 0])
                entry[0], entry[1] = min(entry[0], started), max(entry[1], ended)
                entry[2] += 1
                entry[3] += size
            elif event[1] not in ("send", "recv_into", "cpu"):
                text = " ".join(map(str, event[1:]))
                lines.append((event[0], f"{event[0] - origin:8.3f} {'':8s} {hosts[rank]} {text}"))
    for (host, kind, peer, tag), (started, ended, count, size) in transfers.items():
        lines.append((started, f"{started - origin:8.3f} {ended - origin:8.3f} {host} {kind:9s} "
                               f"{'->' if kind == 'send' else '<-'} {peer} {count} x {size / count / 2**20:.1f} MiB "
                               f"tag {tag:#x}"))
    return "\n".join([line for _t, line in sorted(lines)] + _cpu_lines(per_rank, hosts, origin)) + "\n"


def _cpu_lines(per_rank: list[list[tuple]], hosts: tuple[str, ...], origin: float) -> list[str]:
    """Per CPU_SAMPLE_S: the machine's busy share (of all cores) and each rank's CPU share of one core."""
    samples = [[e for e in events if e[1] == "cpu"] for events in per_rank]
    lines = ["cpu: seconds, machine busy % of all cores, then each rank's % of one core"]
    for i in range(1, min(map(len, samples))):
        (_t0, _c, _p0, busy0, total0), (t1, _c1, _p1, busy1, total1) = samples[0][i - 1], samples[0][i]
        ranks = [(s[i][2] - s[i - 1][2]) / max(s[i][0] - s[i - 1][0], 1e-9) for s in samples]
        lines.append(f"cpu {t1 - origin:8.2f} {100 * (busy1 - busy0) / max(total1 - total0, 1):4.0f} "
                     + " ".join(f"{host}={100 * r:3.0f}" for host, r in zip(hosts, ranks)))
    return lines
