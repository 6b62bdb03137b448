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
    """Hooks set up at init_process_group: the stack probe (and faulthandler on the rank's stderr) and the
    Lightning attribution (one of the rank's recorders set up there)."""
    from distcheck.rank import integrations
    from distcheck.rank.runtime import PROCESS

    PROCESS._arm_stacks = _raising("the stack dumps")
    integrations.install = _raising("the rank's setup of the Lightning attribution")


def break_after_init() -> None:
    """Hooks that run inside the user's calls: the tracer (its slow path, which every call first
    seen takes: collectives, send/recv, each op of a batch_isend_irecv; and the batch's numbering
    after it), the C++-collective sidecar's poll and its flush before destroy_process_group (and at
    the rank's end), the DataLoader recorder and the metric recorder."""
    from distcheck.rank import metrics, samples
    from distcheck.rank.runtime import PROCESS

    runtime = PROCESS.current
    runtime.tracer._define = _raising("the tracer")
    runtime.tracer.numbering.claim_batch = _raising("the tracer's batch_isend_irecv numbering")
    runtime.watcher.poll = _raising("the sidecar")
    runtime.watcher.flush = _raising("the sidecar's flush before destroy_process_group")
    samples.ACTIVE._record = _raising("the sample recorder")
    metrics.user_callsite = _raising("the metric recorder")


def break_rank_setup():
    """The init_process_group hook (tracing the rank right after the user's init) and the
    destroy_process_group hook (ending its generation), for the next process group; returns
    what puts them back."""
    from distcheck.rank import injected

    saved = injected._become_rank, injected._end_generation
    injected._become_rank = _raising("the init_process_group hook")
    injected._end_generation = _raising("the destroy_process_group hook")

    def restore() -> None:
        injected._become_rank, injected._end_generation = saved

    return restore


def break_rank_end() -> None:
    """The rank's end hooks: sys.exit's (recording the failure a harness exits with) and atexit's
    (writing "finished")."""
    from distcheck.rank import injected, runtime

    injected._record = _raising("the sys.exit hook")
    runtime.finish_rank = _raising("the atexit hook")
