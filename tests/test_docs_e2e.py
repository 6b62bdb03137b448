"""The docs lane: every shell block of README.md and docs/*.md runs as written, and the output a page
shows is what distcheck prints (timings aside).

A ```bash block runs command by command (a line ending in a backslash goes on) in a copy of
``examples/``, the files the docs name. Each command must exit 0, or a code the block's marker
allows: ``<!-- docs-lane: exit 0 1 (why) -->`` right above it. ``<!-- docs-lane: skip (why) -->`` opts
a block out (a GPU, several nodes, a package install); keep those few and say why. A plain block
whose first line is ``$ COMMAND`` is a command with the output it shows: it runs too (exit 1 where
the output has a FAIL line, 2 where it has distcheck's error line), and every result line it shows
(``OK``/``FAIL``/``SKIP``/``PASS``, the error line) must be in what it printed, durations masked.
So is the output block right under a ```bash block.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import survivors

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARKER = re.compile(r"<!--\s*docs-lane:\s*(?P<what>skip|exit)\b(?P<rest>[^>]*)-->")
# what a page's output must show as distcheck prints it: result lines, error lines, a finding's first line
RESULT = re.compile(r"^\s*(OK|FAIL|SKIP|PASS|NOTHING RAN)\s|^distcheck: error:|^\s+[A-Z]+ \[(error|warning|info|expected)\] ")
COMMAND_TIMEOUT_S = 240


@dataclass(frozen=True)
class Block:
    page: str
    line: int
    commands: tuple[str, ...]
    exits: frozenset[int]
    shown: tuple[str, ...]     # the result lines the page shows for it


def _fences(text: str) -> list[tuple[int, str, list[str], str]]:
    """(line, language, body, the text right before it) of every fenced block."""
    out, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        if lines[i].startswith("```"):
            lang, start = lines[i][3:].strip(), i
            j = i + 1
            while j < len(lines) and not lines[j].startswith("```"):
                j += 1
            before = "\n".join(lines[max(0, start - 3):start])
            out.append((start + 1, lang, lines[start + 1:j], before))
            i = j + 1
        else:
            i += 1
    return out


def _commands(body: list[str]) -> tuple[str, ...]:
    cmds, current = [], ""
    for line in body:
        line = re.sub(r"\s+#.*$", "", line) if not line.lstrip().startswith("#") else ""
        current += line.rstrip("\\").rstrip() + " " if line.rstrip().endswith("\\") else line
        if not line.rstrip().endswith("\\"):
            if current.strip():
                cmds.append(current.strip())
            current = ""
    return tuple(cmds)


def _results(lines: list[str]) -> tuple[str, ...]:
    return tuple(line for line in lines if RESULT.match(line))


def blocks() -> tuple[list[Block], list[tuple[str, int, str]]]:
    """The blocks to run, and the skipped ones (page, line, why)."""
    run, skipped = [], []
    for page in PAGES:
        fences = _fences(page.read_text(encoding="utf-8"))
        name = str(page.relative_to(ROOT))
        for k, (line, lang, body, before) in enumerate(fences):
            marker = MARKER.search(before.splitlines()[-1]) if before.splitlines() else None
            if lang == "bash":
                if marker and marker["what"] == "skip":
                    skipped.append((name, line, marker["rest"].strip()))
                    continue
                exits = frozenset(int(x) for x in re.findall(r"\b\d+\b", marker["rest"].split("(")[0])) \
                    if marker and marker["what"] == "exit" else frozenset({0})
                after = fences[k + 1] if k + 1 < len(fences) and fences[k + 1][1] == "" \
                    and fences[k + 1][0] - (line + len(body)) <= 3 else None
                run.append(Block(name, line, _commands(body), exits, _results(after[2]) if after else ()))
            elif lang == "" and body and body[0].startswith("$ "):
                shown = _results(body[1:])
                code = 2 if any(s.startswith("distcheck: error:") for s in shown) else \
                    1 if any(s.lstrip().startswith("FAIL") for s in shown) else 0
                run.append(Block(name, line, _commands([body[0][2:]]), frozenset({code}), shown))
    return run, skipped


def _masked(text: str) -> str:
    text = re.sub(r"\(\d+(\.\d+)? s\)", "(… s)", text)
    return re.sub(r"\s+", " ", text).strip()


RUN, SKIPPED = blocks()


def test_the_docs_opt_out_few_blocks_and_say_why():
    assert len(SKIPPED) <= 12, SKIPPED
    assert all(why.startswith("(") and why.endswith(")") and len(why) > 5 for _, _, why in SKIPPED), SKIPPED
    assert len(RUN) >= 10


@pytest.fixture(scope="module")
def examples(tmp_path_factory) -> Path:
    where = tmp_path_factory.mktemp("docs") / "examples"
    shutil.copytree(ROOT / "examples", where)
    return where


@pytest.mark.e2e
@pytest.mark.docs
@pytest.mark.timeout(COMMAND_TIMEOUT_S * 4)
@pytest.mark.parametrize("block", RUN, ids=[f"{b.page}:{b.line}" for b in RUN])
def test_a_docs_block_runs_as_written(block: Block, examples: Path):
    env = {**os.environ, "COLUMNS": "250", "PYTHONPATH": os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    out = ""
    for command in block.commands:
        done = subprocess.run(["bash", "-c", command], cwd=examples, env=env, capture_output=True, text=True,
                              timeout=COMMAND_TIMEOUT_S, start_new_session=True)
        assert done.returncode in block.exits, (command, done.returncode, done.stdout[-3000:], done.stderr[-3000:])
        out += done.stdout + done.stderr
    printed = _masked(out)   # one line: a page wraps a long line where the terminal did not
    for line in block.shown:
        want = _masked(line)
        assert want in printed, (block.page, block.line, want, out[-4000:])
    assert not survivors(str(examples))
