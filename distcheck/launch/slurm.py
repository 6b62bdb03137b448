"""What Slurm tells a job through its environment, read the way Lightning, accelerate and submitit do.

* ``SLURM_JOB_ID``: inside a job. ``SLURM_STEP_ID``: inside a job step (``srun``); without it this is
  the batch step (``sbatch``) or an ``salloc`` shell: one process on the first node of the allocation.
* The per-node pattern (``srun --ntasks-per-node=1 distcheck run ...``): this node is ``SLURM_NODEID`` of
  ``SLURM_STEP_NUM_NODES``; node 0 is the first host of the step's node list.
* The rendezvous port is derived from the job id, so two jobs whose first node is the same host do not
  collide (Lightning derives its ``MASTER_PORT`` the same way).
* The job's end time (``SLURM_JOB_END_TIME``, else ``squeue``): distcheck starts its stop a little before
  Slurm's own, so the report is written before ``KillWait`` runs out.

Everything here reads; nothing changes the job. Slurm's commands are optional: without them the
pure-Python host-list expansion and the node name itself are used.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import re
import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

from distcheck import interrupt
from distcheck.models import EndReason

PORT_BASE = 20000          # below Linux's ephemeral range (32768+), which outgoing connections take from
PORT_SPAN = 6000           # job ids map onto PORT_BASE + 2 * (id % PORT_SPAN): an even port and the next
COMMAND_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class SlurmJob:
    job_id: str
    step_id: str | None         # None: the batch step or an salloc shell
    nodelist: str               # the step's node list (the job's outside a step)
    nnodes: int                 # nodes of the step (of the job outside a step)
    node_id: int                # this node's index among them

    @property
    def in_step(self) -> bool:
        return self.step_id is not None

    @property
    def step(self) -> str:
        return f"{self.job_id}.{self.step_id}" if self.in_step else f"{self.job_id}.batch"

    def metadata(self) -> dict[str, str]:
        """What report.json's run metadata keeps of the job."""
        return {"job_id": self.job_id, "step": self.step, "nodelist": self.nodelist}


def slurm_job(env: Mapping[str, str] | None = None) -> SlurmJob | None:
    """The Slurm job this process runs in, or None outside Slurm."""
    env = os.environ if env is None else env
    job_id = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")
    if not job_id:
        return None
    step_id = env.get("SLURM_STEP_ID") or env.get("SLURM_STEPID") or None
    if step_id is not None:
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST", "")
        nnodes = env.get("SLURM_STEP_NUM_NODES") or env.get("SLURM_NNODES", "1")
    else:
        nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST", "")
        nnodes = env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES", "1")
    return SlurmJob(job_id=job_id, step_id=step_id, nodelist=nodelist, nnodes=_int(nnodes, 1),
                    node_id=_int(env.get("SLURM_NODEID", "0"), 0))


def tasks_per_node(env: Mapping[str, str]) -> int | None:
    """How many tasks of this step run on each node (None: not a step, or uneven)."""
    tasks, nodes = _int(env.get("SLURM_STEP_NUM_TASKS", ""), 0), _int(env.get("SLURM_STEP_NUM_NODES", ""), 0)
    return tasks // nodes if tasks and nodes and tasks % nodes == 0 else None


def endpoint_port(job_id: str) -> int:
    """The rendezvous port of a job (distcheck's store takes the next one)."""
    return PORT_BASE + 2 * (_int(re.sub(r"\D", "", job_id), 0) % PORT_SPAN)


def first_host_address(nodelist: str) -> str:
    """The address of node 0: the first host of the node list, as Slurm itself reaches it (its
    ``NodeAddr``, which is the name itself on most clusters)."""
    names = hostnames(nodelist)
    if not names:
        raise ValueError(f"empty Slurm node list {nodelist!r}")
    return node_addr(names[0]) or names[0]


def hostnames(nodelist: str) -> list[str]:
    """``scontrol show hostnames``, else the pure-Python expansion of the common forms."""
    out = _slurm_command("scontrol", "show", "hostnames", nodelist)
    if out:
        return out.split()
    return expand_hostlist(nodelist)


def expand_hostlist(nodelist: str) -> list[str]:
    """``n[1-3,5],gpu01`` -> n1 n2 n3 n5 gpu01 (ranges keep their zero padding: ``a[08-10]``)."""
    hosts: list[str] = []
    for item in re.findall(r"[^,\[]+(?:\[[^\]]*\][^,\[]*)*", nodelist):
        hosts += _expand_one(item.strip())
    return [h for h in hosts if h]


