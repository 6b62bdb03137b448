"""Real failures planted in distcheck's own hooks inside a rank (tests/scripts/rule0_job.py with
RULE0_BREAK=1): each replaces one of distcheck's internal functions with one that raises, so the
hook meets an error of its own while the user's program runs. Not a test module."""

from __future__ import annotations

from typing import Any


class PlantedFault(RuntimeError):
    """distcheck's own error, planted: it must never reach the user's code."""


def _raising(what: str):
    def fail(*args: Any, **kwargs: Any) -> Any:
        raise PlantedFault(f"planted in {what}")
    return fail


def break_before_init() -> None:
    """Hooks set up at init_process_group: the stack dumps (faulthandler's signal handlers)."""
    from distcheck.rank import worker

    worker.install_stack_dumps = _raising("the stack dumps")


def break_after_init() -> None:
    """Hooks that run inside the user's calls: the tracer (its slow path, which every call first
    seen takes), the C++-collective sidecar's poll, the DataLoader recorder and the metric recorder."""
    from distcheck.rank import injected, metrics, samples

    runtime = injected._RUNTIME
    runtime.tracer._define = _raising("the tracer")
    runtime.watcher.poll = _raising("the sidecar")
    samples.ACTIVE._record = _raising("the sample recorder")
    metrics.user_callsite = _raising("the metric recorder")
