"""Shared output for bench scripts: a printed table, and JSON + PNG with one header shape.

Every bench takes ``--out DIR`` (default: a scratch directory under the system's temp dir) and
``--publish`` (write to bench/results/, replacing the committed files: only for a run meant to be
quoted). Its JSON starts with :func:`header`: machine, CPU count, load before and after, versions,
git commit and command line, so every result says what it was measured on.
"""
from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"


def child_env(**extra: str) -> dict[str, str]:
    """The environment for a bench's child processes: this one's, with the checkout first on
    PYTHONPATH (ahead of what the user had there, not instead of it), and ``extra`` set."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, **extra}
SCRATCH = Path(tempfile.gettempdir()) / "wanlink-bench"

# One colour per variant name across every panel and plot (matplotlib's tab10 order).
PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22",
           "#17becf")


def add_output_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, default=SCRATCH,
                        help=f"directory for the JSON and PNG (default {SCRATCH}; bench/results/ only with --publish)")
    parser.add_argument("--publish", action="store_true",
                        help="write to bench/results/, replacing the committed results")


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _git_commit() -> str | None:
    try:
        done = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10)
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return None
    return (done.stdout.strip() + ("+dirty" if dirty else "")) or None


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


class Run:
    """One bench run: where it writes, and the header every JSON of the run carries."""

    def __init__(self, args: argparse.Namespace):
        self.out = RESULTS if args.publish else Path(args.out)
        self.load_before = _load()
        self.git_commit = _git_commit()  # at the start: a --publish run's own partial saves dirty the tree
        self.started = time.time()
        self.command = [Path(sys.argv[0]).name if sys.argv[0] else "python", *sys.argv[1:]]

    def header(self) -> dict:
        """Machine, CPU count, load before/after, versions, git commit, command line, date."""
        return {
            "machine": {"host": platform.node(), "cpu": _cpu_model(), "cpus": os.cpu_count(),
                        "platform": f"{platform.system()} {platform.release()} {platform.machine()}"},
            "load_before": self.load_before,  # 1, 5, 15 minute load averages
            "load_after": _load(),
            "versions": {"python": platform.python_version(), "wanlink": _version("wanlink"),
                         "torch": _version("torch"), "numpy": _version("numpy")},
            "git_commit": self.git_commit,
            "command": self.command,
            "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.started)),
            "seconds": round(time.time() - self.started, 1),
        }

    def path(self, name: str) -> Path:
        self.out.mkdir(parents=True, exist_ok=True)
        return self.out / name

    def save_json(self, name: str, payload: dict) -> Path:
        path = self.path(f"{name}.json")
        path.write_text(json.dumps({"header": self.header(), **payload}, indent=1, default=str) + "\n")
        return path

    def save_text(self, name: str, text: str) -> Path:
        path = self.path(name)
        path.write_text(text)
        return path

    def save_figure(self, fig, name: str) -> Path:
        path = self.path(f"{name}.png")
        fig.savefig(path, dpi=110, bbox_inches="tight")  # keeps legends placed outside the axes
        return path


def print_table(rows: list[dict], columns: list[tuple[str, str, str]]) -> None:
    """columns: (key, header, format spec); each column as wide as its widest cell."""
    cells = [[format(row[key], fmt) if row.get(key, "") != "" else "" for key, _h, fmt in columns] for row in rows]
    widths = [max([len(header)] + [len(line[i]) for line in cells]) for i, (_k, header, _f) in enumerate(columns)]
    print("  ".join(f"{header:>{w}}" for (_k, header, _f), w in zip(columns, widths)))
    for line in cells:
        print("  ".join(f"{cell:>{w}}" for cell, w in zip(line, widths)))


def new_figure(*args, **kwargs):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(*args, **kwargs)


def colours(names) -> dict[str, str]:
    """A fixed colour per name, in the order given: pass every variant once so panels agree."""
    return {name: PALETTE[i % len(PALETTE)] for i, name in enumerate(dict.fromkeys(names))}


def legend_outside(axis, **kwargs) -> None:
    """The legend to the right of the axes, never over the data."""
    axis.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0, frameon=False, **kwargs)
