"""distcheck under a real two-node Slurm (tests/slurm_cluster.py: slurmctld and slurmd n1, n2 on this host), as
cluster users run it: srun starting every rank, one distcheck per node with no flags, the batch step, and every
ending Slurm causes (scancel, the time limit). Each test has a hard timeout and leaves no process and no job."""

from __future__ import annotations

import datetime
import json
import random
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from conftest import REPO, bindable, kill_tree, process_groups_initialized, wait_for
from distcheck.launch.slurm import OWN_STOP
from slurm_cluster import KILL_WAIT_S, SlurmCluster, SlurmUnavailable

pytestmark = [pytest.mark.e2e, pytest.mark.slurm]

SCRIPTS = REPO / "tests" / "scripts" / "slurm"
JOB = SCRIPTS / "job.py"
DISTCHECK = [sys.executable, "-m", "distcheck", "run"]
HARD_TIMEOUT_S = 180
TIME_LIMIT_S = 60            # srun/sbatch --time=1: Slurm's granularity is minutes
BARRIER_LINE = next(i for i, line in enumerate(JOB.read_text().splitlines(), 1) if "# BARRIER" in line)


def _three_free_ports() -> int:
    """slurmctld's port and the two slurmds' after it, free now, below the ephemeral range."""
    draw = random.SystemRandom()
    for _ in range(200):
        base = draw.randrange(33000 - 6000, 32000)   # above the range Slurm jobs' endpoints take (20000-31999)
        if all(bindable(base + i) for i in range(3)):
            return base
    raise SlurmUnavailable("no three free ports in a row for slurmctld and the two slurmd")


@pytest.fixture(scope="session")
def slurm(tmp_path_factory) -> SlurmCluster:
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"), _three_free_ports())
    try:
        cluster.start()
    except SlurmUnavailable as exc:
        pytest.skip(f"no Slurm to test under: {exc}")
    yield cluster
    left = not wait_for(lambda: not cluster.jobs(), timeout=30, poll=0.5)   # every test's job ended: squeue is empty
    jobs = cluster.jobs()
    cluster.stop()
    assert not left, f"jobs left in the queue: {jobs}"


class Job:
    """One command started beside the test Slurm (srun, sbatch, or distcheck wrapping srun), in its own folder."""

    def __init__(self, slurm: SlurmCluster, folder: Path, argv: list[str], env: dict | None = None) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.slurm, self.folder = slurm, folder
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=folder,
                                     start_new_session=True,
                                     env={**slurm.env, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1",
                                          # each job's runs in its own folder, where its tests look for them
                                          "DISTCHECK_RUNS_DIR": str(folder / "runs"), **(env or {})})
        self.output = ""

    def finish(self, timeout: float = HARD_TIMEOUT_S) -> int:
        try:
            self.output, _ = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_tree(self.proc)
            self.output, _ = self.proc.communicate()
            pytest.fail(f"no end within {timeout} s: {self.output[-3000:]}")
        finally:
            self.cleanup()
        return self.proc.returncode

    def cleanup(self) -> None:
        """No process left that ran in this job's folder, and no job of ours left in the queue."""
        if self.proc.poll() is None:
            kill_tree(self.proc)
        assert wait_for(lambda: not self.left(), timeout=30), [p.info["cmdline"] for p in self.left()]

    def left(self) -> list[psutil.Process]:
        return _left_in(self.folder)

    def ranks_initialized(self, count: int) -> bool:
        files = list(self.folder.rglob("status/rank*.json"))
        return len(files) >= count and process_groups_initialized(files)

    def job_id(self) -> str | None:
        ids = [line.split()[0] for line in self.slurm.command("squeue", "-h", "-o", "%i %Z").stdout.splitlines()
               if line.split()[1:] == [str(self.folder)]]
        return ids[0] if ids else None

    def reports(self) -> list[dict]:
        """Every report.json written in the job's folder (the per-node pattern: one per node's run dir)."""
        return [json.loads(path.read_text()) for path in sorted(self.folder.rglob("report.json"))]


def _per_node(job_args: list[str], *srun: str) -> list[str]:
    """The per-node pattern with no multi-node flags: srun starts one distcheck per node."""
    return ["srun", "-N", "2", "--ntasks-per-node=1", *srun, *DISTCHECK, str(JOB), "--nproc-per-node", "2",
            "--stall-timeout", "600", "--", *job_args]


