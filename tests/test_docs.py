"""Every code block in README.md and docs/*.md runs (tests/support/docblocks.py says how).

Python blocks of one file run in order in one process sharing names (network parts on loopback);
a block marked ``<!-- run-with: torchrun ... -->`` runs as that command. Bash blocks: every command
must name something that exists (a dev.py command, a wanlink entry point, a module, a file, or a
program on PATH), and wanlink's own entry points and modules answer ``--help``.
"""
from __future__ import annotations

import importlib.util
import json
import shlex
import shutil
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

import pytest

from bench.reporting import child_env
from tests.support.docblocks import ROOT, SESSION_RUNNER, Block, all_blocks, blocks_of, commands_of

BLOCKS = all_blocks()
LIMIT_S = 300
NOT_RUN_COMMANDS = {"pip"}  # installs: checked by tests/test_packaging.py, never run here
ENTRY_POINTS = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]


def _run(args: list[str], **kwargs) -> subprocess.CompletedProcess:
    env = child_env(PYTHONUNBUFFERED="1")
    return subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=LIMIT_S, env=env, **kwargs)


def _session_cases():
    cases = []
    for path in sorted({block.path for block in BLOCKS}):
        session = [b for b in blocks_of(path) if b.language == "python" and not b.run_with and not b.not_run]
        if session:
            slow = any("torch" in block.code for block in session)  # a torch import alone takes seconds
            cases.append(pytest.param(session, id=str(path.relative_to(ROOT)), marks=[pytest.mark.slow] * slow))
    return cases


def _marked(kind: str):
    cases = []
    for block in BLOCKS:
        if block.not_run and block.language == kind:
            cases.append(pytest.param(block, id=block.name, marks=pytest.mark.skip(reason=block.not_run)))
        elif block.language == kind and (kind == "bash" or block.run_with):
            marks = [pytest.mark.slow] if block.run_with else []
            cases.append(pytest.param(block, id=block.name, marks=marks))
    return cases


@pytest.mark.parametrize("session", _session_cases())
def test_python_blocks_run(session: list[Block]):
    done = _run([sys.executable, "-c", SESSION_RUNNER], input=json.dumps([(b.name, b.code) for b in session]))
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize("block", _marked("python"))
def test_python_blocks_run_with_their_launcher(block: Block, tmp_path: Path):
    script = tmp_path / "block.py"
    script.write_text(block.code)
    launcher = shlex.split(block.run_with)
    if launcher[0] == "torchrun":  # the venv's, as `python -m torch.distributed.run`
        launcher = [sys.executable, "-m", "torch.distributed.run", *launcher[1:]]
    done = _run([*launcher, str(script)])
    assert done.returncode == 0, done.stdout + done.stderr


def _check_python_command(words: list[str]) -> list[str] | None:
    """The --help probe for ``python3 ...`` (None when there is nothing cheap to run)."""
    args = words[1:]
    if args[:1] == ["dev.py"]:
        import dev  # the repository root is on sys.path (pytest's pythonpath)

        assert args[1] in dev.COMMANDS, f"`dev.py {args[1]}` is not a dev.py command ({sorted(dev.COMMANDS)})"
        rest = args[2:]
        if args[1] in ("bench", "python") and rest:
            return _check_python_command(["python3", *rest])
        return None
    if args[:1] == ["-m"]:
        module = args[1]
        assert importlib.util.find_spec(module) is not None, f"no module {module}"
        return [sys.executable, "-m", module, "--help"]
    script = next((arg for arg in args if not arg.startswith("-")), None)
    if script is not None:
        assert (ROOT / script).exists(), f"{script} does not exist"
        return [sys.executable, script, "--help"]
    return None


@pytest.mark.parametrize("block", _marked("bash"))
def test_bash_block_commands_exist(block: Block):
    probes = []
    for words in commands_of(block):
        program = words[0]
        if program in NOT_RUN_COMMANDS:
            continue
        if program in ("python", "python3"):
            probes.append(_check_python_command(words))
        elif program in ENTRY_POINTS:
            probes.append([str(Path(sys.executable).parent / program), "--help"])
        elif program == "torchrun":
            for arg in words[1:]:
                assert not arg.endswith(".py") or (ROOT / arg).exists(), f"{arg} does not exist"
        else:
            assert shutil.which(program) or (ROOT / program).exists(), f"{block.name}: {program} not found"
    for probe in filter(None, probes):
        done = _run(probe)
        assert done.returncode == 0, f"{shlex.join(probe)}:\n{done.stdout}{done.stderr}"


def test_directives_are_read(tmp_path: Path):
    page = tmp_path / "page.md"
    page.write_text("<!-- not-run: needs two hosts -->\n```bash\nssh a\n```\n\n```\nplain\n```\n"
                    "<!-- run-with: torchrun --nproc-per-node 2 -->\n```python\nprint(1)\n```\n")
    first, second = blocks_of(page)
    assert (first.not_run, first.run_with, first.code) == ("needs two hosts", None, "ssh a\n")
    assert (second.run_with, second.language, second.line) == ("torchrun --nproc-per-node 2", "python", 10)
    page.write_text("<!-- not-run: -->\n```bash\nls\n```\n")
    with pytest.raises(ValueError, match="needs a reason"):
        blocks_of(page)


def test_a_failing_block_fails_its_session():
    with tempfile.TemporaryDirectory() as workdir:
        page = Path(workdir) / "page.md"
        page.write_text("```python\nvalue = 41\n```\n\n```python\nassert value == 42, 'off by one'\n```\n")
        session = blocks_of(page)
    blocks = [(f"block {b.line}", b.code) for b in session]
    done = _run([sys.executable, "-c", SESSION_RUNNER], input=json.dumps(blocks))
    assert done.returncode == 1 and "off by one" in done.stderr and "--- FAILED block 5" in done.stdout
