"""After one rank of a launch failed, its survivors are stopped only once their records hold the call they were in.

torch's agent stops the other ranks in the very poll that finds a rank failed, before their sidecars wrote the
C++-issued call they were waiting in (often the call that explains the failure). Which calls a survivor's
record holds would then depend on the node's load, and so would the majority at the failed call: the
determinism lane (``pytest -m determinism``) catches that. This module holds torch's agent (and a forked
launch's spawn context) until each survivor synced its record inside a call, or stopped making progress.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from distcheck.files.launch_dir import LaunchFiles
from distcheck.files.trace_tail import TraceTail
from distcheck.launch import procs
from distcheck.models import Phase


# How long torch's agent is held after a rank failed, for the survivors' records (see below): a survivor
# already inside a call is let go at its sidecar's next sync; one on its way to the call is waited for while it
# runs (its CPU time grows), up to SURVIVOR_SYNC_MAX_S, and given up once it made no progress for
# SURVIVOR_SYNC_S. Beside CPU hogs DTensor's Python between two calls took over 2 s; with four 4-rank jobs
# and hogs on two cores, over 5 s (a fixed 5 s wait then left the verdict to the load).
SURVIVOR_SYNC_S = 5.0
SURVIVOR_SYNC_MAX_S = 30.0


@contextlib.contextmanager
def survivors_record_first(files: LaunchFiles, exit_codes: dict[int, tuple[int, int]]) -> Iterator[None]:
    """Hold torch's agent, once it saw a rank fail, until the survivors' records hold what they were in.
    Also fills ``exit_codes`` with every forked rank's (``_forked_exit_codes``).

    The agent's process context stops the other ranks in the very poll (every 0.05 s) that finds a
    rank failed (``PContext._poll`` calls ``close()``), often before their sidecars wrote the
    C++-issued call they were waiting in, the very call that explains the failure (DDP's gradient
    bucket against a peer's logging all_reduce). So ``close()`` after a failure first waits until each
    survivor's trace is synced after the failure (by its sidecar's next poll, or by its own failure's
    flush; a poll or two) and shows it inside a call (see ``_wait_for_synced_records``), then stops them as before.
    Forked ranks are stopped earlier, by the spawn context's ``join`` in that same poll: it waits there too.
    A close without a failure (every rank finished, Ctrl-C) does not wait.
    """
    import torch.multiprocessing as mp
    from torch.distributed.elastic.agent.server.api import WorkerState
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    from torch.distributed.elastic.multiprocessing.api import PContext
    from torch.multiprocessing.spawn import ProcessContext

    original_monitor, original_close = LocalElasticAgent._monitor_workers, PContext.close

    def monitor_workers(agent: Any, worker_group: Any) -> Any:
        result = original_monitor(agent, worker_group)
        if result.state in (WorkerState.FAILED, WorkerState.UNHEALTHY):
            exit_codes.update(_forked_exit_codes(agent, worker_group))
        return result

    def close(pcontext: Any, *args: Any, **kwargs: Any) -> None:
        # SubprocessContext keeps its failures; MultiprocessContext closes while handling the exception
        failed = getattr(pcontext, "_failures", None) or isinstance(
            sys.exc_info()[1], (mp.ProcessRaisedException, mp.ProcessExitedException))
        if failed:
            _wait_for_synced_records(files, time.time(), SURVIVOR_SYNC_S)
        original_close(pcontext, *args, **kwargs)

    def join(context: Any, *args: Any, **kwargs: Any) -> Any:
        # Forked ranks: torch's ProcessContext.join terminates the others itself, in the poll that sees one
        # exit non-zero, before the agent ever calls close(): hold it there the same way.
        if _one_failed(context):
            _wait_for_synced_records(files, time.time(), SURVIVOR_SYNC_S)
        return original_join(context, *args, **kwargs)

    original_join = ProcessContext.join
    LocalElasticAgent._monitor_workers, PContext.close, ProcessContext.join = monitor_workers, close, join
    try:
        yield
    finally:
        LocalElasticAgent._monitor_workers, PContext.close, ProcessContext.join = (original_monitor, original_close,
                                                                                   original_join)


def _one_failed(context: Any) -> bool:
    """Whether a process of this spawn context exited non-zero and its join has not handled it yet."""
    try:
        waiting = set(context.sentinels.values())
        return any(i in waiting and p.exitcode not in (None, 0) for i, p in enumerate(context.processes))
    except Exception:   # another torch's ProcessContext: terminate as it would have
        return False


def _forked_exit_codes(agent: Any, worker_group: Any) -> dict[int, tuple[int, int]]:
    """Global rank -> (exit code, pid) of every forked rank that ended by itself. torch's agent reports only the
    first one its poll found (a peer's "Connection closed" exit 1 may come before the SIGKILL that caused
    it); the processes it forked still know theirs. A rank the agent terminated itself shows SIGTERM: a
    consequence, left out. Empty for ranks with processes of their own (the agent reports them all)."""
    processes = getattr(getattr(getattr(agent, "_pcontext", None), "_pc", None), "processes", None) or []
    ranks = {w.local_rank: w.global_rank for w in worker_group.workers}
    return {ranks[i]: (p.exitcode, p.pid) for i, p in enumerate(processes)
            if i in ranks and p.exitcode not in (None, 0, -signal.SIGTERM)}


def _wait_for_synced_records(files: LaunchFiles, since: float, idle_s: float,
                             most_s: float = SURVIVOR_SYNC_MAX_S) -> None:
    """Until every live rank of this node synced its trace after ``since`` and is inside a call (or has
    ended, or finished its part of a shared launch's scenario); a rank that made no progress (CPU time) for
    ``idle_s`` is not waited for, nor anyone past ``most_s``. A survivor on its way to the call the failed
    rank was in (still in the Python between two calls) is stopped inside it, not before: otherwise whether
    its record names that call, and so the majority at it, would depend on the machine's load (issue 41's
    determinism lane)."""
    start = time.monotonic()
    files.flight_recorder_request.touch()   # a crash dumps the survivors' Flight Recorders too, as a stall does
    tails = {path: TraceTail(path) for path in files.traces.glob("rank*.trace")}
    progress: dict[Path, tuple[float, float]] = {}   # trace -> (CPU seconds, when they last grew)
    while tails and time.monotonic() - start < most_s:
        now = time.monotonic()
        for path, tail in list(tails.items()):
            status = files.read_status(int(path.stem.removeprefix("rank")))
            # only a rank in its process group has a sidecar that syncs (one still starting has no calls); one
            # that finished its part of a shared launch's scenario waits for its peers, its record complete
            done = (status is None or not procs.is_alive(status.pid) or status.phase is not Phase.RUNNING
                    or status.done_with_current)
            if (done or _synced_inside_a_call(tail, since)
                    or (status is not None and status.pid is not None   # a running rank has both (``done``)
                        and _stalled(progress, path, status.pid, now, idle_s))):
                del tails[path]
        time.sleep(0.02)


def _stalled(progress: dict[Path, tuple[float, float]], path: Path, pid: int, now: float, idle_s: float) -> bool:
    """Whether the rank's CPU time has not grown for ``idle_s`` (it will not reach a call soon)."""
    cpu = procs.stat_of(pid).cpu_seconds
    last_cpu, since = progress.get(path, (-1.0, now))
    if cpu != last_cpu:
        progress[path] = (cpu, now)
        return False
    return now - since >= idle_s


def _synced_inside_a_call(tail: TraceTail, since: float) -> bool:
    try:
        tail.read()
    except OSError:   # a trace that cannot be read: nothing to wait for
        return True
    return (tail.synced_at or 0.0) >= since and tail.newest_open is not None
