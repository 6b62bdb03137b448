"""Reports stay bounded whatever the run's length and width (synthetic events, no processes).

A long run's calls between the windows around its findings are summarised; a wide job's alike ranks
share a lane, while the ranks a finding singles out keep their own; a small run is drawn whole."""

from __future__ import annotations

import dataclasses
import functools
import json
import re

from distcheck.models import Event, Finding, Kind, RankDetail, RankOutcome, Report, RunInfo, ScenarioResult, Severity
from distcheck.report import chrome_trace, html_timeline
from distcheck.report.timeline import FULL_CALLS, MAX_LANES, WINDOW_CALLS, build

T0 = 1_800_000_000.0
SITE = "/home/u/train.py:412:end"


@functools.lru_cache(maxsize=8)
def _world(world: int) -> tuple[int, ...]:
    """One tuple of a group's ranks shared by its events, as the trace reader shares it."""
    return tuple(range(world))


def _event(rank: int, seq: int, world: int, op: str = "all_reduce", returned: bool = True) -> Event:
    t = T0 + seq * 0.01 + rank * 1e-5
    return Event(rank=rank, group="0", seq=seq, op=op, reduce_op="SUM" if op == "all_reduce" else None,
                 shapes=((256,),) if op == "all_reduce" else (), dtypes=("float32",) if op == "all_reduce" else (),
                 device="cpu", group_ranks=_world(world), t_enter=t, t_exit=t + 0.002 if returned else None,
                 callsite=SITE)


