"""What ``distcheck <cmd> -h`` says holds: every word a help string means is shown (rich markup eats
``[rankN]:`` unless escaped), no typed placeholder (``<bool>``, ``<str>``) stands where a flag or a value's
name should, each panel once, and each command's help ends with its own exit codes, never another's.

Each test runs the real command line (``python -m distcheck CMD -h``), as a user types it.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

COMMANDS = ("run", "list", "report", "analyze", "runs", "env", "attach")
PLACEHOLDER = re.compile(r"<(bool|str|int|float|path|Path|list\[[^\]]*\])>")
# typer's own completion options (on the root help only) carry a '<bool>' distcheck cannot name
TYPERS_OWN = ("--install-completion", "--show-completion")

# What each command can end with (its code paths: cli.py's _exit_code, the errors each one raises), and the
# words of run's exit codes that another command's help must not repeat.
OWN = {
    "run": ("0 every scenario behaved as expected", "4 --timeout ended a launch", "6 nothing ran",
            "starts no process group ends with its own exit code"),
    "list": ("0 listed", "2 an unknown scenario"),
    "report": ("the saved run's own", "2 no such run dir", "5 its report.json is missing"),
    "analyze": ("0 the dumps or traces show no problem", "5 a file is not a readable dump"),
    "runs": ("0 listed", "--limit below 1"),
    "env": ("0 shown", "2 a bad option"),
    "attach": ("0 nothing is wrong", "1 findings (a hang)", "3 the ranks could not be read", "never a pass"),
}
RUNS_WORDS = ("every scenario behaved as expected", "6 nothing ran (every target was skipped")


def help_text(*args: str) -> str:
    env = {**os.environ, "COLUMNS": "200", "TERMINAL_WIDTH": "200", "NO_COLOR": "1"}
    done = subprocess.run([sys.executable, "-m", "distcheck", *args, "-h"], capture_output=True, text=True,
                          env=env, timeout=120)
    assert done.returncode == 0, (args, done.stdout[-2000:], done.stderr[-2000:])
    return done.stdout


def one_line(text: str) -> str:
    """The help's words as one line: panels' borders and the wrapping left out."""
    return " ".join(text.replace("│", " ").split())


@pytest.fixture(scope="module")
def helps() -> dict[str, str]:
    return {name: help_text(*filter(None, [name])) for name in ("", *COMMANDS)}


@pytest.mark.parametrize("name", COMMANDS)
def test_each_command_ends_with_its_own_exit_codes_once(helps, name):
    text = one_line(helps[name])
    assert text.count("Exit codes:") == 1, text
    codes = text[text.index("Exit codes:"):]
    assert helps[name].rstrip().splitlines()[-1].strip() in codes   # the last thing the help says
    for words in OWN[name]:
        assert words in codes, (name, words, codes)
    if name != "run":
        for words in RUNS_WORDS:
            assert words not in codes, (name, words, codes)
    if name == "attach":   # attach starts nothing: no --timeout, no skipped target
        assert "--timeout" not in codes and "nothing ran" not in codes


def test_the_root_help_names_every_code_once_and_points_to_each_commands(helps):
    text = one_line(helps[""])
    assert text.count("Exit codes:") == 1 and "distcheck COMMAND -h" in text, text


@pytest.mark.parametrize("name", ("", *COMMANDS))
def test_no_typed_placeholder_stands_for_a_flag_or_a_value(helps, name):
    rows = [line for line in helps[name].splitlines() if not any(own in line for own in TYPERS_OWN)]
    found = [line.strip() for line in rows if PLACEHOLDER.search(line)]
    assert not found, (name, found)
    assert re.search(r"--help\s+-h\s+Show this message", helps[name]), helps[name]


def test_run_help_shows_the_rank_prefix_and_each_panel_once(helps):
    text = helps["run"]
    assert "'[rankN]:'" in one_line(text), "rich markup ate '[rankN]:'"
    assert "each rank's line ':'" not in one_line(text)
    panels = re.findall(r"╭─ ([^─]+?) ─", text)
    assert len(panels) == len(set(panels)), panels
    assert {"What to run", "Launch", "Limits", "Reports", "Multi-node"} <= set(panels), panels
    assert "TARGETS: built-in scenario names" in one_line(text)   # the argument, said once in the description


@pytest.mark.parametrize("name, argument", [("report", "RUN_DIR:"), ("analyze", "PATHS:"), ("attach", "PID:"),
                                            ("list", "TARGETS:")])
def test_an_argument_is_said_in_words_not_as_its_python_type(helps, name, argument):
    assert argument in one_line(helps[name]), helps[name]
