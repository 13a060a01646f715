"""What a pip user gets: sdist -> wheel -> a fresh venv with the compiled kernels, the README snippet and the demo.

Offline and fast: the builds use this environment's setuptools/Cython/numpy (no build isolation),
and the fresh venv sees this environment's packages (torch, numpy, ...) through a .pth file, but
not its editable wanlink, so what runs there is the installed wheel.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import sysconfig
import tarfile
import venv
from pathlib import Path

import pytest

from tests.support.blocked import blocking_path
from tests.support.docblocks import ROOT, blocks_of

pytestmark = pytest.mark.slow
LIMIT_S = 600


def _run(args, cwd: Path, **env) -> subprocess.CompletedProcess:
    done = subprocess.run([str(a) for a in args], cwd=cwd, capture_output=True, text=True, timeout=LIMIT_S,
                          env={**os.environ, "PYTHONUNBUFFERED": "1", **env})
    assert done.returncode == 0, f"{args}:\n{done.stdout}\n{done.stderr}"
    return done


def _fresh_venv(where: Path) -> Path:
    """A venv whose only wanlink is what gets installed into it; other packages come from this one."""
    venv.EnvBuilder(with_pip=True).create(where)
    python = where / "bin" / "python"
    purelib = _run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], where)
    target = Path(purelib.stdout.strip())
    shared = where / "shared-packages"
    shared.mkdir()
    for entry in Path(sysconfig.get_paths()["purelib"]).iterdir():
        if not re.match(r"(__editable__|wanlink)", entry.name):
            (shared / entry.name).symlink_to(entry)
    (target / "outer-packages.pth").write_text(f"{shared}\n")
    _run([python, "-m", "pip", "uninstall", "-y", "-q", "setuptools"], where)  # venv's old copy hides the shared one
    return python


def test_sdist_builds_a_wheel_with_compiled_kernels_that_runs_the_readme_and_the_demo(tmp_path: Path):
    dist = tmp_path / "dist"
    _run([sys.executable, "-m", "build", "--sdist", "--no-isolation", "--outdir", dist, ROOT], tmp_path)
    [sdist] = dist.glob("wanlink-*.tar.gz")
    with tarfile.open(sdist) as archive:
        names = {Path(*Path(name).parts[1:]).as_posix() for name in archive.getnames()}
    assert {"cython_ext/_kernels.pyx", "cython_ext/_wire.pyx", "LICENSE", "wanlink/py.typed", "CHANGELOG.md"} <= names

    built = _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-v",
                  "-w", dist, sdist], tmp_path)
    assert "wanlink: compiled kernels built" in built.stdout + built.stderr
    [wheel] = dist.glob("wanlink-*.whl")
    assert not wheel.name.endswith("py3-none-any.whl"), wheel.name

    python = _fresh_venv(tmp_path / "venv")
    _run([python, "-m", "pip", "install", "--no-index", wheel], tmp_path)
    work = tmp_path / "work"  # not the checkout: `import wanlink` must find the installed copy
    work.mkdir()
    checked = _run([python, "-c", "import wanlink, wanlink.kernels as k, wanlink.proto.decoder as d; "
                            "print(wanlink.__file__, k.NAME, d.NAME)"], work)
    location, kernels, decoder = checked.stdout.split()
    assert str(tmp_path / "venv") in location and kernels == decoder == "compiled", checked.stdout
    assert "kernels" in _run([python, "-m", "wanlink", "info"], work).stdout

    [snippet] = [b for b in blocks_of(ROOT / "README.md") if b.language == "python" and "wanlink.serve" in b.code]
    assert "'xxxx'" in _run([python, "-c", snippet.code], work).stdout

    demo = _run([python.parent / "wanlink-demo", "--ranks", "2", "--epochs", "1"], work,
                PYTHONPATH=str(blocking_path(tmp_path, "sklearn")))  # the demo must not need scikit-learn
    assert "final test accuracy" in demo.stdout and "time ratio wanlink/gloo" in demo.stdout
