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
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

from conftest import free_port, kill_tree, run_distcheck, survivors, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240),
              pytest.mark.skipif(shutil.which("py-spy") is None, reason="needs py-spy (distcheck[attach])")]

JOB = Path(__file__).parent / "scripts" / "attach" / "job.py"
READY_S = 120          # torch imports slowly on a loaded machine
ATTACH_S = 30          # issue 43: a verdict within 30 s


def line_of(marker: str) -> str:
    """``job.py:N``: the line of the job script that carries ``marker`` (its comment)."""
    [n] = [i for i, text in enumerate(JOB.read_text().splitlines(), 1) if marker in text]
    return f"job.py:{n}"


def _torchrun(mode: str, folder: Path, nproc: int, *extra: str, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                             str(nproc), str(JOB), mode, str(folder), *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env={**os.environ, **(env or {})})


@contextmanager
def job(mode: str, folder: Path, nproc: int = 3, *extra: str, env: dict | None = None):
    """A torchrun job whose ranks all stand where the mode wants them; killed whole afterwards."""
    folder.mkdir(parents=True, exist_ok=True)
    proc = _torchrun(mode, folder, nproc, *extra, env=env)
    try:
        ready = wait_for(lambda: all((folder / f"ready{r}").exists() for r in range(nproc)) or proc.poll() is not None,
                         timeout=READY_S)
        assert ready and proc.poll() is None, f"the job did not get ready: {proc.poll()}"
        yield proc
    finally:
        (folder / "release").touch()
        kill_tree(proc)
        proc.communicate(timeout=30)
        assert wait_for(lambda: not survivors(str(folder)), timeout=15), "the job's processes survived"


def attach(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / "attach.json"
    started = time.monotonic()
    done = run_distcheck(["attach", *args, "--json", str(out), "--run-dir", str(tmp_path / "run")], tmp_path,
                         tmp_path / "run", timeout=ATTACH_S + 30)
    took = time.monotonic() - started
    assert took < ATTACH_S, f"attach took {took:.1f} s"
    assert out.exists(), done.stdout[-3000:] + done.stderr[-3000:]
    return done, json.loads(out.read_text())["scenarios"][0]


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
    alone = _torchrun("healthy", tmp_path / "alone", 2, "--steps", "120")
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


def _finished(procs: list[subprocess.Popen], timeout: float) -> list[tuple[int, str, str]]:
    try:
        outs = [p.communicate(timeout=timeout) for p in procs]
        return [(p.returncode, *o) for p, o in zip(procs, outs)]
    finally:
        for p in procs:
            kill_tree(p)


def test_two_nodes_node0_judges_the_whole_job_and_names_a_node_that_never_joins(tmp_path):
    with two_node_job(tmp_path / "job") as agents:
        # node 1's attach never comes: node 0 says which node and which ranks it could not read, and no pass
        [(rc, out, err)] = _finished([_attach_node(0, agents[0], free_port(), tmp_path, "--rdzv-timeout", "3")],
                                     ATTACH_S + 30)
        alone = json.loads((tmp_path / "attach0.json").read_text())["scenarios"][0]
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
