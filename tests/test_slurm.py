"""Slurm's variables and endings, read without a cluster (tests/test_slurm_e2e.py runs a real one)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from conftest import REPO, bindable
from distcheck.errors import UsageError
from distcheck.files.launch_dir import LaunchFiles
from distcheck.launch.command import _end_reason
from distcheck.launch.launcher import RankFailure
from distcheck.launch.node_config import node_config
from distcheck.launch.slurm import (OWN_STOP, classify, endpoint_port, ending_in_output, expand_hostlist, known_end,
                                    run_metadata, slurm_job, stop_before_end)
from distcheck.launch.watchdog import Decision, WatchdogResult
from distcheck.models import EndReason, Report, RunInfo

STEP = {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_NODES": "4", "SLURM_STEP_NUM_TASKS": "4",
        "SLURM_NODEID": "2", "SLURM_STEP_NODELIST": "gpu[07-09,11]", "SLURM_JOB_NODELIST": "gpu[07-09,11]"}


def config(env, nnodes=None, node_rank=None, **kw):
    return node_config(nnodes, node_rank, kw.get("endpoint"), None, "c10d", 300, kw.get("master_addr"), None, None,
                       env=env)


@pytest.mark.parametrize("nodelist, hosts", [
    ("n[1-3,5]", ["n1", "n2", "n3", "n5"]), ("gpu[08-10],login", ["gpu08", "gpu09", "gpu10", "login"]),
    ("node7", ["node7"]), ("a[1-2]b[1-2]", ["a1b1", "a1b2", "a2b1", "a2b2"]), ("x[3],y", ["x3", "y"]),
])
def test_host_lists_expand_like_scontrol(nodelist, hosts):
    assert expand_hostlist(nodelist) == hosts


def test_the_per_node_pattern_needs_no_flags():
    cfg = config(STEP)
    assert (cfg.nnodes, cfg.node_rank, cfg.rdzv_id) == (4, 2, "slurm-4242.0")
    # no scontrol knows these nodes here: the first host's own name, the port from the job id
    assert cfg.rdzv_endpoint == f"gpu07:{endpoint_port('4242')}"


def test_a_flag_given_alone_keeps_the_rest_from_slurm():
    assert config(STEP, nnodes=4).node_rank == 2                      # --nnodes alone: SLURM_NODEID still counts
    assert config(STEP, node_rank=1).nnodes == 4
    assert config({**STEP, "MASTER_ADDR": "head"}).host == "head"     # an exported MASTER_ADDR is node 0's host


def test_two_jobs_get_two_ports_and_each_port_leaves_room_for_the_store():
    ports = {endpoint_port(str(job)) for job in range(1000, 1100)}
    assert len(ports) == 100 and all(20000 <= p < 32767 and p % 2 == 0 for p in ports)


def test_the_batch_step_of_a_multi_node_job_is_refused_with_the_per_node_command():
    batch = {"SLURM_JOB_ID": "77", "SLURM_JOB_NUM_NODES": "2", "SLURM_NNODES": "2", "SLURM_NODEID": "0",
             "SLURM_JOB_NODELIST": "n[1-2]", "MASTER_ADDR": "n1"}
    with pytest.raises(UsageError) as refused:
        config(batch)
    assert "batch step" in refused.value.message and "srun -N 2 --ntasks-per-node=1" in refused.value.hint
    assert config({**batch, "SLURM_JOB_NUM_NODES": "1", "SLURM_NNODES": "1"}).nnodes == 1   # one node: fine
    assert config(batch, nnodes=1).nnodes == 1                          # told to watch this node only


def test_several_distchecks_per_node_are_refused():
    with pytest.raises(UsageError, match="2 distchecks per node"):
        config({**STEP, "SLURM_STEP_NUM_TASKS": "8"})


def test_the_job_step_and_node_list_go_into_the_report():
    job = slurm_job(STEP)
    assert job is not None and job.metadata() == {"job_id": "4242", "step": "4242.0", "nodelist": "gpu[07-09,11]"}
    assert slurm_job({}) is None
    info = RunInfo.from_dict({**_run_info(), "slurm": job.metadata()})
    assert Report(run=info, scenarios=()).to_dict()["run"]["slurm"]["step"] == "4242.0"


def _run_info() -> dict:
    return {"backend": "gloo", "world_size": 2, "nnodes": 1, "nproc_per_node": 2, "torch_version": "x",
            "distcheck_version": "x", "command": "c", "run_dir": "r", "seed": 0, "duration_s": 1.0,
            "started_at": "t"}


@pytest.mark.parametrize("line, ending", [
    ("slurmstepd: error: *** STEP 23.0 ON n1 CANCELLED AT 2026-12-05T14:23:35 DUE TO TIME LIMIT ***",
     EndReason.SLURM_TIME_LIMIT),
    ("slurmstepd-n1: error: *** STEP 23.0 ON n1 CANCELLED AT 2026-12-05T14:23:35 ***", EndReason.SLURM_CANCELLED),
    ("slurmstepd: error: *** JOB 23 ON n1 CANCELLED AT 2026-12-05T14:23:35 DUE TO PREEMPTION ***",
     EndReason.SLURM_PREEMPTED),
    ("srun: error: n1: task 0: Killed", None),
])
def test_srun_output_tells_which_ending_slurm_caused(line, ending):
    assert ending_in_output(f"some output\n{line}\nsrun: error: n2: task 1: Killed\n") is ending


def test_a_wrapped_srun_cancelled_by_slurm_is_its_ending_even_where_the_watchdog_saw_a_rank_die_first(tmp_path):
    # The time limit SIGTERMs every task; the watchdog saw rank 1 gone while rank 0 still waited in its
    # barrier (a certain hang), before srun ended: Slurm's ending, not distcheck's hang or a crash.
    files = LaunchFiles(tmp_path)
    files.command_log.parent.mkdir(parents=True, exist_ok=True)
    files.command_log.write_text("slurmstepd-n1: error: *** STEP 4.0 ON n1 CANCELLED AT 2026-12-05T23:11:37 "
                                 "DUE TO TIME LIMIT ***\nsrun: error: n1: tasks 0-1: Terminated\n")
    seen_dying = WatchdogResult(decision=Decision.DEADLOCK, killed_ranks=(0,))
    slurms = {1: RankFailure(exit_code=None, signal="SIGTERM", pid=None)}
    assert _end_reason(seen_dying, False, slurms, files) is EndReason.SLURM_TIME_LIMIT
    # distcheck ended the hang itself (it SIGTERMed rank 1): srun's cancel line then follows distcheck's end
    ours = {1: RankFailure(exit_code=None, signal="SIGTERM", pid=None)}
    ended_by_us = WatchdogResult(decision=Decision.DEADLOCK, killed_ranks=(0, 1))
    assert _end_reason(ended_by_us, False, ours, files) is EndReason.CERTAIN_HANG
    # a rank's own crash before distcheck acted is no Slurm ending, whatever srun then says
    crashed = {1: RankFailure(exit_code=None, signal="SIGSEGV", pid=None)}
    assert _end_reason(seen_dying, False, crashed, files) is EndReason.CERTAIN_HANG


def test_slurm_endings_are_interruptions_with_their_own_words():
    assert EndReason.SLURM_TIME_LIMIT.interrupted and not EndReason.CRASH.interrupted
    assert "Slurm time limit" in EndReason.SLURM_TIME_LIMIT.words
    assert "cancelled by Slurm" in EndReason.SLURM_CANCELLED.words


SIGNALS_JOB = textwrap.dedent("""
    import os, signal, sys
    from distcheck import interrupt
    interrupt.install()
    interrupt.begin_run()
    with interrupt.watched():
        for sig in sys.argv[1].split(","):
            os.kill(os.getpid(), getattr(signal, sig))
    print("still running", interrupt.signal_name())
