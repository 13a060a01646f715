"""The fenced code blocks of README.md and docs/*.md, and how the docs test runs each kind.

A block is a ```python or ```bash fence (blocks without a language are diagrams and output: never
run). Two HTML comments on the line right before a fence change what happens to it:

- ``<!-- not-run: REASON -->``: the block is reported as skipped with REASON (say why it cannot run
  here, e.g. "needs two hosts"); use sparingly.
- ``<!-- run-with: COMMAND -->``: the python block is written to a file and run as ``COMMAND FILE``
  (e.g. ``torchrun --standalone --nproc-per-node 2``) instead of in the file's shared session.
"""
from __future__ import annotations

import dataclasses
import re
import shlex
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FENCE = re.compile(r"^```(\w*)\s*$")
DIRECTIVE = re.compile(r"^<!--\s*(not-run|run-with):\s*(.*?)\s*-->$")
RUN_LANGUAGES = ("python", "bash")


@dataclasses.dataclass(frozen=True)
class Block:
    path: Path
    line: int  # of the opening fence, 1-based
    language: str
    code: str
    not_run: str | None = None
    run_with: str | None = None

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def markdown_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def blocks_of(path: Path) -> list[Block]:
    """Every fenced block in ``path`` with a runnable language, with its directive if any."""
    lines = path.read_text().splitlines()
    found, index = [], 0
    while index < len(lines):
        match = FENCE.match(lines[index])
        if not match:
            index += 1
            continue
        end = index + 1
        while end < len(lines) and not lines[end].startswith("```"):
            end += 1
        if end == len(lines):
            raise ValueError(f"{path}:{index + 1}: code fence never closed")
        directive = DIRECTIVE.match(lines[index - 1].strip()) if index else None
        kind, argument = directive.groups() if directive else (None, None)
        if kind and not argument:
            raise ValueError(f"{path}:{index}: <!-- {kind}: --> needs a reason or a command")
        if match.group(1) in RUN_LANGUAGES:
            found.append(Block(path, index + 1, match.group(1), "\n".join(lines[index + 1:end]) + "\n",
                               not_run=argument if kind == "not-run" else None,
                               run_with=argument if kind == "run-with" else None))
        index = end + 1
    return found


def all_blocks() -> list[Block]:
    return [block for path in markdown_files() for block in blocks_of(path)]


def commands_of(block: Block) -> list[list[str]]:
    """A bash block's commands as argument lists: comments, ``sudo`` and VAR=value prefixes dropped."""
    commands = []
    for line in block.code.splitlines():
        words = shlex.split(line, comments=True)
        while words and (words[0] == "sudo" or re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", words[0])):
            words = words[1:]
        if words:
            commands.append(words)
    return commands


# Runs a markdown file's python blocks one after another in one namespace (so a block may use names
# an earlier one defined), each compiled so that top-level `await` works; names the failing block.
SESSION_RUNNER = """
import ast, asyncio, json, sys, traceback
namespace = {"__name__": "__main__"}
for name, code in json.load(sys.stdin):
    print(f"--- running {name}", flush=True)
    try:
        compiled = compile(code, name, "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
        result = eval(compiled, namespace)
        if asyncio.iscoroutine(result):
            asyncio.run(result)
    except BaseException:
        traceback.print_exc()
        print(f"--- FAILED {name}", flush=True)
        sys.exit(1)
"""
