"""Smoke test of the multi-host sites emulator: which path each byte takes, and per-host caps adding up.

Needs root, /dev/net/tun, `ip` and a C compiler; skipped (with the reason) otherwise.
"""
import json
import subprocess
import sys

import pytest

from bench.wanem.netns import Link
from bench.wanem.sites import WanSites
from tests.support.netns import needs_netns

# Receiver: prints its port, takes one connection, reads to EOF, prints bytes and the
# CLOCK_MONOTONIC times of the first and last byte (one clock for every namespace of a host).
RECEIVER = r"""
import json, socket, sys, time
s = socket.socket(); s.bind((sys.argv[1], 0)); s.listen(1)
print(s.getsockname()[1], flush=True)
c, _ = s.accept()
first = None; n = 0
while (b := c.recv(1 << 16)):
    first = first or time.monotonic(); n += len(b)
print(json.dumps({"bytes": n, "first": first, "last": time.monotonic()}), flush=True)
"""

# Sender: connects (printing the connect time), sends N bytes, waits for the receiver to close.
SENDER = r"""
import socket, sys, time
t = time.monotonic()
c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=60)
print(time.monotonic() - t, flush=True)
c.sendall(bytes(int(sys.argv[3]))); c.shutdown(socket.SHUT_WR)
c.settimeout(60); c.recv(1)
"""


def transfers(sites, pairs, nbytes):
    """Send ``nbytes`` from each ``(src, dst)`` host at once; receiver reports and connect times."""
    receivers = []
    for _src, dst in pairs:
        proc = sites.popen(dst, [sys.executable, "-c", RECEIVER, sites.host(dst).addr], stdout=subprocess.PIPE,
                           text=True)
        receivers.append((proc, int(proc.stdout.readline())))
    senders = [sites.popen(src, [sys.executable, "-c", SENDER, sites.host(dst).addr, str(port), str(nbytes)],
                           stdout=subprocess.PIPE, text=True)
               for (src, dst), (_proc, port) in zip(pairs, receivers)]
    connects = [float(proc.communicate(timeout=120)[0]) for proc in senders]
    reports = [json.loads(proc.communicate(timeout=120)[0]) for proc, _port in receivers]
    assert all(r["bytes"] == nbytes for r in reports), reports
    return reports, connects


def egress_bytes(sites):
    return {name: s["egress"]["tx_bytes"] for name, s in sites.stats().items()}


@needs_netns
def test_lan_stays_local_and_each_host_sends_over_its_own_wan_path():
    rtt_ms, nbytes = 20.0, 2 << 20
    with WanSites(hosts=(2, 1), rtt_ms=rtt_ms, rate_mbit=200) as sites:
        names = [h.ns for h in sites.hosts] + [sites.switch("a"), sites.switch("b")]
        transfers(sites, [("a0", "a1")], nbytes)
        assert egress_bytes(sites) == {"a0": 0, "a1": 0, "b0": 0}  # the local network bypasses the WAN
        _reports, connects = transfers(sites, [("a0", "b0"), ("a1", "b0")], nbytes)
        after = egress_bytes(sites)
        # Data went out over each sender's own path; b0's ACKs to both over b0's path alone.
        assert after["a0"] >= nbytes and after["a1"] >= nbytes
        assert 0 < after["b0"] < nbytes // 4
        assert min(connects) >= rtt_ms / 1e3  # a lower bound: the handshake crossed both ways
        _reports, connects = transfers(sites, [("b0", "a1")], nbytes)
        assert egress_bytes(sites)["b0"] >= after["b0"] + nbytes
        assert egress_bytes(sites)["a1"] - after["a1"] < nbytes // 4
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(name in listed for name in names)
    assert set(sites.final_stats) == {"a0", "a1", "b0"}


@needs_netns
def test_per_host_caps_add_up_across_a_site():
    cap_mbit, nbytes = 24.0, 3 << 20  # about one second per host at its cap
    cap, aggregates = cap_mbit * 1e6 / 8, []
    with WanSites(hosts=2, rtt_ms=10, rate_mbit=cap_mbit, egress={"b1": Link(5.0, 48.0)}) as sites:
        # One cap shared by the site could never carry more than ~1x; a starved CPU can only make a
        # try slower, so up to three tries and the best counts (seen: 0.7x beside a bench).
        while len(aggregates) < 3 and max(aggregates, default=0) < 1.3 * cap:
            reports, _connects = transfers(sites, [("a0", "b0"), ("a1", "b1")], nbytes)
            for r in reports:  # upper bounds hold however loaded the machine is: the emulator caps each host
                assert r["bytes"] / (r["last"] - r["first"]) <= 1.05 * cap
            aggregates.append(2 * nbytes / (max(r["last"] for r in reports) - min(r["first"] for r in reports)))
    assert max(aggregates) >= 1.3 * cap, aggregates  # loose: two hosts' caps add up (2x in the ideal)
    assert sites.host("b1").egress.rate_mbit == 48.0 and sites.host("a0").egress.rate_mbit == cap_mbit


@pytest.mark.parametrize("kwargs, message", [
    ({"hosts": 0}, "hosts must be"),
    ({"hosts": (2, 1, 1)}, "hosts must be"),
    ({"egress": {"c0": Link(1.0)}}, r"unknown hosts \['c0'\]"),
    ({"rate_mbit": -1}, "invalid link"),
])
def test_bad_layouts_are_refused_before_anything_is_created(kwargs, message):
    with pytest.raises(ValueError, match=message):
        WanSites(**kwargs)
