"""Issue 16: `distcheck run -- CMD` traces every rank the user's own launch command starts
(mp.spawn, torchrun, Lightning's subprocess launcher), on real gloo process groups.

Every run has a hard timeout (the ``distcheck`` fixture kills the whole tree on expiry), and
every test proves that no process the command started survived: those processes do not
mention the run dir on their command line, so they are found by the environment the
injection gave them (DISTCHECK_LAUNCH_DIR under this test's tmp_path).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from conftest import (findings_less_torch_notes, free_port, injected, kill_tree, process_groups_initialized,
                      wait_for)

pytestmark = pytest.mark.e2e

SCRIPTS = Path(__file__).parent / "scripts"
SPAWN = SCRIPTS / "spawn_barrier.py"
RANK0_COMPUTE = SCRIPTS / "rank0_compute.py"
LIGHTNING_VAL = SCRIPTS / "lightning_val.py"
FAST = ("--stall-timeout", "3")


def _only(report: dict) -> dict:
    [s] = report["scenarios"]
    return s


def _line_of(script: Path, text: str) -> int:
    return next(i for i, line in enumerate(script.read_text().splitlines(), 1) if text in line)


def _hang(s: dict) -> dict:
    [hang] = [f for f in s["findings"] if f["kind"] == "hang"]
    return hang


def test_mp_spawn_rank0_only_barrier_is_a_hang_at_its_line(distcheck, no_survivors):
    r = distcheck("run", *FAST, "--", sys.executable, str(SPAWN), "--bug", "--port", str(free_port()))
    assert r.returncode == 1, r.stdout[-2000:] + r.stderr[-2000:]
    s = _only(r.report)
    assert s["name"] == "spawn_barrier" and str(SPAWN) in s["source"]   # the report names the command
    hang = _hang(s)
    assert hang["waiting_ranks"] == [0] and hang["absent_ranks"] == [1]
    file, line, function = hang["callsite"].split(":")
    assert (file, int(line), function) == (str(SPAWN), _line_of(SPAWN, "# the barrier"), "work")
    assert r.report["run"]["world_size"] == 2 and "crash" not in s["observed"]
    launch = Path(s["launch_dir"])
    assert "spawn_barrier.py" in (launch / "stacks" / "rank0.txt").read_text()   # a rank distcheck did not start
    assert "rank 1 up" in (launch / "logs" / "rank1.log").read_text()


def test_healthy_mp_spawn_runs_clean(distcheck, no_survivors):
    r = distcheck("run", *FAST, "--", sys.executable, str(SPAWN), "--port", str(free_port()))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    s = _only(r.report)
    assert s["ok"] and s["findings"] == [] and s["end_reason"] == "completed"
    assert s["collectives_compared"] == 1 and [x["state"] for x in s["ranks"]] == ["finished", "finished"]


def _torchrun(*args: str) -> tuple[str, ...]:
    return (sys.executable, "-m", "torch.distributed.run", "--standalone", *args)


def test_torchrun_command_gives_the_same_diagnosis_as_a_distcheck_launch(distcheck, tmp_path, no_survivors):
    steps = ("--steps", "12")
    own = distcheck("run", *FAST, "--", *_torchrun("--nproc-per-node", "2", str(RANK0_COMPUTE)), *steps)
    ours = distcheck("run", str(RANK0_COMPUTE), "--nproc-per-node", "2", *FAST, "--run-dir", str(tmp_path / "ours"),
                     "--json", str(tmp_path / "ours.json"), "--", *steps)
    assert own.returncode == ours.returncode == 1, own.stderr[-2000:] + ours.stderr[-2000:]
    a, b = _hang(_only(own.report)), _hang(_only(ours.report))
    same = ("op", "seq", "label", "callsite", "waiting_ranks", "absent_ranks")
    assert {k: a[k] for k in same} == {k: b[k] for k in same}
    assert a["waiting_ranks"] == [0] and a["absent_ranks"] == [1] and a["label"] == "BinaryAUROC.compute"
    assert _only(own.report)["observed"] == _only(ours.report)["observed"] == ["hang"]


def test_healthy_torchrun_command_runs_clean(distcheck, no_survivors):
    r = distcheck("run", *FAST, "--", *_torchrun("--nproc-per-node", "2", str(RANK0_COMPUTE)), "--fixed", "--steps", "6")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    s = _only(r.report)
    assert s["ok"] and s["collectives_compared"] > 0 and r.report["run"]["world_size"] == 2


@pytest.mark.ecosystem   # real Lightning in the ranks: the ecosystem lane
def test_lightning_own_launcher_is_clean_when_healthy(distcheck, no_survivors):
    r = distcheck("run", *FAST, "--", sys.executable, str(LIGHTNING_VAL))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    s = _only(r.report)
    assert s["ok"] and findings_less_torch_notes(s) == [] and s["collectives_compared"] > 0
    assert r.report["run"]["world_size"] == 2   # rank 1 was started by Lightning, not by distcheck


@pytest.mark.ecosystem   # real Lightning in the ranks: the ecosystem lane
def test_lightning_rank0_only_self_log_is_a_hang_on_its_line(distcheck, no_survivors):
    r = distcheck("run", *FAST, "--", sys.executable, str(LIGHTNING_VAL), "--rank0-log")
    assert r.returncode == 1, r.stdout[-2000:] + r.stderr[-2000:]
    hang = _hang(_only(r.report))
    assert hang["waiting_ranks"] == [0] and hang["absent_ranks"] == [1]
    file, line, _ = hang["callsite"].split(":")
    assert (file, int(line)) == (str(LIGHTNING_VAL), _line_of(LIGHTNING_VAL, 'self.log("rank0_loss"'))


@pytest.mark.parametrize("sig, says", [("KILL", "died in the middle of its work without a Python exception"),
                                       ("SEGV", "was killed by SIGSEGV")])
def test_a_rank_of_the_command_killed_by_a_signal_is_the_crash(distcheck, no_survivors, sig, says):
    """No launcher of ours sees the exit status: faulthandler's dump names a fatal signal, a SIGKILL leaves
    none; the peer that mp.spawn then terminates is a consequence, not the cause."""
    script = SCRIPTS / "spawn_dies.py"
    r = distcheck("run", *FAST, "--", sys.executable, str(script), "--signal", sig, "--port", str(free_port()))
    assert r.returncode == 1, r.stdout[-3000:] + r.stderr[-2000:]
    s = _only(r.report)
    assert s["end_reason"] == "crash"
    [crash] = [f for f in s["findings"] if f["kind"] == "crash"]
    assert crash["data"]["root_rank"] == 1 and says in crash["summary"]
    assert {x["rank"]: x["state"] for x in s["ranks"]}[1] == "crashed"


def test_a_command_that_fails_after_its_ranks_finished_is_a_crash(distcheck, no_survivors):
    r = distcheck("run", *FAST, "--", sys.executable, str(SPAWN), "--exit", "3", "--port", str(free_port()))
    assert r.returncode == 1, r.stdout[-3000:] + r.stderr[-2000:]
    s = _only(r.report)
    [crash] = s["findings"]
    assert crash["kind"] == "crash" and crash["data"]["command_exit"] == 3
    assert "the command itself exited with code 3" in crash["summary"]
    assert all(x["state"] == "finished" for x in s["ranks"])


def test_a_script_that_spawns_its_own_ranks_is_refused_with_the_command_form(distcheck):
    r = distcheck("run", str(SPAWN), "--", "--bug", json=False, timeout=60)
    assert r.returncode == 2
    [line] = r.stderr.strip().splitlines()
    assert f"distcheck run -- python {SPAWN} --bug" in line and "crash" not in line


@pytest.mark.parametrize("code", [0, 5])
def test_a_command_that_never_initializes_a_process_group_ends_with_its_own_exit_code(distcheck, code):
    """A CI job wraps its whole suite, some of whose selections are not distributed (pytest's own 0, or 5 for
    "no tests collected"): distcheck says in one line that nothing was checked and ends as the command ended."""
    r = distcheck("run", "--", sys.executable, "-c", f"import sys; print('hello'); sys.exit({code})", json=False,
                  timeout=60)
    assert r.returncode == code, r.stdout + r.stderr
    assert "Traceback" not in r.stderr and "hello" in r.stdout
    assert f"started no process group, so nothing was checked (it exited with code {code}" in r.stdout
    assert "NOTHING CHECKED" in r.stdout and "timeline" not in r.stdout


def test_require_process_group_makes_a_command_without_one_an_error(distcheck):
    r = distcheck("run", "--require-process-group", "--", sys.executable, "-c", "print('hello')", json=False,
                  timeout=60)
    assert r.returncode == 6 and "--require-process-group makes that an error" in r.stdout, r.stdout + r.stderr


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_killing_distcheck_ends_every_process_the_command_started(tmp_path, sig, no_survivors):
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "distcheck", "run", "--run-dir", str(run_dir), "--json", str(tmp_path / "r.json"),
         "--", sys.executable, str(SPAWN), "--hold", "--port", str(free_port())],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        status = [run_dir / "spawn_barrier" / "status" / f"rank{r}.json" for r in (0, 1)]
        assert wait_for(lambda: process_groups_initialized(status), timeout=120), proc.stderr
        ranks = [json.loads(p.read_text())["pid"] for p in status]
        assert all(psutil.pid_exists(pid) for pid in ranks)
        os.kill(proc.pid, sig)   # distcheck alone: not its process group
        proc.wait(timeout=60)
        # The mp.spawn children are grandchildren of the command: gone, even after a SIGKILL.
        assert wait_for(lambda: not injected(tmp_path), timeout=15), [p.pid for p in injected(tmp_path)]
        if sig == signal.SIGTERM:
            assert proc.returncode == 130
    finally:
        kill_tree(proc)
        proc.communicate()


def test_sigterm_before_any_rank_initialized_is_still_an_interrupted_run(tmp_path, no_survivors):
    """The window between a rank's start and its discovery: Ctrl-C there is no pass and no 'no rank' error."""
    started = tmp_path / "started"
    code = f"import pathlib, time; pathlib.Path({str(started)!r}).touch(); time.sleep(120)"
    proc = subprocess.Popen(
        [sys.executable, "-m", "distcheck", "run", "--run-dir", str(tmp_path / "run"), "--json",
         str(tmp_path / "r.json"), "--", sys.executable, "-c", code],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert wait_for(started.exists, timeout=120), proc.stderr
        os.kill(proc.pid, signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 130, err
        assert "Traceback" not in err and "init_process_group" not in err
        assert json.loads((tmp_path / "r.json").read_text())["interrupted"] is True
    finally:
        kill_tree(proc)
        proc.communicate()


def _report_of(distcheck, run_dir: Path, tmp_path: Path) -> tuple[int, dict]:
    """`distcheck report DIR --json`: its exit code and the report it read back."""
    out = tmp_path / "again.json"
    r = distcheck("report", str(run_dir), "--json", str(out), json=False, timeout=60)
    assert "Traceback" not in r.stderr and out.exists(), (r.returncode, r.stdout, r.stderr)
    return r.returncode, json.loads(out.read_text())


def test_ctrl_c_before_any_rank_started_leaves_a_report_that_says_nothing_ran(distcheck, tmp_path, no_survivors):
    """--run-dir is made with the flags, before torch is imported: an interrupt then ends at once, and the
    run dir it made holds a report `distcheck report` reads (interrupted, no scenario)."""
    run_dir = tmp_path / "early"
    proc = subprocess.Popen(
        [sys.executable, "-m", "distcheck", "run", "--run-dir", str(run_dir),
         "--", sys.executable, "-c", "import time; time.sleep(120)"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert wait_for(run_dir.exists, timeout=120, poll=0.01), proc.stderr
        os.kill(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 130 and "nothing ran" in err and "Traceback" not in err, err
    finally:
        kill_tree(proc)
        proc.communicate()
    code, report = _report_of(distcheck, run_dir, tmp_path)
    assert code == 130 and report["interrupted"] is True and report["scenarios"] == []
    assert "nothing ran" in report["run"]["command_output"]
    runs = distcheck("runs", "--dir", str(tmp_path), "--json", json=False, timeout=60)
    assert runs.returncode == 0 and "interrupted" in runs.stdout and "incomplete" not in runs.stdout


def test_a_command_that_could_not_start_keeps_its_log_and_a_report_saying_why(distcheck, tmp_path):
    missing = tmp_path / "no-such-program"
    r = distcheck("run", "--", str(missing), "--flag", json=False, timeout=120)
    # the shell's own code for a program that cannot start, and the line that says why
    assert r.returncode == 127 and "Traceback" not in r.stderr, r.stderr
    assert "nothing was checked (it exited with code 127" in r.stdout and "No such file or directory" in r.stdout
    [launch] = [p for p in r.run_dir.iterdir() if p.is_dir()]
    assert "No such file or directory" in (launch / "logs" / "command.log").read_text()
    code, report = _report_of(distcheck, r.run_dir, tmp_path)
    scenario = _only(report)
    assert code == 127 and scenario["command_exit"] == 127 and not scenario["findings"]
    assert "No such file or directory" in scenario["skipped"] and "No such file or directory" in scenario["log_tail"]
    runs = distcheck("runs", "--dir", str(tmp_path), "--json", json=False, timeout=60)
    assert runs.returncode == 0 and "incomplete" not in runs.stdout, runs.stdout


def _command_node(rank: int, port: int, master_port: int, tmp_path: Path, *script_args: str) -> subprocess.Popen:
    """One "node": distcheck with torchrun's multi-node flags, running torchrun for that node."""
    args = [sys.executable, "-m", "distcheck", "run", "--nnodes", "2", "--node-rank", str(rank),
            "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"c{port}", *FAST,
            "--run-dir", str(tmp_path / f"node{rank}"), "--json", str(tmp_path / f"node{rank}.json"),
            "--", sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(rank),
            "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", str(master_port),
            str(RANK0_COMPUTE), *script_args]
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, cwd=tmp_path)


@pytest.mark.multinode   # two distcheck nodes on this host: the multinode lane
@pytest.mark.parametrize("script_args, verdict", [(("--steps", "12"), "hang"), (("--fixed", "--steps", "6"), "pass")])
def test_a_command_on_two_nodes_is_judged_as_one_job(tmp_path, no_survivors, script_args, verdict):
    """One `distcheck run -- torchrun ...` per node, as for a script: node 0 writes the merged report."""
    port, master_port = free_port(), free_port()
    procs = [_command_node(n, port, master_port, tmp_path, *script_args) for n in (0, 1)]
    try:
        outs = [p.communicate(timeout=180) for p in procs]   # two nodes of torchrun: 15 s quiet, minutes at load 30
    finally:
        for p in procs:
            kill_tree(p)
    codes = [p.returncode for p in procs]
    assert codes == ([1, 1] if verdict == "hang" else [0, 0]), [o[-2000:] for out in outs for o in out]
    [s] = json.loads((tmp_path / "node0.json").read_text())["scenarios"]
    assert {r["rank"]: r["node"] for r in s["ranks"]} == {0: 0, 1: 1}
    if verdict == "pass":
        assert s["ok"] and s["observed"] == ["pass"] and all(r["state"] == "finished" for r in s["ranks"])
        return
    [hang] = [f for f in s["findings"] if f["kind"] == "hang"]
    assert (hang["waiting_ranks"], hang["absent_ranks"], hang["label"]) == ([0], [1], "BinaryAUROC.compute")


def test_the_commands_ranks_output_reaches_the_terminal_as_under_torchrun(distcheck, no_survivors):
    """What the command's ranks print is shown as it comes, each line "[rankN]:" (their logs keep it whole)."""
    r = distcheck("run", *FAST, "--", sys.executable, str(SPAWN), "--port", str(free_port()))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "[rank0]:rank 0 up" in r.stdout and "[rank1]:rank 1 up" in r.stdout
    quiet = distcheck("run", *FAST, "--quiet-ranks", "--", sys.executable, str(SPAWN), "--port", str(free_port()))
    assert quiet.returncode == 0 and "[rank0]:" not in quiet.stdout


BUGGY = SCRIPTS / "buggy.py"


def test_under_torchrun_the_diagnosis_leads_and_the_launchers_report_is_one_line(distcheck, no_survivors):
    """What the report says is what was seen (item 4): ``distcheck run -- torchrun --nproc-per-node 3 buggy.py``,
    typed as a user types it (in the script's folder, torchrun on PATH, the default --stall-timeout), prints the
    finding within its first 6 lines and at most 25 in all (it printed 83-86: the launcher's ChildFailedError
    traceback before the finding and again in the tails); the ranks' lines carry one ``[rankN]:``; a rank whose
    log ends in gloo's "Connection closed by peer" is shown with it, not as stuck; the logs keep every line."""
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    r = distcheck("run", "--", "torchrun", "--nproc-per-node", "3", BUGGY.name, cwd=SCRIPTS, env={"PATH": path})
    assert r.returncode == 1, r.stdout[-3000:] + r.stderr[-2000:]
    lines = r.stdout.splitlines()
    assert len(lines) <= 25, r.stdout
    finding = next(i for i, line in enumerate(lines) if line.lstrip().startswith("HANG [error]"))
    assert finding < 6, r.stdout
    assert not any("[rank0]:[rank0]:" in line or "[rank1]:[rank1]:" in line for line in lines), r.stdout
    assert "=====" not in r.stdout and "raise ChildFailedError" not in r.stdout, r.stdout
    [folded] = [line for line in lines if "ChildFailedError" in line]
    assert "buggy.py FAILED" in folded and "lines" in r.stdout.split("ChildFailedError", 1)[1], folded
    # the verdict block ends the output: the FAIL line, then what needs attention and the run dir
    assert lines[-1].strip().startswith("run dir:") and "timeline.html" in lines[-1], lines[-3:]
    assert any(line.startswith("FAIL  ") for line in lines[-4:]), lines[-4:]
    s = _only(r.report)
    launch = Path(s["launch_dir"])
    assert "ChildFailedError" in (launch / "logs" / "command.log").read_text()   # kept whole in the logs
    rank0 = next(x for x in s["ranks"] if x["rank"] == 0)
    row = next(line for line in lines if line.split()[:1] == ["0"])
    if "Connection closed by peer" in (rank0["exception"] or ""):   # gloo ended rank 0's wait before distcheck did
        assert row.split()[1] == "error" and "Connection closed by peer" in row, row
        assert "Connection closed by peer" not in r.stdout.replace(row, ""), r.stdout   # once: its row
    assert _line_of(BUGGY, "THE BUG") == int(_hang(s)["callsite"].split(":")[1])


def test_a_command_that_never_started_a_rank_says_its_own_first_error(distcheck, no_survivors, tmp_path):
    """torchrun's children could not open the script: the skip line says the interpreter's own words, once, and
    the launcher's ChildFailedError banner is one line (the log keeps it)."""
    missing = tmp_path / "missing.py"
    r = distcheck("run", *FAST, "--", *_torchrun("--nproc-per-node", "2", str(missing)))
    assert r.returncode == 1, r.stdout[-3000:] + r.stderr[-2000:]
    said = " ".join(r.stdout.split())   # as one line: the terminal wraps it at 140 columns
    assert "nothing was checked (it exited with code 1: " in said and f"can't open file '{missing}'" in said, r.stdout
    assert said.split("nothing was checked", 1)[1].count("can't open file") == 1, r.stdout   # not again under it
    assert "=====" not in r.stdout and len([ln for ln in r.stdout.splitlines() if "ChildFailedError" in ln]) == 1, r.stdout
    assert len(r.stdout.splitlines()) <= 16, r.stdout   # 56 before: the banner whole, and again in the tail
