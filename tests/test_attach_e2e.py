"""``distcheck attach`` on plain torchrun jobs distcheck did not launch: real gloo ranks, real torchmetrics
and DDP, read from outside with py-spy. Each job runs in a session of its own and is killed whole at the
end; nothing it started may survive."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import psutil
import pytest

from conftest import free_port, kill_tree, run_distcheck, survivors, wait_for
from distcheck.attach.discover import read_environ

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240),
              pytest.mark.skipif(shutil.which("py-spy") is None, reason="needs py-spy (distcheck[attach])")]

JOB = Path(__file__).parent / "scripts" / "attach" / "job.py"
SYNC_JOB = JOB.parent / "device_sync.py"      # on emulated_nccl: rank 0 blocked in a device sync
READY_S = 120          # torch imports slowly on a loaded machine
ATTACH_S = 30          # issue 43: a verdict within 30 s


def line_of(marker: str, script: Path = JOB) -> str:
    """``job.py:N``: the line of the job script that carries ``marker`` (its comment)."""
    [n] = [i for i, text in enumerate(script.read_text().splitlines(), 1) if marker in text]
    return f"{script.name}:{n}"


def _torchrun(mode: str, folder: Path, nproc: int, extra: tuple[str, ...] = (), env: dict | None = None,
              launch: tuple[str, ...] = ("--standalone",), prefix: tuple[str, ...] = (),
              script: Path = JOB) -> subprocess.Popen:
    """torchrun (``prefix``: the command it runs under, another user's), its rendezvous as ``launch`` says; a
    ``script`` other than job.py takes the folder alone (no mode)."""
    args = [mode, str(folder)] if script == JOB else [str(folder)]
    return subprocess.Popen([*prefix, sys.executable, "-m", "torch.distributed.run", *launch, "--nproc-per-node",
                             str(nproc), str(script), *args, *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env={**os.environ, **(env or {})})


def rank_pids(folder: Path, nproc: int) -> list[int]:
    """The ranks' pids, rank by rank, as each wrote it in its ready file."""
    return [int((folder / f"ready{r}").read_text()) for r in range(nproc)]


def kill_ranks(folder: Path) -> None:
    """SIGKILL every rank that wrote a ready file in ``folder`` (and still runs the job script on it): a rank lives
    in a session of its own, so killing torchrun's process group leaves it, and so does a SIGKILLed torchrun."""
    for ready in folder.glob("ready*"):
        try:
            proc = psutil.Process(int(ready.read_text()))
            if str(folder) in " ".join(proc.cmdline()):
                proc.kill()
        except (ValueError, OSError, psutil.Error):
            continue


@contextmanager
def jobs(*specs: tuple[str, Path, int, dict]):
    """torchrun jobs, all started at once, whose ranks all stand where their modes want them; each a (mode,
    folder, nproc, keywords for ``_torchrun``). Killed whole afterwards, ranks included."""
    for _, folder, _, _ in specs:
        folder.mkdir(parents=True, exist_ok=True)
    procs = [_torchrun(mode, folder, nproc, **kw) for mode, folder, nproc, kw in specs]
    try:
        every = [(folder, nproc) for _, folder, nproc, _ in specs]
        ready = wait_for(lambda: all((f / f"ready{r}").exists() for f, n in every for r in range(n))
                         or any(p.poll() is not None for p in procs), timeout=READY_S)
        assert ready and all(p.poll() is None for p in procs), f"a job did not get ready: {[p.poll() for p in procs]}"
        yield procs
    finally:
        for proc, (_, folder, _, _) in zip(procs, specs):
            (folder / "release").touch()
            kill_tree(proc)
            kill_ranks(folder)
            proc.communicate(timeout=30)
            assert wait_for(lambda: not survivors(str(folder)), timeout=15), "the job's processes survived"


@contextmanager
def job(mode: str, folder: Path, nproc: int = 3, *extra: str, env: dict | None = None, **launch):
    """A torchrun job whose ranks all stand where the mode wants them; killed whole afterwards."""
    with jobs((mode, folder, nproc, {"extra": extra, "env": env, **launch})) as procs:
        yield procs[0]


def attach(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / "attach.json"
    started = time.monotonic()
    done = run_distcheck(["attach", *args, "--json", str(out), "--run-dir", str(tmp_path / "run")], tmp_path,
                         tmp_path / "run", timeout=ATTACH_S + 30)
    took = time.monotonic() - started
    assert took < ATTACH_S, f"attach took {took:.1f} s"
    assert out.exists(), done.stdout[-3000:] + done.stderr[-3000:]
    return done, json.loads(out.read_text())["scenarios"][0]


def report_of(tmp_path: Path) -> dict:
    return json.loads((tmp_path / "attach.json").read_text())


def table_states(out: str) -> dict[int, str]:
    """The rank table's state column, rank by rank, as the terminal shows it."""
    return {int(m[1]): m[2] for m in re.finditer(r"^\s+(\d+)\s+(\w+)\s+\d+\s", out, re.MULTILINE)}


def _hang(s: dict) -> dict:
    [hang] = [f for f in s["findings"] if f["kind"] == "hang"]
    return hang


def _hang_with_dumps(tmp_path: Path, mode: str, nproc: int) -> tuple[dict, dict]:
    """Attach to a hung job whose ranks dump their Flight Recorder (as TORCH_FR_DUMP_TEMP_FILE asks): the
    report's scenario and its one hang (attach exits 1)."""
    folder = tmp_path / "job"
    env = {"TORCH_FR_BUFFER_SIZE": "200", "TORCH_FR_DUMP_TEMP_FILE": str(folder / "fr_")}
    with job(mode, folder, nproc, env=env) as proc:
        done, s = attach(tmp_path, str(proc.pid))
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-2000:]
    return s, _hang(s)


def test_rank0_in_all_reduce_others_in_user_code_is_a_hang(tmp_path):
    with job("allreduce", tmp_path / "job") as proc:
        done, s = attach(tmp_path, str(proc.pid))
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-2000:]
    hang = _hang(s)
    assert hang["waiting_ranks"] == [0] and hang["absent_ranks"] == [1, 2] and hang["op"] == "all_reduce"
    assert line_of("waits for ranks that never come") in hang["callsite"]
    assert line_of("the user's line the hang report names") in hang["summary"]   # both lines
    assert "Decided: certain from outside" in hang["summary"]
    assert s["end_reason"] == "attached" and "all_reduce" in done.stdout
    # the table's state of the absent ranks is the word the text says of them, and the text says no other
    states = table_states(done.stdout)
    assert states[1] == states[2] == "running" and "running outside any collective" in hang["summary"]
    assert not re.search(r"\bidle\b", hang["summary"] + done.stdout)
    # the backend, as the ranks' threads name it
    assert report_of(tmp_path)["run"]["backend"] == "gloo" and "gloo × 3 ranks" in done.stdout
    again = subprocess.run([sys.executable, "-m", "distcheck", "report", str(tmp_path / "run")],
                           capture_output=True, text=True, timeout=60)
    assert again.returncode == 1 and hang["summary"][:60] in again.stdout.replace("\n", " ")


