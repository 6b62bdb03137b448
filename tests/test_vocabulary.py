"""The typed vocabulary (issue 56 item 5) and the rules in phases (item 6): finding kinds and severities are
enums that are still their plain strings on disk, a call's group is a ``GroupKey`` parsed in one place, a
finding's cause is a typed field that report.json keeps where it always was; every rule works from the facts
alone, and one pass links the findings. Pure, milliseconds."""

from __future__ import annotations

import inspect
import json

from distcheck.diagnose import causes, rules
from distcheck.diagnose.facts import Facts, facts_of
from distcheck.diagnose.rules import RunFacts, analyze, find_all, observed_kinds
from distcheck.models import (FINDING_KINDS, PASS, SEVERITIES, Cause, Event, Finding, GroupKey, Kind, RankOutcome,
                              Severity, expectations)
from distcheck.report.json_schema import FINDING

WORLD4 = (0, 1, 2, 3)


def ev(rank: int, seq: int, *, dtype: str = "int64", done: bool = True, group: str = "0") -> Event:
    return Event(rank=rank, group=group, seq=seq, op="all_gather", shapes=((8,),), dtypes=(dtype,), device="cpu",
                 group_ranks=WORLD4, t_enter=float(seq), t_exit=float(seq) + 0.001 if done else None,
                 callsite="/home/u/eval.py:30:main")


def _dtype_crash() -> tuple[dict[int, list[Event]], dict[int, RankOutcome]]:
    """Rank 3 aborted inside all_gather #2, where its dtype differs from the others'; ranks 0-2 wait there."""
    traces = {r: [ev(r, 1), ev(r, 2, dtype="float32" if r == 3 else "int64", done=False)] for r in WORLD4}
    outcomes = {r: RankOutcome(rank=r, state="stuck", last_event=traces[r][-1]) for r in (0, 1, 2)}
    outcomes[3] = RankOutcome(rank=3, state="crashed", signal="SIGABRT", last_event=traces[3][-1])
    return traces, outcomes


def test_kinds_and_severities_are_enums_that_stay_their_strings_in_json():
    f = Finding(kind=Kind.HANG, severity=Severity.ERROR, summary="s", group="0", seq=1)
    assert f.kind == "hang" and f"{f.kind}" == "hang" and f.kind.upper() == "HANG"
    d = f.to_dict()
    assert (d["kind"], d["severity"]) == ("hang", "error") and type(d["kind"]) is str and type(d["severity"]) is str
    assert json.loads(json.dumps(d))["kind"] == "hang"
    assert [k.value for k in FINDING_KINDS] == ["crash", "hang", "mismatch", "order", "count", "numeric",
                                                "duplicates", "straggler", "health", "coverage"]
    assert [s.value for s in SEVERITIES] == ["error", "warning", "info"] and Severity.ERROR.weight == 0
    assert FINDING["properties"]["kind"]["enum"] == [k.value for k in Kind]   # the schema names plain strings


def test_a_finding_built_or_read_with_plain_strings_holds_the_typed_values():
    f = Finding.from_dict({"kind": "crash", "severity": "warning", "summary": "s", "group": "p2p:0>1"})
    assert f.kind is Kind.CRASH and f.severity is Severity.WARNING
    assert type(f.group) is GroupKey and f.group.is_p2p and (f.group.src, f.group.dst) == (0, 1)


def test_expectations_stay_strings_on_the_users_side_and_are_read_as_kinds():
    assert expectations(("hang", "crash")) == (Kind.HANG, Kind.CRASH)
    assert expectations(("pass",)) == (PASS,)
    assert observed_kinds([]) == (PASS,)
    try:
        expectations(("desync",))
    except ValueError:
        pass
    else:
        raise AssertionError("an unknown expectation must not pass")


def test_the_group_key_is_built_and_parsed_in_one_place():
    pair = GroupKey.p2p(2, 5)
    assert pair == "p2p:2>5" and pair.is_p2p and (pair.src, pair.dst, pair.any_source) == (2, 5, False)
    anyone = GroupKey.p2p(None, 3)
    assert anyone == "p2p:any>3" and anyone.any_source and (anyone.src, anyone.dst, anyone.src_text) == (None, 3, "any")
    world = GroupKey("0")
    assert not world.is_p2p and (world.src, world.dst) == (None, None)
    assert GroupKey.of(world) is world and {"0": 1}[world] == 1 and json.dumps(world) == '"0"'


def test_the_cause_is_a_typed_field_that_report_json_keeps_in_data():
    traces, outcomes = _dtype_crash()
    found = analyze(traces, outcomes, RunFacts(world_size=4, end_reason="crash"))
    assert [f.kind for f in found] == [Kind.MISMATCH, Kind.CRASH]
    crash = found[1]
    assert crash.caused_by == Cause(kind=Kind.MISMATCH, group="0", seq=2, fields=("dtype",))
    assert "caused_by" not in crash.data and "most likely a consequence of the dtype mismatch" in crash.summary
    d = crash.to_dict()
    assert "caused_by" not in d and d["data"]["caused_by"] == {"kind": "mismatch", "group": "0", "seq": 2,
                                                               "fields": ["dtype"]}
    assert json.loads(json.dumps(d))["data"]["caused_by"]["kind"] == "mismatch"
    assert Finding.from_dict(json.loads(json.dumps(d))) == crash   # a saved run reads back the same


def test_an_older_saved_finding_with_its_cause_in_data_reads_back_typed():
    saved = {"kind": "hang", "severity": "error", "summary": "s", "group": "0", "seq": 4,
             "data": {"evidence": "certain", "caused_by": {"kind": "order", "group": "1", "seq": 2, "ranks": [1]}}}
    f = Finding.from_dict(saved)
    assert f.caused_by == Cause(kind=Kind.ORDER, group="1", seq=2, ranks=(1,)) and f.data == {"evidence": "certain"}
    assert f.to_dict()["data"] == saved["data"]


def test_every_rule_works_from_the_facts_alone():
    assert list(inspect.signature(find_all).parameters) == ["facts"]
    traces, outcomes = _dtype_crash()
    seen = facts_of(traces, outcomes, RunFacts(world_size=4, end_reason="crash"))
    found = find_all(seen)
    # unlinked: the crash does not yet know its mismatch, and the hang it leaves is still there
    assert [f.kind for f in found.crashes] == [Kind.CRASH] and found.crashes[0].caused_by is None
    assert "most likely" not in found.crashes[0].summary
    assert [f.kind for f in found.hangs] == [Kind.HANG] and [f.fields for f in found.mismatches] == [("dtype",)]
    # linking: the crash follows from the mismatch and explains the hang, which is not said
    linked = causes.link(found, seen)
    assert [f.kind for f in linked] == [Kind.MISMATCH, Kind.CRASH] and linked[1].caused_by.seq == 2
    assert isinstance(seen, Facts) and rules.analyze(traces, outcomes, seen.run) == linked


def test_a_backend_abort_a_fingerprint_mismatch_explains_is_linked_away():
    mismatch = Finding(kind=Kind.MISMATCH, severity=Severity.ERROR, summary="m", group="0", seq=2)
    same = Finding(kind=Kind.MISMATCH, severity=Severity.ERROR, summary="gloo", group="0", seq=2, fields=("bytes",))
    other = Finding(kind=Kind.MISMATCH, severity=Severity.ERROR, summary="gloo", group="0", seq=3, fields=("bytes",))
    outside = Finding(kind=Kind.MISMATCH, severity=Severity.ERROR, summary="gloo", fields=("bytes",))
    assert causes.unexplained([same, other, outside], [mismatch]) == [other, outside]
