#!/usr/bin/env python3
"""One-command set-up and entry points: `python3 dev.py demo` and `python3 dev.py test`.

Creates .venv (if missing), installs wanlink with its test extras pinned by constraints.txt
(re-installing only when pyproject.toml, setup.py, constraints.txt or cython_ext/ change), then runs
the loopback demo or the whole test suite. Extra arguments are passed through.
"""
import hashlib
import os
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = ROOT / ".venv"
STAMP = ROOT / ".dev-stamp"
INSTALL_INPUTS = ["pyproject.toml", "setup.py", "constraints.txt"]


def venv_python() -> Path:
    return VENV / "bin" / "python"


def install_fingerprint() -> str:
    digest = hashlib.sha256()
    paths = [ROOT / name for name in INSTALL_INPUTS]
    paths += sorted((ROOT / "cython_ext").glob("*.p*"))
    for path in paths:
        if path.exists():
            digest.update(path.name.encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


def ensure_installed() -> None:
    if not venv_python().exists():
        print(f"dev.py: creating {VENV}", flush=True)
        venv.EnvBuilder(with_pip=True).create(VENV)
    fingerprint = install_fingerprint()
    if STAMP.exists() and STAMP.read_text() == fingerprint:
        return
    print("dev.py: installing wanlink[test] (torch pinned by constraints.txt)", flush=True)
    subprocess.run(
        [str(venv_python()), "-m", "pip", "install", "--quiet", "-c", str(ROOT / "constraints.txt"),
         "-e", f"{ROOT}[test]"],
        check=True,
    )
    STAMP.write_text(fingerprint)


# What each command runs in .venv's Python, before the arguments passed through ("bench" and
# "python" both run a script or `-m module`; "bench" says what it is for).
COMMANDS = {
    "demo": ["-m", "wanlink.cli.demo"],
    "test": ["-m", "pytest"],
    "bench": [],
    "python": [],
}


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in COMMANDS:
        print(__doc__)
        print("usage: python3 dev.py {demo|test|bench SCRIPT|python ...} [args...]")
        return 2
    ensure_installed()
    command, rest = argv[0], argv[1:]
    args = [str(venv_python()), *COMMANDS[command], *rest]
    return subprocess.call(args, cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"})


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
