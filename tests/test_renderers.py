"""Every renderer on one fixed Report built from real model objects.

No process is started here: the report and the per-rank events are built by
hand (a 4-rank hang, a tie mismatch on 2 ranks, a crash, a clean pass, a skip),
rendered by each renderer, and each output is parsed back: JSON against the
report schema, JUnit with a JUnit parser, the Chrome trace and the HTML/SVG
structurally.
"""

from __future__ import annotations

import dataclasses
import io
import json
import re
import xml.etree.ElementTree as ET

import jsonschema
import pytest
from junitparser import Error, Failure, JUnitXml, Skipped
from rich.console import Console

from distcheck import envinfo
from distcheck.errors import CorruptInputError, ExitCode, UsageError
from distcheck.models import Event, Finding, Kind, RankDetail, RankOutcome, Report, RunInfo, ScenarioResult, Severity
from distcheck.report import (chrome_trace, env_view, html_timeline, json_report, json_schema, junit, runs_table,
                              scenario_list, terminal)
from distcheck.report.live import ANNOUNCE_AFTER_S, LiveState, LiveView, rank_rows, renderable
from distcheck.files.saved_runs import list_runs, load_report, load_run, resolve_run_dir
from distcheck.report.outputs import write_outputs
from distcheck.scenario import ScenarioSpec
from distcheck.report.timeline import build
from distcheck.launch.progress import RankProgress

T0 = 1_800_000_000.0
SITE = "/home/u/eval.py:24:main"
LIB = "/site-packages/torchmetrics/utilities/distributed.py:121:gather_all_tensors"


def ev(rank, seq, op="all_reduce", t=0.0, dur=0.002, returned=True, reduce_op="SUM", label=None, group="0",
       ranks=(0, 1, 2, 3), error=None):
    return Event(rank=rank, group=group, seq=seq, op=op, reduce_op=reduce_op if op == "all_reduce" else None,
                 shapes=((4,),) if op != "barrier" else (), dtypes=("float32",) if op != "barrier" else (),
                 device="cpu", group_ranks=ranks, t_enter=T0 + t, t_exit=(T0 + t + dur) if returned else None,
                 callsite=SITE, library_callsite=LIB if label else None, label=label, error=error)


def hang_scenario():
    events = {r: [ev(r, s, t=0.01 * s + 0.001 * r) for s in (1, 2, 3)] for r in range(4)}
    stuck = ev(0, 4, op="barrier", t=0.05, returned=False, label="BinaryAUROC.compute")
    events[0].append(stuck)
    finding = Finding(
        kind=Kind.HANG, severity=Severity.ERROR, group="0", seq=4, op="barrier", label="BinaryAUROC.compute", callsite=SITE,
        waiting_ranks=(0,), absent_ranks=(1, 2, 3), detected_after_s=3.05,
        summary="Rank 0 is waiting in barrier #4 (group 0) called from BinaryAUROC.compute at eval.py:24; "
                "ranks 1, 2, 3 never entered it (finished, now idle).",
        ranks=(RankDetail(rank=0, role="waiting", op="barrier", seq=4, label="BinaryAUROC.compute", callsite=SITE,
                          state="stuck", fingerprint=stuck.fingerprint()),
               *(RankDetail(rank=r, role="absent", state="finished", note="finished, now idle") for r in (1, 2, 3))),
    )
    ranks = (RankOutcome(rank=0, state="stuck", host="n1", pid=100, collectives=4, last_event=stuck, where=SITE,
                         stack="File eval.py, line 24 in main", phase="running"),
             *(RankOutcome(rank=r, state="finished", host="n1", pid=100 + r, collectives=3, phase="finished")
               for r in (1, 2, 3)))
    result = ScenarioResult(
        name="auroc_rank0_only_compute", source="/home/u/scenarios/auroc.py", expected=("hang",),
        observed=("hang",), ok=True, duration_s=9.5, findings=(finding,), ranks=ranks, end_reason="stall",
        launch_dir="/tmp/run/auroc_rank0_only_compute", description="Only rank 0 calls compute().",
        collectives_compared=3, started_at=T0 - 4.0, ended_at=T0 + 3.4, stall_onset=T0 + 0.05,
        detected_at=T0 + 3.1,
    )
    return result, events


def mismatch_scenario():
    pair = (0, 1)
    events = {r: [ev(r, 1, t=0.001, ranks=pair, group="1"),
                  ev(r, 2, t=0.004, reduce_op="MAX" if r == 1 else "SUM", ranks=pair, group="1"),
                  ev(r, 3, op="all_gather", t=0.007, ranks=pair, group="1")] for r in pair}
    fields = ("reduce_op",)
    finding = Finding(
        kind=Kind.MISMATCH, severity=Severity.ERROR, group="1", seq=2, op="all_reduce", callsite=SITE, fields=fields, tie=True,
        summary="Collective #2 on group 1: ranks disagree and no side has a majority (tie): reduce_op SUM (rank 0) "
                "vs MAX (rank 1).",
        ranks=tuple(RankDetail(rank=r, role="tie", op="all_reduce", seq=2, callsite=SITE,
                               fingerprint=events[r][1].fingerprint()) for r in pair),
    )
    ranks = tuple(RankOutcome(rank=r, state="finished", host="n1", pid=200 + r, collectives=3) for r in pair)
    return ScenarioResult(
        name="reduce_op_mismatch", source="/home/u/scenarios/mm.py", expected=("pass",), observed=("mismatch",),
        ok=False, duration_s=4.0, findings=(finding,), ranks=ranks, started_at=T0 + 10, ended_at=T0 + 14,
        log_tail="rank 1: reducing with MAX\n\x1b[31mcolour\x1b[0m and a NUL \x00 byte",
    ), events


