"""Plain result objects: what the tracer records, what the watchdog observes,
what analysis concludes (the names they use are ``models.enums``). Frozen dataclasses (``Event``, of which there are
millions, is a NamedTuple) that round-trip through JSON, so a saved run can be
re-rendered without re-running it."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from distcheck.models.cause import Cause
from distcheck.models.enums import REPORT_SCHEMA, EndReason, Kind, ReportSchema, Severity
from distcheck.models.report_form import inline, shared
from distcheck.models.group_key import GroupKey, is_p2p
from distcheck.models.runs import bounded, ranks_from_json


class Event(NamedTuple):
    """One collective or p2p call on one rank, as the tracer recorded it.

    Immutable like the other results, but a NamedTuple rather than a frozen
    dataclass: a run of 1,024 ranks holds a million of these, and building one
    is a ``tuple.__new__`` (measured 4× faster than the frozen dataclass's
    ``__init__``; see benchmarks/analysis_scale.py). The field order puts what
    differs per call first, so the trace reader builds an event from one
    tuple of per-call values and one shared tuple per fingerprint.
    """

    rank: int
    group: GroupKey                 # a GroupKey as the trace readers build it (a plain str where a test builds one)
    seq: int
    op: str
    t_enter: float = 0.0
    t_exit: float | None = None
    error: str | None = None
    reduce_op: str | None = None
    shapes: tuple[tuple[int, ...], ...] = ()
    dtypes: tuple[str, ...] = ()
    device: str | None = None
    root: int | None = None
    group_ranks: tuple[int, ...] = ()
    async_op: bool = False
    callsite: str | None = None
    library_callsite: str | None = None
    label: str | None = None
    native: bool = False            # issued from C++ (DDP, FSDP2, functional collectives), seen via the Flight Recorder
    # all_to_all(_single): (elements sent to, elements received from) each group rank, in group-rank order
    splits: tuple[tuple[int, ...], tuple[int, ...]] | None = None
    members: tuple[int, ...] | None = None   # new_group: the ranks this call asked for (sorted)
    # On a group whose calls complete after they return (NCCL): when the call returned to Python (its work was
    # enqueued); ``t_exit`` is then its completion (None: it never completed). None on every other group.
    t_returned: float | None = None

    @property
    def is_p2p(self) -> bool:
        return is_p2p(self.group)

    @property
    def completed(self) -> bool:
        """The call's work is done: it returned (gloo), or its backend said it completed (NCCL)."""
        return self.t_exit is not None

    @property
    def enqueued(self) -> bool:
        """Returned to Python but never completed (NCCL: its work waits on the device): the rank waits in it."""
        return self.t_returned is not None and self.t_exit is None

    def fingerprint(self) -> dict[str, Any]:
        """The comparable part of the call, as JSON-ready values."""
        return {
            "op": self.op,
            "reduce_op": self.reduce_op,
            "shapes": [list(s) for s in self.shapes],
            "dtypes": list(self.dtypes),
            "device": self.device,
            "root": self.root,
            "group": self.group,
            # the group's one tuple, not a copy: every waiting rank's detail holds a fingerprint, and at 16,384 ranks
            # in one barrier a list each was 268 M entries (2 GB of node 0's memory, twice over in report.json's dict)
            "group_ranks": self.group_ranks,
        }

    def to_dict(self) -> dict[str, Any]:
        d = self._asdict()
        d["shapes"] = [list(s) for s in self.shapes]
        d["dtypes"] = list(self.dtypes)
        # group_ranks as it is (a tuple, written as a JSON list): a group's members are one tuple shared by every
        # call naming it, and a copy per rank's last call was 4,096 lists of 4,096 ranks at 4,096 ranks
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Event:
        d = dict(d)
        d["shapes"] = tuple(tuple(s) for s in d.get("shapes", ()))
        d["dtypes"] = tuple(d.get("dtypes", ()))
        d["group_ranks"] = ranks_from_json(d.get("group_ranks", ()))
        if d.get("splits") is not None:
            d["splits"] = tuple(tuple(side) for side in d["splits"])
        if d.get("members") is not None:
            d["members"] = tuple(d["members"])
        return cls(**{k: v for k, v in d.items() if k in _EVENT_FIELDS})


_EVENT_FIELDS = set(Event._fields)


_SCALARS = frozenset({int, float, str, bool, type(None)})


