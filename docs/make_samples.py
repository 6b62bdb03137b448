"""Rewrite the sample outputs in README.md and docs/*.md from real runs of the commands they show.

    python docs/make_samples.py [PAGE ...]          # every page with samples, or these

A sample is a fenced block between two marker comments that name the command and the part of its output
shown (``all``; ``block``: the target's result block; ``catalogue``: the header, the first results, every
skipped or failed one and the verdict block):

    <!-- sample: distcheck run | catalogue -->
    *(the machine and the date of the run, written by this script)*
    ```
    ...
    ```
    <!-- /sample -->

Each command runs in a copy of ``examples/`` (the files the docs name), with a runs dir of its own shown as
the default one (``~/.local/state/distcheck/runs``) and a 140-column terminal, as in a log. The docs lane
(``tests/test_docs_e2e.py``, ``pytest -m docs``) runs every sample's command again and fails where a count,
a result line, the command or the verdict block no longer matches (``differences``).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
OPEN = re.compile(r"^<!--\s*sample:\s*(?P<command>.+?)\s*(?:\|\s*(?P<mode>all|block|catalogue)\s*)?-->\s*$")
CLOSE = "<!-- /sample -->"
MODES = ("all", "block", "catalogue")
SHOWN_RUNS = "~/.local/state/distcheck/runs"
TIMEOUT_S = 900

# what a run prints, line by line
HEADER = re.compile(r"^distcheck \S+: ")
RESULT = re.compile(r"^  (OK|FAIL|SKIP)\s{1,3}\S")
VERDICT = re.compile(r"^(PASS|FAIL|NOTHING RAN|NOTHING CHECKED)  ")
ERROR = re.compile(r"^distcheck: error: ")
FINDING = re.compile(r"^\s+[A-Z]+ \[(error|warning|info|expected)\] ")


@dataclass(frozen=True)
class Sample:
    page: Path
    line: int                  # the opening marker's line (1-based)
    fence: int                 # its block's opening fence line (1-based)
    command: str
    mode: str
    body: tuple[str, ...]      # the fenced block's lines
    dollar: bool               # the block starts with "$ COMMAND"

    @property
    def shown(self) -> tuple[str, ...]:
        """The output lines the block shows (without its "$ COMMAND" line)."""
        return self.body[1:] if self.dollar else self.body


def samples_in(page: Path) -> list[Sample]:
    """The samples of one page, in order."""
    lines = page.read_text(encoding="utf-8").splitlines()
    found = []
    for i, line in enumerate(lines):
        m = OPEN.match(line)
        if m is None:
            continue
        end = lines.index(CLOSE, i)
        fence = [j for j in range(i, end) if lines[j].startswith("```")]
        if len(fence) != 2:
            raise SystemExit(f"{page}:{i + 1}: a sample holds one fenced block")
        body = tuple(lines[fence[0] + 1:fence[1]])
        dollar = bool(body) and body[0].startswith("$ ")
        if dollar and body[0][2:].split("  #")[0].strip() != m["command"]:
            raise SystemExit(f"{page}:{i + 1}: the block's '$' line is not the marker's command")
        found.append(Sample(page, i + 1, fence[0] + 1, m["command"], m["mode"] or "all", body, dollar))
    return found


# -- running a command as the docs show it ------------------------------------------------------------------


@dataclass(frozen=True)
class Ran:
    code: int
    lines: tuple[str, ...]     # stdout and stderr, the runs dir shown as the default one


def run_command(command: str, workdir: Path) -> Ran:
    """``command`` (a ``distcheck ...`` line) in ``workdir`` (a copy of examples/), with a runs dir of its own."""
    runs = workdir.parent / "runs"
    env = {**os.environ, "COLUMNS": "140", "DISTCHECK_RUNS_DIR": str(runs),
           "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    done = subprocess.run(["bash", "-c", command], cwd=workdir, env=env, capture_output=True, text=True,
                          timeout=TIMEOUT_S, start_new_session=True)
    # paths as a reader's checkout shows them: the runs dir as the default one, this repository's files relative
    text = (done.stdout + done.stderr).replace(str(runs), SHOWN_RUNS).replace(f"{workdir}/", "").replace(f"{ROOT}/", "")
    return Ran(done.returncode, tuple(line.rstrip() for line in text.splitlines()))


def examples_copy(where: Path) -> Path:
    workdir = where / "examples"
    shutil.copytree(ROOT / "examples", workdir)
    return workdir


# -- the part a sample shows ----------------------------------------------------------------------------------


def verdict_at(lines: tuple[str, ...] | list[str]) -> int | None:
    """Where the verdict block starts (the PASS/FAIL/NOTHING line), or None."""
    return next((i for i in range(len(lines) - 1, -1, -1) if VERDICT.match(lines[i])), None)


def excerpt(lines: tuple[str, ...], mode: str) -> list[str]:
    """The part of a run's output a sample shows."""
    lines = tuple(line for line in lines if line.strip())
    at = verdict_at(lines)
    if mode == "all" or at is None:
        return list(lines)
    results = [i for i, line in enumerate(lines[:at]) if RESULT.match(line)]
    if mode == "block":
        first = results[0] if results else 0
        return [line for line in lines[first:at] if not line.lstrip().startswith("wrote ")]
    header = [line for line in lines[:1] if HEADER.match(line)]
    shown = [lines[i] for i in results]
    odd = [line for line in shown if not line.startswith("  OK")]
    # two targets that behaved as they do on any machine (observed what they expect, one clean, one a planted bug)
    steady = [line for line in shown if line.startswith("  OK") and _observed_as_expected(line)]
    first = [*[x for x in steady if "expected pass," in x][:1], *[x for x in steady if "expected pass," not in x][:1]]
    middle = [*first, *(["  ..."] if len(shown) > len(first) else []), *odd[:6], *(["  ..."] if odd else [])]
    return [*header, *middle, *lines[at:]]