def crash_scenario():
    pair = (0, 1)
    events = {0: [ev(0, 1, ranks=pair), ev(0, 2, t=0.01, ranks=pair, error="RuntimeError: Connection closed")],
              1: [ev(1, 1, ranks=pair, t=0.002)]}
    finding = Finding(
        kind=Kind.CRASH, severity=Severity.ERROR, group="0", seq=1, op="all_reduce", callsite="/home/u/eval.py:30:main",
        odd_ranks=(1,), summary="Rank 1 raised ValueError: bad batch at eval.py:30.",
        ranks=(RankDetail(rank=1, role="crashed", state="crashed", where="/home/u/eval.py:30:main",
                          note="ValueError: bad batch"),
               RankDetail(rank=0, role="peer", state="killed", note="waiting in all_reduce #2")),
    )
    ranks = (RankOutcome(rank=0, state="killed", host="n1", pid=300, collectives=2, signal="SIGTERM"),
             RankOutcome(rank=1, state="crashed", host="n1", pid=301, exit_code=1, collectives=1,
                         exception="ValueError: bad batch", where="/home/u/eval.py:30:main"))
    return ScenarioResult(
        name="rank_raises", source="/home/u/scenarios/crash.py", expected=("crash",), observed=("crash",), ok=True,
        duration_s=3.0, findings=(finding,), ranks=ranks, end_reason="crash", started_at=T0 + 20, ended_at=T0 + 23,
    ), events


@pytest.fixture(scope="module")
def fixed():
    hang, hang_events = hang_scenario()
    mismatch, mismatch_events = mismatch_scenario()
    crash, crash_events = crash_scenario()
    clean = ScenarioResult(name="collectives_sanity", source="/home/u/scenarios/sanity.py", expected=("pass",),
                           observed=(), ok=True, duration_s=2.0,
                           ranks=tuple(RankOutcome(rank=r, state="finished", collectives=1) for r in range(2)),
                           started_at=T0 + 30, ended_at=T0 + 32)
    skipped = ScenarioResult(name="nccl_only", source="/home/u/scenarios/nccl.py", expected=("hang",), observed=(),
                             ok=True, duration_s=0.0, skipped="only meaningful on nccl; this run uses gloo")
    run = RunInfo(backend="gloo", world_size=4, nnodes=1, nproc_per_node=4, torch_version="2.13.0+cpu",
                  distcheck_version="0.1.0", command="distcheck run --json r.json", run_dir="/tmp/run", seed=7,
                  duration_s=21.0, started_at="2027-01-15T10:00:00", hostname="n1", python_version="3.11.7",
                  versions={"torchmetrics": "1.9.0", "lightning": "2.6.6"})
    report = Report(run=run, scenarios=(hang, mismatch, crash, clean, skipped))
    events = {"auroc_rank0_only_compute": hang_events, "reduce_op_mismatch": mismatch_events,
              "rank_raises": crash_events, "collectives_sanity": {r: [ev(r, 1, ranks=(0, 1))] for r in (0, 1)}}
    return report, events


def console(width=100):
    return Console(file=io.StringIO(), width=width, force_terminal=False, color_system=None, highlight=False)


# -- terminal -------------------------------------------------------------------


def test_terminal_by_default_shows_findings_only_where_the_outcome_was_not_expected(fixed):
    report, _ = fixed
    c = console()
    terminal.render(report, c)
    out = c.file.getvalue()
    assert "OK   auroc_rank0_only_compute  expected hang, observed hang" in out
    assert "FAIL reduce_op_mismatch  expected pass, observed mismatch" in out
    assert "SKIP nccl_only" in out
    assert "Rank 0 is waiting in barrier #4" not in out       # the expected hang: its one line only
    assert "MISMATCH [error]" in out                           # the unexpected one: its findings and ranks
    assert "[error]" not in "".join(line for line in out.splitlines() if "HANG" in line)
    assert "FAIL  3/4 scenarios behaved as expected (2 planted bugs found, 1 clean), 1 skipped" in out
    assert "needs attention: reduce_op_mismatch (pass expected, mismatch observed)" in out
    assert "torch 2" not in out                                # the torch line is -v's (and distcheck env's)
    assert max(len(line) for line in out.splitlines()) <= 100


def test_terminal_verbose_marks_expected_findings_expected_and_shows_every_rank_table(fixed):
    report, _ = fixed
    c = console()
    terminal.render(report, c, verbose=True)
    out = c.file.getvalue()
    assert "HANG [expected] Rank 0 is waiting in barrier #4" in out
    assert "barrier #4 [BinaryAUROC.compute]" in out          # the stuck rank's row
    assert "MISMATCH [error]" in out


def test_terminal_quiet_is_one_line(fixed):
    report, _ = fixed
    c = console()
    terminal.render(report, c, quiet=True)
    [line] = c.file.getvalue().splitlines()
    assert line.startswith("FAIL  3/4 scenarios behaved as expected")


