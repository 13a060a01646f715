"""Bench output: a scratch directory unless --publish, and one JSON header shape for every bench."""
import argparse
import ast
import json
import os
from pathlib import Path

import pytest

from bench import reporting
from bench.reporting import ROOT, child_env

BENCH = Path(reporting.__file__).parent


def parse(*argv):
    parser = argparse.ArgumentParser()
    reporting.add_output_options(parser)
    return parser.parse_args(list(argv))


def test_results_go_to_scratch_unless_published(tmp_path):
    assert reporting.Run(parse()).out == reporting.SCRATCH != reporting.RESULTS
    assert reporting.Run(parse("--out", str(tmp_path))).out == tmp_path
    assert reporting.Run(parse("--publish")).out == reporting.RESULTS


def test_every_json_has_the_same_header(tmp_path):
    path = reporting.Run(parse("--out", str(tmp_path))).save_json("probe", {"rows": [1]})
    saved = json.loads(path.read_text())
    assert saved["rows"] == [1]
    header = saved["header"]
    assert {"machine", "load_before", "load_after", "versions", "git_commit", "command", "date_utc"} <= set(header)
    assert header["machine"]["cpus"] >= 1 and len(header["load_before"]) == len(header["load_after"]) == 3
    assert {"python", "wanlink", "torch", "numpy"} <= set(header["versions"])


@pytest.mark.parametrize("script", sorted(p.name for p in BENCH.glob("*.py")
                                          if p.name not in ("__init__.py", "reporting.py")))
def test_every_bench_takes_out_and_publish(script):
    tree = ast.parse((BENCH / script).read_text())
    called = {node.func.id for node in ast.walk(tree) if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)}
    assert "add_output_options" in called and "Run" in called, f"{script} must write through bench.reporting"


def test_colours_are_fixed_per_name():
    first = reporting.colours(["wanlink", "gloo"])
    assert reporting.colours(["wanlink", "gloo", "extra"])["gloo"] == first["gloo"] != first["wanlink"]


def test_child_env_puts_the_checkout_ahead_of_the_users_pythonpath(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    env = child_env(WANLINK_STREAMS="4")
    assert env["PYTHONPATH"] == f"{ROOT}{os.pathsep}/elsewhere" and env["WANLINK_STREAMS"] == "4"
    monkeypatch.delenv("PYTHONPATH")
    assert child_env()["PYTHONPATH"] == str(ROOT)
