"""The loopback demo trains with both backends and reports what it promises."""
from __future__ import annotations

import os
import re
import subprocess
import sys


def run_demo(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "wanlink.cli.demo", *args], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONUNBUFFERED": "1"})


def test_demo_trains_with_wanlink_and_gloo():
    done = run_demo("--ranks", "2", "--epochs", "3")
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    for backend in ("wanlink", "gloo"):
        assert re.search(rf"\[\s*{backend}\] epoch  3/3 ", out), out
        accuracy = float(re.search(rf"\[\s*{backend}\] final test accuracy ([\d.]+)%", out).group(1))
        assert accuracy > 60, out
    assert "per-link stats on rank 0" in out and "unix" in out  # local ranks link over Unix sockets
    assert re.search(r"time ratio wanlink/gloo = [\d.]+", out), out


def test_demo_reaches_the_transfer_demo():
    done = run_demo("--transfer", "--size-mib", "8", "--repeat", "1", "--streams", "2")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "striped transfer over loopback" in done.stdout
