"""Fault injection and bad input (issue 7): every fault ends in the right diagnosis, a clear
message, the right exit code, the traces already written kept on disk, and no surviving process.

Real processes and real gloo process groups throughout. To stay cheap on 2 cores, the rank
faults are scenarios of ONE file run by ONE ``distcheck run`` (each scenario is its own launch),
shared by the tests of this module; script-mode and CLI cases run distcheck once each.
Cases already in test_run_e2e.py (exception on a rank, SIGKILL between collectives, Ctrl-C and
SIGKILL of distcheck, unknown scenario, --nproc-per-node 0, nccl without GPUs, syntax error),
test_postmortem.py (truncated and malicious Flight Recorder dumps) and test_cli_reports.py (torn
report.json, `distcheck env` redaction) are not repeated here.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import shlex
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from conftest import (is_loopback_ip, kill_tree, listening_sockets, process_groups_initialized, process_tree,
                      run_distcheck, survivors, wait_for)

pytestmark = pytest.mark.e2e

STALL = 3
BUSY = 8      # --busy-timeout: a rank busy in its own code is waited for this long (late, not hung)
CANARY = "distcheck-canary-7f3a"          # a source line no stack passes through
SECRET = "distcheck-secret-value-91c2"    # in the environment of the run only

FAULTS = f'''
import ctypes
import os
import re
import signal
import sys
import threading
import time

from distcheck import scenario

NOT_ON_ANY_STACK = "{CANARY}"


def _inside(thread_id, name):
    frame = sys._current_frames().get(thread_id)
    while frame is not None:
        if frame.f_code.co_name == name and "distributed_c10d" in frame.f_code.co_filename:
            return True
        frame = frame.f_back
    return False


@scenario(expect="crash")
def sigkill_inside_all_reduce(ctx):
    """The OOM killer, simulated: rank 1 allocates 256 MiB and is SIGKILLed while it waits
    inside all_reduce #3; rank 0 never comes."""
    import torch
    import torch.distributed as dist

    t = torch.ones(4)
    dist.all_reduce(t)
    dist.all_reduce(t)
    if ctx.rank == 1:
        ballast = torch.ones(64 * 2**20)   # 256 MiB, touched
        main = threading.get_ident()

        def killer():
            while not _inside(main, "all_reduce"):
                time.sleep(0.01)
            os.kill(os.getpid(), signal.SIGKILL)

        threading.Thread(target=killer, daemon=True).start()
        dist.all_reduce(t)  # KILLED-INSIDE
    else:
        while True:
            time.sleep(0.05)


@scenario(expect="crash")
def segfault(ctx):
    import torch
    import torch.distributed as dist

    t = torch.ones(4)
    dist.all_reduce(t)
    if ctx.rank == 1:
        ctypes.string_at(0)  # SEGFAULT
    dist.all_reduce(t)


@scenario(expect="crash")
def abort(ctx):
    import torch
    import torch.distributed as dist

    t = torch.ones(4)
    dist.all_reduce(t)
    if ctx.rank == 1:
        os.abort()  # ABORT
    dist.all_reduce(t)


@scenario(expect="crash")
def abort_then_peer_raises(ctx):
    """Two failures at once: torch's agent reports only the first it sees (of forked ranks)."""
    import psutil
    import torch
    import torch.distributed as dist

    pids = [None] * ctx.world_size
    dist.all_gather_object(pids, os.getpid())
    if ctx.rank == 1:
        os.abort()  # ABORT-FIRST
    while psutil.pid_exists(pids[1]) and psutil.Process(pids[1]).status() != psutil.STATUS_ZOMBIE:
        time.sleep(0.001)
    raise RuntimeError("rank 1 is gone")


@scenario(expect="hang")
def busy_python_loop(ctx):
    import torch
    import torch.distributed as dist

    t = torch.ones(4)
    dist.all_reduce(t)
    if ctx.rank == 1:
        x = 0
        while True: x += 1  # STUCK   (one line: a stack sample can land on the loop test or its body)
    dist.all_reduce(t)


@scenario(expect="hang")
def c_call_holding_the_gil(ctx):
    import torch
    import torch.distributed as dist

    t = torch.ones(4)
    dist.all_reduce(t)
    if ctx.rank == 1:
        re.match(r"(a+)+$", "a" * 64 + "b")  # STUCK (catastrophic backtracking in C, GIL held)
    dist.all_reduce(t)


