"""The replay process (``launch.replay.Replayer``): one per distcheck run, kept between launches, started anew
after one that failed or ran past its time. Real subprocesses, requests as ``metric_reference`` sends them."""

from __future__ import annotations

import json
import os
import signal
import subprocess

import pytest

from distcheck.launch.replay import ReplayFailed, Replayer, _run


def _request(tmp_path, name: str) -> tuple:
    src, dst = tmp_path / f"{name}-in.json", tmp_path / f"{name}-out.json"
    src.write_text(json.dumps({"ranks": {}, "sys_path": [], "chains": []}))
    return src, dst


@pytest.fixture
def replayer():
    r = Replayer()
    yield r
    r.close()


def test_successive_launches_share_one_replay_process(replayer, tmp_path):
    replayer.replay(*_request(tmp_path, "a"), timeout_s=60)
    first = replayer._proc.pid
    replayer.replay(*_request(tmp_path, "b"), timeout_s=60)
    assert replayer._proc.pid == first
    assert json.loads((tmp_path / "b-out.json").read_text()) == {"chains": {}}


def test_a_replay_that_fails_says_why_and_the_next_gets_a_fresh_process(replayer, tmp_path):
    replayer.replay(*_request(tmp_path, "a"), timeout_s=60)
    first = replayer._proc.pid
    with pytest.raises(ReplayFailed, match="FileNotFoundError"):
        replayer.replay(tmp_path / "missing.json", tmp_path / "x-out.json", timeout_s=60)
    assert replayer._proc is None
    replayer.replay(*_request(tmp_path, "b"), timeout_s=60)
    assert replayer._proc.pid != first


def test_a_replay_past_its_time_is_stopped_and_the_next_works(replayer, tmp_path):
    with pytest.raises(subprocess.TimeoutExpired):
        replayer.replay(*_request(tmp_path, "a"), timeout_s=0.001)   # not even started by then
    assert replayer._proc is None
    replayer.replay(*_request(tmp_path, "b"), timeout_s=60)


def test_a_replay_process_killed_between_launches_is_replaced(replayer, tmp_path):
    replayer.replay(*_request(tmp_path, "a"), timeout_s=60)
    os.kill(replayer._proc.pid, signal.SIGKILL)
    replayer._proc.wait()
    replayer.replay(*_request(tmp_path, "b"), timeout_s=60)
    assert (tmp_path / "b-out.json").exists()


def test_the_answer_of_a_failed_replay_is_an_error_for_the_report(tmp_path):
    out = _run(tmp_path / "missing.json", tmp_path / "out.json", timeout_s=60)
    assert out["error"].startswith("the single-process replay failed: FileNotFoundError")