def _the_hang(report: dict) -> str:
    hangs = [f["summary"] for s in report["scenarios"] for f in s["findings"] if f["kind"] == "hang"]
    assert hangs, report
    return hangs[0]


# -- every ending Slurm causes: the five slow jobs start together, their tests read them as they end --

@pytest.fixture(scope="module")
def endings(slurm, tmp_path_factory) -> dict[str, Job]:
    root = tmp_path_factory.mktemp("endings")
    jobs = {
        # the per-node pattern, stuck in a barrier until Slurm's time limit
        "per_node_time_limit": Job(slurm, root / "pn_tl", _per_node(["stuck"], "--time=1")),
        # the batch step wrapping srun, stuck until the time limit
        "batch_time_limit": Job(slurm, root / "batch_tl", [
            "sbatch", "-W", "-N", "1", "-n", "2", "--time=1", "-o", str(root / "batch_tl" / "out.txt"), "--wrap",
            " ".join([*DISTCHECK, "--json", "report.json", "--stall-timeout", "600", "--", "srun", "-n", "2",
                      sys.executable, str(JOB), "stuck"])], env=_master()),
        "per_node_scancel": Job(slurm, root / "pn_cancel", _per_node(["stuck"])),
        # distcheck outside the job: srun makes the job, scancel ends it; distcheck gets no signal
        "wrapped_scancel": Job(slurm, root / "wrapped_cancel", _wrapped_srun(), env=_master()),
        # the same, ended by srun's own --time: only srun's output says it was the time limit
        "wrapped_time_limit": Job(slurm, root / "wrapped_tl", _wrapped_srun("--time=1"), env=_master()),
    }
    yield jobs
    for job in jobs.values():
        job.cleanup()


def _wrapped_srun(*srun: str) -> list[str]:
    return [*DISTCHECK, "--json", "report.json", "--stall-timeout", "600", "--", "srun", "-N", "1", "-n", "2", *srun,
            sys.executable, str(JOB), "stuck"]


def _cancel_once_started(job: Job, ranks: int) -> None:
    assert wait_for(lambda: job.ranks_initialized(ranks) or job.proc.poll() is not None, timeout=120)
    job_id = job.job_id()
    assert job_id, job.proc.poll()
    assert job.slurm.command("scancel", job_id).returncode == 0


def test_scancel_in_the_per_node_pattern_is_told_with_a_report_on_both_nodes(endings):
    job = endings["per_node_scancel"]
    _cancel_once_started(job, 4)
    assert job.finish() == 130, job.output[-3000:]
    reports = job.reports()
    assert len(reports) == 2 and all(r["end_reason"] == "slurm_cancelled" for r in reports), job.output
    assert f"job.py:{BARRIER_LINE}" in _the_hang(reports[0])
    assert "interrupted: cancelled by Slurm" in " ".join(job.output.split())


def test_scancel_of_a_wrapped_srun_is_an_interruption_not_a_crash(endings):
    job = endings["wrapped_scancel"]
    _cancel_once_started(job, 2)
    assert job.finish() == 130, job.output[-3000:]
    _interrupted_not_crashed(job, "slurm_cancelled")


def _interrupted_not_crashed(job: Job, end_reason: str) -> None:
    report = json.loads((job.folder / "report.json").read_text())
    assert report["end_reason"] == end_reason, job.output[-3000:]
    assert not [f for s in report["scenarios"] for f in s["findings"] if f["kind"] == "crash"], job.output[-3000:]
    assert "CRASH" not in job.output
    assert f"job.py:{BARRIER_LINE}" in _the_hang(report)


# -- the patterns --

@pytest.mark.parametrize("mode, code", [("healthy", 0), ("hang", 1)])
def test_srun_started_ranks(slurm, tmp_path, mode, code):
    job = Job(slurm, tmp_path, [*DISTCHECK, "--json", "report.json", "--stall-timeout", "5", "--", "srun", "-N", "1",
                                "-n", "3", sys.executable, str(JOB), mode],
              env=_master())
    assert job.finish() == code, job.output[-3000:]
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["scenarios"][0]["ranks"] and len(report["scenarios"][0]["ranks"]) == 3
    if mode == "hang":
        assert f"job.py:{BARRIER_LINE}" in _the_hang(report)


