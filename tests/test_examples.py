"""The examples run under torchrun on two local ranks, without scikit-learn (a plain install has none)."""
import os
import subprocess
import sys

import pytest

from tests.support.blocked import blocking_path
from tests.support.docblocks import ROOT

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("script, args, expect", [
    ("examples/ddp_torchrun.py", ["--epochs", "2"], "epoch 2: test accuracy"),
    ("examples/custom_loop.py", ["--steps", "50"], "parameters identical on all ranks: True"),
])
def test_example_runs_under_torchrun(script, args, expect, tmp_path):
    env = {**os.environ, "PYTHONPATH": f"{blocking_path(tmp_path, 'sklearn')}{os.pathsep}{ROOT}",
           "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           script, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and expect in done.stdout, done.stdout + done.stderr