def _run(world: int) -> RunInfo:
    return RunInfo(backend="gloo", world_size=world, nnodes=max(1, world // 8), nproc_per_node=min(world, 8),
                   torch_version="2.13.0+cpu", distcheck_version="0.1.0", command="distcheck run train.py",
                   run_dir="/tmp/run", seed=0, duration_s=200.0, started_at="2027-01-15T10:00:00", hostname="n1",
                   python_version="3.11.7", versions={})


def healthy(world: int, calls: int) -> tuple[Report, dict]:
    events = {r: [_event(r, s, world) for s in range(1, calls + 1)] for r in range(world)}
    result = ScenarioResult(name="train", source="train.py", expected=("pass",), observed=(), ok=True,
                            duration_s=calls * 0.01, ranks=tuple(RankOutcome(rank=r, state="finished",
                                                                             collectives=calls) for r in range(world)),
                            started_at=T0, ended_at=T0 + calls * 0.01 + 1)
    return Report(run=_run(world), scenarios=(result,)), {"train": events}


def hang(world: int, calls: int, finished: int) -> tuple[Report, dict]:
    """Every rank but ``finished`` waits in barrier #calls+1; ``finished`` ended after its calls."""
    events = {r: [_event(r, s, world) for s in range(1, calls + 1)] for r in range(world)}
    waiting = tuple(r for r in range(world) if r != finished)
    for r in waiting:
        events[r].append(_event(r, calls + 1, world, op="barrier", returned=False))
    finding = Finding(kind=Kind.HANG, severity=Severity.ERROR, group="0", seq=calls + 1, op="barrier", callsite=SITE,
                      waiting_ranks=waiting, absent_ranks=(finished,), summary="the planted hang",
                      ranks=(RankDetail(rank=finished, role="absent", state="finished", note="finished, now idle"),))
    ranks = tuple(RankOutcome(rank=r, state="finished" if r == finished else "stuck", collectives=len(events[r]))
                  for r in range(world))
    end = T0 + (calls + 1) * 0.01
    result = ScenarioResult(name="train", source="train.py", expected=("hang",), observed=("hang",), ok=True,
                            duration_s=calls * 0.01 + 5, findings=(finding,), ranks=ranks, end_reason="stall",
                            started_at=T0, ended_at=end + 5, stall_onset=end, detected_at=end + 0.5)
    return Report(run=_run(world), scenarios=(result,)), {"train": events}


def test_a_small_run_is_drawn_whole():
    report, events = hang(4, 20, finished=2)
    tl = build(report.scenarios[0], events["train"])
    assert [lane.rank for lane in tl.lanes] == [0, 1, 2, 3] and all(not lane.ranks for lane in tl.lanes)
    assert len(tl.slices) == sum(len(e) for e in events["train"].values())
    assert tl.summarised == 0 and tl.windows == ()
    assert "close-up" not in html_timeline.render(report, events)


def test_a_long_healthy_run_gives_a_small_timeline():
    # 2 ranks x 20,000 all_reduces: every call drawn was a 9 MB page of 40,000 rectangles.
    report, events = healthy(2, 20_000)
    tl = build(report.scenarios[0], events["train"])
    assert tl.summarised == 2 * (20_000 - WINDOW_CALLS - 1)
    assert len(tl.slices) == 2 * (WINDOW_CALLS + 2)   # the last calls in full, one summary before them
    page = html_timeline.render(report, events)
    assert len(page.encode()) < 200_000
    assert "19,987 calls: all_reduce x19,987" in page and "close-up: the last calls" in page
    trace = json.loads(chrome_trace.render(report, events))
    assert [e["args"]["calls"] for e in trace["traceEvents"] if e.get("cat") == "summary"] == [19_987, 19_987]


def test_a_wide_hang_groups_alike_ranks_and_shows_the_planted_window_in_full():
    world, calls, finished = 128, FULL_CALLS + 20, 99
    report, events = hang(world, calls, finished)
    tl = build(report.scenarios[0], events["train"])
    # the waiting ranks behave alike: one lane; the rank that finished keeps its own
    assert [(lane.rank, len(lane.ranks) or 1, lane.state) for lane in tl.lanes] == [(0, world - 1, "stuck"),
                                                                                   (finished, 1, "finished")]
    assert len(tl.lanes) <= MAX_LANES and tl.ranks == world
    page = html_timeline.render(report, events)
    assert len(page.encode()) < 1_000_000
    assert "close-up: around hang at barrier #" + str(calls + 1) in page
    assert f"ranks 0-98, 100-127 ({world - 1})" in page
    close_up = page[page.index("close-up: around hang"):]
    assert re.search(rf"rank 0: barrier #{calls + 1}\b", close_up)      # the stuck call, drawn in full
    assert f"rank {finished}: never entered barrier #{calls + 1}" in close_up or "never entered barrier" in close_up


def test_a_4096_rank_report_json_stays_small_and_reads_back_whole():
    # Each rank's last call names its whole group, as do the finding's fingerprints: one rank per line, that
    # was hundreds of MB at 4,096 ranks. Long groups go as runs; they read back as every rank.
    from distcheck.models import Report as Loaded
    from distcheck.report import json_report

    world = 4096
    report, _ = hang(world, 2, finished=4059)
    result = report.scenarios[0]
    last = {r: _event(r, 3, world, op="barrier", returned=False) for r in range(world)}
    ranks = tuple(RankOutcome(rank=o.rank, state=o.state, collectives=o.collectives, last_event=last[o.rank],
                              where=SITE) for o in result.ranks)
    detail = tuple(RankDetail(rank=r, role="waiting", op="barrier", seq=3, callsite=SITE,
                              fingerprint=last[r].fingerprint()) for r in range(world) if r != 4059)
    finding = result.findings[0]
    finding = type(finding)(**{**finding.__dict__, "ranks": finding.ranks + detail})
    report = Report(run=report.run, scenarios=(type(result)(**{**result.__dict__, "ranks": ranks,
                                                                "findings": (finding,)}),))
    # every waiting rank's fingerprint names the one members tuple of its group, in the finding and in its plain
    # form: a copy each was 268 M entries at 16,384 ranks in one barrier (node 0 went from 0.9 to 5.4 GB)
    plain = finding.to_dict()["ranks"]
    assert len({id(d["fingerprint"]["group_ranks"]) for d in plain if d["fingerprint"]}) == 1
    text = json_report.render(report)
    assert len(text) < 10_000_000, len(text)
    data = json.loads(text)
    assert data["scenarios"][0]["calls"][0]["group_ranks"] == [[0, 4095]]   # the call every rank waits in, once
    back = Loaded.from_dict(data).scenarios[0]
    assert back.ranks[17].last_event.group_ranks == tuple(range(world))
    assert back.findings[0].ranks[1].fingerprint["group_ranks"] == tuple(range(world))
    assert back.findings[0].waiting_ranks == finding.waiting_ranks
    # a small group is written as it is
    small, _ = hang(4, 2, finished=3)
    assert json.loads(json_report.render(small)) == small.to_dict()


def _stack(ident: int, waiting: bool) -> str:
    """Two threads as distcheck's stack probe writes them (``rank.stack_probe``): each rank's own thread ids."""
    top = '  File "/venv/torch/distributed/distributed_c10d.py", line 4200 in barrier\n' if waiting else ""
    frames = "".join(f'  File "/home/u/model.py", line {100 + i} in forward\n' for i in range(12))
    return (f"Thread 0x{ident + 1:016x} (most recent call first):\n  File \"/venv/threading.py\", line 331 in wait\n\n"
            f"Thread 0x{ident:016x} (most recent call first):\n{top}{frames}  File \"/home/u/train.py\", line 412 "
            "in end\n\n")


def test_a_large_jobs_report_shares_what_its_ranks_share_and_reads_back_exactly(tmp_path):
    # At 2,048 nodes x 8 every rank's row held its whole stack and the finding a detail per waiting rank: 38-59 MB
    # of report.json. A job that large is written in /2: each stack text once (thread ids apart), a run of alike
    # details once; 10 MB at 16,384 ranks is 610 bytes a rank (checked at 4,096 ranks, 4x quicker: the form's
    # size grows with the ranks, its shared parts do not). Both report.json writers, read back to every value.
    import jsonschema

    from distcheck.files.saved_runs import load_report, write_report
    from distcheck.models import SHARE_ABOVE, ReportSchema
    from distcheck.report import json_report, json_schema

    world, per_rank = 4096, 10_000_000 // 16384
    report, _ = hang(world, 2, finished=3001)
    result = report.scenarios[0]
    last = {r: _event(r, 3, world, op="barrier", returned=False) for r in range(world)}
    barrier = last[0]
    dp = {r % 32: tuple(range(r % 32, world, 32)) for r in range(32)}   # a DeviceMesh's DP groups: strided ranks
    for r in range(1, world, 4):   # some ranks wait in their DP group's all-gather instead
        last[r] = last[r]._replace(group=f"dp{r % 32}", op="all_gather_into_tensor", group_ranks=dp[r % 32])
    ranks = tuple(RankOutcome(rank=o.rank, state=o.state, host=f"node{o.rank // 8:04d}", node=o.rank // 8,
                              pid=40000 + o.rank, collectives=o.collectives, last_event=last[o.rank], where=SITE,
                              stack=_stack(0x7F0000000000 + o.rank * 4096, o.rank != 3001),
                              rss_bytes=2_000_000_000 + o.rank) for o in result.ranks)
    detail = tuple(RankDetail(rank=r, role="waiting", op="barrier", seq=3, callsite=SITE, state="stuck",
                              fingerprint=barrier.fingerprint()) for r in range(world) if r != 3001)
    finding = result.findings[0]
    finding = type(finding)(**{**finding.__dict__, "ranks": detail[:3001] + finding.ranks + detail[3001:]})
    report = Report(run=report.run, scenarios=(type(result)(**{**result.__dict__, "ranks": ranks,
                                                                "findings": (finding,)}),))
    text = json_report.render(report)
    assert len(text) < world * per_rank, len(text) / world
    data = json.loads(text)
    scenario = data["scenarios"][0]
    # the schema holds for the form (its rows alike past the first hundreds: checking all 16,384 took 6 s)
    jsonschema.validate({**data, "scenarios": [{**scenario, "ranks": scenario["ranks"][:300]}]}, json_schema.REPORT)
    assert data["schema"] == ReportSchema.SHARED and len(scenario["stacks"]) == 2      # the waiting and the finished
    # the calls they wait in, each once: the world's barrier and each DP group's all-gather, a strided group plain
    assert len(scenario["calls"]) == 1 + 8 and scenario["ranks"][1]["last_event"] == {
        "rank": 1, "group": "dp1", "seq": 3, "t_enter": last[1].t_enter, "call": 1}
    assert scenario["calls"][1]["group_ranks"] == list(dp[1])
    assert scenario["ranks"][5]["stack"] == {"text": 0, "threads": ["0x00007f0000005001", "0x00007f0000005000"]}
    # the finding's details in their order: the waiting ranks before the absent one, it, the waiting after it
    assert [d["ranks"] for d in scenario["findings"][0]["ranks"]] == [[[0, 3000]], [3001], [[3002, 4095]]]
    write_report(tmp_path, report)
    assert (tmp_path / "report.json").stat().st_size < world * per_rank
    back = load_report(tmp_path)
    assert json_report.render(back) == text                    # every value, as it was written
    assert back.scenarios[0].ranks[5].stack == ranks[5].stack
    assert back.scenarios[0].ranks[6].last_event.group_ranks is back.scenarios[0].ranks[7].last_event.group_ranks
    assert back.scenarios[0].ranks[5].last_event.group_ranks is back.scenarios[0].ranks[37].last_event.group_ranks
    # `distcheck analyze` reads a saved run's rank rows from its report.json: a large job's as every other's
    from distcheck.evidence.from_traces import _saved_scenario

    saved_at = tmp_path / "saved"
    saved_at.mkdir()
    write_report(saved_at, Report(run=report.run, scenarios=(dataclasses.replace(
        report.scenarios[0], launch_dir=str(saved_at / "train-1")),)))
    rows = _saved_scenario(saved_at / "train-1")["ranks"]
    assert RankOutcome.from_dict(rows[5]) == ranks[5] and RankOutcome.from_dict(rows[3001]) == ranks[3001]
    # a job of SHARE_ABOVE ranks keeps /1: every value in place
    small, _ = hang(SHARE_ABOVE, 2, finished=3)
    assert json.loads(json_report.render(small))["schema"] == "distcheck.report/1"


def test_a_strided_group_is_written_plain_where_runs_would_be_longer():
    from distcheck.models import rank_runs, ranks_from_json
    from distcheck.models.runs import shorter_form

    dp = tuple(range(5, 4096, 32))   # a DeviceMesh's DP group: no two ranks consecutive
    assert shorter_form(dp) == list(dp) and ranks_from_json(shorter_form(dp)) == dp
    assert shorter_form(tuple(range(64))) == [[0, 63]]
    assert rank_runs(dp)[:2] == [[5, 5], [37, 37]]   # the progress wire's form stays pairs, whatever their length


def test_a_large_jobs_rank_list_reads_as_runs_and_a_small_one_as_it_was():
    from distcheck.text import rank_list

    assert rank_list([r for r in range(4096) if r != 4059]) == "ranks 0-4058, 4060-4095"   # one line, not 4,095 numbers
    assert rank_list(range(16)) == "ranks 0-15"
    assert rank_list([0, 1, 2]) == "ranks 0, 1, 2" and rank_list([2]) == "rank 2"


def test_a_wide_jobs_terminal_and_junit_reports_give_one_line_to_ranks_alike():
    """4,096 ranks stuck in one barrier read as one line (their run of ranks and its count) in the terminal
    report and in JUnit, the rank that finished as a line of its own; a small job keeps a line per rank."""
    import io
    import xml.etree.ElementTree as ET

    from rich.console import Console

    from distcheck.report import junit, terminal

    world, finished = 4096, 4091
    report, _ = hang(world, 2, finished=finished)
    result = report.scenarios[0]
    waiting = tuple(RankDetail(rank=r, role="waiting", op="barrier", seq=3, callsite=SITE)
                    for r in range(world) if r != finished)
    finding = type(result.findings[0])(**{**result.findings[0].__dict__, "ranks": result.findings[0].ranks + waiting})
    report = Report(run=report.run, scenarios=(type(result)(**{**result.__dict__, "findings": (finding,)}),))
    out = io.StringIO()
    terminal.render(report, Console(file=out, width=120, color_system=None), verbose=True)   # an expected hang's ranks: -v
    rows = [line.split() for line in out.getvalue().splitlines() if " stuck " in f" {line} " or " finished " in line]
    assert rows == [["0-4090,", "4092-4095", "(4,095)", "stuck", "3", "-"], ["4091", "finished", "2", "-"]]
    body = junit.render(report)
    assert ET.fromstring(body).find(".//failure") is None   # expected hang: a pass; its findings go to system-out
    assert "ranks 0-4090, 4092-4095 (4,095) (waiting) barrier #3" in body
    assert "rank 4091 (absent) state=finished - finished, now idle" in body
    assert len(body) < 20_000 and len(out.getvalue()) < 20_000

    small, _ = hang(4, 2, finished=3)
    out = io.StringIO()
    terminal.render(small, Console(file=out, width=120, color_system=None), verbose=True)
    assert sum(1 for line in out.getvalue().splitlines() if " stuck " in f" {line} ") == 3


def _stalled_tp_group(world: int = 64, tp: int = 16) -> dict[int, list[Event]]:
    """A TP group (the last ``tp`` ranks) stuck in its second all_reduce; every other rank ran on into its DP
    group's all_gather, where it waits on the stuck group's member: one wait per DP group, downstream of the stall."""
    traces: dict[int, list[Event]] = {}
    for r in range(world):
        tp_group = tuple(range(r - r % tp, r - r % tp + tp))
        dp_group = tuple(range(r % tp, world, tp))
        stuck = r >= world - tp

        def call(seq, group, members, op, done, r=r):
            t = T0 + seq * 0.01
            return Event(rank=r, group=group, seq=seq, op=op, reduce_op=None, shapes=((4,),), dtypes=("float32",),
                         device="cpu", group_ranks=members, t_enter=t, t_exit=t + 0.001 if done else None,
                         callsite=f"/home/u/train.py:{140 if op == 'all_reduce' else 120}:step")

        tp_name, dp_name = f"{1 + tp + r // tp}", f"{1 + r % tp}"
        traces[r] = [call(1, tp_name, tp_group, "all_reduce", True), call(2, tp_name, tp_group, "all_reduce", not stuck)]
        if not stuck:
            traces[r].append(call(1, dp_name, dp_group, "all_gather_into_tensor", False))
    return traces


def test_a_stalled_tp_group_is_one_finding_that_says_what_waits_downstream_of_it():
    """Issue 57: the TP group stuck in its all_reduce is the finding; the DP groups' waits on its members (one per
    DP group: thousands at 16,384 ranks, a 1,989-line terminal report and a 43 MB timeline at 512) are a sentence
    of it. A few such waits stay findings of their own."""
    import io

    from rich.console import Console

    from distcheck.diagnose.hang import FOLD_PAST
    from distcheck.diagnose.rules import RunFacts, analyze
    from distcheck.report import terminal

    world, tp = 64, 16
    traces = _stalled_tp_group(world, tp)
    outcomes = {r: RankOutcome(rank=r, state="stuck") for r in range(world)}
    found = analyze(traces, outcomes, RunFacts(world_size=world, end_reason="stall", evidence="stuck: 5 s"))
    hangs = [f for f in found if f.kind == "hang"]
    assert len(hangs) == 1 and hangs[0].op == "all_reduce" and hangs[0].waiting_ranks == tuple(range(48, 64))
    assert hangs[0].data["downstream"] == {"ranks": 48, "calls": tp, "ops": {"all_gather_into_tensor": tp}}
    assert "Ranks 0-47 wait downstream of it, in 16 calls of other groups" in hangs[0].summary
    result = ScenarioResult(name="train", source="train.py", expected=("hang",), observed=("hang",), ok=True,
                            duration_s=5.0, findings=tuple(found), ranks=tuple(outcomes.values()), end_reason="stall",
                            started_at=T0, ended_at=T0 + 5)
    out = io.StringIO()
    terminal.render(Report(run=_run(world), scenarios=(result,)), Console(file=out, width=120, color_system=None))
    assert len(out.getvalue().splitlines()) <= 60

    few = _stalled_tp_group(world=2 * FOLD_PAST, tp=FOLD_PAST)   # FOLD_PAST waits downstream: each its own finding
    found = analyze(few, {r: RankOutcome(rank=r, state="stuck") for r in few},
                    RunFacts(world_size=len(few), end_reason="stall"))
    assert len([f for f in found if f.kind == "hang"]) == 1 + FOLD_PAST


def test_ranks_of_a_mesh_waiting_alike_in_groups_of_their_own_share_a_lane():
    """Issue 57: the ranks of a 3-D mesh are in different groups (each TP group, each DP group its own), and a lane
    per group kept 512 ranks in hundreds of lanes (a 10-19 MB timeline). Ranks whose calls stand alike (the same
    op and number, in a group of the same size) share one; the stuck TP group's ranks keep theirs apart."""
    from distcheck.diagnose.rules import RunFacts, analyze

    world, tp = 256, 16   # 16 DP groups waiting downstream: folded into the TP group's finding (FOLD_PAST)
    traces = _stalled_tp_group(world, tp)
    outcomes = {r: RankOutcome(rank=r, state="stuck", collectives=len(traces[r])) for r in range(world)}
    found = analyze(traces, outcomes, RunFacts(world_size=world, end_reason="stall", evidence="stuck: 5 s"))
    result = ScenarioResult(name="train", source="train.py", expected=("hang",), observed=("hang",), ok=True,
                            duration_s=5.0, findings=tuple(found), ranks=tuple(outcomes.values()), end_reason="stall",
                            started_at=T0, ended_at=T0 + 5)
    tl = build(result, traces)
    downstream = [lane for lane in tl.lanes if len(lane.ranks) == world - tp]
    assert len(downstream) == 1 and downstream[0].label == f"ranks 0-{world - tp - 1} ({world - tp})"
    assert [lane.label for lane in tl.lanes] == [f"ranks 0-{world - tp - 1} ({world - tp})",
                                                 f"ranks {world - tp}-{world - 1} ({tp})"]   # the stuck TP group
    assert tl.ranks == world


def test_a_group_waiting_on_a_lost_nodes_rank_is_the_finding():
    """Issue 57, a node lost mid-step: its ranks' records went with it. The DP group whose other members wait in
    its all_gather is the hang, the lost rank "not known" in it (the group was no finding at all, and a 512-rank
    job's report was the 130 waits downstream of it)."""
    from distcheck.diagnose.rules import RunFacts, analyze

    members = (0, 1, 2, 3)

    def call(rank, seq, done):
        t = T0 + seq * 0.01
        return Event(rank=rank, group="1", seq=seq, op="all_gather_into_tensor", reduce_op=None, shapes=((4,),),
                     dtypes=("float32",), device="cpu", group_ranks=members, t_enter=t,
                     t_exit=t + 0.001 if done else None, callsite="/home/u/train.py:120:unshard")

    traces = {r: [call(r, s, s < 5) for s in range(1, 6)] for r in (0, 1, 2)}
    outcomes = {r: RankOutcome(rank=r, state="stuck") for r in (0, 1, 2)} | {3: RankOutcome(rank=3, state="killed")}
    found = analyze(traces, outcomes, RunFacts(world_size=4, end_reason="certain_hang", records_lost=(3,)))
    [h] = [f for f in found if f.kind == "hang"]
    assert (h.group, h.seq, h.waiting_ranks, h.absent_ranks) == ("1", 5, (0, 1, 2), (3,))
    assert "rank 3: not known (their records went with their lost node)" in h.summary


def test_a_lost_node_s_ranks_awaited_alike_in_many_groups_are_one_finding():
    """Issue 57, a node lost mid-step at 512 ranks: each of its 8 ranks was in a DP group of its own, and each DP
    group's all_gather waiting on it was a finding (16 findings with the pipeline's receives: 112 terminal lines).
    The same call stuck in groups of other ranks, for ranks of the same end, is one finding said once."""
    from distcheck.diagnose.rules import RunFacts, analyze

    world, dp_groups = 32, 8   # ranks 24-31 are the lost node, one in each DP group of 4
    traces, outcomes = {}, {}
    for r in range(24):
        members = tuple(range(r % dp_groups, world, dp_groups))
        t = T0 + 0.05
        traces[r] = [Event(rank=r, group=str(1 + r % dp_groups), seq=5, op="all_gather_into_tensor", reduce_op=None,
                           shapes=((4,),), dtypes=("float32",), device="cpu", group_ranks=members, t_enter=t,
                           t_exit=None, callsite="/home/u/train.py:120:unshard")]
        outcomes[r] = RankOutcome(rank=r, state="stuck")
    outcomes |= {r: RankOutcome(rank=r, state="killed") for r in range(24, world)}
    found = analyze(traces, outcomes, RunFacts(world_size=world, end_reason="certain_hang",
                                               records_lost=tuple(range(24, world))))
    [h] = [f for f in found if f.kind == "hang"]
    assert h.waiting_ranks == tuple(range(24)) and h.absent_ranks == tuple(range(24, world))
    assert h.summary.startswith("Ranks 0-23 wait in 8 calls alike (all_gather_into_tensor #5 at "), h.summary
    assert "train.py:120, each in a group of other ranks) for ranks 24-31; the first: " in h.summary
    assert len(h.data["alike_groups"]) == dp_groups


def test_cycles_alike_on_every_tp_lane_are_one_finding():
    """Issue 57: a pipeline stage that skipped a micro-batch leaves a cycle of receives per TP lane of the stage
    pair (8 at tp=8: 91 terminal lines at 512 ranks); cycles of the same calls on other ranks are said once."""
    from distcheck.diagnose.rules import RunFacts, analyze

    lanes, world = 4, 8

    def recv(rank, peer, line):
        return Event(rank=rank, group=f"p2p:{peer}>{rank}", seq=1, op="recv", reduce_op=None, shapes=((4,),),
                     dtypes=("float32",), device="cpu", group_ranks=(peer, rank), t_enter=T0, t_exit=None,
                     callsite=f"/home/u/train.py:{line}:pipeline")

    traces = {}
    for t in range(lanes):   # stage 0 is ranks 0-3, stage 1 ranks 4-7: each waits for the other's send
        traces[t], traces[lanes + t] = [recv(t, lanes + t, 230)], [recv(lanes + t, t, 205)]
    found = analyze(traces, {r: RankOutcome(rank=r, state="stuck") for r in range(world)},
                    RunFacts(world_size=world, end_reason="certain_hang"))
    [h] = [f for f in found if f.kind == "hang"]
    assert h.waiting_ranks == tuple(range(world)) and len(h.data["alike"]) == lanes and len(h.data["cycle"]) == 2
    assert h.summary.startswith(f"Ranks 0-7 wait for each other in {lanes} cycles alike")
