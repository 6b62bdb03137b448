"""The closed sets of names every part of distcheck shares: how a rank ended (``RankState``), how a launch
ended (``EndReason``), a rank's phase (``Phase``), distcheck's hooks in a rank (``Hook``, ``HOOK_LOST``), the
finding kinds and severities (``Kind``, ``Severity``; ``PASS`` where nothing was found); and the constants the
report states (its schema, distcheck's version)."""

from __future__ import annotations

import enum
from collections.abc import Iterable
from typing import Final, Literal

UNKNOWN_OP = "?"   # a C++-issued call whose Flight Recorder entry was never read
JOIN_LABEL = "Join"   # the label of a shadow collective torch's Join runs for a rank out of data

VERSION = "0.1.0"   # distcheck's own (pyproject.toml says the same); ``distcheck.__version__``



class _Named(str, enum.Enum):
    """A closed set of names that is also its plain string in JSON, comparisons and f-strings."""

    __str__ = str.__str__
    __format__ = str.__format__   # type: ignore[assignment]  # str's own (typeshed reads it short of self)


class ReportSchema(_Named):
    """report.json's forms (``models.report_form``): every value in place, or (a job of many ranks) what many
    ranks share written once."""

    INLINE = "distcheck.report/1"
    SHARED = "distcheck.report/2"


REPORT_SCHEMA = ReportSchema.INLINE   # the form every report is read into (``Report.from_dict``)


class RankState(_Named):
    """How a rank ended (``RankOutcome.state``)."""

    FINISHED = "finished"
    STUCK = "stuck"          # inside a collective at the end
    CRASHED = "crashed"      # the root-cause failure
    KILLED = "killed"        # ended from outside (a reaction, or distcheck's teardown)
    RUNNING = "running"      # outside any collective, busy, when the run was cut


class EndReason(_Named):
    """Why a launch ended (``ScenarioResult.end_reason``); ``priority`` ranks them across nodes (and across
    a run's scenarios, ``Report.end_reason``): the most telling first. ``words`` is how every view says it."""

    INTERRUPTED = "interrupted"
    SLURM_TIME_LIMIT = "slurm_time_limit"     # Slurm's time limit (its SIGTERM, or the command's step cancelled)
    SLURM_CANCELLED = "slurm_cancelled"       # scancel
    SLURM_PREEMPTED = "slurm_preempted"       # pre-empted or requeued by Slurm
    CERTAIN_HANG = "certain_hang"     # the wait-for graph: nothing can release the waiting ranks
    STALL = "stall"                   # no progress for --stall-timeout
    BUSY_TIMEOUT = "busy_timeout"     # a rank busy in its own code kept the others waiting past --busy-timeout
    TIMEOUT = "timeout"
    MAX_DURATION = "max_duration"
    CRASH = "crash"
    ATTACHED = "attached"             # ``distcheck attach`` read a job it did not launch; the job runs on
    POSTMORTEM = "postmortem"         # ``distcheck analyze`` of the Flight Recorder dumps a job left: nothing was run
    COMPLETED = "completed"
    NOTHING_RAN = "nothing_ran"       # skipped: it could not run here (a library missing, too few ranks)

    @property
    def abnormal(self) -> bool:
        return self not in (EndReason.COMPLETED, EndReason.NOTHING_RAN)

    @property
    def interrupted(self) -> bool:
        """Someone asked the run to stop (Ctrl-C, SIGTERM, Slurm's own endings): never a pass, never a crash."""
        return self in (EndReason.INTERRUPTED, EndReason.SLURM_TIME_LIMIT, EndReason.SLURM_CANCELLED,
                        EndReason.SLURM_PREEMPTED)

    @property
    def hang_watchdog(self) -> bool:
        """distcheck's hang watchdog ended it: a certain hang, a stall, or a busy rank past --busy-timeout."""
        return self in (EndReason.CERTAIN_HANG, EndReason.STALL, EndReason.BUSY_TIMEOUT)

    @property
    def by_distcheck(self) -> bool:
        """distcheck ended it by its own verdict (the hang watchdog, or --timeout): never a pass."""
        return self.hang_watchdog or self is EndReason.TIMEOUT

    @property
    def words(self) -> str:
        """How every view names this end (terminal, JUnit, ``distcheck runs``; docs/endings.md)."""
        return _END_WORDS[self]

    @property
    def priority(self) -> int:
        return list(EndReason).index(self)

    @classmethod
    def of(cls, value: str | None) -> EndReason:
        """A saved report's ``end_reason`` (absent: completed; a name this version does not know: a stall,
        the only hang watchdog's end older reports had)."""
        try:
            return cls(value or cls.COMPLETED)
        except ValueError:
            return cls.STALL