""")


@pytest.mark.parametrize("signals, one_request", [
    ("SIGTERM,SIGCONT,SIGTERM", True),     # Slurm's time limit: one request to stop, the report still written
    ("SIGINT,SIGINT", False),              # a second Ctrl-C: stopped at once
])
def test_slurms_second_sigterm_is_the_same_request(signals, one_request):
    done = subprocess.run([sys.executable, "-c", SIGNALS_JOB, signals], capture_output=True, text=True,
                          timeout=60, cwd=REPO)
    if one_request:
        assert (done.returncode, done.stdout.strip()) == (0, "still running SIGTERM"), done.stderr
    else:
        assert done.returncode == 130 and "interrupted again" in done.stderr


@pytest.mark.parametrize("state, reason, at, ending", [
    ("COMPLETING", "TimeLimit", 100.0, EndReason.SLURM_TIME_LIMIT),   # measured at a time limit (22.05)
    ("COMPLETING", "None", 100.0, EndReason.SLURM_CANCELLED),         # measured at a scancel: far from the end
    ("COMPLETING", "None", 997.0, EndReason.SLURM_TIME_LIMIT),        # no reason, but the end time had come
    ("COMPLETING", "None", 1020.0, EndReason.SLURM_TIME_LIMIT),       # Slurm checks its limits late
    ("TIMEOUT", None, 100.0, EndReason.SLURM_TIME_LIMIT), ("CANCELLED", None, 999.0, EndReason.SLURM_CANCELLED),
    ("PREEMPTED", None, 100.0, EndReason.SLURM_PREEMPTED),
    ("RUNNING", "None", 100.0, None),                                  # a plain kill: the job goes on
    (None, None, 100.0, None), (None, None, 999.0, EndReason.SLURM_TIME_LIMIT),   # no scontrol: the end time
])
def test_a_sigterm_is_told_by_the_jobs_state_reason_and_end_time(state, reason, at, ending):
    assert classify(state, reason, 1000.0, at) is ending


def test_a_cancel_is_not_taken_for_a_time_limit_without_an_end_time():
    assert classify("COMPLETING", "None", None, 100.0) is EndReason.SLURM_CANCELLED
    assert classify(None, None, None, 100.0) is None


OWN_STOP_JOB = textwrap.dedent("""
    import json, os, signal, time
    from distcheck import interrupt
    from distcheck.launch import slurm
    interrupt.install()
    interrupt.begin_run()
    env = {"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0", "SLURM_JOB_END_TIME": str(int(time.time()) + 3)}
    with interrupt.watched(), slurm.stop_before_end(env, lead_s=1.5) as end:
        deadline = time.time() + 30
        while not interrupt.requested() and time.time() < deadline:
            time.sleep(0.01)
        asked = time.time()
        os.kill(os.getpid(), signal.SIGTERM)   # Slurm's own SIGTERM at the limit, after distcheck's own stop
        print(json.dumps({"lead": end - asked, "name": interrupt.signal_name(), "known": slurm.known_end() == end,
                          "ending": slurm.requested_ending().value}))
    print(json.dumps({"known_after": slurm.known_end()}))