def test_a_sigterm_handler_that_issues_a_collective_as_slurm_ends_the_step_changes_nothing(slurm, tmp_path):
    """distcheck wraps srun: the ranks get their SIGTERM from Slurm (srun forwards it as distcheck ends the step), and
    rank 0's handler issues a broadcast then; the verdict decided before stands (tests/test_teardown_e2e.py)."""
    from test_teardown_e2e import SCRIPT as TEARDOWN, assert_the_teardown_changed_nothing

    job = Job(slurm, tmp_path, [*DISTCHECK, "--json", "report.json", "--stall-timeout", "3", "--", "srun", "-N", "1",
                                "-n", "2", sys.executable, str(TEARDOWN)], env=_master())
    assert job.finish() == 1, job.output[-3000:]
    assert_the_teardown_changed_nothing(json.loads((tmp_path / "report.json").read_text()), job.output)


def test_the_per_node_pattern_names_a_hang_with_no_flags(slurm, tmp_path):
    job = Job(slurm, tmp_path, ["srun", "-N", "2", "--ntasks-per-node=1", *DISTCHECK, str(JOB), "--nproc-per-node",
                                "2", "--stall-timeout", "5", "--", "hang"])
    assert job.finish() == 1, job.output[-3000:]
    reports = job.reports()
    assert len(reports) == 2
    for report in reports:
        assert (report["run"]["nnodes"], report["run"]["world_size"]) == (2, 4)
        assert f"job.py:{BARRIER_LINE}" in _the_hang(report)
        assert report["run"]["slurm"]["step"].endswith(".0")


def test_two_jobs_sharing_a_first_node_both_run(slurm, tmp_path):
    """Each job's endpoint port comes from its id; the second gives --nnodes alone (half the flags): its node
    rank still comes from SLURM_NODEID."""
    half_given = [[], ["--nnodes", "2"]]
    jobs = [Job(slurm, tmp_path / f"job{i}", ["srun", "-N", "2", "--ntasks-per-node=1", *DISTCHECK, str(JOB),
                                              "--nproc-per-node", "1", *half_given[i], "--", "healthy"])
            for i in range(2)]
    codes = [job.finish() for job in jobs]
    assert codes == [0, 0], [job.output[-2000:] for job in jobs]
    ids = {r["run"]["slurm"]["job_id"] for job in jobs for r in job.reports()}
    assert len(ids) == 2


@pytest.mark.parametrize("exported", [{}, {"MASTER_ADDR": "127.0.0.1"}])
def test_a_multi_node_batch_step_is_refused_with_the_per_node_command(slurm, tmp_path, exported):
    out = tmp_path / "out.txt"
    wrap = " ".join([*DISTCHECK, "--", "srun", sys.executable, str(JOB), "healthy"])
    job = Job(slurm, tmp_path, ["sbatch", "-W", "-N", "2", "-o", str(out), "--wrap", wrap], env=exported)
    assert job.finish() == 2, out.read_text()   # sbatch -W exits with the job's code: distcheck's usage error
    text = out.read_text()
    assert "batch step" in text and "srun -N 2 --ntasks-per-node=1 distcheck run" in text, text
    assert "Traceback" not in text and len([line for line in text.splitlines() if line.strip()]) <= 3, text


def test_lightning_under_slurm_is_never_requeued_and_its_hang_is_named(slurm, tmp_path):
    """Lightning DDP under SLURMEnvironment (auto-requeue on SIGUSR1) with rank 0 stuck in a barrier."""
    pytest.importorskip("lightning")
    out = tmp_path / "out.txt"
    wrap = " ".join([*DISTCHECK, "--json", "report.json", "--stall-timeout", "5", "--", "srun",
                     sys.executable, str(SCRIPTS / "lit_stuck.py")])
    # Lightning refuses --ntasks (it wants --ntasks-per-node); its main address is the first node's name, which
    # only this test's Slurm cannot resolve (n1 is 127.0.0.1): MASTER_ADDR/PORT, which Lightning reads first.
    master = ",".join(f"{k}={v}" for k, v in _master().items())
    submitted = slurm.command("sbatch", "--parsable", "-N", "1", "--ntasks-per-node=2", "--requeue", "-D",
                              str(tmp_path), "-o", str(out), "--export", f"ALL,PYTHONPATH={REPO},{master}",
                              "--wrap", wrap)
    job_id = submitted.stdout.strip().split(";")[0]
    assert job_id, submitted.stderr
    try:
        assert wait_for(lambda: not _running(slurm, job_id) or slurm.job_field(job_id, "Restarts") != "0",
                        timeout=HARD_TIMEOUT_S, poll=0.5)
        assert slurm.job_field(job_id, "Restarts") == "0", out.read_text()[-3000:]
        assert not list(tmp_path.rglob("hpc_ckpt_*.ckpt"))
        report = json.loads((tmp_path / "report.json").read_text())
        line = next(i for i, t in enumerate((SCRIPTS / "lit_stuck.py").read_text().splitlines(), 1) if "# STUCK" in t)
        assert f"lit_stuck.py:{line}" in _the_hang(report)
    finally:
        slurm.command("scancel", job_id)
        assert wait_for(lambda: not _left_in(tmp_path), timeout=30)


