"""Smoke test of the wanem WAN emulator: build, TCP across a 20 ms path, 100% loss, teardown.

Needs root, /dev/net/tun, `ip` and a C compiler; skipped (with the reason) otherwise.
"""
import json
import os
import subprocess
import sys

import pytest

from bench.wanem import WanemError, WanPath, build, check_environment
from tests.support.netns import needs_netns

RTT_MS = 20.0


# Echo server for namespace B: prints its port, then echoes each connection until EOF.
SERVER = r"""
import socket, sys
s = socket.socket(); s.bind((sys.argv[1], 0)); s.listen(4)
print(s.getsockname()[1], flush=True)
while True:
    c, _ = s.accept()
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    while (b := c.recv(1 << 16)):
        c.sendall(b)
    c.close()
"""

# Client for namespace A: connect time, small-message round trips, and a 2 MB echo.
CLIENT = r"""
import hashlib, json, os, socket, sys, time
host, port, timeout = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
out = {}
t = time.monotonic()
try:
    c = socket.create_connection((host, port), timeout=timeout)
except OSError as e:
    print(json.dumps({"error": type(e).__name__})); sys.exit(0)
out["connect_s"] = time.monotonic() - t
c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
rtts = []
for _ in range(5):
    t = time.monotonic(); c.sendall(b"x")
    assert c.recv(1) == b"x"
    rtts.append(time.monotonic() - t)
out["rtts_s"] = rtts
data = os.urandom(2 << 20)
c.sendall(data); c.shutdown(socket.SHUT_WR)
got = bytearray()
while (b := c.recv(1 << 16)):
    got += b
out["echo_ok"] = hashlib.sha256(got).digest() == hashlib.sha256(data).digest()
print(json.dumps(out))
"""


def _start_server(path: WanPath) -> tuple[subprocess.Popen, int]:
    srv = path.popen_b([sys.executable, "-c", SERVER, path.addr_b], stdout=subprocess.PIPE, text=True)
    return srv, int(srv.stdout.readline())


def _client(path: WanPath, port: int, timeout: float) -> dict:
    proc = path.run_a([sys.executable, "-c", CLIENT, path.addr_b, str(port), str(timeout)],
                      capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_not_root_gives_clear_error(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(WanemError, match="needs root"):
        check_environment()


@needs_netns
def test_build_produces_executable():
    binary = build()
    assert binary.is_file() and os.access(binary, os.X_OK)


@needs_netns
def test_tcp_crosses_path_with_configured_delay():
    with WanPath(rtt_ms=RTT_MS, rate_mbit=200) as path:
        srv, port = _start_server(path)
        res = _client(path, port, timeout=10)
        stats = path.stats()
        srv.terminate()
    assert res.get("echo_ok") is True, res
    # Lower bounds only: they cannot hold unless packets waited in the emulator.
    assert res["connect_s"] >= RTT_MS / 1e3
    assert min(res["rtts_s"]) >= RTT_MS / 1e3
    for d in ("ab", "ba"):
        assert stats[d]["rx_segs"] > 0 and stats[d]["tx_segs"] > 0
    assert stats["ab"]["tx_bytes"] >= 2 << 20  # the echo payload went through the emulator


@needs_netns
def test_full_loss_blocks_traffic():
    with WanPath(rtt_ms=2, rate_mbit=0, loss=1.0) as path:
        srv, port = _start_server(path)
        res = _client(path, port, timeout=1.5)
        stats = path.stats()
    assert res == {"error": "TimeoutError"}
    assert stats["ab"]["drop_loss"] >= 1 and stats["ab"]["tx_pkts"] == 0


@needs_netns
def test_teardown_removes_namespaces_and_emulator():
    path = WanPath(rtt_ms=RTT_MS).up()
    names, emulator = [path.ns_a, path.ns_b], path.emulator
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert all(n in listed for n in names)
    path.down()
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(n in listed for n in names)
    assert not any(os.path.exists(f"/run/netns/{n}") for n in names)
    assert emulator.poll() is not None
    path.down()  # idempotent


@needs_netns
def test_environment_check_names_a_missing_program():
    check_environment(programs=("ip",))
    with pytest.raises(WanemError, match="wanlink-no-such-program is required"):
        check_environment(programs=("ip", "wanlink-no-such-program"))