def test_terminal_rerender_from_json_is_identical(fixed):
    report, _ = fixed
    again = Report.from_dict(json.loads(json_report.render(report)))
    first, second = console(), console()
    terminal.render(report, first, verbose=True)
    terminal.render(again, second, verbose=True)
    assert first.file.getvalue() == second.file.getvalue()
    assert again == report


# -- JSON -----------------------------------------------------------------------


def test_json_report_matches_the_contract_schema(fixed):
    report, _ = fixed
    doc = json.loads(json_report.render(report))
    jsonschema.validate(doc, json_schema.REPORT)
    assert doc["schema"] == "distcheck.report/1" and doc["verdict"] == "fail"
    hang = doc["scenarios"][0]["findings"][0]
    assert hang["waiting_ranks"] == [0] and hang["absent_ranks"] == [1, 2, 3]
    assert hang["detected_after_s"] == pytest.approx(3.05)
    for scenario in doc["scenarios"]:
        for finding in scenario["findings"]:
            assert finding["waiting_ranks"] == sorted(finding["waiting_ranks"])
            assert finding["absent_ranks"] == sorted(finding["absent_ranks"])


def test_schema_rejects_a_report_missing_a_contract_field(fixed):
    report, _ = fixed
    doc = json.loads(json_report.render(report))
    del doc["scenarios"][0]["findings"][0]["absent_ranks"]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(doc, json_schema.REPORT)


# -- JUnit ----------------------------------------------------------------------


def test_junit_in_pytest_shape_through_a_junit_parser(fixed, tmp_path):
    report, _ = fixed
    path = tmp_path / "junit.xml"
    path.write_text(junit.render(report), encoding="utf-8")
    xml = JUnitXml.fromfile(str(path))
    suites = list(xml)
    assert len(suites) == 1
    suite = suites[0]
    assert (suite.name, suite.tests, suite.failures, suite.errors, suite.skipped) == ("distcheck", 5, 1, 0, 1)
    assert suite.hostname == "n1" and suite.timestamp == "2027-01-15T10:00:00"
    props = {p.name: p.value for p in suite.properties()}
    assert props["seed"] == "7" and props["torch"] == "2.13.0+cpu" and props["torchmetrics"] == "1.9.0"
    assert props["backend"] == "gloo" and props["world_size"] == "4"
    cases = {case.name: case for case in suite}
    assert set(cases) == {s.name for s in report.scenarios}
    assert all(case.classname == "distcheck.gloo.4ranks" for case in cases.values())

    assert cases["auroc_rank0_only_compute"].is_passed     # expected hang, observed hang
    assert "Rank 0 is waiting in barrier #4" in cases["auroc_rank0_only_compute"].system_out

    failed = cases["reduce_op_mismatch"]
    [failure] = failed.result
    assert isinstance(failure, Failure)
    assert failure.message.startswith("expected pass, observed mismatch: Collective #2 on group 1")
    assert "rank 0 (tie) all_reduce #2" in failure.text and "rank 1 (tie)" in failure.text
    assert "differs in: reduce_op" in failure.text
    assert "reducing with MAX" in failed.system_out
    assert "\x00" not in failed.system_out and "\x1b" not in failed.system_out

    [skip] = cases["nccl_only"].result
    assert isinstance(skip, Skipped) and "only meaningful on nccl" in skip.message
    assert float(cases["auroc_rank0_only_compute"].time) == pytest.approx(9.5)


def test_junit_marks_an_interrupted_run_as_an_error(fixed):
    report, _ = fixed
    cut = Report(run=report.run, scenarios=report.scenarios[:1], interrupted=True)
    xml = JUnitXml.fromstring(junit.render(cut))
    suite = next(iter(xml))
    assert suite.errors == 1 and suite.tests == 2
    interrupted = [c for c in suite if c.name == "(run interrupted)"]
    assert interrupted and isinstance(interrupted[0].result[0], Error)


# -- Chrome trace -----------------------------------------------------------------


