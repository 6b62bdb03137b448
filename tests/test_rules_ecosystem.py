"""Library shapes on hand-built traces: gloo's monitored_barrier, a barrier against a data call, the
files the user named. Pure: no processes, milliseconds each."""

from __future__ import annotations

import os

from distcheck.diagnose.analyze import RunFacts, analyze
from distcheck.files import user_code
from distcheck.files.stacks import LIBRARY, USER, classify_file, torch_dir
from distcheck.library_shapes import (monitored_barrier_counts, monitored_barrier_waits_for, waits_elsewhere)
from distcheck.models import Event, RankOutcome

SITE = "/home/u/train.py:{}:main"


def ev(rank: int, seq: int, op: str = "all_reduce", *, members=(0, 1), shapes=((4,),), line: int = 10,
       done: bool = True, label: str | None = None) -> Event:
    data = op not in ("barrier", "monitored_barrier")
    return Event(rank=rank, group="0", seq=seq, op=op, reduce_op="SUM" if op == "all_reduce" else None,
                 shapes=tuple(shapes) if data else (), dtypes=("float32",) if data else (), device="cpu" if data else None,
                 root=None, group_ranks=members, t_enter=0.0, t_exit=0.001 if done else None,
                 callsite=SITE.format(line), label=label)


def stalled(traces: dict[int, list[Event]]) -> list:
    outcomes = {r: RankOutcome(rank=r, state="stuck", last_event=es[-1]) for r, es in traces.items()}
    return analyze(traces, outcomes, RunFacts(world_size=len(traces), end_reason="stall"))


# -- monitored_barrier on gloo --------------------------------------------------


def test_monitored_barrier_on_gloo_is_p2p_with_rank_0():
    # measured on torch 2.13: rank 0's counter moves 2 (N - 1), the others' 2 (tests/test_ecosystem_e2e.py)
    assert [monitored_barrier_counts(r, 4) for r in range(4)] == [6, 2, 2, 2]
    assert monitored_barrier_counts(0, 4, "nccl") is None
    assert monitored_barrier_waits_for(0, (0, 1, 2)) == (1, 2)
    assert monitored_barrier_waits_for(2, (0, 1, 2)) == (0,)
    assert monitored_barrier_waits_for(1, (4, 5, 6)) == (4,)


# -- a barrier against a data call ---------------------------------------------


def test_a_barrier_against_a_broadcast_still_waiting_is_a_hang_naming_both_lines():
    # accelerate's wait_for_everyone on rank 1, DDP's forward broadcast on rank 0 (test_distributed_data_loop.py)
    traces = {0: [ev(0, 1), ev(0, 2, "broadcast", line=173, done=False, label="DDP broadcast")],
              1: [ev(1, 1), ev(1, 2, "barrier", line=178, done=False)]}
    [hang] = [f for f in stalled(traces) if f.severity == "error"]
    assert hang.kind == "hang" and not hang.tie
    assert hang.waiting_ranks == (1,) and hang.absent_ranks == (0,)
    assert hang.callsite == SITE.format(178)
    assert {d.rank: d.callsite for d in hang.ranks} == {1: SITE.format(178), 0: SITE.format(173)}
    assert "train.py:173" in hang.summary and "train.py:178" in hang.summary


def test_a_rank_that_skips_monitored_barrier_is_the_one_named_absent():
    members = (0, 1, 2)
    traces = {r: [ev(r, 1, members=members)] for r in members}
    traces[0].append(ev(0, 2, "monitored_barrier", members=members, line=27, done=False))
    traces[2].append(ev(2, 2, "monitored_barrier", members=members, line=27, done=False))
    traces[1].append(ev(1, 2, "all_reduce", members=members, line=28, done=False))
    # two ranks against one: the majority's monitored_barrier, and rank 1 the odd one out at its own line
    [odd] = [f for f in stalled(traces) if f.severity == "error"]
    assert odd.kind == "mismatch" and odd.odd_ranks == (1,) and "op" in odd.fields
    assert odd.op == "monitored_barrier" and odd.callsite == SITE.format(27)
    assert {d.rank: d.callsite for d in odd.ranks}[1] == SITE.format(28)


def test_a_barrier_paired_with_a_data_call_that_completed_is_still_a_mismatch():
    events = {0: ev(0, 1, "barrier"), 1: ev(1, 1, "all_reduce")}
    assert waits_elsewhere(events) is None
    traces = {0: [events[0]], 1: [events[1]]}
    outcomes = {r: RankOutcome(rank=r, state="finished", phase="finished") for r in (0, 1)}
    found = analyze(traces, outcomes, RunFacts(world_size=2))
    assert [f.kind for f in found if f.severity == "error"] == ["mismatch"]


def test_two_data_calls_that_differ_are_a_mismatch_not_a_hang_elsewhere():
    assert waits_elsewhere({0: ev(0, 1, "broadcast", done=False), 1: ev(1, 1, "all_reduce", done=False)}) is None


# -- the files the user named ---------------------------------------------------


def test_a_file_named_on_the_command_line_is_user_code_even_under_site_packages(tmp_path, monkeypatch):
    site = tmp_path / "lib" / "site-packages" / "accelerate" / "test_utils"
    site.mkdir(parents=True)
    script, other = site / "test_loop.py", site / "helpers.py"
    script.write_text("")
    other.write_text("")
    monkeypatch.setenv(user_code.USER_FILES_ENV, "")   # restored after the test, whatever declare() sets
    assert classify_file(str(script), torch_dir()) == LIBRARY
    named = user_code.named_paths(["accelerate", "launch", "--num_processes", "2", str(script),
                                   f"--config={tmp_path / 'missing.py'}"], cwd=str(tmp_path))
    assert named == [str(script)]
    user_code.declare(named)
    assert os.environ[user_code.USER_FILES_ENV] == str(script)
    assert classify_file(str(script), torch_dir()) == USER
    assert classify_file(str(other), torch_dir()) == LIBRARY   # only what was named


def test_a_test_folder_and_a_pytest_node_id_name_user_code(tmp_path, monkeypatch):
    tests = tmp_path / "site-packages" / "pkg" / "tests"
    tests.mkdir(parents=True)
    (tests / "test_a.py").write_text("")
    monkeypatch.setenv(user_code.USER_FILES_ENV, "")   # restored after the test, whatever declare() sets
    named = user_code.named_paths(["pytest", "-x", str(tests), f"{tests / 'test_a.py'}::test_one"])
    assert named == [str(tests) + os.sep, str(tests / "test_a.py")]
    user_code.declare(named)
    assert classify_file(str(tests / "sub" / "test_b.py"), torch_dir()) == USER


def test_a_folder_that_holds_installed_packages_is_not_user_code():
    import sysconfig
    purelib = sysconfig.get_paths()["purelib"]
    assert user_code.named_paths([purelib, os.path.dirname(purelib)]) == []
