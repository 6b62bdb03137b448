"""distcheck's data model: the names every part shares (``enums``; ``group_key``: a call's group; ``cause``: what a
finding follows from) and the results that round-trip through JSON (``results``; ``runs``: long rank lists as
runs; ``report_form``: report.json's two forms). Import from here:
``from distcheck.models import Finding, EndReason``."""

from distcheck.models.enums import (
    REPORT_SCHEMA, ReportSchema, UNKNOWN_OP, JOIN_LABEL, VERSION, RankState, EndReason, Phase, Hook, HOOK_LOST,
    CAP_HOOKS, FINDING_KINDS, RANK_STATES, SEVERITIES, Kind, Severity, PASS, Expectation, expectations)
from distcheck.models.cause import Cause
from distcheck.models.group_key import GroupKey, is_p2p
from distcheck.models.runs import rank_runs, RUNS_ABOVE, bounded, ranks_from_json, shorter_form
from distcheck.models.report_form import SHARE_ABOVE, inline
from distcheck.models.results import (
    Event, StackFrame, RankOutcome, RankDetail, Finding,
    ScenarioResult, RunInfo, Report, RunSummary, FINDING_RANK_LISTS)

__all__ = [
    'CAP_HOOKS',
    'FINDING_KINDS',
    'FINDING_RANK_LISTS',
    'HOOK_LOST',
    'JOIN_LABEL',
    'PASS',
    'RANK_STATES',
    'REPORT_SCHEMA',
    'RUNS_ABOVE',
    'SEVERITIES',
    'SHARE_ABOVE',
    'UNKNOWN_OP',
    'VERSION',
    'Cause',
    'EndReason',
    'Event',
    'Expectation',
    'Finding',
    'GroupKey',
    'Hook',
    'Kind',
    'Phase',
    'RankDetail',
    'RankOutcome',
    'RankState',
    'Report',
    'ReportSchema',
    'RunInfo',
    'RunSummary',
    'ScenarioResult',
    'Severity',
    'StackFrame',
    'bounded',
    'expectations',
    'inline',
    'is_p2p',
    'rank_runs',
    'ranks_from_json',
    'shorter_form',
]