def test_chrome_trace_structure(fixed):
    report, events = fixed
    doc = json.loads(chrome_trace.render(report, events))
    trace = doc["traceEvents"]
    assert doc["displayTimeUnit"] == "ms" and doc["otherData"]["seed"] == 7
    for e in trace:
        assert {"ph", "ts", "pid", "tid"} <= e.keys(), e
        assert isinstance(e["ts"], (int, float)) and e["ts"] >= 0
    # one process per scenario that ran, named; one lane (thread) per rank, named once
    names = {e["pid"]: e["args"]["name"] for e in trace if e["ph"] == "M" and e["name"] == "process_name"}
    assert sorted(names.values())[0].startswith("auroc_rank0_only_compute: expected hang")
    assert len(names) == 4      # the skipped scenario has no lane
    lanes = [(e["pid"], e["tid"]) for e in trace if e["ph"] == "M" and e["name"] == "thread_name"]
    assert len(lanes) == len(set(lanes))
    by_name = {v.split(":")[0]: k for k, v in names.items()}
    hang_pid = by_name["auroc_rank0_only_compute"]
    assert sorted(t for p, t in lanes if p == hang_pid) == [0, 1, 2, 3]
    # slices: complete events with a duration, on a named lane, args carry fingerprint + call site
    slices = [e for e in trace if e["ph"] == "X"]
    assert len(slices) == sum(len(evs) for evs in events.values() for evs in evs.values())
    for s in slices:
        assert s["dur"] >= 0 and (s["pid"], s["tid"]) in lanes
        assert {"fingerprint", "callsite", "label"} <= s["args"].keys()
    per_lane: dict = {}
    for s in slices:
        per_lane.setdefault((s["pid"], s["tid"]), []).append(s)
    for lane in per_lane.values():       # slices of one rank never overlap: well nested
        lane.sort(key=lambda s: s["ts"])
        for a, b in zip(lane, lane[1:]):
            assert a["ts"] + a["dur"] <= b["ts"] + 1e-3
    # the stuck collective is marked, named, and never returned
    [stuck] = [s for s in slices if s["cat"] == "distcheck.stuck"]
    assert (stuck["pid"], stuck["tid"]) == (hang_pid, 0)
    assert stuck["name"] == "barrier #4 BinaryAUROC.compute (never returned)"
    assert stuck["args"]["finding"]["kind"] == "hang" and stuck["cname"] == "terrible"
    # the absent ranks and the crash are instant events on their own lanes; the stall on the process
    instants = [e for e in trace if e["ph"] == "i"]
    absent = sorted(e["tid"] for e in instants if e["cat"] == "distcheck.absent" and e["pid"] == hang_pid)
    assert absent == [1, 2, 3]
    [crash] = [e for e in instants if e["cat"] == "distcheck.crash"]
    assert crash["tid"] == 1 and crash["s"] == "t" and "ValueError: bad batch" in crash["name"]
    assert any(e["cat"] == "distcheck.stall" and e["s"] == "p" for e in instants)
    # a tie mismatch marks both ranks' collective as odd
    odd = [s for s in slices if s["cat"] == "distcheck.odd"]
    assert sorted(s["tid"] for s in odd) == [0, 1] and all(s["name"].startswith("all_reduce #2") for s in odd)


# -- timeline model + HTML ------------------------------------------------------------


def test_timeline_joins_findings_to_slices(fixed):
    report, events = fixed
    tl = build(report.scenarios[0], events["auroc_rank0_only_compute"])
    marked = [s for s in tl.slices if s.mark]
    assert [(s.rank, s.event.seq, s.mark, s.returned) for s in marked] == [(0, 4, "stuck", False)]
    assert marked[0].end == pytest.approx(3.4 - (tl.origin - T0), abs=1e-6)   # lasts until the launch ended
    assert [m.rank for m in tl.markers if m.kind == "absent"] == [1, 2, 3]
    assert tl.stall == pytest.approx((0.05 - (tl.origin - T0), 3.1 - (tl.origin - T0)))
    assert all(0 <= s.start <= s.end <= tl.end for s in tl.slices)


def test_html_timeline_is_self_contained_and_marks_the_hang(fixed):
    report, events = fixed
    page = html_timeline.render(report, events)
    assert page.startswith("<!DOCTYPE html>")
    # no network: no script, no external stylesheet or image, no URL but the SVG namespace
    assert "<script" not in page and "<link" not in page
    urls = set(re.findall(r"https?://[^\s\"'<>)]+", page))
    assert urls <= {"http://www.w3.org/2000/svg"}
    svgs = re.findall(r"<svg.*?</svg>", page, re.S)
    assert len(svgs) == 4                      # every scenario that ran
    ns = "{http://www.w3.org/2000/svg}"
    hang = ET.fromstring(svgs[0])
    classes = [el.get("class", "") for el in hang.iter()]
    assert any("m-stuck" in c for c in classes)
    assert sum(1 for c in classes if c == "absent") == 3
    assert any(c == "stall" for c in classes)
    titles = " ".join(t.text or "" for t in hang.iter(f"{ns}title"))
    assert "HANG: Rank 0 is waiting in barrier #4" in titles and "at /home/u/eval.py:24" in titles
    texts = " ".join(t.text or "" for t in hang.iter(f"{ns}text"))
    assert "never entered barrier #4 (finished, now idle)" in texts
    mismatch = ET.fromstring(svgs[1])
    texts = " ".join(t.text or "" for t in mismatch.iter(f"{ns}text"))
    assert "reduce_op MAX" in texts and "reduce_op SUM" in texts
    crash = ET.fromstring(svgs[2])
    assert "rank 1 crashed: ValueError: bad batch" in " ".join(t.text or "" for t in crash.iter(f"{ns}text"))
    assert "skipped: only meaningful on nccl" in page


# -- live view ----------------------------------------------------------------------


STALLED = {0: RankProgress(records=9, open_collectives=1, phase="running", current="barrier #4 [group 0]",
                           since=T0, label="BinaryAUROC.compute"),
           **{r: RankProgress(records=6, phase="finished") for r in (1, 2, 3)}}


def test_live_rows_group_ranks_with_the_same_state():
    rows = rank_rows(STALLED, now=T0 + 2.5)
    assert rows == [("rank 0", "waiting", "yellow", "barrier #4 [group 0]", "BinaryAUROC.compute", "2.5 s"),
                    ("ranks 1, 2, 3", "finished", "green", "", "", "")]


