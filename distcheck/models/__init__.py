"""distcheck's data model: the names every part shares (``enums``) and the results that round-trip through JSON
(``results``). Import from here: ``from distcheck.models import Finding, EndReason``."""

from distcheck.models.enums import (
    REPORT_SCHEMA, UNKNOWN_OP, JOIN_LABEL, VERSION, RankState, EndReason, Phase, Hook, HOOK_LOST, CAP_HOOKS,
    FINDING_KINDS, RANK_STATES, SEVERITIES)
from distcheck.models.results import (
    Event, rank_runs, RUNS_ABOVE, bounded, ranks_from_json, StackFrame, RankOutcome, RankDetail, Finding,
    ScenarioResult, RunInfo, Report, RunSummary)

__all__ = [
    'REPORT_SCHEMA', 'UNKNOWN_OP', 'JOIN_LABEL', 'VERSION', 'RankState', 'EndReason', 'Phase', 'Hook',
    'HOOK_LOST', 'CAP_HOOKS', 'FINDING_KINDS', 'RANK_STATES', 'SEVERITIES', 'Event', 'rank_runs',
    'RUNS_ABOVE', 'bounded', 'ranks_from_json', 'StackFrame', 'RankOutcome', 'RankDetail', 'Finding',
    'ScenarioResult', 'RunInfo', 'Report', 'RunSummary'
]
