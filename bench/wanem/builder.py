"""Build the wanem emulator from source with the system C compiler (into bench/wanem/build/)."""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

HERE = Path(__file__).resolve().parent
SOURCE = HERE / "wanem.c"
BUILD_DIR = HERE / "build"
BINARY = BUILD_DIR / "wanem"
CFLAGS = ["-O2", "-g", "-std=gnu11", "-Wall", "-Wextra", "-pthread"]


class BuildError(RuntimeError):
    """The emulator could not be compiled."""


def compiler() -> str | None:
    """Path of the C compiler (``$CC`` or gcc/cc), or None."""
    return shutil.which(os.environ.get("CC", "gcc")) or shutil.which("cc")


def build(force: bool = False) -> Path:
    """Compile wanem.c when it (or the flags) changed; return the binary's path."""
    cc = compiler()
    if cc is None:
        raise BuildError("no C compiler found (install gcc or set $CC) to build bench/wanem/wanem.c")
    digest = hashlib.sha256(SOURCE.read_bytes() + " ".join([cc, *CFLAGS]).encode()).hexdigest()
    stamp = BUILD_DIR / "wanem.sha256"
    if not force and BINARY.exists() and stamp.exists() and stamp.read_text() == digest:
        return BINARY
    BUILD_DIR.mkdir(exist_ok=True)
    tmp = BUILD_DIR / f"wanem.{os.getpid()}.tmp"
    proc = subprocess.run([cc, *CFLAGS, "-o", str(tmp), str(SOURCE), "-lm"], capture_output=True, text=True)
    if proc.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise BuildError(f"{cc} failed to build {SOURCE}:\n{proc.stderr}")
    os.replace(tmp, BINARY)  # atomic: parallel builders never see a half-written binary
    stamp.write_text(digest)
    return BINARY


if __name__ == "__main__":
    print(build(force=True))
