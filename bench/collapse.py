"""The collapse of momentum SGD behind the block-sparse hook, and its fix.

A digits MLP (``--shape digits-mlp-24m``: the issue's ~24M-parameter one, slow on 2 cores), 2 ranks
over loopback, batch 16 per rank, 1 % density, staleness 1, 50 dense warm-up steps (README's
configuration), SGD momentum 0.9 (the shape's learning rate). Variants:
dense gloo DDP; the sparse hook behind torch.optim.SGD(momentum=0.9)'s arithmetic (which the hook
now refuses, so it runs as ``UncheckedMomentumSGD``); the same with the momentum in the hook
(``BlockSparseState(momentum=0.9)`` + ``SGD(momentum=0)``); and SparseSGD. Per step it records
the loss, the norm of the parameter update and the norm of every momentum buffer (the optimizer's
and the hook's velocities); the uncorrected variant runs every seed, the others the seed whose
uncorrected run fell lowest. Writes collapse.{json,png} to --out (bench/results/ with --publish).

    python3 dev.py bench bench/collapse.py [--shape digits-mlp] [--seeds 0 1 2] [--steps 600] [--publish]
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.fidelity import SHAPES, run_jobs

WARMUP = 50
VARIANTS = (("dense", "sgd", "dense gloo, SGD momentum 0.9"),
            ("sparse s1", "sgd-uncorrected", "sparse 1 % stale-1, SGD momentum 0.9 in the optimizer (refused now)"),
            ("sparse s1", "sgd", "sparse 1 % stale-1, momentum 0.9 in the hook (masked)"),
            ("sparse s1", "sparse-sgd", "sparse 1 % stale-1, SparseSGD momentum 0.9"))


def smooth(values: list[float], width: int = 9) -> list[float]:
    half = width // 2
    return [sum(values[max(0, i - half):i + half + 1]) / len(values[max(0, i - half):i + half + 1])
            for i in range(len(values))]


def plot(runs: list[dict], shape: str, failing: int, output) -> None:
    """Accuracy, loss, update norm and momentum norm per step of every variant on the failing seed."""
    from bench.reporting import new_figure

    fig, axes = new_figure(4, 1, figsize=(9, 11), sharex=True)
    for mode, optimizer, label in VARIANTS:
        run = next(r for r in runs if r["seed"] == failing and (r["mode"], r["optimizer"]) == (mode, optimizer))
        steps = [t["step"] for t in run["trace"]]
        axes[0].plot([p["step"] for p in run["curve"]], [p["metric"] for p in run["curve"]], marker="o", label=label)
        axes[1].plot(steps, smooth([t["loss"] for t in run["trace"]]), label=label)
        axes[2].plot(steps, [t["update_norm"] for t in run["trace"]], lw=0.8, label=label)
        axes[3].plot(steps, [t["momentum_norm"] for t in run["trace"]], lw=0.8, label=label)
    for ax, ylabel in zip(axes, ("test accuracy (%)", "training loss (9-step mean)", "|parameter update| per step",
                                 "|momentum| (optimizer + hook)")):
        ax.set_ylabel(ylabel)
        ax.axvline(WARMUP, color="grey", lw=0.5, ls=":")
    axes[1].set_yscale("log")
    axes[2].set_yscale("log")
    axes[3].set_yscale("log")
    axes[3].set_xlabel("step")
    axes[0].set_title(f"{shape}, seed {failing}, 2 ranks, batch 16 per rank (dotted: end of dense warm-up)")
    axes[0].legend(fontsize=7)
    print("wrote", output.save_figure(fig, "collapse"))


def main(argv: list[str] | None = None) -> int:
    from bench.reporting import Run, add_output_options, print_table

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--shape", default="digits-mlp", choices=("digits-mlp", "digits-mlp-24m"))
    parser.add_argument("--steps", type=int, default=None, help="default: the shape's own")
    add_output_options(parser)
    args = parser.parse_args(argv)
    output = Run(args)
    shape = args.shape
    steps = args.steps or SHAPES[shape].steps
    load_before = os.getloadavg()
    started = time.perf_counter()

    def job(mode, optimizer, seed):
        return {"shape": shape, "seed": seed, "mode": mode, "optimizer": optimizer, "warmup": WARMUP, "trace": True,
                "steps": steps}

    def show(run):
        print(f"  seed {run['seed']} {run['mode']} {run['optimizer']}: {run.get('final', run.get('failed'))}",
              flush=True)

    uncorrected = run_jobs([job("sparse s1", "sgd-uncorrected", seed) for seed in args.seeds], show)
    # the seed whose run fell lowest (a run that diverged to NaN keeps its curve up to there)
    failing = min(uncorrected, key=lambda run: min((p["metric"] for p in run["curve"]), default=0.0))["seed"]
    others = run_jobs([job(mode, optimizer, failing) for mode, optimizer, _ in VARIANTS
                       if optimizer != "sgd-uncorrected"], show)
    runs = uncorrected + others
    rows = [{"seed": r["seed"], "variant": label, "lowest": min((p["metric"] for p in r["curve"]), default=math.nan),
             "final": r.get("final", math.nan), "peak_momentum": max((t["momentum_norm"] for t in r["trace"]),
                                                                     default=math.nan),
             "diverged": r.get("failed", "")}
            for r in runs for mode, optimizer, label in VARIANTS if (r["mode"], r["optimizer"]) == (mode, optimizer)]
    print_table(rows, [("seed", "seed", "d"), ("variant", "variant", ""), ("lowest", "lowest test acc %", ".1f"),
                       ("final", "final %", ".1f"), ("peak_momentum", "peak |momentum|", ".1f")])
    minutes = (time.perf_counter() - started) / 60
    print(f"failing seed {failing}; {minutes:.1f} min; load average before {load_before[0]:.2f}, "
          f"after {os.getloadavg()[0]:.2f}")
    output.save_json("collapse", {"shape": shape, "steps": steps, "warmup_steps": WARMUP, "failing_seed": failing,
                           "load_before": load_before, "load_after": os.getloadavg(), "rows": rows, "runs": runs})

    plot(runs, shape, failing, output)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