def test_live_renderable_shows_per_rank_state_only_during_a_stall():
    state = LiveState(name="auroc", index=0, total=2, started=T0 - 5, progress=STALLED, idle_s=2.0)
    c = console(120)
    c.print(renderable(state, T0 + 2.0, stall_timeout=3))
    out = c.file.getvalue()
    assert "RUN  auroc [1/2] 7.0 s" in out and "no progress for 2.0/3 s" in out
    assert "barrier #4 [group 0]" in out and "BinaryAUROC.compute" in out and "ranks 1, 2, 3" in out
    calm = console(120)
    calm.print(renderable(LiveState(name="auroc", index=0, total=2, started=T0, progress=STALLED, idle_s=0.2),
                          T0 + 1, stall_timeout=3))
    assert "barrier" not in calm.file.getvalue()


def test_live_view_plain_mode_prints_lines_and_one_stall_line(fixed):
    report, _ = fixed
    c = console(120)
    clock = iter([T0 - 5, T0 + 2.0, T0 + 2.1, T0 + 2.2, T0 + 2.3, T0 + 2.4]).__next__
    view = LiveView(c, stall_timeout=3, clock=clock)
    assert not view.interactive
    spec = ScenarioSpec(name="auroc_rank0_only_compute", file="x.py")
    with view:
        view.scenario_started(spec, 0, 1)
        view.on_poll(STALLED, 0.5)
        view.on_poll(STALLED, 1.6)
        view.on_poll(STALLED, 2.0)      # same stall: no second line
        view.scenario_finished(report.scenarios[0])
    out = c.file.getvalue()
    assert "RUN  auroc_rank0_only_compute  [1/1]" in out
    assert out.count("no progress for") == 1
    assert "rank 0 in barrier #4 [group 0] [BinaryAUROC.compute] for" in out and "ranks 1, 2, 3 finished" in out
    assert "OK   auroc_rank0_only_compute" in out


def _spec(name):
    return ScenarioSpec(name=name, file="x.py")


def test_live_view_plain_mode_pairs_each_start_with_its_result(fixed):
    """Piped: no block of RUN lines first. The run's first launch says it started; a shared launch's other
    targets are one result line each; a later launch's RUN line comes once it takes a while."""
    report, _ = fixed
    now = [T0]
    c = console(120)
    view = LiveView(c, stall_timeout=3, clock=lambda: now[0])
    hang, mismatch, crash = report.scenarios[:3]
    with view:
        for i, result in enumerate((hang, mismatch)):     # one shared launch
            view.scenario_started(_spec(result.name), i, 4)
        view.scenario_finished(hang)
        view.scenario_finished(mismatch)
        view.scenario_started(_spec(crash.name), 2, 4)    # a launch of its own, quick
        view.on_poll({}, 0.0)
        view.scenario_finished(crash)
        view.scenario_started(_spec("slow"), 3, 4)        # one that takes a while
        now[0] += ANNOUNCE_AFTER_S + 0.5
        view.on_poll({}, 0.0)
    lines = [line.strip() for line in c.file.getvalue().splitlines() if line.startswith("  ") and
             line.strip().startswith(("RUN", "OK", "FAIL"))]
    assert [line.split()[:2] for line in lines] == [
        ["RUN", hang.name], ["OK", hang.name], ["FAIL", mismatch.name], ["OK", crash.name], ["RUN", "slow"]]


def test_live_view_quiet_prints_nothing(fixed):
    report, _ = fixed
    c = console(120)
    view = LiveView(c, stall_timeout=3, quiet=True)
    with view:
        view.scenario_started(_spec(report.scenarios[0].name), 0, 1)
        view.on_poll(STALLED, 2.0)
        view.note("waiting for the fork server")
        view.scenario_finished(report.scenarios[0])
    assert c.file.getvalue() == ""


def test_live_view_on_a_terminal_uses_a_live_display(fixed):
    report, _ = fixed
    c = Console(file=io.StringIO(), width=100, force_terminal=True, color_system=None)
    view = LiveView(c, stall_timeout=3)
    assert view.interactive
    with view:
        view.scenario_started(ScenarioSpec(name="auroc_rank0_only_compute", file="x.py"), 0, 1)
        view.on_poll(STALLED, 2.0)
        view._live.refresh()
        view.scenario_finished(report.scenarios[0])
    out = c.file.getvalue()
    assert "BinaryAUROC.compute" in out and "OK   auroc_rank0_only_compute" in out


# -- env ------------------------------------------------------------------------------


@pytest.mark.parametrize("name, value, shown", [
    ("HF_TOKEN", "hf_abc", "***"),
    ("WANDB_API_KEY", "k", "***"),
    ("AWS_SECRET_ACCESS_KEY", "s", "***"),
    ("DB_PASSWORD", "p", "***"),
    ("TORCHELASTIC_RDZV_ENDPOINT", "https://user:pass@rdzv.example:29400/x", "https://***@rdzv.example:29400/x"),
    ("PIP_INDEX_URL", "https://token@pypi.example/simple", "https://***@pypi.example/simple"),
    ("MASTER_ADDR", "10.0.0.1", "10.0.0.1"),
    ("NCCL_DEBUG", "INFO", "INFO"),
])
def test_redaction(name, value, shown):
    assert envinfo.redact(name, value) == shown