_END_WORDS = {
    EndReason.INTERRUPTED: "interrupted", EndReason.SLURM_TIME_LIMIT: "interrupted: Slurm time limit",
    EndReason.SLURM_CANCELLED: "interrupted: cancelled by Slurm",
    EndReason.SLURM_PREEMPTED: "interrupted: pre-empted or requeued by Slurm",
    EndReason.CERTAIN_HANG: "ended at a certain hang",
    EndReason.STALL: "ended by --stall-timeout", EndReason.BUSY_TIMEOUT: "ended by --busy-timeout",
    EndReason.TIMEOUT: "ended by --timeout", EndReason.MAX_DURATION: "ended by --max-duration",
    EndReason.CRASH: "a rank crashed", EndReason.ATTACHED: "read while running, nothing ended",
    EndReason.POSTMORTEM: "read from the dumps the job left",
    EndReason.COMPLETED: "completed", EndReason.NOTHING_RAN: "nothing ran",
}


class Phase(_Named):
    """Where a rank's worker is (its status file's ``phase``)."""

    STARTING = "starting"
    RUNNING = "running"
    FINISHED = "finished"
    ERROR = "error"
    INTERRUPTED = "interrupted"


class Hook(_Named):
    """distcheck's hooks in the user's process (``rank.guard`` counts their failures); the value names it in
    the status file's ``hook_failures``."""

    TRACER = "tracer"
    SIDECAR = "sidecar"
    METRICS = "metrics"
    SAMPLES = "samples"
    LIGHTNING = "lightning"
    STACK_DUMPS = "stack_dumps"
    RANK_SETUP = "rank_setup"
    RANK_END = "rank_end"
    NUMBERING = "numbering"
    COMPLETION = "completion"   # reading when a call's work completed (NCCL: the Flight Recorder; a backend's hook)
    # Not failures: a recorder reached the cap on the memory it keeps in the user's process (rank.guard.capped)
    SAMPLES_CAP = "samples_cap"
    METRICS_CAP = "metrics_cap"


# What a failing hook leaves unrecorded, as its coverage note says it (diagnose.coverage).
HOOK_LOST = {
    Hook.TRACER: "some of its Python collective calls were not recorded (or recorded without their end)",
    Hook.SIDECAR: "collectives issued from C++ (DDP, FSDP, DTensor) were not all watched",
    Hook.METRICS: "some torchmetrics calls were not recorded, so the single-process check of them is incomplete",
    Hook.SAMPLES: "some DataLoader draws were not recorded, so the sample accounting is incomplete",
    Hook.LIGHTNING: "some self.log lines were not attributed to Lightning's epoch-end reductions",
    Hook.STACK_DUMPS: "no stack dumps could be installed, so a hang there is named without its stack",
    Hook.RANK_SETUP: "part of the rank's tracing could not be set up",
    Hook.COMPLETION: ("when collectives completed on the device could not always be read, so some calls that had "
                      "returned were taken as still running, or as done when they returned"),
    Hook.RANK_END: "how the rank ended (its failure or its finish) may not be recorded",
    Hook.NUMBERING: "some calls' collective numbers could not be reconciled, so later calls may be compared "
                    "with their peers' under shifted numbers",
    Hook.SAMPLES_CAP: "past it, some DataLoader draws were not recorded, so the sample accounting is incomplete",
    Hook.METRICS_CAP: "past it, part of the torchmetrics record was not kept, so some checks of it were not made",
}
CAP_HOOKS = frozenset({Hook.SAMPLES_CAP, Hook.METRICS_CAP})


class Kind(_Named):
    """A finding's kind (``Finding.kind``), in the order a reader should see them."""

    CRASH = "crash"
    HANG = "hang"
    MISMATCH = "mismatch"
    ORDER = "order"
    COUNT = "count"
    NUMERIC = "numeric"
    DUPLICATES = "duplicates"
    STRAGGLER = "straggler"
    HEALTH = "health"
    COVERAGE = "coverage"


class Severity(_Named):
    """How much a finding weighs (``Finding.severity``), the heaviest first: an error fails the run, a warning
    is shown beside it, an info is a note."""

    ERROR = "error"
    WARNING = "warning"
    INFO = "info"

    @property
    def weight(self) -> int:
        """0 for an error, 1 for a warning, 2 for an info: sorts the heaviest first."""
        return list(Severity).index(self)


# What a scenario expects, and a run observes, where there is no finding to show: no finding's kind.
PASS: Final = "pass"
Expectation = Kind | Literal["pass"]


def expectations(values: Iterable[str]) -> tuple[Expectation, ...]:
    """A scenario's ``expect`` as the run reads it (plain strings on the user's side): each a ``Kind``, or
    ``PASS``. A name that is neither raises ValueError."""
    return tuple(PASS if v == PASS else Kind(v) for v in values)


FINDING_KINDS = tuple(Kind)
RANK_STATES = tuple(s.value for s in RankState)
SEVERITIES = tuple(Severity)