@scenario(expect="hang")
def sleeping(ctx):
    import torch
    import torch.distributed as dist

    t = torch.ones(4)
    dist.all_reduce(t)
    if ctx.rank == 1:
        time.sleep(3600)  # STUCK
    dist.all_reduce(t)


@scenario(expect="crash")
def undeclared_missing_import(ctx):
    import distcheck_no_such_package  # noqa: F401  MISSING-IMPORT


@scenario(expect="pass", requires=("distcheck_no_such_package",))
def declared_missing_requirement(ctx):
    import distcheck_no_such_package  # noqa: F401
'''

JOB = '''
import os
import sys

import torch
import torch.distributed as dist

mode = sys.argv[1]
rank = int(os.environ["RANK"])
if mode == "raise-before" and rank == 1:
    raise RuntimeError("bad config before init")  # RAISE-BEFORE
dist.init_process_group("gloo")
t = torch.ones(2)
dist.all_reduce(t)
if rank == 1:
    if mode == "sys-exit":
        sys.exit(0)
    if mode == "os-exit":
        os._exit(0)  # OS-EXIT
    if mode == "raise-after":
        raise RuntimeError("bad batch after init")  # RAISE-AFTER
dist.all_reduce(t)  # SECOND
dist.destroy_process_group()
'''

HANG = '''
import time

from distcheck import scenario


@scenario(expect="hang")
def rank1_sleeps(ctx):
    import torch
    import torch.distributed as dist

    t = torch.ones(4)
    dist.all_reduce(t)
    if ctx.rank == 1:
        time.sleep(3600)
    dist.all_reduce(t)
'''


# -- helpers ------------------------------------------------------------------


def line_of(path: Path, marker: str) -> int:
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if marker in line)


def crash_of(s: dict) -> dict:
    [crash] = [f for f in s["findings"] if f["kind"] == "crash"]
    return crash


def hang_of(s: dict) -> dict:
    [hang] = [f for f in s["findings"] if f["kind"] == "hang"]
    return hang


def ranks_of(s: dict) -> dict[int, dict]:
    return {x["rank"]: x for x in s["ranks"]}


def events(launch_dir: Path, rank: int):
    from distcheck.files.trace_reader import read_trace_dir

    return read_trace_dir(launch_dir / "traces")[rank].events


# -- one run, many rank faults ---------------------------------------------------


class FaultRun:
    def __init__(self, proc: subprocess.CompletedProcess, source: Path, run_dir: Path, report: dict) -> None:
        self.proc, self.source, self.run_dir, self.report = proc, source, run_dir, report

    def scenario(self, name: str) -> dict:
        return next(s for s in self.report["scenarios"] if s["name"] == name)


@pytest.fixture(scope="module")
def faults(tmp_path_factory) -> FaultRun:
    tmp = tmp_path_factory.mktemp("faults")
    source = tmp / "faults.py"
    source.write_text(FAULTS)
    run_dir = tmp / "run"
    json_path = tmp / "report.json"
    proc = run_distcheck(["run", str(source), "--nproc-per-node", "2", "--backend", "gloo",
                          "--stall-timeout", str(STALL), "--busy-timeout", str(BUSY), "--run-dir", str(run_dir), "--json", str(json_path)],
                         cwd=tmp, marker=run_dir, env={"DISTCHECK_TEST_API_TOKEN": SECRET})
    assert json_path.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    return FaultRun(proc, source, run_dir, json.loads(json_path.read_text()))


def test_every_rank_fault_behaves_as_expected_and_the_run_exits_0(faults):
    bad = [(s["name"], s["observed"]) for s in faults.report["scenarios"] if not s["ok"]]
    assert not bad, faults.proc.stdout[-4000:]
    assert faults.proc.returncode == 0
    assert "Traceback" not in faults.proc.stderr


def test_rank_sigkilled_inside_a_collective(faults):
    s = faults.scenario("sigkill_inside_all_reduce")
    crash = crash_of(s)
    assert crash["data"]["root_rank"] == 1 and crash["data"]["signal"] == "SIGKILL"
    assert crash["op"] == "all_reduce" and crash["seq"] == 3
    assert "Rank 1 was killed by SIGKILL" in crash["summary"]
    assert "distcheck did not send that SIGKILL" in crash["summary"]
    assert crash["data"]["oom_kills"] in (0, None)          # a simulation: no OOM kill was counted
    r = ranks_of(s)
    assert r[1]["state"] == "crashed" and r[1]["collectives"] == 3
    # sampled by the watchdog while the rank ran (the 256 MiB may or may not have been seen yet)
    assert crash["data"]["rss_bytes"] == r[1]["rss_bytes"] and r[1]["rss_bytes"] > 50 * 2**20
    assert r[1]["peak_rss_bytes"] >= r[1]["rss_bytes"]
    assert r[1]["where"].endswith(f"faults.py:{line_of(faults.source, 'KILLED-INSIDE')}:sigkill_inside_all_reduce")
    assert r[0]["state"] in ("killed", "running")          # never came: not blamed
    # the enter record written before the collective survived the SIGKILL; no exit record
    last = events(Path(s["launch_dir"]), 1)[-1]
    assert (last.op, last.seq, last.t_exit) == ("all_reduce", 3, None)


OOM = '''
import torch
import torch.distributed as dist