def test_relevant_env_keeps_launch_variables_and_redacts():
    env = {"MASTER_ADDR": "h", "RANK": "3", "WORLD_SIZE": "8", "NCCL_DEBUG": "INFO", "SLURM_JOB_ID": "42",
           "TORCH_HUB_TOKEN": "x", "HOME": "/root", "GLOO_SOCKET_IFNAME": "eth0", "CUDA_VISIBLE_DEVICES": "0,1",
           "TORCHELASTIC_RUN_ID": "r", "PATH": "/bin"}
    got = envinfo.relevant_env(env)
    assert "HOME" not in got and "PATH" not in got
    assert got["TORCH_HUB_TOKEN"] == "***" and got["RANK"] == "3" and got["CUDA_VISIBLE_DEVICES"] == "0,1"
    info = envinfo.EnvInfo(distcheck="0.1.0", python="3.11", platform="Linux", hostname="n1", cpus=2,
                           torch="2.13.0+cpu", backends={"gloo": True, "nccl": False}, env=got,
                           context=envinfo._context(env), libraries={"torchmetrics": "1.9.0", "lightning": None})
    assert info.context == {"slurm": "job 42", "torchelastic": "run r", "rank": "3 of 8"}
    c = console(120)
    env_view.render(info, c)
    out = c.file.getvalue()
    assert "TORCH_HUB_TOKEN" in out and "x" not in out.split("TORCH_HUB_TOKEN")[1].split("\n")[0]
    assert "not installed" in out and "slurm" in out


# -- saved runs -------------------------------------------------------------------------


def test_saved_run_roundtrip_and_listing(fixed, tmp_path):
    report, events = fixed
    run_dir = tmp_path / "runs" / "20270115-100000-abcdef"
    run_dir.mkdir(parents=True)
    write_outputs(report, events, json_path=run_dir / "report.json")
    saved = load_run(run_dir)
    assert saved.report == report
    assert resolve_run_dir("20270115-100000-abcdef", root=tmp_path / "runs") == run_dir
    assert resolve_run_dir(run_dir / "report.json") == run_dir
    (tmp_path / "runs" / "20270115-090000-000000" / "x" / "traces").mkdir(parents=True)   # died before report.json
    runs = list_runs(tmp_path / "runs")
    assert {r.id for r in runs} == {"20270115-100000-abcdef", "20270115-090000-000000"}
    by_id = {r.id: r for r in runs}
    done = by_id["20270115-100000-abcdef"]
    assert (done.verdict, done.scenarios, done.ok, done.skipped, done.backend, done.world_size) == \
        ("fail", 5, 3, 1, "gloo", 4)
    assert by_id["20270115-090000-000000"].verdict == "incomplete"
    c = console(140)
    runs_table.render(runs, c, "runs")
    out = c.file.getvalue()
    assert "20270115-100000-abcdef" in out and "2027-01-15 10:00:00" in out and "FAIL" in out
    assert "gloo × 4" in out and "3/4 ok, 1 skipped" in out and "incomplete" in out


def test_bad_run_dirs_are_distinct_errors(tmp_path):
    with pytest.raises(UsageError) as missing:
        resolve_run_dir(tmp_path / "nope")
    assert missing.value.exit_code == ExitCode.USAGE
    (tmp_path / "empty").mkdir()
    with pytest.raises(UsageError):
        load_report(tmp_path / "empty")
    torn = tmp_path / "torn"
    torn.mkdir()
    (torn / "report.json").write_text('{"schema": "distcheck.report/1", "verd')
    with pytest.raises(CorruptInputError) as corrupt:
        load_report(torn)
    assert corrupt.value.exit_code == ExitCode.CORRUPT_INPUT == 5 and "not valid JSON" in corrupt.value.message
    (torn / "report.json").write_text('{"schema": "someone.else/9"}')
    with pytest.raises(CorruptInputError, match="unsupported report schema"):
        load_report(torn)
    (torn / "report.json").write_text('{"schema": "distcheck.report/1", "run": {}}')
    with pytest.raises(CorruptInputError, match="not a complete distcheck report"):
        load_report(torn)


def test_scenario_list_shows_missing_requirements():
    specs = [ScenarioSpec(name="a", file="/x/a.py", expect=("hang",), requires=("torchmetrics", "nosuchlib"),
                          description="A thing.", builtin=True),
             ScenarioSpec(name="bb", file="/x/b.py", backends=("nccl",), min_world_size=4)]
    c = console(120)
    scenario_list.render(specs, {"a": ["nosuchlib"], "bb": []}, c)
    out = c.file.getvalue()
    assert "needs torchmetrics, nosuchlib (missing)" in out and "nccl only" in out and "≥4 ranks" in out
    assert "2 scenario(s): 1 built-in, 1 given" in out and "skipped by 'distcheck run'" in out