def _plain(value: Any) -> Any:
    """``dataclasses.asdict``'s copy of one value, with a list of plain values copied whole: asdict walks
    each element, and at 4,096 ranks (every rank's last call and fingerprint naming its group) that was
    50 M calls and minutes for one report."""
    if isinstance(value, (list, tuple)):
        if hasattr(value, "_fields"):                      # a NamedTuple (Event)
            return type(value)(*[_plain(v) for v in value])
        if set(map(type, value)) <= _SCALARS:
            return list(value) if isinstance(value, list) else tuple(value)
        return type(value)(_plain(v) for v in value)
    if isinstance(value, dict):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _as_dict(value)
    return value


def _as_dict(obj: Any, apart: frozenset[str] = frozenset()) -> dict[str, Any]:
    """``obj``'s fields as plain values, in their order; those named in ``apart`` None, for the caller to write its
    own way (at 4,096 ranks a finding's ranks were each copied twice, once to be thrown away)."""
    return {f.name: None if f.name in apart else _plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}


_OWN_EVENT = frozenset({"last_event"})
_OWN_FINGERPRINT = frozenset({"fingerprint"})
_OWN_RANKS = frozenset({"ranks", "caused_by"})


@dataclass(frozen=True)
class StackFrame:
    file: str
    line: int
    function: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line} in {self.function}"


@dataclass(frozen=True)
class RankOutcome:
    """How one rank ended, and where it was at the end."""

    rank: int
    state: str                      # one of RANK_STATES
    host: str = ""
    node: int = 0                   # the launcher node (torchrun's group rank) this rank ran on
    pid: int | None = None
    exit_code: int | None = None
    signal: str | None = None
    collectives: int = 0
    last_event: Event | None = None
    where: str | None = None        # callsite of the open collective, or user stack top
    stack: str | None = None        # all threads, as captured before teardown
    exception: str | None = None    # "TypeName: message" when the rank raised
    traceback: str | None = None
    phase: str | None = None        # worker phase: starting, running, finished, error
    # PyTorch Flight Recorder per process group: last enqueued / started / completed collective
    # (GPU-side truth on NCCL, where "exit" only means enqueued), when it was dumped.
    flight_recorder: dict[str, dict[str, int]] | None = None
    busy_at: str | None = None          # where it was busy (late) while others waited past --stall-timeout
    unwatched: str | None = None        # why its C++-issued collectives were counted but not watched
    hook_failures: dict[str, dict[str, Any]] | None = None   # distcheck's own hooks that failed (rank.guard)
    pg_timeout_s: float | None = None   # its process group's timeout: the backend's own end of a hang (NCCL's watchdog)
    pg_initialized: bool | None = None  # it got past init_process_group (None: not known)
    rss_bytes: int | None = None        # resident memory when last seen alive (sampled by the watchdog)
    peak_rss_bytes: int | None = None

    def to_dict(self) -> dict[str, Any]:
        d = _as_dict(self, _OWN_EVENT)
        d["last_event"] = self.last_event.to_dict() if self.last_event else None
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RankOutcome:
        d = dict(d)
        if d.get("last_event"):
            d["last_event"] = Event.from_dict(d["last_event"])
        return cls(**{k: v for k, v in d.items() if k in _OUTCOME_FIELDS})


_OUTCOME_FIELDS = {f.name for f in dataclasses.fields(RankOutcome)}
SCHEMAS = tuple(str(s) for s in ReportSchema)


@dataclass(frozen=True)
class RankDetail:
    """Per-rank detail attached to a finding: what this rank did at that point."""

    rank: int
    role: str                       # waiting, absent, odd, majority, crashed, ...
    op: str | None = None
    seq: int | None = None
    label: str | None = None
    callsite: str | None = None
    where: str | None = None
    state: str | None = None
    note: str | None = None
    fingerprint: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        d = _as_dict(self, _OWN_FINGERPRINT)
        # a fingerprint's values are plain already (``Event.fingerprint``): copied shallow, its members not walked
        d["fingerprint"] = None if self.fingerprint is None else dict(self.fingerprint)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RankDetail:
        fingerprint = d.get("fingerprint")
        if fingerprint and "group_ranks" in fingerprint:
            d = {**d, "fingerprint": {**fingerprint, "group_ranks": ranks_from_json(fingerprint["group_ranks"])}}
        return cls(**d)


