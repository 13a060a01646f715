"""Without the compiled kernels, the import warns once, says how to fix or silence it, and the reference runs."""
import os
import subprocess
import sys

import pytest

# Makes `import wanlink._kernels` fail as it does when the build skipped the extension.
PROBE = """
import importlib.abc, sys, warnings
class NoCompiledKernels(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "wanlink._kernels":
            raise ImportError("No module named 'wanlink._kernels'")
sys.meta_path.insert(0, NoCompiledKernels())
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import wanlink.kernels
    import wanlink.compress
print(wanlink.kernels.NAME, len(caught))
for warning in caught:
    print(warning.category.__name__, warning.message)
"""


def probe(script: str = PROBE, **env) -> subprocess.CompletedProcess:
    environment = {k: v for k, v in os.environ.items() if k != "WANLINK_PUREPYTHON"}
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True,
                          env={**environment, **env})


@pytest.mark.skipif(sys.platform not in ("linux", "darwin"), reason="the warning is for platforms that build them")
def test_missing_compiled_kernels_warn_once_with_the_way_out():
    lines = probe().stdout.splitlines()
    assert lines[0] == "reference 1", lines
    assert lines[1].startswith("RuntimeWarning") and "WANLINK_PUREPYTHON=1" in lines[1] and "pip install -v" in lines[1]


def test_choosing_the_reference_silences_the_warning():
    assert probe(WANLINK_PUREPYTHON="1").stdout.splitlines() == ["reference 0"]


# A stale build is a broken install on any platform: it warns even where no build is expected.
STALE_ON_ANOTHER_PLATFORM = """
import sys, types, warnings
import numpy, wanlink  # imported before the platform is faked
sys.platform = "win32"
sys.modules["wanlink._kernels"] = types.SimpleNamespace(KERNEL_ABI=-1)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import wanlink.kernels
print(wanlink.kernels.NAME, len(caught))
for warning in caught:
    print(warning.category.__name__, warning.message)
"""


def test_a_stale_build_warns_on_a_platform_that_does_not_build_them():
    lines = probe(STALE_ON_ANOTHER_PLATFORM).stdout.splitlines()
    assert lines[0] == "reference 1", lines
    assert lines[1].startswith("RuntimeWarning") and "stale (KERNEL_ABI is -1" in lines[1]

