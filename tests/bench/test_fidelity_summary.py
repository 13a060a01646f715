"""bench/fidelity.py's table: a missed cell whose seeds all warned is "warned"; judge-only runs give verdicts alone."""
import math

from bench.fidelity import summarise


def _run(seed, mode, final=None, ratio=None, judged_at=None):
    run = {"shape": "stdlib-lm", "optimizer": "adamw", "mode": mode, "seed": seed}
    if final is not None:
        run["final"] = final
    if ratio is not None:
        run["guard"] = {"sparse_steps": 500, "density": 0.01, "ratio": ratio, "warned": ratio >= 0.2, "message": None}
    if judged_at is not None:
        run["judged_at"] = judged_at
    return run


def _rows(runs):
    return {row["mode"]: row for row in summarise(runs)}


def test_a_missed_cell_is_warned_only_when_every_seed_warned():
    dense = [_run(seed, "dense", final=1.0) for seed in range(2)]
    rows = _rows(dense + [_run(0, "sparse s0", final=1.1, ratio=0.5), _run(1, "sparse s0", final=1.1, ratio=0.6),
                          _run(0, "sparse s1", final=1.1, ratio=0.5), _run(1, "sparse s1", final=1.1, ratio=0.1)])
    assert rows["sparse s0"]["verdict"] == "warned" and rows["sparse s0"]["warned"] == "2/2"
    assert rows["sparse s1"]["verdict"] == "MISSED" and rows["sparse s1"]["warned"] == "1/2"
    assert rows["sparse s1"]["guard_ratio"] == [0.5, 0.1]
    within = _rows(dense + [_run(0, "sparse s0", final=1.01, ratio=0.5)])["sparse s0"]
    assert within["verdict"] == "ok"  # within the target: the warning does not matter


def test_judge_only_runs_give_the_guards_verdicts_and_no_metric():
    rows = _rows([_run(0, "sparse s0", ratio=0.5, judged_at=550), _run(1, "sparse s0", ratio=0.3, judged_at=550),
                  _run(0, "sparse s1", ratio=0.5, judged_at=550), _run(1, "sparse s1", ratio=0.05, judged_at=550)])
    assert rows["sparse s0"]["verdict"] == "warned" and math.isnan(rows["sparse s0"]["mean"])
    assert rows["sparse s1"]["verdict"] == "not warned" and rows["sparse s1"]["warned"] == "1/2"