def _expand_one(item: str) -> list[str]:
    match = re.match(r"([^\[]*)\[([^\]]*)\](.*)$", item)
    if not match:
        return [item]
    prefix, ranges, rest = match.groups()
    out = []
    for part in ranges.split(","):
        low, _, high = part.partition("-")
        if high and low.isdigit() and high.isdigit():
            out += [f"{prefix}{str(i).zfill(len(low))}" for i in range(int(low), int(high) + 1)]
        else:
            out.append(prefix + low)
    return [head + tail for head in out for tail in _expand_one(rest)]


def node_addr(name: str) -> str | None:
    """The ``NodeAddr`` Slurm has for a node (None without ``scontrol`` or an answer)."""
    out = _slurm_command("scontrol", "-o", "show", "node", name)
    found = re.search(r"\bNodeAddr=(\S+)", out or "")
    return found.group(1) if found else None


def end_time(env: Mapping[str, str] | None = None) -> float | None:
    """When Slurm ends the job (epoch seconds), or None: no limit, not in Slurm, or unknown. Read before any
    ending: after a cancel, Slurm's end time is the cancel's."""
    env = os.environ if env is None else env
    job = slurm_job(env)
    if job is None:
        return None
    found = env_end_time(env)
    if found is not None:
        return found
    out = _slurm_command("squeue", "-h", "-j", job.job_id, "-o", "%e")
    return _parse_time(out.strip()) if out else None


def env_end_time(env: Mapping[str, str]) -> float | None:
    """``SLURM_JOB_END_TIME`` (set for batch jobs by newer Slurms; 22.05 sets none)."""
    text = env.get("SLURM_JOB_END_TIME", "")
    return float(text) if text.isdigit() else None


# Slurm's job states at the SIGTERM of one of its own endings (``scontrol show job``'s JobState).
_STATE_ENDINGS = {"TIMEOUT": EndReason.SLURM_TIME_LIMIT, "DEADLINE": EndReason.SLURM_TIME_LIMIT,
                  "CANCELLED": EndReason.SLURM_CANCELLED, "PREEMPTED": EndReason.SLURM_PREEMPTED,
                  "REQUEUED": EndReason.SLURM_PREEMPTED, "REQUEUE_HOLD": EndReason.SLURM_PREEMPTED,
                  "REQUEUE_FED": EndReason.SLURM_PREEMPTED}
# The job's ``Reason`` while it completes: measured on Slurm 22.05, a time limit leaves the job COMPLETING with
# Reason=TimeLimit, scancel leaves it COMPLETING with Reason=None.
_REASON_ENDINGS = {"TimeLimit": EndReason.SLURM_TIME_LIMIT, "Preempted": EndReason.SLURM_PREEMPTED}
# What slurmstepd writes to the tasks' stderr (so to srun's) when Slurm ends a job or step.
_CANCEL_LINE = re.compile(r"\*\*\* (?:JOB|STEP) \S+ ON \S+ CANCELLED AT \S+(?: DUE TO ([A-Z ]+?))? \*\*\*")
_CAUSE_ENDINGS = {"TIME LIMIT": EndReason.SLURM_TIME_LIMIT, "PREEMPTION": EndReason.SLURM_PREEMPTED,
                  "JOB REQUEUE": EndReason.SLURM_PREEMPTED}
TIME_LIMIT_SLACK_S = 5.0   # a SIGTERM this close to the job's end time (or after it) is its time limit


def ending(signal_name: str | None, at: float | None, env: Mapping[str, str] | None = None,
           known_end: float | None = None) -> EndReason | None:
    """Which of Slurm's endings a SIGTERM was, by evidence: the job's state and reason (TIMEOUT, CANCELLED,
    Reason=TimeLimit...); else the job's end time, as known before the signal (``known_end``: once a job is
    cancelled, Slurm moves its end time to the moment of the cancel), had come; else a job Slurm is ending
    (COMPLETING) was cancelled. None outside Slurm, for another signal, or when nothing says (a plain
    ``kill``)."""
    env = os.environ if env is None else env
    job = slurm_job(env)
    if signal_name != "SIGTERM" or job is None:
        return None
    state, reason = job_state(job.job_id)
    return classify(state, reason, known_end if known_end is not None else env_end_time(env), at)