from distcheck import scenario


@scenario(expect="crash")
def rank1_eats_memory(ctx):
    t = torch.ones(4)
    dist.all_reduce(t)
    if ctx.rank == 1:
        hog = []
        while True:
            hog.append(torch.ones(16 * 2**20))   # 64 MiB a step, touched, until the OOM killer comes
    dist.all_reduce(t)
'''


@contextlib.contextmanager
def memory_cgroup(limit_bytes: int):
    """A child memory cgroup of ours, limited to ``limit_bytes``; skips where cgroups are not writable."""
    from distcheck.launch.memory import CGROUP_ROOT

    name = f"distcheck-oom-test-{os.getpid()}"
    made = None
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        try:
            if "memory" in controllers.split(","):                               # cgroup v1
                made = CGROUP_ROOT / "memory" / path.lstrip("/") / name
                made.mkdir()
                (made / "memory.limit_in_bytes").write_text(str(limit_bytes))
                with contextlib.suppress(OSError):                              # no swap accounting: fine
                    (made / "memory.memsw.limit_in_bytes").write_text(str(limit_bytes))
                break
            if controllers == "" and (CGROUP_ROOT / "cgroup.controllers").exists():   # cgroup v2
                made = CGROUP_ROOT / path.lstrip("/") / name
                made.mkdir()
                (made / "memory.max").write_text(str(limit_bytes))
                with contextlib.suppress(OSError):
                    (made / "memory.swap.max").write_text("0")
                break
        except OSError as exc:
            if made is not None and made.exists():
                made.rmdir()
            pytest.skip(f"cannot make a memory cgroup here: {exc}")
    if made is None:
        pytest.skip("no memory cgroup here")
    try:
        yield made
    finally:
        wait_for(lambda: not (made / "cgroup.procs").read_text().strip(), 30)
        made.rmdir()


def test_a_rank_killed_by_the_real_oom_killer_is_named_as_such(tmp_path):
    source = tmp_path / "oom.py"
    source.write_text(OOM)
    run_dir = tmp_path / "run"
    with memory_cgroup(1536 * 2**20) as cgroup:
        # distcheck itself starts inside the cgroup, so its ranks (and its OOM counter) are there too
        command = shlex.join([sys.executable, "-m", "distcheck", "run", str(source), "--nproc-per-node", "2",
                              "--backend", "gloo", "--run-dir", str(run_dir), "--json", str(tmp_path / "r.json")])
        proc = subprocess.Popen(["sh", "-c", f"echo $$ > {cgroup}/cgroup.procs && exec {command}"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                                cwd=tmp_path)
        try:
            out, err = proc.communicate(timeout=240)
        finally:
            kill_tree(proc)
    assert proc.returncode == 0, out[-3000:] + err[-3000:]
    [s] = json.loads((tmp_path / "r.json").read_text())["scenarios"]
    crash = crash_of(s)
    assert crash["data"]["root_rank"] == 1 and crash["data"]["signal"] == "SIGKILL"
    assert crash["data"]["oom_kills"] >= 1
    assert "The kernel's OOM killer sent that SIGKILL" in crash["summary"]
    assert crash["data"]["peak_rss_bytes"] > 512 * 2**20      # it was seen growing
    # rank 0 waits in all_reduce #2: not blamed. The kernel may kill again before rank 1's memory is
    # back (a second kill ~6 ms after the first): then it takes rank 0, never distcheck.
    allowed = ("stuck", "killed", "crashed") if crash["data"]["oom_kills"] >= 2 else ("stuck", "killed")
    assert ranks_of(s)[0]["state"] in allowed
    assert not survivors(str(run_dir))


OOM_STANDING = '''
import os
import sys

