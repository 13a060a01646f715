"""What a bug report needs: versions, the kernels in use, the event loop, and the kernel's TCP facts.

``python -m wanlink info`` prints :func:`report`; ``wanlink-iperf --version`` prints it too.
Everything is read without importing torch or opening a socket, and a fact the system does not
offer reads "unavailable" instead of failing.
"""
from __future__ import annotations

import importlib.metadata
import platform
import socket
import sys

import wanlink

UNAVAILABLE = "unavailable"
CPU_FLAGS = ("sse4_2", "popcnt", "avx2", "avx512f", "fma", "asimd", "sve")
SYSCTLS = {
    "congestion controls available": "/proc/sys/net/ipv4/tcp_available_congestion_control",
    "default congestion control": "/proc/sys/net/ipv4/tcp_congestion_control",
    "tcp_rmem (min default max)": "/proc/sys/net/ipv4/tcp_rmem",
    "tcp_wmem (min default max)": "/proc/sys/net/ipv4/tcp_wmem",
    "net.core.rmem_max": "/proc/sys/net/core/rmem_max",
    "net.core.wmem_max": "/proc/sys/net/core/wmem_max",
    "tcp_notsent_lowat (system default)": "/proc/sys/net/ipv4/tcp_notsent_lowat",
    "tcp_slow_start_after_idle": "/proc/sys/net/ipv4/tcp_slow_start_after_idle",
}


def _read(path: str) -> str:
    try:
        with open(path) as handle:
            return " ".join(handle.read().split())
    except OSError:
        return UNAVAILABLE


def _distribution_version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def cpu_features() -> list[str]:
    """The CPU flags the kernels care about, as /proc/cpuinfo lists them (empty where it does not exist)."""
    listed: set[str] = set()
    try:
        with open("/proc/cpuinfo") as handle:
            lines = handle.read().splitlines()
    except OSError:
        lines = []
    for line in lines:
        if line.startswith(("flags", "Features")):  # x86, ARM
            listed.update(line.partition(":")[2].split())
    return [flag for flag in CPU_FLAGS if flag in listed]


def kernels_facts() -> dict[str, str]:
    from wanlink import kernels
    from wanlink.proto import decoder

    facts = {"in use": kernels.NAME, "available": ", ".join(kernels.available())}
    if "compiled" in kernels.available():
        facts["vector scoring"] = getattr(kernels.load("compiled"), "VECTOR_SCORING", UNAVAILABLE)
    facts["threads"] = str(kernels.num_threads())
    facts["frame decoder"] = decoder.NAME
    facts["CPU features"] = ", ".join(cpu_features()) or UNAVAILABLE
    return facts


def event_loop_facts() -> dict[str, str]:
    version = _distribution_version("uvloop")
    loop = "asyncio (stdlib)" if version == "not installed" else f"uvloop {version}"
    return {"wanlink's event loop": loop}


def tcp_facts() -> dict[str, str]:
    facts = {name: _read(path) for name, path in SYSCTLS.items()}
    facts["TCP_NOTSENT_LOWAT socket option"] = "yes" if hasattr(socket, "TCP_NOTSENT_LOWAT") else "no"
    return facts


def collect() -> dict[str, dict[str, str]]:
    """Every fact, grouped by section; a plain dict, for JSON output and tests."""
    return {
        "versions": {
            "wanlink": wanlink.__version__,
            "python": f"{platform.python_implementation()} {platform.python_version()}",
            "torch": _distribution_version("torch"),
            "numpy": _distribution_version("numpy"),
            "platform": f"{platform.system()} {platform.release()} {platform.machine()}",
        },
        "kernels": kernels_facts(),
        "event loop": event_loop_facts(),
        "kernel TCP": tcp_facts(),
    }


def report() -> str:
    """:func:`collect` as aligned text, one section per heading."""
    sections = collect()
    width = max(len(key) for facts in sections.values() for key in facts)
    lines = []
    for title, facts in sections.items():
        lines.append(f"{title}:")
        lines += [f"  {key:<{width}}  {value}" for key, value in facts.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``python -m wanlink info [--json]``."""
    import argparse
    import json

    parser = argparse.ArgumentParser(prog="python -m wanlink", description="wanlink's command-line helpers")
    commands = parser.add_subparsers(dest="command", required=True)
    info = commands.add_parser("info", help="versions, kernels, event loop and TCP facts for a bug report")
    info.add_argument("--json", action="store_true", help="print the facts as JSON")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    print(json.dumps(collect(), indent=2) if args.json else report())
    return 0