# -- the time limits started with the endings above: read last, so the tests between run while they tick --

def test_the_time_limit_in_the_per_node_pattern_leaves_a_report_naming_the_stuck_barrier(endings):
    job = endings["per_node_time_limit"]
    started = time.monotonic()
    assert job.finish(timeout=TIME_LIMIT_S + 120) == 130, job.output[-3000:]
    reports = job.reports()
    assert len(reports) == 2, job.output[-3000:]   # one on each node: Slurm's second SIGTERM is the same request
    for report in reports:
        assert report["end_reason"] == "slurm_time_limit" and report["run"]["slurm"]["nodelist"] == "n[1-2]"
        assert f"job.py:{BARRIER_LINE}" in _the_hang(report) and "barrier" in _the_hang(report)
    said = " ".join(job.output.split())   # srun's output is no terminal: rich wraps it at 80 columns
    assert "interrupted: Slurm time limit" in said and "stopped at once" not in said
    # distcheck stopped itself ahead of the limit (its own request, not Slurm's SIGTERM) ...
    assert f"interrupted: {OWN_STOP}" in said, job.output[-3000:]
    # ... and node 0's report was on disk before Slurm's SIGKILL could come (KillWait after its end time)
    ends = datetime.datetime.fromisoformat(reports[0]["run"]["slurm"]["ends_at"]).timestamp()
    written = max(path.stat().st_mtime for path in job.folder.rglob("report.json"))
    print(f"the per-node time limit: the last report was written {ends - written:.1f} s before the job's end time")
    assert written < ends + KILL_WAIT_S, (written, ends)
    assert time.monotonic() - started < TIME_LIMIT_S + 60


def test_the_time_limit_of_a_batch_step_wrapping_srun_is_told_as_such(endings):
    job = endings["batch_time_limit"]
    assert job.finish(timeout=TIME_LIMIT_S + 120) != 0
    out = " ".join((job.folder / "out.txt").read_text().split())   # the batch step's terminal wraps at 80
    report = json.loads((job.folder / "report.json").read_text())
    assert report["end_reason"] == "slurm_time_limit", out[-3000:]
    assert report["run"]["slurm"]["step"].endswith(".batch")
    assert f"job.py:{BARRIER_LINE}" in _the_hang(report)
    assert "interrupted: Slurm time limit" in out and "CRASH" not in out


def test_the_time_limit_of_a_wrapped_srun_is_an_interruption_not_a_crash(endings):
    job = endings["wrapped_time_limit"]
    assert job.finish(timeout=TIME_LIMIT_S + 120) == 130, job.output[-3000:]
    _interrupted_not_crashed(job, "slurm_time_limit")


def _left_in(folder: Path) -> list[psutil.Process]:
    """Live processes working in this folder (distcheck, srun, the ranks: srun passes its cwd on)."""
    return [p for p in psutil.process_iter(["pid", "cwd", "cmdline", "status"])
            if p.info["cwd"] and p.info["cwd"].startswith(str(folder)) and p.info["status"] != psutil.STATUS_ZOMBIE]


def _running(slurm: SlurmCluster, job_id: str) -> bool:
    return slurm.job_field(job_id, "JobState") in ("RUNNING", "PENDING", "COMPLETING", "REQUEUED")


def _master() -> dict[str, str]:
    """What a batch script exports for ranks srun starts itself (the script reads SLURM_PROCID/SLURM_NTASKS)."""
    from conftest import free_port

    return {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