def test_rank0_only_auroc_compute_is_named_with_its_collective_and_line(tmp_path):
    with job("auroc", tmp_path / "job") as proc:
        done, s = attach(tmp_path, str(proc.pid))
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-2000:]
    hang = _hang(s)
    assert hang["op"] == "barrier" and hang["label"] == "BinaryAUROC.compute"
    assert hang["callsite"].endswith(line_of("only rank 0 computes") + ":main") and hang["absent_ranks"] == [1, 2]
    assert "BinaryAUROC.compute" in hang["summary"]


def test_ddp_hung_in_the_reducers_all_reduce(tmp_path):
    with job("ddp", tmp_path / "job", 2) as proc:
        done, s = attach(tmp_path, str(proc.pid))
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-2000:]
    hang = _hang(s)
    assert hang["waiting_ranks"] == [0] and hang["absent_ranks"] == [1] and hang["op"] == "all_reduce"
    assert line_of("the reducer's all_reduce waits") in hang["callsite"]
    [rank0] = [r for r in s["ranks"] if r["rank"] == 0]
    assert "Reducer" in rank0["stack"]            # the native frame the verdict rests on


def test_a_rank_busy_in_user_code_is_late_not_stuck(tmp_path):
    with job("busy", tmp_path / "job", 2) as proc:
        done, s = attach(tmp_path, str(proc.pid))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert not [f for f in s["findings"] if f["severity"] == "error"]
    [late] = [f for f in s["findings"] if f["kind"] == "straggler"]
    assert late["waiting_ranks"] == [0] and "late, not hung" in late["summary"]
    busy = int(line_of("computing in Python").split(":")[1])
    assert re.search(rf"job\.py:({busy}|{busy + 1}|{busy + 2})", late["summary"])   # where: busy_until's loop
    assert "cores" in late["summary"] or "running in" in late["summary"]            # and why (CPU, or running)