""")


def test_distcheck_stops_itself_before_the_time_limit_and_slurms_sigterm_then_is_the_same_request():
    done = subprocess.run([sys.executable, "-c", OWN_STOP_JOB], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert done.returncode == 0 and "interrupted again" not in done.stderr, done.stderr
    during, after = (json.loads(line) for line in done.stdout.splitlines())
    assert (during["name"], during["known"], during["ending"]) == (OWN_STOP, True, "slurm_time_limit")
    assert 1.0 < during["lead"] <= 1.5   # asked lead_s before the end, not at once
    assert after == {"known_after": None}


def test_outside_slurm_nothing_is_known_and_no_stop_is_planned():
    with stop_before_end({}, lead_s=1e9) as end:
        assert end is None and known_end() is None
    assert run_metadata() == {} or "SLURM_JOB_ID" in os.environ


@pytest.mark.parametrize("held", ["endpoint", "store"])
def test_a_port_in_use_is_named_with_where_it_came_from_and_how_to_choose_another(held):
    import socket

    from distcheck.errors import LaunchError
    from distcheck.launch.node_config import check_endpoint_address

    job = next(j for j in range(5000, 6000) if bindable(endpoint_port(str(j))) and bindable(endpoint_port(str(j)) + 1))
    node0 = {**STEP, "SLURM_JOB_ID": str(job), "SLURM_NODEID": "0", "MASTER_ADDR": "127.0.0.1"}
    cfg = config(node0)
    assert (cfg.port, cfg.port_from_job) == (endpoint_port(str(job)), str(job))
    port = cfg.port if held == "endpoint" else cfg.port + 1
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port))
        taken.listen(1)
        with pytest.raises(LaunchError) as refused:
            check_endpoint_address(cfg)
    assert f"127.0.0.1:{port} is already in use" in refused.value.message
    assert f"derived from Slurm job {job}'s id" in refused.value.hint and "--rdzv-endpoint 127.0.0.1:PORT" \
        in refused.value.hint
    check_endpoint_address(cfg)   # free again: no error
    # a port the user chose is not "derived": the hint says to choose another, not why it was picked
    assert config({**node0, "MASTER_PORT": str(port)}).port_from_job is None
