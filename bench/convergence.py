"""Convergence of block-sparse training against dense DDP: 2 ranks over loopback, scikit-learn digits.

Variants, same seeds and data split: dense DDP on gloo; wanlink with the block-sparse hook at 1 %
density and error feedback, SGD's momentum in the hook; the same with partial staleness 1. Prints the
per-epoch test accuracy, writes convergence.{json,png} to --out (bench/results/ with --publish).
tests/c10d/test_convergence.py runs it on CI.

    python3 dev.py bench bench/convergence.py [--epochs 30] [--density 0.01]
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

VARIANTS = {
    "dense gloo": {"backend": "gloo", "density": None, "staleness": 0},
    "sparse wanlink": {"backend": "wanlink", "density": 0.01, "staleness": 0},
    "sparse wanlink stale-1": {"backend": "wanlink", "density": 0.01, "staleness": 1},
}


def load_split(seed: int = 0):
    """scikit-learn's bundled digits as float tensors: (train_x, train_y, test_x, test_y), a fixed 80/20 split."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    features = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    labels = torch.tensor(digits.target, dtype=torch.int64)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
    cut = int(0.8 * len(labels))
    train, test = order[:cut], order[cut:]
    return features[train], labels[train], features[test], labels[test]


def make_model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256),
                               torch.nn.ReLU(), torch.nn.Linear(256, 10))


def train_rank(rank: int, world: int, init_file: str, variant: dict, epochs: int, warmup_steps: int,
               results) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    import wanlink  # noqa: F401 - registers the backend
    from wanlink.c10d.sparse_hook import BlockSparseState, block_sparse_hook

    torch.set_num_threads(1)
    dist.init_process_group(variant["backend"], init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        model = make_model()
        ddp = DDP(model)
        state = None
        if variant["density"] is not None:
            # momentum 0.9 in the hook (momentum correction) and none in the optimizer: docs/sparse.md
            state = BlockSparseState(density=variant["density"], warmup_steps=warmup_steps,
                                     staleness=variant["staleness"], momentum=0.9)
            ddp.register_comm_hook(state, block_sparse_hook)
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.0 if state else 0.9)
        train_x, train_y, test_x, test_y = load_split()
        mean, std = train_x.mean(0), train_x.std(0) + 1e-6  # standardised: steadier for momentum SGD
        train_x, test_x = (train_x - mean) / std, (test_x - mean) / std
        shard_x, shard_y = train_x[rank::world], train_y[rank::world]
        batch = 32
        curve = []
        start = time.perf_counter()
        for epoch in range(epochs):
            order = torch.randperm(len(shard_y), generator=torch.Generator().manual_seed(1000 * epoch + rank))
            steps = len(shard_y) // batch
            for step in range(steps):
                index = order[step * batch:(step + 1) * batch]
                optimizer.zero_grad()
                loss = torch.nn.functional.cross_entropy(ddp(shard_x[index]), shard_y[index])
                loss.backward()
                optimizer.step()
            if state is not None and epoch == epochs - 1 and state.flush():
                optimizer.step()
            with torch.no_grad():
                accuracy = (model(test_x).argmax(1) == test_y).float().mean().item()
            curve.append({"epoch": epoch + 1, "loss": loss.item(), "test_accuracy": accuracy,
                          "seconds": time.perf_counter() - start})
        if rank == 0:
            results.put({"curve": curve, "bytes_sent": state.bytes_sent if state else None})
    finally:
        dist.destroy_process_group()


def run_variant(name: str, epochs: int = 30, warmup_steps: int = 20, density: float | None = None) -> dict:
    variant = dict(VARIANTS[name])
    if density is not None and variant["density"] is not None:
        variant["density"] = density
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        mp.start_processes(train_rank, args=(2, init_file, variant, epochs, warmup_steps, results), nprocs=2,
                           start_method="spawn")
    outcome = results.get(timeout=10)
    return {"variant": name, **variant, "epochs": epochs, "warmup_steps": warmup_steps, **outcome,
            "final_accuracy": outcome["curve"][-1]["test_accuracy"]}


def main(argv: list[str] | None = None) -> int:
    from bench.reporting import Run, add_output_options, legend_outside, new_figure, print_table

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--warmup-steps", type=int, default=20)
    parser.add_argument("--density", type=float, default=0.01)
    add_output_options(parser)
    args = parser.parse_args(argv)
    run = Run(args)
    runs = [run_variant(name, args.epochs, args.warmup_steps, args.density) for name in VARIANTS]
    dense = runs[0]["final_accuracy"]
    rows = [{"variant": r["variant"], "final_accuracy": 100 * r["final_accuracy"],
             "vs_dense_points": 100 * (r["final_accuracy"] - dense), "seconds": r["curve"][-1]["seconds"]}
            for r in runs]
    print_table(rows, [("variant", "variant", ""), ("final_accuracy", "test acc %", ".2f"),
                       ("vs_dense_points", "vs dense (pts)", "+.2f"), ("seconds", "seconds", ".1f")])
    print("wrote", run.save_json("convergence", {"runs": runs}))
    fig, ax = new_figure(figsize=(7, 4))
    for r in runs:
        ax.plot([p["epoch"] for p in r["curve"]], [100 * p["test_accuracy"] for p in r["curve"]], label=r["variant"])
    ax.set_xlabel("epoch")
    ax.set_ylabel("test accuracy (%)")
    ax.set_title("digits, 2 ranks, same seeds")
    legend_outside(ax)
    print("wrote", run.save_figure(fig, "convergence"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