def test_a_healthy_job_attached_mid_run_ends_exactly_as_unattached(tmp_path):
    alone = _torchrun("healthy", tmp_path / "alone", 2, ("--steps", "120"))
    (tmp_path / "alone").mkdir()
    try:
        alone_out, _ = alone.communicate(timeout=180)
    finally:
        kill_tree(alone)
    with job("healthy", tmp_path / "job", 2, "--steps", "120") as proc:
        done, s = attach(tmp_path, str(proc.pid))
        out, _ = proc.communicate(timeout=180)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert not [f for f in s["findings"] if f["severity"] in ("error", "warning")]
    assert proc.returncode == alone.returncode == 0
    # what each rank printed, however the two ranks' writes to the job's one stdout interleave (and torchrun's blank lines)
    lines = lambda text: sorted(re.findall(r"rank \d+ total \d+", text))   # noqa: E731
    assert lines(out) == lines(alone_out) == ["rank 0 total 240", "rank 1 total 240"]
    assert not re.sub(r"rank \d+ total \d+", "", out).strip() and not re.sub(r"rank \d+ total \d+", "", alone_out).strip()


def _node_agent(n: int, port: int, folder: Path) -> subprocess.Popen:
    """One of two torchrun agents on this machine: node ``n`` of 2 (ranks 2n, 2n+1), static rendezvous."""
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(n),
                             "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", str(port),
                             str(JOB), "allreduce", str(folder)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


@contextmanager
def two_node_job(folder: Path):
    """A 4-rank job on two torchrun "nodes": rank 0 waits in an all_reduce on node 0, ranks 1-3 poll."""
    folder.mkdir(parents=True, exist_ok=True)
    port = free_port()
    agents = [_node_agent(n, port, folder) for n in (0, 1)]
    try:
        ready = wait_for(lambda: all((folder / f"ready{r}").exists() for r in range(4))
                         or any(a.poll() is not None for a in agents), timeout=READY_S)
        assert ready and all(a.poll() is None for a in agents), "the two-node job did not get ready"
        yield agents
    finally:
        (folder / "release").touch()
        for a in agents:
            kill_tree(a)
            a.communicate(timeout=30)
        assert wait_for(lambda: not survivors(str(folder)), timeout=15), "the job's processes survived"


def _attach_node(n: int, agent: subprocess.Popen, port: int, tmp_path: Path, *extra: str) -> subprocess.Popen:
    args = [sys.executable, "-m", "distcheck", "attach", str(agent.pid), "--nnodes", "2", "--node-rank", str(n),
            "--rdzv-endpoint", f"127.0.0.1:{port}", "--json", str(tmp_path / f"attach{n}.json"),
            "--run-dir", str(tmp_path / f"run{n}"), *extra]
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            cwd=tmp_path)


def _attach_alone(agent: subprocess.Popen, tmp_path: Path) -> subprocess.Popen:
    """One agent's pid, without --nnodes: attach reads every rank of its job on this machine."""
    args = [sys.executable, "-m", "distcheck", "attach", str(agent.pid), "--json", str(tmp_path / "alone1.json"),
            "--run-dir", str(tmp_path / "run_alone1")]
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            cwd=tmp_path)


def assert_not_decided(out: str, s: dict) -> None:
    """Ranks were not read and nothing was found among the others: "NOT DECIDED" first, never a pass."""
    assert out.lstrip().startswith("NOT DECIDED"), out[:2000]
    assert not re.search(r"\bPASS\b", out) and not s["ok"] and s["observed"] == ["coverage"]
    assert s["findings"][0]["summary"].startswith("Not decided: ")


def _finished(procs: list[subprocess.Popen], timeout: float) -> list[tuple[int, str, str]]:
    try:
        outs = [p.communicate(timeout=timeout) for p in procs]
        return [(p.returncode, *o) for p, o in zip(procs, outs)]
    finally:
        for p in procs:
            kill_tree(p)