@dataclass(frozen=True)
class Finding:
    kind: Kind
    severity: Severity
    summary: str                    # one sentence a person can act on
    group: GroupKey | None = None
    seq: int | None = None
    op: str | None = None
    label: str | None = None
    callsite: str | None = None
    waiting_ranks: tuple[int, ...] = ()
    absent_ranks: tuple[int, ...] = ()
    odd_ranks: tuple[int, ...] = ()
    fields: tuple[str, ...] = ()
    majority: dict[str, Any] | None = None
    tie: bool = False
    detected_after_s: float | None = None
    ranks: tuple[RankDetail, ...] = ()
    data: dict[str, Any] = field(default_factory=dict)  # kind-specific detail (numeric, duplicates, ...)
    caused_by: Cause | None = None  # the finding this one follows from (the causal linking pass sets it)

    def __post_init__(self) -> None:
        # a Finding built with plain strings (a saved report, a test) still holds the typed values
        if type(self.kind) is not Kind:
            object.__setattr__(self, "kind", Kind(self.kind))
        if type(self.severity) is not Severity:
            object.__setattr__(self, "severity", Severity(self.severity))
        if self.group is not None and type(self.group) is not GroupKey:
            object.__setattr__(self, "group", GroupKey(self.group))

    def to_dict(self) -> dict[str, Any]:
        d = _as_dict(self, _OWN_RANKS)
        for key in ("waiting_ranks", "absent_ranks", "odd_ranks", "fields"):
            d[key] = list(d[key])
        d["ranks"] = [r.to_dict() for r in self.ranks]
        d["kind"], d["severity"] = str(self.kind), str(self.severity)
        del d["caused_by"]
        if self.caused_by is not None:   # where report.json has always kept it
            d["data"] = {**d["data"], "caused_by": self.caused_by.to_dict()}
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Finding:
        d = dict(d)
        for key in FINDING_RANK_LISTS:   # plain, or as runs (the verdict node 0 sends the other nodes)
            d[key] = ranks_from_json(d.get(key, ()))
        d["fields"] = tuple(d.get("fields", ()))
        d["ranks"] = tuple(RankDetail.from_dict(r) for r in d.get("ranks", ()))
        data = dict(d.get("data") or {})
        cause = data.pop("caused_by", None)
        d["data"], d["caused_by"] = data, Cause.from_dict(cause) if cause else None
        return cls(**{k: v for k, v in d.items() if k in _FINDING_FIELDS})


_FINDING_FIELDS = {f.name for f in dataclasses.fields(Finding)}
FINDING_RANK_LISTS = ("waiting_ranks", "absent_ranks", "odd_ranks")


@dataclass(frozen=True)
class ScenarioResult:
    name: str
    source: str
    expected: tuple[str, ...]
    observed: tuple[str, ...]
    ok: bool
    duration_s: float
    findings: tuple[Finding, ...] = ()
    ranks: tuple[RankOutcome, ...] = ()
    skipped: str | None = None      # reason, when the scenario could not run here
    end_reason: str = EndReason.COMPLETED   # an EndReason value (a plain str once read back from JSON)
    launch_dir: str | None = None
    description: str | None = None
    collectives_compared: int = 0
    log_tail: str | None = None
    tables: tuple[dict[str, Any], ...] = ()   # scenario-reported tables (e.g. bus bandwidth per size)
    # wall-clock times (epoch seconds) of the launch, for timelines; None in older reports
    started_at: float | None = None
    ended_at: float | None = None
    stall_onset: float | None = None    # last progress before a stall/timeout was declared
    detected_at: float | None = None    # when the watchdog declared it
    script: bool = False                # the user's own script (or -m module), not a @scenario
    test: str | None = None             # ``run -- pytest``: the pytest node id its ranks served
    command_exit: int | None = None     # ``run -- CMD`` that started no process group: the command's own exit

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "source": self.source,
            "script": self.script,
            "description": self.description,
            "expected": list(self.expected),
            "observed": list(self.observed),
            "ok": self.ok,
            "skipped": self.skipped,
            "end_reason": self.end_reason,
            "duration_s": round(self.duration_s, 3),
            "launch_dir": self.launch_dir,
            "collectives_compared": self.collectives_compared,
            "ranks": [r.to_dict() for r in self.ranks],
            "findings": [f.to_dict() for f in self.findings],
            "log_tail": self.log_tail,
            "tables": list(self.tables),
            "started_at": self.started_at,
            "ended_at": self.ended_at,
            "stall_onset": self.stall_onset,
            "detected_at": self.detected_at,
            "test": self.test,
            "command_exit": self.command_exit,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ScenarioResult:
        return cls(
            name=d["name"], source=d["source"], description=d.get("description"),
            expected=tuple(d["expected"]), observed=tuple(d["observed"]), ok=d["ok"],
            duration_s=d["duration_s"], skipped=d.get("skipped"),
            end_reason=d.get("end_reason", "completed"), launch_dir=d.get("launch_dir"),
            collectives_compared=d.get("collectives_compared", 0),
            findings=tuple(Finding.from_dict(f) for f in d.get("findings", ())),
            ranks=tuple(RankOutcome.from_dict(r) for r in d.get("ranks", ())),
            log_tail=d.get("log_tail"),
            tables=tuple(d.get("tables", ())), started_at=d.get("started_at"), ended_at=d.get("ended_at"),
            stall_onset=d.get("stall_onset"), detected_at=d.get("detected_at"), script=d.get("script", False),
            test=d.get("test"), command_exit=d.get("command_exit"),
        )


