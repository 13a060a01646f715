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


def probe(**env) -> subprocess.CompletedProcess:
    environment = {k: v for k, v in os.environ.items() if k != "WANLINK_PUREPYTHON"}
    return subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120, check=True,
                          env={**environment, **env})


@pytest.mark.skipif(sys.platform not in ("linux", "darwin"), reason="the warning is for platforms that build them")
def test_missing_compiled_kernels_warn_once_with_the_way_out():
    lines = probe().stdout.splitlines()
    assert lines[0] == "reference 1", lines
    assert lines[1].startswith("RuntimeWarning") and "WANLINK_PUREPYTHON=1" in lines[1] and "pip install -v" in lines[1]


def test_choosing_the_reference_silences_the_warning():
    assert probe(WANLINK_PUREPYTHON="1").stdout.splitlines() == ["reference 0"]
