"""Shared output for bench scripts: a printed table, JSON and a PNG under bench/results/."""
from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def machine_info() -> dict:
    """What the figures were measured on, including the load when the run started."""
    load = os.getloadavg()
    return {"host": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version(),
            "loadavg_1_5_15": [round(x, 2) for x in load], "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def print_table(rows: list[dict], columns: list[tuple[str, str, str]]) -> None:
    """columns: (key, header, format spec); each column as wide as its widest cell."""
    cells = [[format(row[key], fmt) if row.get(key, "") != "" else "" for key, _h, fmt in columns] for row in rows]
    widths = [max([len(header)] + [len(line[i]) for line in cells]) for i, (_k, header, _f) in enumerate(columns)]
    print("  ".join(f"{header:>{w}}" for (_k, header, _f), w in zip(columns, widths)))
    for line in cells:
        print("  ".join(f"{cell:>{w}}" for cell, w in zip(line, widths)))


def save_json(name: str, payload: dict) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps({"machine": machine_info(), **payload}, indent=2))
    return path


def new_figure(*args, **kwargs):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(*args, **kwargs)


def save_figure(fig, name: str) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.png"
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path
