"""Judging in one place (issue 56 item 3): one definition of progress shared by the live watchdog and attach,
the root-cause choice and where a rank is as pure functions of ``diagnose``, one spelling of a call site."""

from __future__ import annotations

import time

from distcheck.diagnose.progress import BUSY_CPU, IO_FLOOR_BPS, Signs, progress
from distcheck.diagnose.root_cause import RankEnd, another_failed_first, primary_failures, waiting_in
from distcheck.files.launch_dir import LaunchFiles, RankStatus
from distcheck.launch.procs import Activity
from distcheck.launch.progress import RankMonitor
from distcheck.models import Event, Phase
from distcheck.text import call_site, site


def both(signs: Signs) -> tuple[str | None, str | None]:
    return progress(signs, keeps_watching=True), progress(signs, keeps_watching=False)


def test_the_same_signs_are_the_same_progress_for_the_watchdog_and_for_attach():
    busy = Signs(span=0.5, cores=BUSY_CPU)
    writing = Signs(span=2.0, io_bytes=64 * 1024)
    moved = Signs(span=2.0, stack_moved=True)
    for signs, words in ((busy, "its main process used 0.1 cores"),
                         (writing, "its main process read or wrote 64.0 KiB in the last 2.0 s"),
                         (moved, "its stack moved")):
        assert both(signs) == (words, words)


def test_a_trickle_of_io_is_no_progress_for_either_observer():
    trickle = Signs(span=0.5, io_bytes=int(IO_FLOOR_BPS * 0.5) - 1)   # a log line now and then
    assert both(trickle) == (None, None)
    assert both(Signs(span=0.5, cores=BUSY_CPU * 0.9)) == (None, None)


def test_wakeups_count_only_for_an_observer_that_keeps_watching_and_a_spin_is_no_work():
    download = Signs(span=0.5, wakeups=5)   # a socket read at zero CPU
    assert both(download) == ("its main thread woke 5 times in the last 0.5 s", None)
    assert both(Signs(span=2.0, cores=1.0, spinning=True)) == (None, None)
    starved = Signs(span=2.0, cores=0.05, running=(3, 3))
    assert both(starved)[1] == "its main thread was running in 3 of 3 samples (0.05 cores)"


def test_each_sign_is_said_of_the_process_that_made_it():
    worker = Signs(span=0.5, io_bytes=64 * 1024, child_io_bytes=64 * 1024, children=(4242,))
    assert both(worker)[0] == "its child process 4242 read or wrote 64.0 KiB in the last 0.5 s"
    both_busy = Signs(span=1.0, cores=1.5, child_cores=0.9, children=(4242, 4243))
    assert both(both_busy)[0] == "its main process and child processes 4242, 4243 used 1.5 cores"
    ended = Signs(span=1.0, cores=0.8, child_cores=0.8)   # a child reaped since: its CPU, no pid left
    assert both(ended)[0] == "its child processes (since ended) used 0.8 cores"


def test_the_watchdog_s_evidence_is_that_definition(tmp_path, monkeypatch):
    monitor = RankMonitor(LaunchFiles(tmp_path), 1)
    monkeypatch.setattr(monitor._activity, "sample", lambda rank, pid, now: None)
    now = time.monotonic()
    monitor._activity.latest[0] = Activity(now, 0.5, 0.0, 100, 0)      # 100 B in 0.5 s: a log line
    assert monitor._evidence(0, 1234, None, now, outside=True) == {}
    monitor._activity.latest[0] = Activity(now, 0.5, 0.0, 41 * 1024, 0)
    assert (monitor._evidence(0, 1234, None, now, outside=True)["evidence"]
            == "its main process read or wrote 41.0 KiB in the last 0.5 s")


def _end(rank: int, phase: str, *, exception: str | None = None, signal: str | None = None,
         exit_code: int | None = None, events=()) -> RankEnd:
    return RankEnd(rank, RankStatus(rank=rank, phase=phase, exception=exception), tuple(events), exit_code, signal)


def test_the_root_cause_is_the_failure_that_is_no_reaction():
    ends = [_end(0, Phase.ERROR, exception="RuntimeError: Connection closed by peer", exit_code=1),
            _end(1, Phase.ERROR, exception="ValueError: bad shape", exit_code=1),
            _end(2, Phase.RUNNING, signal="SIGTERM")]
    assert primary_failures(ends, set(), node_lost=False) == {1}
    # every rank SIGTERMed from outside: reported as they are
    termed = [_end(r, Phase.RUNNING, signal="SIGTERM") for r in range(2)]
    assert primary_failures(termed, set(), node_lost=False) == {0, 1}
    assert primary_failures(termed, {0, 1}, node_lost=False) == set()   # distcheck's own teardown


def test_only_reactions_name_the_one_that_failed_outside_every_collective():
    inside = Event(rank=0, group="0", seq=3, op="all_reduce", t_enter=1.0, t_exit=2.0, error="closed by peer")
    ends = [_end(0, Phase.ERROR, exception="RuntimeError: Connection closed by peer", exit_code=1, events=[inside]),
            _end(1, Phase.ERROR, exception="RuntimeError: Connection closed by peer", exit_code=1)]
    assert waiting_in([inside]) == inside and primary_failures(ends, set(), node_lost=False) == {1}
    assert primary_failures(ends, set(), node_lost=True) == set()   # a lost node explains them


def test_another_rank_failed_first_unless_it_only_reacted():
    reacted = {1: RankStatus(rank=1, phase=Phase.ERROR, exception="RuntimeError: Connection closed by peer")}
    assert not another_failed_first({1: (1, None)}, reacted, records_lost=False)
    assert another_failed_first({1: (None, "SIGKILL")}, {}, records_lost=False)
    assert another_failed_first({}, {}, records_lost=True)


def test_a_call_site_is_spelled_once_and_read_back():
    where = call_site("/job/train.py", 30, "main")
    assert where == "/job/train.py:30:main" and site(where).endswith("train.py:30")
