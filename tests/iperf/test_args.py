"""wanlink-iperf's command line: iperf3's options, defaults and refusals."""
import argparse

import pytest

from wanlink.iperf.options import parse_args, parse_size


def test_defaults_follow_iperf3():
    o = parse_args(["-c", "127.0.0.1"])
    assert (o.host, o.port, o.time, o.interval, o.length) == ("127.0.0.1", 5201, 10.0, 1.0, 128 * 1024)
    assert o.parallel is None  # automatic: probed
    assert not (o.json or o.reverse or o.bidir or o.server) and o.wanlink and o.window is None
    s = parse_args(["-s"])
    assert s.server and s.port == 5201 and not s.one_off


def test_all_client_options():
    o = parse_args(["-c", "h", "-p", "6000", "-P", "8", "-t", "3", "-i", "0.5", "-J", "-R", "-C", "cubic",
                    "-w", "4M", "-l", "64K", "--connect-timeout", "500", "--max-streams", "16"])
    assert (o.port, o.parallel, o.time, o.interval, o.json, o.reverse) == (6000, 8, 3.0, 0.5, True, True)
    assert (o.congestion, o.window, o.length, o.connect_timeout, o.max_streams) == \
        ("cubic", 4 << 20, 64 << 10, 0.5, 16)
    n = parse_args(["-c", "h", "-n", "10M", "--bidir"])
    assert n.bytes == 10 << 20 and n.time == 0 and n.bidir
    assert parse_args(["-s", "-1", "-p", "0"]).one_off


@pytest.mark.parametrize("text,value", [("0", 0), ("100", 100), ("128K", 131072), ("1.5m", 1572864),
                                        ("2G", 2 << 30), ("1t", 1 << 40)])
def test_sizes(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["", "K", "ten", "-1M", "1Q"])
def test_bad_sizes(text):
    with pytest.raises(argparse.ArgumentTypeError):
        parse_size(text)


@pytest.mark.parametrize("argv", [
    [], ["-s", "-c", "h"], ["-c", "h", "-R", "--bidir"], ["-c", "h", "-t", "1", "-n", "1M"],
    ["-c", "h", "-P", "0"], ["-c", "h", "-P", "129"], ["-c", "h", "-t", "0"], ["-c", "h", "-t", "100000"],
    ["-c", "h", "-i", "0.01"], ["-c", "h", "-p", "70000"], ["-c", "h", "-p", "0"], ["-c", "h", "-l", "2M"],
    ["-c", "h", "-w", "1G"], ["-s", "-R"], ["-s", "-P", "2"], ["-c", "h", "-1"], ["-c", "h", "-f", "a"],
    ["-c", "h", "-f", "x"],
])
def test_refusals_exit_with_status_2(argv, capsys):
    with pytest.raises(SystemExit) as info:
        parse_args(argv)
    assert info.value.code == 2
    assert "wanlink-iperf" in capsys.readouterr().err


@pytest.mark.parametrize("argv,reason", [
    (["-c", "h", "-u"], "-u: UDP tests are not supported"), (["-s", "--udp"], "-u: UDP tests are not supported"),
    (["-c", "h", "-b", "100M"], "-b 100M: pacing to a target bitrate is not supported"),
])
def test_udp_and_pacing_are_refused_with_the_reason(argv, reason, capsys):
    with pytest.raises(SystemExit) as info:
        parse_args(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert reason in err and "unrecognized" not in err


def test_rate_format_and_unlimited_bitrate():
    assert parse_args(["-c", "h"]).rate_format == "a"
    assert [parse_args(["-c", "h", "-f", f]).rate_format for f in "kMgT"] == list("kMgT")
    assert parse_args(["-s", "-f", "G"]).rate_format == "G"
    assert parse_args(["-c", "h", "-b", "0"]).host == "h"  # iperf3's TCP default: unlimited


def test_console_script_and_python_m_reach_main():
    import importlib
    import pathlib
    import re
    import subprocess
    import sys

    pyproject = (pathlib.Path(__file__).parents[2] / "pyproject.toml").read_text()
    module, function = re.search(r'^wanlink-iperf = "([\w.]+):(\w+)"$', pyproject, re.M).groups()
    assert getattr(importlib.import_module(module), function) is importlib.import_module("wanlink.iperf.cli").main
    done = subprocess.run([sys.executable, "-m", "wanlink.iperf", "-c", "h", "-u"], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2 and "UDP tests are not supported" in done.stderr


def test_version_prints_the_bug_report_facts(capsys):
    """``-v`` names wanlink's one version and carries ``python -m wanlink info``'s report."""
    import wanlink

    with pytest.raises(SystemExit) as done:
        parse_args(["--version"])
    out = capsys.readouterr().out
    assert done.value.code == 0
    assert out.startswith(f"wanlink-iperf {wanlink.__version__} (iperf3 protocol)\n")
    assert "kernels:" in out and "kernel TCP:" in out and "event loop:" in out