@dataclass(frozen=True)
class RunInfo:
    backend: str
    world_size: int
    nnodes: int
    nproc_per_node: int
    torch_version: str
    distcheck_version: str
    command: str
    run_dir: str
    seed: int
    duration_s: float
    started_at: str
    hostname: str = ""
    python_version: str = ""
    versions: dict[str, str] = field(default_factory=dict)  # optional libraries seen
    torch_features: dict[str, bool] = field(default_factory=dict)  # distcheck.torch_features, by name
    command_output: str | None = None   # ``run -- CMD``: the last lines of the command's own output (pytest's summary)
    slurm: dict[str, str] = field(default_factory=dict)   # the Slurm job it ran in: job_id, step, nodelist

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["duration_s"] = round(self.duration_s, 3)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RunInfo:
        return cls(**{k: v for k, v in d.items() if k in _RUNINFO_FIELDS})


_RUNINFO_FIELDS = {f.name for f in dataclasses.fields(RunInfo)}


@dataclass(frozen=True)
class Report:
    run: RunInfo
    scenarios: tuple[ScenarioResult, ...]
    interrupted: bool = False

    @property
    def verdict(self) -> str:
        if self.interrupted or self.nothing_ran:   # a run that ran nothing did not pass
            return "fail"
        return "pass" if all(s.ok for s in self.scenarios) else "fail"

    @property
    def unchecked_exit(self) -> int | None:
        """The exit code of a wrapped command that ran to its end without a process group (nothing to check):
        the run ends with it. None for any other run."""
        if self.interrupted or not self.nothing_ran:
            return None
        codes = [s.command_exit for s in self.scenarios]
        return codes[-1] if all(c is not None for c in codes) else None

    @property
    def nothing_ran(self) -> bool:
        """Every target was skipped (its library missing, too few ranks): not a pass (exit 6)."""
        return bool(self.scenarios) and all(s.skipped for s in self.scenarios)

    @property
    def end_reason(self) -> EndReason:
        """How the run ended: interrupted, nothing ran, cut short by --timeout (it stops the run), else its one
        launch's end; a run of several launches that went through them all completed (each has its own)."""
        ends = [EndReason.of(s.end_reason) for s in self.scenarios if not s.skipped]
        if self.interrupted:   # Slurm's own ending, where a launch knew it
            return next((e for e in ends if e.interrupted and e is not EndReason.INTERRUPTED), EndReason.INTERRUPTED)
        if self.nothing_ran:
            return EndReason.NOTHING_RAN
        if EndReason.TIMEOUT in ends:
            return EndReason.TIMEOUT
        return ends[0] if len(ends) == 1 else EndReason.COMPLETED

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": str(REPORT_SCHEMA),
            "verdict": self.verdict,
            "end_reason": str(self.end_reason),
            "interrupted": self.interrupted,
            "run": self.run.to_dict(),
            "scenarios": [s.to_dict() for s in self.scenarios],
        }

    def as_written(self) -> dict[str, Any]:
        """The report as report.json holds it: every long ``group_ranks`` as runs, and a job of many ranks in the
        shared form (``report_form``). Both writers of a report's JSON write this."""
        return shared(bounded(self.to_dict()))

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Report:
        """A report from its JSON, in either form."""
        if d.get("schema") not in SCHEMAS:
            raise ValueError(f"unsupported report schema {d.get('schema')!r} (expected one of {', '.join(SCHEMAS)})")
        d = inline(d)
        return cls(
            run=RunInfo.from_dict(d["run"]),
            scenarios=tuple(ScenarioResult.from_dict(s) for s in d["scenarios"]),
            interrupted=d.get("interrupted", False),
        )


@dataclass(frozen=True)
class RunSummary:
    """One saved run as ``distcheck runs`` lists it (built by ``files.saved_runs.summarize``)."""

    id: str
    path: str
    started_at: str | None
    verdict: str               # pass, fail, incomplete, corrupt
    scenarios: int = 0
    ok: int = 0
    skipped: int = 0
    names: tuple[str, ...] = ()
    backend: str | None = None
    world_size: int | None = None
    duration_s: float | None = None
    problem: str | None = None
    end_reason: str | None = None   # the run's ``Report.end_reason`` (None: not read)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["names"] = list(self.names)
        return d
