"""Package metadata says only what is true: versions CI runs, one version source, the licence file, `info`."""
import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import wanlink
from wanlink import about

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def test_claimed_python_versions_agree():
    claimed = [c.rsplit(":: ", 1)[1] for c in PROJECT["classifiers"] if re.fullmatch(r".*Python :: 3\.\d+", c)]
    lowest = min(claimed, key=lambda v: tuple(map(int, v.split("."))))
    assert PROJECT["requires-python"] == f">={lowest}"
    assert sys.version_info >= tuple(map(int, lowest.split(".")))


def test_one_version_source_and_a_licence():
    assert "version" not in PROJECT and "version" in PROJECT["dynamic"]
    assert re.fullmatch(r"\d+\.\d+\.\d+", wanlink.__version__)
    assert PROJECT["license"] == "Apache-2.0" and "Apache License" in (ROOT / "LICENSE").read_text()
    assert (ROOT / "wanlink" / "py.typed").exists() and (ROOT / "CHANGELOG.md").exists()


def test_info_names_versions_kernels_loop_and_tcp():
    facts = about.collect()
    assert facts["versions"]["wanlink"] == wanlink.__version__
    assert facts["kernels"]["in use"] in ("compiled", "reference")
    assert facts["kernels"]["frame decoder"] in ("compiled", "reference")
    assert set(facts) == {"versions", "kernels", "event loop", "kernel TCP"}
    assert "congestion controls available" in facts["kernel TCP"]
    shown = subprocess.run([sys.executable, "-m", "wanlink", "info", "--json"], capture_output=True, text=True,
                           timeout=120, check=True).stdout
    assert json.loads(shown)["versions"]["wanlink"] == wanlink.__version__
    assert about.report().splitlines()[0] == "versions:"
