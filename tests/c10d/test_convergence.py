"""Block-sparse training (1 % density, error feedback) reaches dense accuracy on a real data set.

2 ranks over loopback, scikit-learn's digits, same seeds: dense DDP on gloo, wanlink with the
block-sparse hook, and the same with partial staleness 1 (bench/convergence.py, which also
writes the curves).
"""
from bench.convergence import VARIANTS, run_variant

EPOCHS = 30


def test_sparse_variants_reach_dense_accuracy_within_one_point():
    results = {name: run_variant(name, epochs=EPOCHS) for name in VARIANTS}
    dense = results["dense gloo"]["final_accuracy"]
    assert dense > 0.9, f"dense baseline did not learn: {dense:.4f}"
    for name in ("sparse wanlink", "sparse wanlink stale-1"):
        accuracy = results[name]["final_accuracy"]
        assert accuracy >= dense - 0.01, f"{name}: {accuracy:.4f} vs dense {dense:.4f}"
        assert results[name]["bytes_sent"] > 0
