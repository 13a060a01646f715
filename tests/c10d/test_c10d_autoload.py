"""backend="wanlink" works without ``import wanlink`` (torch entry points), and registration is safe."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from importlib import metadata

import pytest

USE_WITHOUT_IMPORT = textwrap.dedent("""
    import sys
    import torch, torch.distributed as dist
    print("imported-before-init", "wanlink" in sys.modules)
    dist.init_process_group("wanlink", store=dist.HashStore(), rank=0, world_size=1)
    tensor = torch.ones(3)
    dist.all_reduce(tensor)
    print("backend", dist.get_backend(), tensor.tolist())
    dist.destroy_process_group()
""")


def run_python(code: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **env})


def wanlink_entry_points(group: str) -> list:
    return [ep for ep in metadata.entry_points(group=group) if ep.name == "wanlink"]


@pytest.fixture
def installed():
    if not wanlink_entry_points("torch.backends"):
        pytest.skip("wanlink is not installed with its entry points (pip install -e .)")


def test_entry_points_are_declared(installed):
    assert wanlink_entry_points("torch.backends")[0].value == "wanlink.c10d._register:autoload"
    assert wanlink_entry_points("torch.distributed.backends")[0].value == "wanlink.c10d._register:register"


def test_backend_works_without_importing_wanlink(installed):
    done = run_python(USE_WITHOUT_IMPORT, TORCH_DEVICE_BACKEND_AUTOLOAD="1")
    assert done.returncode == 0, done.stderr
    assert "backend wanlink [1.0, 1.0, 1.0]" in done.stdout, done.stdout


def test_autoload_can_be_switched_off():
    done = run_python(USE_WITHOUT_IMPORT, TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    assert done.returncode != 0
    assert "imported-before-init False" in done.stdout
    assert "wanlink" in done.stderr.lower()  # torch names the unknown backend


def test_import_before_torch_registers_once_torch_distributed_loads():
    code = "import wanlink, sys\nassert 'torch' not in sys.modules\n" + USE_WITHOUT_IMPORT
    done = run_python(code, TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    assert done.returncode == 0, done.stderr
    assert "backend wanlink" in done.stdout


def test_import_wanlink_stays_cheap():
    done = run_python("import sys, wanlink\nprint(sorted(m for m in ('torch', 'asyncio', 'wanlink.io.link') "
                      "if m in sys.modules))", TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", done.stdout


def test_registration_is_idempotent_and_autoload_never_raises(monkeypatch, caplog):
    import torch.distributed as dist

    from wanlink.c10d import _register

    assert _register.register() and _register.register()
    assert "wanlink" in dist.Backend.backend_list
    assert dist.Backend.backend_capability["wanlink"] == ["cpu", "cuda"]

    def broken(*args, **kwargs):
        raise RuntimeError("registry unavailable")

    monkeypatch.setattr(_register, "_registered", False)
    monkeypatch.setattr(_register, "register", broken)
    _register.autoload()  # must not raise
    assert "registry unavailable" in caplog.text