import torch.distributed as dist

dist.init_process_group("gloo")
def proc(pid, name):
    return int(open(f"/proc/{pid}/{name}").read())
launcher = os.environ["DISTCHECK_LAUNCHER_PID"]
with open(sys.argv[1] + f".{dist.get_rank()}", "w") as out:
    out.write(" ".join(str(proc(pid, name)) for pid in ("self", launcher) for name in ("oom_score_adj", "oom_score")))
dist.barrier()
dist.destroy_process_group()
'''


def _oom_score_adj() -> int:
    return int(Path("/proc/self/oom_score_adj").read_text())


def _may_lower_oom_score_adj() -> bool:
    """Lowering it needs CAP_SYS_RESOURCE (dropped on these VMs); tried on a throwaway child."""
    probe = (f"import os; fd = os.open('/proc/self/oom_score_adj', os.O_WRONLY); "
             f"os.write(fd, b'{max(_oom_score_adj() - 1, -999)}')")
    return subprocess.run([sys.executable, "-c", probe], capture_output=True).returncode == 0


def test_the_oom_killer_takes_a_rank_before_distcheck(distcheck, tmp_path):
    """The kernel can kill twice in a row (seen here: the second kill, 6 ms after the first, took
    distcheck, 13 MB bigger than the other rank); the witness must be the last choice."""
    from distcheck.rank.oom_standing import JOB_OOM_SCORE_ADJ_ENV

    assert JOB_OOM_SCORE_ADJ_ENV not in os.environ
    script = tmp_path / "standing.py"
    script.write_text(OOM_STANDING)
    r = distcheck("run", str(script), "--nproc-per-node", "2", "--", str(tmp_path / "adj"))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    own, privileged = _oom_score_adj(), _may_lower_oom_score_adj()
    for rank in (0, 1):
        adj, score, launcher_adj, launcher_score = map(int, (tmp_path / f"adj.{rank}").read_text().split())
        assert score > launcher_score       # the kernel's own ranking
        if privileged:
            assert (adj, launcher_adj) == (own, max(own - 500, -999))   # the job keeps its standing
        else:
            assert launcher_adj == own and adj > own


@pytest.mark.parametrize("own, rss_mb, counted_mb, may_lower, expected", [
    (0, 250, 1536, True, (-500, 0)),            # privileged: distcheck steps back, the job is untouched
    (-800, 250, 1536, True, (-999, -800)),      # never -1000: distcheck stays killable
    (0, 250, 1536, False, (0, 326)),            # 2 x 250 MB in points of 1.536 MB
    (0, 250, 2 * 2**20, False, (0, 1)),         # 2 TB: one point is already 2 GB
    (900, 250, 1536, False, (900, 1000)),
])
def test_the_jobs_oom_standing_is_the_smallest_step_that_outweighs_distcheck(own, rss_mb, counted_mb,
                                                                             may_lower, expected):
    from distcheck.launch.memory import job_oom_score_adj

    assert job_oom_score_adj(own, rss_mb * 2**20, counted_mb * 2**20, may_lower) == expected


def test_the_command_under_the_guard_takes_the_oom_standing_meant_for_the_job():
    """``run -- CMD``: the guard takes the value distcheck passes down before it starts CMD."""
    from distcheck.rank.oom_standing import JOB_OOM_SCORE_ADJ_ENV

    job = _oom_score_adj() + 7      # raising it needs no privilege: a value nobody had by chance
    read = f"import os; print(open('/proc/self/oom_score_adj').read().strip(), os.environ.get({JOB_OOM_SCORE_ADJ_ENV!r}))"
    distcheck_alive, hold = os.pipe()         # the guard ends everything once the watched pipe closes
    try:
        done = subprocess.run([sys.executable, "-m", "distcheck.launch.subreaper", "--watch-fd", str(distcheck_alive),
                               sys.executable, "-c", read],
                              env={**os.environ, JOB_OOM_SCORE_ADJ_ENV: str(job)}, pass_fds=(distcheck_alive,),
                              capture_output=True, text=True, timeout=60)
    finally:
        os.close(distcheck_alive)
        os.close(hold)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [str(job), "None"]


@pytest.mark.parametrize("name, sig, marker", [
    ("segfault", "SIGSEGV", "SEGFAULT"),
    ("abort", "SIGABRT", "ABORT"),
])
def test_rank_killed_by_a_fatal_signal_is_the_root_cause_with_its_line(faults, name, sig, marker):
    s = faults.scenario(name)
    crash = crash_of(s)
    assert crash["data"]["root_rank"] == 1 and crash["data"]["signal"] == sig
    assert f"Rank 1 was killed by {sig}" in crash["summary"]
    r = ranks_of(s)
    assert r[1]["where"].endswith(f"faults.py:{line_of(faults.source, marker)}:{name}")
    assert r[0]["state"] == "stuck"                   # waiting in the next all_reduce: a consequence
    assert "all_reduce #2" in crash["summary"]
    launch = Path(s["launch_dir"])
    assert len(events(launch, 0)) == 2 and len(events(launch, 1)) == 1
    # faulthandler wrote the dying rank's stack itself, to its stderr (the rank's log), as without distcheck
    log = (launch / "logs" / "rank1.log").read_text()
    assert "Fatal Python error" in log and f"line {line_of(faults.source, marker)} in {name}" in log
    assert not (launch / "stacks" / "rank1.txt").exists() or "Fatal Python error" not in \
        (launch / "stacks" / "rank1.txt").read_text()


def test_two_ranks_failing_at_once_are_both_reported_as_they_failed(faults):
    r = ranks_of(faults.scenario("abort_then_peer_raises"))
    assert (r[1]["state"], r[1]["signal"]) == ("crashed", "SIGABRT"), r[1]
    assert r[0]["exception"] == "RuntimeError: rank 1 is gone" and r[0]["exit_code"] == 1, r[0]


@pytest.mark.parametrize("name, limit", [("busy_python_loop", BUSY), ("c_call_holding_the_gil", BUSY),
                                         ("sleeping", STALL)])
def test_rank_stuck_outside_any_collective_is_named_with_its_line(faults, name, limit):
    """A rank busy forever (CPU in use, GIL held or not) is late until --busy-timeout, then a hang;
    one asleep is a hang at --stall-timeout."""
    s = faults.scenario(name)
    hang = hang_of(s)
    assert hang["waiting_ranks"] == [0] and hang["absent_ranks"] == [1]
    assert hang["op"] == "all_reduce" and hang["seq"] == 2
    assert limit - 0.5 <= hang["detected_after_s"] <= limit + 3
    start = line_of(faults.source, f"def {name}(")
    stuck_line = next(i for i, line in enumerate(faults.source.read_text().splitlines(), 1)
                      if i > start and "# STUCK" in line)
    r = ranks_of(s)
    assert r[1]["state"] == "running"
    assert r[1]["where"].endswith(f"faults.py:{stuck_line}:{name}")
    assert f"faults.py:{stuck_line}" in hang["summary"]
    # stacks were captured even with the GIL held in C (read from outside with py-spy: the rank's own
    # stack probe cannot run then)
    assert f"line {stuck_line} in {name}" in (Path(s["launch_dir"]) / "stacks" / "rank1.txt").read_text()


def test_undeclared_missing_import_is_a_crash_naming_the_import_error(faults):
    crash = crash_of(faults.scenario("undeclared_missing_import"))
    assert "ModuleNotFoundError: No module named 'distcheck_no_such_package'" in crash["summary"]
    assert crash["callsite"].endswith(f":{line_of(faults.source, 'MISSING-IMPORT')}:undeclared_missing_import")


def test_declared_missing_requirement_is_skipped_with_the_reason(faults):
    s = faults.scenario("declared_missing_requirement")
    assert s["ok"] and s["skipped"].startswith("needs distcheck_no_such_package")
    assert "pip install distcheck_no_such_package" in s["skipped"]
    assert not (faults.run_dir / "declared_missing_requirement").exists()   # nothing launched


def test_every_launch_kept_one_trace_per_rank(faults):
    for s in faults.report["scenarios"]:
        if s.get("skipped"):
            continue
        traces = Path(s["launch_dir"]) / "traces"
        assert sorted(p.name for p in traces.iterdir()) == ["rank0.trace", "rank1.trace"], s["name"]


def test_run_dirs_are_private_and_reports_embed_no_file_contents_or_secrets(faults):
    assert stat.S_IMODE(faults.run_dir.stat().st_mode) == 0o700
    for s in faults.report["scenarios"]:
        if not s.get("skipped"):
            assert stat.S_IMODE(Path(s["launch_dir"]).stat().st_mode) == 0o700, s["name"]
    for name in ("report.json", "timeline.html"):
        text = (faults.run_dir / name).read_text()
        assert CANARY not in text, name      # source lines only where a stack/traceback passes
        assert SECRET not in text, name


# -- corrupt saved runs ------------------------------------------------------------


def test_truncated_and_corrupt_traces_still_render_and_analyze(faults, tmp_path):
    run = tmp_path / "copy"
    shutil.copytree(faults.run_dir, run)
    launch = run / "segfault"
    t0 = launch / "traces" / "rank0.trace"
    data = t0.read_bytes()
    t0.write_bytes(data[: len(data) - 7])                                   # cut inside the last record
    (launch / "traces" / "rank1.trace").write_bytes(b"\x00\xffgarbage\tE\t1\n" + os.urandom(64) + b"\nE\tx\n")
    rep = run_distcheck(["report", str(run)], cwd=tmp_path, marker=run, timeout=120)
    assert rep.returncode == 0, rep.stderr[-2000:]          # the saved run's own verdict
    assert "Traceback" not in rep.stderr and "segfault" in rep.stdout
    ana = run_distcheck(["analyze", str(launch)], cwd=tmp_path, marker=run, timeout=120)
    assert ana.returncode in (0, 1), ana.stderr[-2000:]
    assert "Traceback" not in ana.stderr + ana.stdout
    assert "torn or corrupt record; the complete records are used" in ana.stdout


@pytest.mark.parametrize("content", [b"", b'{"schema": "distcheck.report/1", "scenarios": [', b"\x89PNG\r\n\x1a\n"])
def test_truncated_or_binary_report_json_is_exit_5(faults, tmp_path, content):
    run = tmp_path / "copy"
    shutil.copytree(faults.run_dir, run)
    (run / "report.json").write_bytes(content)
    rep = run_distcheck(["report", str(run)], cwd=tmp_path, marker=run, timeout=120)
    assert rep.returncode == 5, rep.stderr[-2000:]
    assert rep.stderr.startswith("distcheck: error: ") and "Traceback" not in rep.stderr


# -- scripts: failures around init_process_group, early exits -----------------------


@pytest.fixture
def job(tmp_path) -> Path:
    path = tmp_path / "job.py"
    path.write_text(JOB)
    return path


def _only(r) -> dict:
    [s] = r.report["scenarios"]
    return s


def test_script_rank_leaving_with_sys_exit_0_while_others_wait(distcheck, job):
    r = distcheck("run", str(job), "--nproc-per-node", "2", "--stall-timeout", str(STALL), "--", "sys-exit")
    assert r.returncode == 1, r.stderr[-2000:]
    hang = hang_of(_only(r))
    assert hang["waiting_ranks"] == [0] and hang["absent_ranks"] == [1]
    assert hang["callsite"].endswith(f"job.py:{line_of(job, 'SECOND')}:<module>")
    assert "rank 1 never entered it (finished" in hang["summary"]


def test_script_rank_leaving_with_os_exit_0_is_the_root_cause(distcheck, job):
    r = distcheck("run", str(job), "--nproc-per-node", "2", "--stall-timeout", str(STALL), "--", "os-exit")
    assert r.returncode == 1, r.stderr[-2000:]
    s = _only(r)
    crash = crash_of(s)
    assert crash["data"]["root_rank"] == 1 and crash["data"]["exit_code"] == 0
    assert "Rank 1 exited with code 0" in crash["summary"]
    ranks = ranks_of(s)
    assert ranks[1]["state"] == "crashed"
    assert ranks[0]["state"] == "stuck"           # its "Connection closed by peer" is a consequence
    assert f"job.py:{line_of(job, 'SECOND')}" in ranks[0]["where"]


def test_script_raising_after_then_before_init_in_a_reused_run_dir(distcheck, job):
    """Two runs into the same --run-dir: a rank raises after init_process_group, then (second run)
    before it. The second report must be the second run's alone: no stale traces, logs or status."""
    r = distcheck("run", str(job), "--nproc-per-node", "2", "--stall-timeout", str(STALL), "--", "raise-after")
    assert r.returncode == 1, r.stderr[-2000:]
    after = _only(r)
    crash = crash_of(after)
    assert crash["data"]["root_rank"] == 1 and "RuntimeError: bad batch after init" in crash["summary"]
    assert f"job.py:{line_of(job, 'RAISE-AFTER')}" in crash["summary"]
    assert [x["collectives"] for x in after["ranks"]] == [2, 1]
    assert ranks_of(after)[0]["state"] == "stuck"     # in all_reduce #2; its connection error is a consequence

    r = distcheck("run", str(job), "--nproc-per-node", "2", "--stall-timeout", str(STALL), "--", "raise-before")
    assert r.returncode == 1, r.stderr[-2000:]
    before = _only(r)
    assert before["launch_dir"] == after["launch_dir"]          # the same launch dir, re-used
    crash = crash_of(before)
    assert crash["data"]["root_rank"] == 1 and "RuntimeError: bad config before init" in crash["summary"]
    assert f"job.py:{line_of(job, 'RAISE-BEFORE')}" in crash["summary"]
    assert [x["collectives"] for x in before["ranks"]] == [0, 0]  # nothing of the first run's traces
    assert ranks_of(before)[0]["state"] in ("killed", "running")  # waiting in init_process_group: not blamed
    log = (Path(before["launch_dir"]) / "logs" / "rank1.log").read_text()
    assert "bad config before init" in log and "bad batch after init" not in log


def test_launch_dir_in_use_by_a_live_run_is_refused(tmp_path):
    from distcheck.errors import LaunchError
    from distcheck.files.run_dir import prepare_launch_dir

    launch = tmp_path / "run" / "scenario"
    (launch / "traces").mkdir(parents=True)
    holder = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()", "--launch-dir", str(launch)],
                              stdin=subprocess.PIPE)
    try:
        with pytest.raises(LaunchError, match="in use by running processes"):
            prepare_launch_dir(launch)
    finally:
        holder.kill()
        holder.wait(timeout=10)
    prepare_launch_dir(launch)                       # stale, nobody home: emptied
    assert list(launch.iterdir()) == [] and stat.S_IMODE(launch.stat().st_mode) == 0o700


# -- distcheck itself: SIGTERM, ports, run dirs ----------------------------------------


def test_sigterm_mid_run_and_every_port_listens_on_loopback_only(tmp_path):
    source = tmp_path / "hang.py"
    source.write_text(HANG)
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "distcheck", "run", str(source), "--nproc-per-node", "2", "--backend", "gloo",
         "--stall-timeout", "120", "--run-dir", str(run_dir), "--json", str(tmp_path / "r.json")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True, cwd=tmp_path)
    try:
        statuses = [run_dir / "rank1_sleeps" / "status" / f"rank{r}.json" for r in (0, 1)]
        assert wait_for(lambda: process_groups_initialized(statuses), 120), \
            "ranks never initialized their process group"
        tree = process_tree(proc.pid)
        listening = listening_sockets(tree)
        # the rendezvous store and the workers' store (distcheck), one gloo listener per rank
        assert len(listening) >= 4, listening
        assert all(is_loopback_ip(ip) for _, ip, _ in listening), listening
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        kill_tree(proc)
    assert proc.returncode == 130, err[-2000:]
    assert "Traceback" not in err
    report = json.loads((run_dir / "report.json").read_text())
    assert report["interrupted"] is True
    traces = run_dir / "rank1_sleeps" / "traces"
    assert (traces / "rank0.trace").stat().st_size > 0 and (traces / "rank1.trace").stat().st_size > 0
    assert wait_for(lambda: not survivors(str(run_dir)), 10), survivors(str(run_dir))


def test_rendezvous_port_already_in_use_is_a_clear_error_before_launch(distcheck, tmp_path):
    source = tmp_path / "hang.py"
    source.write_text(HANG)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        started = time.monotonic()
        r = distcheck("run", str(source), "--nproc-per-node", "2", "--rdzv-endpoint", f"127.0.0.1:{port}",
                      json=False, timeout=120)
        took = time.monotonic() - started
    assert r.returncode == 3, r.stderr[-2000:]
    assert f"the rendezvous port 127.0.0.1:{port} is already in use" in r.stderr
    assert "Traceback" not in r.stderr and took < 60
    assert not list(r.run_dir.glob("*/status/rank*.json"))     # no rank started


def test_stores_bind_to_the_address_they_are_given():
    from distcheck.launch.rendezvous import bound_tcp_store

    store = bound_tcp_store("127.0.0.1", 0, timeout_s=10)
    listening = listening_sockets([psutil.Process()])
    assert ("127.0.0.1", store.port) in [(ip, port) for _, ip, port in listening]
    assert not [x for x in listening if x[2] == store.port and not is_loopback_ip(x[1])]


@pytest.mark.parametrize("where, message", [
    ("/proc/distcheck-no-such-dir/run", "cannot write the run directory"),
    ("{tmp}/a-file/run", "Not a directory"),
    ("{tmp}/a-file", "exists and is not a directory"),
])
def test_unwritable_run_dir_is_a_clear_error_before_launch(distcheck, tmp_path, where, message):
    (tmp_path / "a-file").write_text("not a directory\n")
    source = tmp_path / "hang.py"
    source.write_text(HANG)
    target = where.format(tmp=tmp_path)
    r = distcheck("run", str(source), "--nproc-per-node", "2", "--run-dir", target, json=False, timeout=120,
                  env={"PYTHONPROFILEIMPORTTIME": "1"})
    assert r.returncode == 3, r.stderr[-2000:]
    assert message in r.stderr and "--run-dir" in r.stderr and "Traceback" not in r.stderr
    assert not [line for line in r.stderr.splitlines() if line.endswith("| torch")]   # refused before torch loads
    assert not survivors(target)


def test_a_run_dir_with_no_room_is_a_clear_error_before_launch(tmp_path):
    """A full disk, as far as distcheck can tell: writes beyond 16 KiB fail (RLIMIT_FSIZE; EFBIG)."""
    import resource

    def no_room() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (16 * 1024, 16 * 1024))

    run = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "distcheck", "run", "collectives_sanity", "--nproc-per-node", "2",
                           "--run-dir", str(run)], preexec_fn=no_room, capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)
    assert proc.returncode == 3, proc.stderr[-2000:]
    assert "cannot write the run directory" in proc.stderr and "File too large" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not list(run.glob("*/traces")) and not survivors(str(run))


@pytest.mark.parametrize("options, message, hint", [
    ("ro,size=1m", "Read-only file system", "pick a writable place with --run-dir"),
    ("size=32k", "No space left on device", "free some space there"),
])
def test_a_read_only_or_full_file_system_is_a_clear_error_before_launch(tmp_path, options, message, hint):
    """Real file systems: a tmpfs mounted read-only, and one too small for the 64 KiB probe."""
    mount_point = tmp_path / "fs"
    mount_point.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(mount_point)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        run = mount_point / "run"
        proc = subprocess.run([sys.executable, "-m", "distcheck", "run", "collectives_sanity", "--nproc-per-node",
                               "2", "--run-dir", str(run)], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    finally:
        subprocess.run(["umount", str(mount_point)], check=True)
    assert proc.returncode == 3, proc.stderr[-2000:]
    assert f"cannot write the run directory {run}: {message}" in proc.stderr and hint in proc.stderr
    assert "Traceback" not in proc.stderr and not survivors(str(run))


# -- bad command lines (the ones test_run_e2e.py does not have) ------------------------


def test_scenario_file_without_scenario_next_to_others_and_conflicting_flags(distcheck, tmp_path):
    plain = tmp_path / "plain.py"
    plain.write_text("x = 1\n")
    source = tmp_path / "hang.py"
    source.write_text(HANG)
    cases = [
        (["run", str(source), str(plain)], f"{plain} has no @scenario function"),
        (["run", "-m", "json.tool", str(source)], "give either -m MODULE or targets, not both"),
        (["run", str(source), str(plain), "--", "--lr", "0.1"], "arguments after '--' are for a script"),
        (["run", str(source), "--nproc-per-node", "-3"], "--nproc-per-node must be at least 1"),
    ]
    for args, message in cases:
        r = distcheck(*args, json=False, timeout=120)
        assert r.returncode == 2, (args, r.stderr[-2000:])
        assert message in r.stderr and "Traceback" not in r.stderr, (args, r.stderr[-2000:])
        assert not list(r.run_dir.glob("*/status")), args            # refused before launch