def classify(state: str | None, reason: str | None, end: float | None, at: float | None) -> EndReason | None:
    """The ending a SIGTERM at ``at`` was, from the job's state and reason and its end time before the signal."""
    found = _STATE_ENDINGS.get(state or "") or _REASON_ENDINGS.get(reason or "")
    if found is not None:
        return found
    if end is not None and at is not None and at >= end - TIME_LIMIT_SLACK_S:
        return EndReason.SLURM_TIME_LIMIT
    return EndReason.SLURM_CANCELLED if state == "COMPLETING" else None


def ending_in_output(text: str) -> EndReason | None:
    """A command (``srun``) whose job or step Slurm cancelled says so in its output: which ending it was."""
    found = None
    for match in _CANCEL_LINE.finditer(text):
        found = _CAUSE_ENDINGS.get((match.group(1) or "").strip(), EndReason.SLURM_CANCELLED)
    return found


def job_state(job_id: str) -> tuple[str | None, str | None]:
    """The job's ``JobState`` (RUNNING, COMPLETING, TIMEOUT, CANCELLED...) and ``Reason`` (TimeLimit, None...)
    from ``scontrol`` (no accounting needed); (None, None) when it does not answer."""
    out = _slurm_command("scontrol", "-o", "show", "job", job_id) or ""
    state, reason = re.search(r"\bJobState=(\S+)", out), re.search(r"\bReason=(\S+)", out)
    return (state.group(1) if state else None), (reason.group(1) if reason else None)


def _parse_time(text: str) -> float | None:
    """squeue's ``%e``: local time ``2026-12-05T14:30:00``, or N/A / Unknown / NONE."""
    try:
        return datetime.datetime.strptime(text, "%Y-%m-%dT%H:%M:%S").timestamp()
    except ValueError:
        return None


def _slurm_command(*argv: str) -> str | None:
    if shutil.which(argv[0]) is None:
        return None
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S,
                              stdin=subprocess.DEVNULL)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout if done.returncode == 0 else None


def _int(text: str, default: int) -> int:
    try:
        return int(text)
    except (TypeError, ValueError):
        return default


STOP_BEFORE_END_S = 15.0    # distcheck stops this long before the job's end time: its report is written then
OWN_STOP = "the coming Slurm time limit"   # the name of that request (``interrupt.request_stop``)


@dataclass
class _Known:
    end: float | None = None    # the job's end time, read when the run began (before any ending moved it)


_known = _Known()


@contextlib.contextmanager
def stop_before_end(env: Mapping[str, str] | None = None, clock: Callable[[], float] = time.time,
                    lead_s: float = STOP_BEFORE_END_S) -> Iterator[float | None]:
    """For one run inside a Slurm job with a time limit: its end time is remembered (a SIGTERM long before it
    is no time limit), and ``lead_s`` before it distcheck asks itself to stop, so every rank's stack is taken
    and the report written before Slurm's SIGTERM and, ``KillWait`` later, its SIGKILL. Yields the end time."""
    _known.end = end = end_time(env)
    timer = None
    if end is not None:
        timer = threading.Timer(max(0.0, end - lead_s - clock()), interrupt.request_stop, args=(OWN_STOP,))
        timer.daemon = True
        timer.start()
    try:
        yield end
    finally:
        if timer is not None:
            timer.cancel()
        _known.end = None


def known_end() -> float | None:
    """The job's end time as read when the run began (``stop_before_end``), or None."""
    return _known.end


def run_metadata() -> dict[str, str]:
    """What report.json keeps of the Slurm job a run ran in (job id, step, node list, and the end time Slurm had
    set when the run began); empty outside Slurm."""
    job = slurm_job()
    if job is None:
        return {}
    ends = {"ends_at": datetime.datetime.fromtimestamp(_known.end).astimezone().isoformat(timespec="seconds")} \
        if _known.end is not None else {}
    return {**job.metadata(), **ends}


def requested_ending() -> EndReason:
    """The ``EndReason`` of an interrupt request: distcheck's own stop before the time limit, or which of Slurm's
    endings a SIGTERM was (``ending``), else ``INTERRUPTED``."""
    def decide() -> EndReason:
        if interrupt.signal_name() == OWN_STOP:
            return EndReason.SLURM_TIME_LIMIT
        return ending(interrupt.signal_name(), interrupt.requested_at(), known_end=_known.end) \
            or EndReason.INTERRUPTED
    return interrupt.ending_once(decide)