def _observed_as_expected(line: str) -> bool:
    m = re.search(r"expected (\S+), observed (\S+?)[ ,]", line + " ")
    return m is not None and m[1] == m[2]


# -- what must hold between a sample and a run ---------------------------------------------------------------


def masked(line: str) -> str:
    """A line with what changes from run to run left out: durations, run ids, ports, pids."""
    line = re.sub(r"\d+(\.\d+)? s\b", "… s", line)
    line = re.sub(r"runs/[\w.-]+", "runs/…", line)
    line = re.sub(r"\]:\d+\b", "]:…", line)
    return " ".join(line.split())


def facts(lines: list[str] | tuple[str, ...], mode: str) -> dict[str, object]:
    """What a sample states that a run must state too: the header (command, target count, backend, ranks), the
    verdict line (its counts), the skipped and failed targets, and how a whole output ends (its verdict block)."""
    at = verdict_at(lines)
    return {
        "header": next((masked(line) for line in lines if HEADER.match(line)), None),
        "verdict": masked(lines[at]) if at is not None else None,
        "skipped or failed": sorted(masked(line) for line in lines if RESULT.match(line) and not line.startswith("  OK")),
        "ends with": masked(lines[-1]) if lines and mode != "block" else None,
        "error": next((masked(line) for line in lines if ERROR.match(line)), None),
    }


def differences(sample: Sample, ran: Ran) -> list[str]:
    """Where a sample no longer says what its command prints: every fact, every result and finding line it shows,
    and the last line (the run's verdict block, or its error)."""
    real = excerpt(ran.lines, sample.mode)
    shown, printed = facts(sample.shown, sample.mode), facts(real, sample.mode)
    out = [f"{key}: the page shows {shown[key]!r}, a run prints {printed[key]!r}"
           for key in shown if shown[key] != printed[key] and (sample.mode != "catalogue" or key != "skipped or failed"
                                                              or not set(shown[key]) <= set(printed[key]))]
    everything = " ".join(masked(line) for line in ran.lines)
    out += [f"not printed: {line.strip()!r}" for line in sample.shown
            if (RESULT.match(line) or FINDING.match(line) or VERDICT.match(line)) and masked(line) not in everything]
    if verdict_at(ran.lines) is None and not any(ERROR.match(line) for line in ran.lines):
        out.append("the run printed no verdict line")
    elif verdict_at(ran.lines) is not None and not masked(ran.lines[-1]).startswith(("run dir:", "PASS", "FAIL")):
        out.append(f"the run's last line is not its verdict block: {ran.lines[-1]!r}")
    return out


# -- writing the pages ---------------------------------------------------------------------------------------


def machine() -> str:
    """This machine in a few words: CPU cores, GPUs, torch."""
    try:
        import torch

        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        gpu = f", {gpus} x {torch.cuda.get_device_name(0)}" if gpus else ", no GPU"
        version = f", torch {torch.__version__}"
    except ImportError:
        gpu, version = "", ""
    return f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPU cores{gpu}{version}"


def stamp(command: str, when: datetime.date, where: str, load: float) -> str:
    return (f"*Printed by `{command}` on {when.isoformat()} ({where}, load average {load:.1f} as it started); "
            "`docs/make_samples.py` rewrites it.*")


def rewritten(text: str, sample: Sample, lines: list[str], note: str) -> str:
    """The page with the sample's block (and its note) replaced."""
    page = text.splitlines()
    start = sample.line - 1
    end = page.index(CLOSE, start)
    body = ([sample.body[0]] if sample.dollar else []) + lines   # its "$ COMMAND  # note" line as it was
    page[start + 1:end] = [note, "", "```", *body, "```"]
    return "\n".join(page) + ("\n" if text.endswith("\n") else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("pages", nargs="*", type=Path, help="pages to rewrite (default: every page with samples)")
    args = parser.parse_args()
    where, when, ran = machine(), datetime.date.today(), {}
    with tempfile.TemporaryDirectory(prefix="distcheck-samples-") as tmp:
        for page in [p.resolve() for p in args.pages] or PAGES:
            text = page.read_text(encoding="utf-8")
            for sample in reversed(samples_in(page)):   # bottom up: the markers above keep their lines
                if sample.command not in ran:
                    print(f"running {sample.command} ...", flush=True)
                    load = os.getloadavg()[0]
                    ran[sample.command] = (run_command(sample.command, examples_copy(Path(tmp) / str(len(ran)))), load)
                lines = excerpt(ran[sample.command][0].lines, sample.mode)
                text = rewritten(text, sample, lines, stamp(sample.command, when, where, ran[sample.command][1]))
                print(f"  {page.relative_to(ROOT)}:{sample.line} ({sample.mode}): {len(lines)} lines")
            page.write_text(text, encoding="utf-8")
    for command, (done, _) in ran.items():
        if done.code not in (0, 1, 2):
            print(f"make_samples: {shlex.quote(command)} exited {done.code}", file=sys.stderr)


if __name__ == "__main__":
    main()
