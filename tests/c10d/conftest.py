"""Most tests here start torch.distributed worlds in fresh processes (seconds each, a minute under
load): they are marked slow, so ``-m "not slow"`` leaves them out. New modules are slow unless
listed as in-process below."""
from pathlib import Path

import pytest

HERE = Path(__file__).parent
IN_PROCESS = {"test_c10d_algorithms.py", "test_c10d_gc.py", "test_fidelity_guard.py"}


def pytest_collection_modifyitems(items):
    for item in items:
        if item.path.parent == HERE and item.path.name not in IN_PROCESS:
            item.add_marker(pytest.mark.slow)