@pytest.mark.multinode   # two attach nodes meeting through node 0's store: the multinode lane
def test_two_nodes_node0_judges_the_whole_job_and_names_a_node_that_never_joins(tmp_path):
    with two_node_job(tmp_path / "job") as agents:
        # node 1's attach never comes: node 0 says which node and which ranks it could not read, and no pass
        [(rc, out, err)] = _finished([_attach_node(0, agents[0], free_port(), tmp_path, "--rdzv-timeout", "3")],
                                     ATTACH_S + 30)
        alone = json.loads((tmp_path / "attach0.json").read_text())["scenarios"][0]
        # node 1's agent given alone, without --nnodes: every rank of the job on this machine is read, node 0's too
        [(rc1_alone, out1_alone, _)] = _finished([_attach_alone(agents[1], tmp_path)], ATTACH_S + 30)
        started = time.monotonic()
        port = free_port()
        procs = [_attach_node(n, agents[n], port, tmp_path) for n in (0, 1)]
        (rc0, out0, err0), (rc1, out1, err1) = _finished(procs, ATTACH_S + 30)
        took = time.monotonic() - started
    assert rc == 3, out[-3000:] + err[-2000:]
    assert "ranks 2, 3 were not read (node(s) 1 never joined)" in err
    assert not [f for f in alone["findings"] if f["kind"] == "hang"]            # not decided: no false hang
    [note] = [f for f in alone["findings"] if f["kind"] == "coverage"]
    assert note["data"]["unread_ranks"] == [2, 3] and note["waiting_ranks"] == [0]
    assert_not_decided(out, alone)
    assert rc1_alone == 1, out1_alone[-3000:]
    s1 = json.loads((tmp_path / "alone1.json").read_text())["scenarios"][0]
    assert sorted(r["rank"] for r in s1["ranks"]) == [0, 1, 2, 3] and _hang(s1)["absent_ranks"] == [1, 2, 3]
    assert rc0 == 1, out0[-3000:] + err0[-2000:]
    assert rc1 == 1 and "node 0 judged the job" in out1, out1[-2000:] + err1[-2000:]
    assert took < ATTACH_S, f"the two attaches took {took:.1f} s"
    s = json.loads((tmp_path / "attach0.json").read_text())["scenarios"][0]
    hang = _hang(s)
    assert hang["waiting_ranks"] == [0] and hang["absent_ranks"] == [1, 2, 3] and hang["op"] == "all_reduce"
    nodes = {r["rank"]: r["node"] for r in s["ranks"]}
    assert nodes == {0: 0, 1: 0, 2: 1, 3: 1}                  # the waiting rank on node 0, absent ones on node 1
    assert line_of("waits for ranks that never come") in hang["callsite"]
    assert line_of("the user's line the hang report names") in hang["summary"]   # both lines
    assert not (tmp_path / "attach1.json").exists()           # node 0 alone writes the report


def test_flight_recorder_dumps_are_joined_by_sequence_number(tmp_path):
    """Rank 0 waits on an async all_reduce (#6) its Python stack does not show; every rank's dump is on disk."""
    s, hang = _hang_with_dumps(tmp_path, "frdump", 3)
    assert hang["waiting_ranks"] == [0] and hang["absent_ranks"] == [1, 2] and hang["op"] == "all_reduce"
    assert hang["seq"] == 6 and "all_reduce #6" in hang["summary"]
    assert line_of("waits in all_reduce #6") in hang["callsite"]
    assert line_of("the user's line the hang report names") in hang["summary"]
    assert "Flight Recorder dumps of every rank, joined by sequence number" in hang["summary"]   # what it rests on
    assert "joined by sequence number" in s["description"]


def test_ddp_hung_in_the_reducer_with_dumps_is_named_by_number_without_a_native_read(tmp_path):
    """The Flight Recorder says which call the reducer has in flight: no rank is stopped for a native read."""
    s, hang = _hang_with_dumps(tmp_path, "ddp", 2)
    assert hang["waiting_ranks"] == [0] and hang["absent_ranks"] == [1] and hang["op"] == "all_reduce"
    assert hang["seq"] and f"all_reduce #{hang['seq']}" in hang["summary"]
    assert line_of("the reducer's all_reduce waits") in hang["callsite"]
    assert "joined by sequence number" in hang["summary"] and "native frames" not in s["description"]


def _c10d_without_id() -> dict:
    """torchrun --rdzv-backend c10d without --rdzv-id: its ranks' TORCHELASTIC_RUN_ID is "none", as every such job's."""
    return {"launch": ("--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--nnodes", "1")}


