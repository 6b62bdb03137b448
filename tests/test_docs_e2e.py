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

A sample (``<!-- sample: COMMAND | MODE -->`` ... ``<!-- /sample -->``, written by ``docs/make_samples.py``)
is checked harder: its command runs again, and the counts it states (the header's targets, the verdict line's
OK/FAIL/skip counts), every result line, and how the output ends (the verdict block, never a ``wrote`` line)
must be what the run prints (``make_samples.differences``).
"""

from __future__ import annotations

import importlib.util
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


def _make_samples():
    spec = importlib.util.spec_from_file_location("make_samples", ROOT / "docs" / "make_samples.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["make_samples"] = module   # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


make_samples = _make_samples()
SAMPLES = [s for page in PAGES for s in make_samples.samples_in(page)]
SAMPLE_FENCES = {(str(s.page.relative_to(ROOT)), s.fence) for s in SAMPLES}


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
            elif lang == "" and body and body[0].startswith("$ ") and (name, line) not in SAMPLE_FENCES:
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
    assert len(RUN) + len(SAMPLES) >= 10   # a sample's command runs in test_a_sample_is_what_its_command_prints


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


# -- samples: what a page shows as a run's output is what that run prints ------------------------------------

STALE_README = """distcheck 0.1.0: 43 scenario(s) on 4 gloo ranks
  RUN  auroc_all_ranks_compute  [1/43]
  OK   auroc_all_ranks_compute  expected pass, observed pass  (2.1 s)
  ...
  SKIP cpu_state_on_nccl  only meaningful on nccl; this run uses gloo
  ...
PASS  42/42 scenarios behaved as expected (24 planted bugs found, 18 clean), 1 skipped  · gloo × 4 ranks · 53.0 s
      run dir: ~/.local/state/distcheck/runs/20261205-142906-3f2a1c""".splitlines()
A_RUN = """distcheck 0.1.0: 45 scenario(s) on 4 gloo ranks
  RUN  auroc_all_ranks_compute  [1/45]
  OK   auroc_all_ranks_compute  expected pass, observed pass  (3.4 s)
  OK   auroc_rank0_only_compute  expected hang, observed hang (ended at a certain hang)  (2.9 s)
  SKIP cpu_state_on_nccl  only meaningful on nccl; this run uses gloo
PASS  44/44 scenarios behaved as expected (24 planted bugs found, 20 clean), 1 skipped  · gloo × 4 ranks · 71.2 s
      run dir: ~/.local/state/distcheck/runs/20261207-101500-aa11bb  (timeline.html inside)""".splitlines()


def _sample(body: list[str], mode: str = "catalogue", command: str = "distcheck run"):
    return make_samples.Sample(ROOT / "README.md", 1, 2, command, mode, tuple(body), body[0].startswith("$ "))


def test_every_run_shown_on_a_page_is_a_sample():
    """A block that shows a run's header or verdict line is rewritten by docs/make_samples.py and checked below."""
    loose = []
    for page in PAGES:
        name = str(page.relative_to(ROOT))
        for line, lang, body, _ in _fences(page.read_text(encoding="utf-8")):
            shows_a_run = any(make_samples.HEADER.match(x) or make_samples.VERDICT.match(x) for x in body)
            if lang == "" and shows_a_run and (name, line) not in SAMPLE_FENCES:
                loose.append(f"{name}:{line}")
    assert not loose, loose
    assert len(SAMPLES) >= 5 and {s.mode for s in SAMPLES} == set(make_samples.MODES)


def test_a_stale_sample_is_caught():
    """The README's sample before docs/make_samples.py: 43 scenarios and 42/42 where a run prints 45 and 44/44."""
    ran = make_samples.Ran(0, tuple(A_RUN))
    found = make_samples.differences(_sample(STALE_README), ran)
    assert any(d.startswith("header:") and "43 scenario" in d and "45 scenario" in d for d in found), found
    assert any(d.startswith("verdict:") and "42/42" in d and "44/44" in d for d in found), found
    assert not make_samples.differences(_sample(make_samples.excerpt(ran.lines, "catalogue")), ran)
    wrote_last = make_samples.Ran(0, (*A_RUN, "      wrote ~/.local/state/distcheck/runs/x/timeline.html"))
    assert any("last line" in d for d in make_samples.differences(_sample(STALE_README), wrote_last))


@pytest.fixture(scope="module")
def sample_runs(tmp_path_factory) -> dict:
    return {}   # command -> make_samples.Ran: a command two pages show runs once


@pytest.mark.e2e
@pytest.mark.docs
@pytest.mark.timeout(make_samples.TIMEOUT_S + 60)
@pytest.mark.parametrize("sample", SAMPLES, ids=[f"{s.page.relative_to(ROOT)}:{s.line}" for s in SAMPLES])
def test_a_sample_is_what_its_command_prints(sample, sample_runs, tmp_path):
    if sample.command not in sample_runs:
        workdir = make_samples.examples_copy(tmp_path)
        sample_runs[sample.command] = make_samples.run_command(sample.command, workdir)
        assert not survivors(str(workdir))
    ran = sample_runs[sample.command]
    expected = 2 if any(make_samples.ERROR.match(x) for x in sample.shown) else \
        1 if any(x.startswith(("FAIL", "  FAIL")) for x in sample.shown) else 0
    assert ran.code == expected, (sample.command, ran.code, ran.lines[-30:])
    found = make_samples.differences(sample, ran)
    assert not found, (f"{sample.page.name}:{sample.line}: rerun python docs/make_samples.py", found, ran.lines[-30:])
