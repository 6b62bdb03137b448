"""How a result is stated in words, the same in every view (terminal, JUnit, ``distcheck runs``):
a scenario against its expectation, a script as a script, and how its launch ended
(``EndReason.words``). Pure text."""

from __future__ import annotations

from distcheck.models import EndReason, ScenarioResult


def script_name(result: ScenarioResult) -> str:
    """How a script is named to its user: the file they gave ("train.py"), else "-m module" or the command."""
    plain_file = result.source.endswith(".py") and " " not in result.source
    return result.source.rsplit("/", 1)[-1] if plain_file else result.source


def script_observed(result: ScenarioResult) -> str:
    """What a script showed: "ran clean" only when it ran to its end (or through the pre-flight window)."""
    if result.observed != ("pass",):
        return "+".join(result.observed)
    ended = EndReason.of(result.end_reason)
    return "ran clean" if ended in (EndReason.COMPLETED, EndReason.MAX_DURATION) else ended.words


def ending(result: ScenarioResult) -> str:
    """How the launch ended, wherever it did not simply complete: " (ended at a certain hang)",
    " (ended by --timeout)", " (interrupted)"; empty for a completed launch and a crash (the finding itself)."""
    ended = EndReason.of(result.end_reason)
    if ended in (EndReason.COMPLETED, EndReason.CRASH) or (result.script and script_observed(result) == ended.words):
        return ""
    return f" ({ended.words})"


def verdict(result: ScenarioResult) -> str:
    """One line: "train.py: hang (ended at a certain hang)" for a script (it declared no expectation),
    "expected hang, observed hang (ended at a certain hang)" for a scenario."""
    if result.skipped:
        return f"skipped: {result.skipped}"
    if result.script:
        return f"{result.test or script_name(result)}: {script_observed(result)}{ending(result)}"
    observed = "+".join(result.observed) or "pass"
    return f"expected {'+'.join(result.expected) or 'pass'}, observed {observed}{ending(result)}"
