"""PNG timeline of simulated iterations: compute per rank, each bucket's collective (needs matplotlib)."""
from __future__ import annotations

from pathlib import Path

from wanlink.errors import ConfigError
from wanlink.plan.simulate import Prediction

COLOURS = {"forward": "C0", "backward": "C1", "wait": "0.8", "step": "C2"}


def plot_timeline(prediction: Prediction, path: str | Path, iterations: int = 2) -> Path:
    """Draw the last ``iterations`` simulated iterations of ``prediction`` (a fine-model result)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError("--png needs matplotlib (pip install matplotlib)") from None
    if not prediction.segments:
        raise ConfigError("this prediction has no timeline (only the fine model records one)")
    last = max(s[2] for s in prediction.segments)
    shown = [s for s in prediction.segments if s[2] > last - iterations]
    ranks = sorted({s[0] for s in shown if s[0] != "comm"})
    comms = sorted({s[1] for s in shown if s[0] == "comm"}, key=lambda label: int(label.split()[-1]))
    rows = [f"rank {r}" for r in ranks] + comms
    fig, ax = plt.subplots(figsize=(11, 0.45 * len(rows) + 1.5))
    seen = set()
    for rank, kind, iteration, start, end in shown:
        row = rows.index(f"rank {rank}" if rank != "comm" else kind)
        colour = COLOURS.get(kind, f"C{3 + iteration % 6}")
        label = kind if rank != "comm" else f"exchange of iteration {iteration}"
        ax.barh(row, end - start, left=start, color=colour, edgecolor="black", linewidth=0.3,
                label=None if label in seen else label)
        seen.add(label)
    ax.set_yticks(range(len(rows)), rows, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("seconds")
    ax.set_title(f"{prediction.choice.describe()}: {prediction.iteration_s * 1e3:.1f} ms per iteration", fontsize=9)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