def test_a_script_is_worded_as_a_script(fixed):
    """A user's script declares no expectation: "train.py: hang", never "expected pass"."""
    import dataclasses

    report, _ = fixed
    hang = dataclasses.replace(report.scenarios[0], name="train", source="/home/u/train.py", expected=("pass",),
                               ok=False, script=True)
    clean = dataclasses.replace(hang, name="evaluate", source="-m mypkg.evaluate", observed=("pass",), ok=True,
                                findings=(), end_reason="completed")
    assert terminal.scenario_line(hang).plain.startswith("  FAIL train.py: hang (ended by --stall-timeout)  (")
    assert terminal.scenario_line(clean).plain.startswith("  OK   -m mypkg.evaluate: ran clean  (")
    failed = dataclasses.replace(report, scenarios=(hang,))
    assert terminal.summary_line(failed).plain.startswith("FAIL  train.py: hang (ended by --stall-timeout)  ·")
    assert "scenario" not in terminal.summary_line(failed).plain
    assert Report.from_dict(json.loads(json_report.render(failed))).scenarios[0].script


# -- what the report says is what was seen: the diagnosis first, a launcher's report of its children's end folded --

from distcheck.diagnose.mismatch import consequence   # noqa: E402
from distcheck.launch.rank_output import Ends, folded_output, shown_with_prefix   # noqa: E402

GLOG = "W1207 03:39:45.705000 25888 site-packages/torch/distributed/run.py:874] "
AGENT = "E1207 03:39:51.872000 25888 site-packages/torch/distributed/elastic/multiprocessing/api.py:1002] "
TORCHRUN_LOG = [
    GLOG, GLOG + "*" * 41, GLOG + "Setting OMP_NUM_THREADS environment variable for each process to be 1 in default",
    GLOG + "*" * 41,
    AGENT + "failed (exitcode: 1) local_rank: 0 (pid: 25941) of binary: /usr/bin/python3.11",
    "Traceback (most recent call last):",
    '  File "/usr/bin/torchrun", line 8, in <module>', "    sys.exit(main())",
    '  File "/site-packages/torch/distributed/launcher/api.py", line 383, in launch_agent',
    "    raise ChildFailedError(",
    "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: ",
    "=" * 60, "buggy.py FAILED", "-" * 60, "Failures:", "  <NO_OTHER_FAILURES>", "-" * 60,
    "Root Cause (first observed failure):", "[0]:", "  time      : 2026-12-07_03:39:51", "  host      : localhost",
    "  rank      : 0 (local_rank: 0)", "  exitcode  : 1 (pid: 25941)", "  error_file: <N/A>",
    "  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html", "=" * 60,
]
GLOO_GONE = ("RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed "
             "by peer [127.0.0.1]:22193. This is typically caused by a remote worker crashing. Check the logs of the "
             "remote worker before reporting an error. GLHF!")
RANK0_LOG = ["[rank0]: Traceback (most recent call last):", '[rank0]:   File "/tmp/buggy.py", line 9, in <module>',
             "[rank0]:     dist.all_reduce(t)", '[rank0]:   File "/site-packages/torch/distributed/distributed_c10d.py", '
             'line 3252, in all_reduce', "[rank0]:     work.wait()", f"[rank0]: {GLOO_GONE}"]


def _feed(source: Ends, lines: list[str]) -> list[str]:
    return [shown for line in lines for shown in source.feed(line)]


def test_a_launchers_report_of_its_childrens_end_is_one_line_live_and_in_the_tail():
    live = Ends(launcher=True)
    shown = _feed(live, TORCHRUN_LOG)
    assert shown == [GLOG + "Setting OMP_NUM_THREADS environment variable for each process to be 1 in default"]
    state, held = live.end()
    assert state == "folded" and len(held) == len(TORCHRUN_LOG) - 4   # the agent's line, the traceback, the banner
    [omp, folded] = folded_output("\n".join(TORCHRUN_LOG))
    assert folded.startswith("the launcher's ChildFailedError: buggy.py FAILED; first failure: rank 0 "
                             "(local_rank: 0), exitcode 1 (22 lines folded"), folded
    # a launcher's other traceback is its own news: shown whole, as it came
    other = ["Traceback (most recent call last):", '  File "x.py", line 1, in <module>', "ValueError: bad flag"]
    assert folded_output("\n".join(other)) == other and _feed(Ends(launcher=True), other) == other


def test_a_ranks_backend_error_after_its_peers_left_waits_for_the_result_and_its_own_error_does_not():
    rank = Ends(launcher=False)
    assert _feed(rank, RANK0_LOG) == [] and rank.end() == ("consequence", RANK0_LOG)
    crash = ["[rank1]: Traceback (most recent call last):", '[rank1]:   File "/tmp/train.py", line 10, in <module>',
             "[rank1]: ValueError: rank 1 gives up"]
    assert _feed(Ends(launcher=False), crash) == crash   # the rank's own error: shown at its last line
    later = Ends(launcher=False)   # a backend error the rank caught and went on from: shown once it goes on
    assert _feed(later, [*RANK0_LOG, "[rank0]: retrying"]) == [*RANK0_LOG, "[rank0]: retrying"]
    assert shown_with_prefix(0, "[rank0]: Traceback") == "[rank0]: Traceback"   # torch's own prefix: one
    assert shown_with_prefix(0, "loss 0.25") == "[rank0]:loss 0.25" and shown_with_prefix(None, "x") == "x"


