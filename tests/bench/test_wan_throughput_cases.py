"""bench/wan_throughput.py: which cases a run plans, and the ratios it reports (no network)."""
import pytest

from bench.wan_throughput import plan_cases, ratios, run_gloo, run_iperf3, run_wanlink


def names(planned):
    return [(name, policy) for name, policy, _runner, _n in planned]


def test_full_plan_runs_every_case_per_buffer_policy_and_gloo_once():
    planned = plan_cases("4M", 256)
    assert len(planned) == 2 * 6 + 1
    assert names(planned).count(("wanlink auto", None)) == 1 and ("wanlink auto", "4M") in names(planned)
    assert planned[-1][0] == "gloo broadcast 256 MiB" and planned[-1][2] is run_gloo
    assert {runner for _name, _p, runner, _n in planned} == {run_iperf3, run_wanlink, run_gloo}
    assert ("wanlink auto", None, run_wanlink, None) in planned and ("iperf3 -P 8", "4M", run_iperf3, 8) in planned


def test_cases_and_buffers_select_single_cells():
    planned = plan_cases("4M", 256, cases=["wanlink auto", "iperf3 -P 8"], buffers="window")
    assert names(planned) == [("iperf3 -P 8", "4M"), ("wanlink auto", "4M")]
    assert names(plan_cases(None, 64, cases=["gloo"])) == [("gloo broadcast 64 MiB", None)]
    assert all(policy is None for _n, policy, _r, _c in plan_cases("4M", 64, buffers="autotune"))
    assert plan_cases(None, 64, cases=["no such case"]) == []


def test_bad_buffer_selection_is_a_clear_error():
    with pytest.raises(ValueError, match="needs --window"):
        plan_cases(None, 256, buffers="window")
    with pytest.raises(ValueError, match="buffers must be"):
        plan_cases("4M", 256, buffers="some")


def test_ratios_without_single_flow_baseline_still_compare_with_p8():
    rows = [{"path": "40ms", "case": "wanlink auto", "buffers": "4M", "gbps": 1.8},
            {"path": "40ms", "case": "iperf3 -P 8", "buffers": "4M", "gbps": 2.0}]
    (entry,) = ratios(rows)
    assert entry["vs_iperf3_P8"] == pytest.approx(0.9) and "striping_gain" not in entry
    assert "buffer_gain_iperf3_P1" not in entry