def _listed_jobs(err: str) -> list[set[int]]:
    """The pids of each job a "several jobs" error lists."""
    return [set(map(int, re.findall(r"\d+", pids))) for pids in re.findall(r"ranks \(pids ([\d, .]+)\)", err)]


def test_two_jobs_with_torchrun_s_default_run_id_are_two_jobs(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    with jobs(("allreduce", a, 2, _c10d_without_id()), ("allreduce", b, 2, _c10d_without_id())):
        pids = {"a": rank_pids(a, 2), "b": rank_pids(b, 2)}
        envs = [read_environ(p) for p in pids["a"] + pids["b"]]
        listed = run_distcheck(["attach"], tmp_path, tmp_path / "listed", timeout=ATTACH_S + 30)
        done, s = attach(tmp_path, str(pids["a"][1]))   # one rank's pid: its own job, whole, and no other
    assert {e["TORCHELASTIC_RUN_ID"] for e in envs} == {"none"}
    # with no pid: several jobs on the node (this machine may run others too), listed apart, exit 2
    assert listed.returncode == 2 and "torch.distributed jobs on this node" in listed.stderr, listed.stderr[-2000:]
    assert set(pids["a"]) in _listed_jobs(listed.stderr) and set(pids["b"]) in _listed_jobs(listed.stderr)
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-2000:]
    assert sorted(r["pid"] for r in s["ranks"]) == sorted(pids["a"]) and _hang(s)["absent_ranks"] == [1]


def test_a_job_whose_torchrun_was_sigkilled_is_found_whole_from_one_rank_s_pid(tmp_path):
    folder = tmp_path / "job"
    with job("barrier", folder) as proc:
        pids = rank_pids(folder, 3)
        proc.kill()                       # SIGKILL: torchrun ends, its ranks (each in a session of its own) run on
        proc.wait(timeout=30)
        assert wait_for(lambda: all(psutil.Process(p).ppid() != proc.pid for p in pids), timeout=10)
        done, s = attach(tmp_path, str(pids[2]))    # an absent rank's pid, polling in user code
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-2000:]
    assert sorted(r["pid"] for r in s["ranks"]) == sorted(pids)
    hang = _hang(s)
    assert hang["op"] == "barrier" and hang["waiting_ranks"] == [0] and hang["absent_ranks"] == [1, 2]
    assert line_of("only rank 0 enters the barrier") in hang["callsite"] and "Decided:" in hang["summary"]
    assert "not read" not in done.stdout + done.stderr and "gloo × 3 ranks" in done.stdout


