"""bench/chaos.py: the table merges row groups measured by separate calls; the torch-world rows
measure what they claim (a killed rank is reported by every survivor; the soak compares exactly)."""
import json
from argparse import Namespace

import pytest

from bench import chaos
from bench.reporting import Run


def test_only_keeps_the_other_groups_rows_and_drops_rows_without_a_group(tmp_path):
    run = Run(Namespace(publish=False, out=tmp_path))
    rows = [{"scenario": "old", "ok": True},  # written before row groups existed: measured again
            {"scenario": "kills", "group": "kills", "ok": True},
            {"scenario": "soak", "group": "soak", "ok": False}]
    run.save_json("chaos", {"rows": rows})
    kept = chaos._kept_rows(run, "chaos", ["soak"])
    assert [row["scenario"] for row in kept] == ["kills"]
    assert chaos._kept_rows(run, "absent", ["soak"]) == []
    assert json.loads((tmp_path / "chaos.json").read_text())["rows"] == rows


def test_soak_cases_are_exact_in_every_dtype():
    """Inputs stay small enough that sums and products of 4 ranks are exact even in half precision."""
    import random

    rng = random.Random(0)
    for _ in range(500):
        case = chaos._soak_case(rng)
        low, high = case["range"]
        assert case["op"] in chaos.SOAK_OPS and 0 <= case["root"] < chaos.WORLD
        bound = max(abs(low), abs(high - 1)) ** chaos.WORLD if case["reduce_op"] == "PRODUCT" else \
            chaos.WORLD * max(abs(low), abs(high - 1))
        exact = 256 if str(case["dtype"]) in ("torch.float16", "torch.bfloat16") else 1 << 24
        assert bound <= exact, case


PATHS = pytest.mark.parametrize("express", ["1", "0"], ids=["express", "loop"])  # (docs/c10d.md, the express path)


@pytest.mark.slow
@PATHS
@pytest.mark.parametrize("seed", [7, 8])
def test_a_killed_rank_is_named_by_every_survivor_before_the_timeout(seed, express, monkeypatch):
    """Also survivors that were waiting on another survivor (ring all_reduce, halving) hear of the death."""
    import random

    monkeypatch.setenv("WANLINK_EXPRESS", express)
    trial = chaos._peer_trial("kill", random.Random(seed), timeout_s=30)
    survivors = trial["survivors"]
    assert len(survivors) == chaos.WORLD - 1
    for report in survivors:
        assert report["type"] == "PeerLost", report
        assert report["names_victim"], report
        assert report["after_s"] < 30, report


@pytest.mark.slow
@PATHS
def test_a_frozen_rank_is_named_as_silent_when_the_collective_times_out(express, monkeypatch):
    """On the express path the links carry only pings, so the frozen rank's link may have failed of
    its silence (after the same timeout) by the time the collective times out: named so."""
    import random
    import re

    monkeypatch.setenv("WANLINK_EXPRESS", express)
    trial = chaos._peer_trial("freeze", random.Random(7), timeout_s=6)
    victim = trial["victim"]
    silent = re.compile(rf"rank {victim} sent nothing for" + ("" if express == "0" else
                        rf"|<-> rank {victim} failed \(.*\): .*peer silent for more than 6 s"))
    for report in trial["survivors"]:
        assert report["type"] == "DeadlineExceeded", report
        assert silent.search(report["message"]), report


@pytest.mark.slow
def test_soak_finds_no_mismatch_between_wanlink_and_gloo():
    row = chaos.soak(48, timeout_s=60)
    assert row["ok"], row
    assert "48/48 ran on every rank; 0 mismatches" in row["outcome"]