def _buggy_result() -> ScenarioResult:
    stuck = ev(0, 1, returned=False, ranks=(0, 1, 2), error=GLOO_GONE)
    finding = Finding(kind=Kind.HANG, severity=Severity.ERROR, group="0", seq=1, op="all_reduce", callsite=SITE,
                      waiting_ranks=(0,), absent_ranks=(1, 2), summary="Rank 0 is waiting in all_reduce #1 (group 0).")
    ranks = (RankOutcome(rank=0, state="stuck", pid=1, collectives=1, last_event=stuck, where=SITE, exit_code=1,
                         exception=GLOO_GONE, phase="error",
                         flight_recorder={"0": {"last_enqueued_collective": 2, "last_completed_collective": 1}}),
             *(RankOutcome(rank=r, state="finished", pid=1 + r, collectives=0) for r in (1, 2)))
    return ScenarioResult(name="buggy", source="torchrun --nproc-per-node 3 buggy.py", expected=("pass",),
                          observed=("hang",), ok=False, duration_s=9.5, findings=(finding,), ranks=ranks, script=True,
                          end_reason="crash", log_tail="\n".join(RANK0_LOG))


def _text(renderable, width=140) -> str:
    c = console(width)
    c.print(renderable)
    return c.file.getvalue()


def test_a_stuck_rank_whose_log_ends_in_a_backend_error_is_shown_with_it_once():
    result = _buggy_result()
    out = _text(terminal.scenario_block(result))
    row = next(line for line in out.splitlines() if line.split()[:1] == ["0"])
    assert row.split()[1] == "error" and "RuntimeError: Connection closed by peer [127.0.0.1]:22193" in row, row
    assert "pair.cc" not in out and "typically caused" not in out and "stuck" not in out
    assert out.count("Connection closed by peer") == 1, out   # the log tail that only repeats it: one line
    assert "log tail: rank 0's traceback of the error in its row above" in out
    assert terminal.shows_error_of(result, 0) and not terminal.shows_error_of(result, 1)


def test_the_flight_recorders_count_is_labelled_as_its_own_and_shown_at_v():
    result = _buggy_result()
    assert "Flight Recorder" not in _text(terminal.scenario_block(result))
    verbose = _text(terminal.scenario_block(result, verbose=True))
    assert "(Flight Recorder's own count, group 0: enqueued 2, started none, completed 1)" in " ".join(verbose.split())
    assert "FR[" not in verbose and "enqueued #" not in verbose   # never read as the trace's "#N"


def test_the_verdict_block_ends_the_output_and_the_launchers_report_is_one_line_above_it(fixed):
    report, _ = fixed
    tail = "\n".join(folded_output("\n".join(TORCHRUN_LOG)))
    with_command = Report(run=dataclasses.replace(report.run, command_output=tail), scenarios=(_buggy_result(),))
    out = _text(terminal.summary_line(with_command, timeline=True))
    lines = out.splitlines()
    assert lines[-1].strip() == "run dir: /tmp/run  (timeline.html inside)", lines
    assert lines[0].startswith("    the command's last output: the launcher's ChildFailedError: buggy.py FAILED")
    assert "=====" not in out and "OMP_NUM_THREADS" not in out and lines[-3].startswith("FAIL  ")
    # a command that started no rank: its skip line says its first error; the tail under it says the rest, once
    said = "\n".join(["python: can't open file 'x.py'", folded_output("\n".join(TORCHRUN_LOG))[-1]])
    skip = dataclasses.replace(_buggy_result(), skipped="it exited with code 1: python: can't open file 'x.py'",
                               observed=(), ok=False, log_tail=said)   # a skip's block shows no log tail
    unchecked = Report(run=dataclasses.replace(report.run, command_output=said), scenarios=(skip,))
    shown = _text(terminal.command_output(unchecked))
    assert "can't open file" not in shown and "the launcher's ChildFailedError: buggy.py FAILED" in shown, shown


def _mm(r, **fields):
    base = dict(rank=r, group="0", seq=1, op="all_reduce", reduce_op="SUM", shapes=((4,),), dtypes=("float32",),
                device="cpu", group_ranks=(0, 1))
    return Event(**{**base, **fields})


def test_a_mismatchs_consequence_holds_together_and_for_the_backend_it_ran_on():
    both = consequence(("reduce_op", "shape"), {0: _mm(0), 1: _mm(1, reduce_op="MAX", shapes=((8,),))})
    assert "without any error on every backend" not in both and "completes without an error" not in both
    assert "alone would raise no error" in both and "gloo aborts" in both and "NCCL" not in both   # CPU tensors: gloo
    assert consequence(("reduce_op",), {0: _mm(0), 1: _mm(1, reduce_op="MAX")}).startswith(
        "no backend checks the reduce op: the call completes without an error")
    same = consequence(("shape",), {0: _mm(0, shapes=((2, 3),)), 1: _mm(1, shapes=((3, 2),))})
    assert "same number of bytes (24)" in same and "aborts" not in same   # a transpose passes every check
    nccl = consequence(("shape",), {r: _mm(r, shapes=((4 * (r + 1),),), t_returned=T0) for r in (0, 1)})
    assert "NCCL checks nothing" in nccl and "gloo" not in nccl and "(16 B vs 32 B)" in nccl
    cuda = consequence(("dtype",), {0: _mm(0, device="cuda"), 1: _mm(1, device="cuda", dtypes=("float64",))})
    assert "gloo aborts" in cuda and "NCCL checks nothing" in cuda   # CUDA tensors: gloo or NCCL