def _venv_with_py_spy(where: Path) -> Path:
    """A venv seeing this interpreter's packages (distcheck among them), with py-spy in its bin and a ``distcheck``
    script as pip writes one; its bin is then called by path, never put on PATH."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", "--system-site-packages", str(where)], check=True,
                   timeout=120)
    # what this interpreter imports (distcheck, torch), also where it runs from a venv of its own
    site = where / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}" / "site-packages"
    (site / "outer.pth").write_text("\n".join(p for p in sys.path if p and Path(p).is_dir()) + "\n")
    shutil.copy2(Path(sys.executable).parent / "py-spy", where / "bin" / "py-spy")
    script = where / "bin" / "distcheck"
    script.write_text(f"#!{where / 'bin' / 'python'}\nimport sys\nfrom distcheck.cli import main\n"
                      "if __name__ == '__main__':\n    sys.exit(main())\n")
    script.chmod(0o755)
    return script


@pytest.mark.skipif(not (Path(sys.executable).parent / "py-spy").is_file(), reason="py-spy is not beside python")
def test_installed_in_a_venv_called_by_path_it_finds_py_spy_beside_its_interpreter(tmp_path):
    distcheck_in_venv = _venv_with_py_spy(tmp_path / "v")
    path = "/usr/bin:/bin"
    assert shutil.which("py-spy", path=path) is None     # py-spy is only in the venv's bin
    with job("allreduce", tmp_path / "job", 2) as proc:
        done = subprocess.run([str(distcheck_in_venv), "attach", str(proc.pid), "--json", str(tmp_path / "v.json"),
                               "--run-dir", str(tmp_path / "run")], capture_output=True, text=True,
                              timeout=ATTACH_S + 30, cwd=tmp_path, env={**os.environ, "PATH": path})
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-2000:]
    assert "not installed" not in done.stderr
    s = json.loads((tmp_path / "v.json").read_text())["scenarios"][0]
    assert _hang(s)["waiting_ranks"] == [0] and _hang(s)["absent_ranks"] == [1]


NOBODY = 65534        # the job's owner: the account every Linux has
ATTACHER = 4242       # attach's user: a uid of no account and no process here (the kernel needs no account)


def _can_switch_users() -> bool:
    if os.geteuid() != 0 or not (shutil.which("unshare") and shutil.which("setpriv")):
        return False
    return subprocess.run(["unshare", "--mount", "true"], capture_output=True, timeout=30).returncode == 0


def _as_user(uid: int, scratch: Path) -> tuple[str, ...]:
    """The prefix that runs a command as ``uid`` with this interpreter (tests/scripts/attach/as_user.sh says how)."""
    home = scratch / f"root-{uid}"
    home.mkdir(mode=0o711)
    home.chmod(0o711)
    return ("unshare", "--mount", "--propagation", "private", "sh", str(JOB.parent / "as_user.sh"), str(home),
            str(uid), str(uid))


@pytest.mark.skipif(not _can_switch_users(), reason="needs root, unshare --mount and setpriv to run as two other users")
def test_the_pid_of_another_user_s_torchrun_is_named_with_what_to_do(tmp_path):
    scratch = Path(tempfile.mkdtemp(prefix="distcheck-attach-users-", dir="/tmp"))   # others may enter it
    try:
        scratch.chmod(0o755)
        folder = scratch / "job"
        folder.mkdir(mode=0o777)
        folder.chmod(0o777)
        with job("allreduce", folder, 2, prefix=_as_user(NOBODY, scratch), env={"HOME": str(folder)}) as proc:
            assert all(psutil.Process(p).uids().real == NOBODY for p in [proc.pid, *rank_pids(folder, 2)])
            done = subprocess.run([*_as_user(ATTACHER, scratch), sys.executable, "-m", "distcheck", "attach",
                                   str(proc.pid)], capture_output=True, text=True, timeout=ATTACH_S + 30, cwd=folder)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    assert done.returncode == 3, done.stdout[-2000:] + done.stderr[-2000:]
    assert f"process {proc.pid} (" in done.stderr and "belongs to user nobody" in done.stderr
    assert f"attach runs as uid {ATTACHER}" in done.stderr and "no torch.distributed job found" not in done.stderr
    assert f"sudo -u nobody distcheck attach {proc.pid}" in done.stderr and "ptrace_scope" in done.stderr


def test_a_rank_blocked_in_a_device_sync_is_named_there_and_no_call_number_is_claimed(tmp_path):
    """emulated_nccl, no Flight Recorder: rank 0's all_reduce returned and its work waits on the stream for rank 1,
    which sleeps in a loop; rank 0's host is blocked in ``emulated_nccl.synchronize()``. Not decided (nothing says
    which call it waits in), never a pass: rank 0 named blocked in the device sync at its line, rank 1 outside any
    collective, and what to set for the Flight Recorder."""
    with job("", tmp_path / "job", 2, script=SYNC_JOB) as proc:
        done, s = attach(tmp_path, str(proc.pid))
    assert done.returncode == 3, done.stdout[-3000:] + done.stderr[-2000:]
    first = s["findings"][0]
    summary = first["summary"]
    assert first["kind"] == "coverage" and summary.startswith("Not decided: ") and not s["ok"], summary
    sync_line, sleep_line = line_of("the host blocks here", SYNC_JOB), line_of("rank 1: outside any", SYNC_JOB)
    assert re.search(rf"the host of rank 0 is blocked in a device sync at \S*{re.escape(sync_line)} "
                     r"\(emulated_nccl\.synchronize\(\)\)", summary), summary
    assert re.search(rf"rank 1 is running outside any collective at \S*{re.escape(sleep_line)}\b", summary), summary
    assert "no Flight Recorder dump was reachable" in summary and "TORCH_FR_BUFFER_SIZE" in summary
    assert "TORCH_FR_DUMP_TEMP_FILE" in summary and "watchdog" in summary
    assert not re.search(r"#\d", summary) and not [f for f in s["findings"] if f["kind"] == "hang"]   # no number
    assert first["waiting_ranks"] == [0] and first["data"]["device_sync"]["0"]["callsite"].endswith(":main")
    assert done.stdout.lstrip().startswith("NOT DECIDED") and "rank 0 blocked in a device sync" in done.stdout
    assert table_states(done.stdout) == {0: "stuck", 1: "running"}
