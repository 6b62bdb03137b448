"""`distcheck run` end to end on real gloo process groups (issue 2's 'done when')."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from conftest import finish_process, kill_tree, survivors, wait_for

pytestmark = pytest.mark.e2e

CRASH_SCENARIOS = '''
import os
import signal
from distcheck import scenario


@scenario(expect="crash")
def raises_on_rank1(ctx):
    """Rank 1 raises in the middle of the loop; the others block in the next all_reduce."""
    import torch
    import torch.distributed as dist

    t = torch.ones(1)
    for step in range(5):
        if ctx.rank == 1 and step == 2:
            raise ValueError("bad batch at step 2")
        dist.all_reduce(t)


@scenario(expect="crash")
def sigkilled_rank2(ctx):
    """Rank 2 is SIGKILLed (as the OOM killer would) in the middle of the loop."""
    import torch
    import torch.distributed as dist

    t = torch.ones(1)
    for step in range(5):
        if ctx.rank == 2 and step == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        dist.all_reduce(t)
'''


# The seed hang (auroc_rank0_only_compute on 4 ranks: rank 0, BinaryAUROC.compute, its line, the traces, stacks
# and Flight Recorder it leaves) is asserted on the catalogue's 4-rank run: tests/test_catalogue.py's _seed; the
# pass scenarios collectives_sanity and auroc_all_ranks_compute (no finding, every rank exit 0, the report's schema,
# verdict, world size and backend) on its 2-rank run.


def test_raising_and_sigkilled_ranks_are_crashes_with_the_others_state(distcheck, tmp_path):
    path = tmp_path / "crashes.py"
    path.write_text(CRASH_SCENARIOS)
    r = distcheck("run", str(path), "--nproc-per-node", "4", "--backend", "gloo", "--stall-timeout", "5")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]

    raised = r.scenario("raises_on_rank1")
    [crash] = [f for f in raised["findings"] if f["kind"] == "crash"]
    assert crash["data"]["root_rank"] == 1
    assert "ValueError: bad batch at step 2" in crash["summary"]
    assert f"{path}:".replace(str(tmp_path), "") in crash["summary"] or "crashes.py" in crash["summary"]
    states = {x["rank"]: x["state"] for x in raised["ranks"]}
    assert states[1] == "crashed"
    assert all(states[i] in ("stuck", "killed") for i in (0, 2, 3))

    killed = r.scenario("sigkilled_rank2")
    [crash] = [f for f in killed["findings"] if f["kind"] == "crash"]
    assert crash["data"]["root_rank"] == 2 and crash["data"]["signal"] == "SIGKILL"
    ranks = {x["rank"]: x for x in killed["ranks"]}
    assert ranks[2]["state"] == "crashed" and ranks[2]["signal"] == "SIGKILL"
    assert ranks[2]["collectives"] == 2


def _start(args: list[str], tmp_path: Path, console_script: bool = False) -> subprocess.Popen:
    cmd = ["distcheck"] if console_script else [sys.executable, "-m", "distcheck"]
    return subprocess.Popen(cmd + args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, cwd=tmp_path)


def _ranks_started(run_dir: Path, n: int) -> bool:
    return len(list(run_dir.glob("*/status/rank*.json"))) >= n


def test_ctrl_c_stops_the_run_keeps_traces_and_leaves_nothing(tmp_path):
    run_dir = tmp_path / "run"
    proc = _start(["run", "auroc_rank0_only_compute", "--nproc-per-node", "2", "--backend", "gloo",
                   "--stall-timeout", "60", "--run-dir", str(run_dir), "--json", str(tmp_path / "r.json")],
                  tmp_path, console_script=True)
    try:
        assert wait_for(lambda: _ranks_started(run_dir, 2), 90), "ranks never started"
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        kill_tree(proc)
    assert proc.returncode == 130, err[-2000:]
    assert "Traceback" not in err
    assert list(run_dir.glob("*/traces/rank0.trace"))
    assert (run_dir / "report.json").exists()
    assert wait_for(lambda: not survivors(str(run_dir)), 10), survivors(str(run_dir))


def test_ranks_die_with_a_sigkilled_distcheck(tmp_path):
    run_dir = tmp_path / "run"
    proc = _start(["run", "auroc_rank0_only_compute", "--nproc-per-node", "2", "--backend", "gloo",
                   "--stall-timeout", "60", "--run-dir", str(run_dir)], tmp_path)
    try:
        assert wait_for(lambda: _ranks_started(run_dir, 2), 90), "ranks never started"
        workers = [p for p in survivors(str(run_dir), proc.pid) if p.pid != proc.pid]
        assert len(workers) >= 2, workers   # the 2 ranks (forked from the fork server, which is there too)
        os.kill(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=30)
        gone, alive = psutil.wait_procs(workers, timeout=10)
        assert not alive, [p.pid for p in alive]
    finally:
        kill_tree(proc)
        for p in survivors(str(run_dir), proc.pid):
            p.kill()


def test_a_scenario_imports_modules_beside_the_run_as_under_python_m(tmp_path):
    """Ranks forked from the fork server get the launching directory on sys.path, as
    ``python -m distcheck.rank.worker`` had it, also when distcheck is started from a script
    elsewhere (a console script's sys.path[0] is its own folder)."""
    (tmp_path / "helper_mod.py").write_text("VALUE = 3\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "scen.py").write_text(
        "from distcheck import scenario\n\n\n@scenario()\ndef uses_cwd_module(ctx):\n"
        "    import torch, torch.distributed as dist\n    import helper_mod\n"
        "    t = torch.ones(1) * helper_mod.VALUE\n    dist.all_reduce(t)\n    assert t.item() == 3 * ctx.world_size\n")
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "distcheck").write_text("import sys\nfrom distcheck.cli import main\nsys.exit(main())\n")
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, str(tmp_path / "bin" / "distcheck"), "run", "sub/scen.py",
                             "--nproc-per-node", "2", "--run-dir", str(run_dir)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
                            start_new_session=True)
    r = finish_process(proc, str(run_dir), timeout=120)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]


@pytest.mark.parametrize("args, message", [
    (["run", "no_such_scenario"], "unknown scenario or file: 'no_such_scenario'"),
    (["run", "collectives_sanity", "--nproc-per-node", "0"], "--nproc-per-node must be at least 1"),
    (["run", "collectives_sanity", "--backend", "mpi"], "unknown backend 'mpi'"),
    (["run", "collectives_sanity", "--stall-timeout", "-1"], "--stall-timeout must be greater than 0"),
])
def test_bad_input_is_one_line_and_exit_code_2(distcheck, args, message):
    r = distcheck(*args, json=False)
    assert r.returncode == 2
    assert message in r.stderr
    assert "Traceback" not in r.stderr


def test_nccl_without_gpus_is_refused_before_launch(distcheck):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    r = distcheck("run", "collectives_sanity", "--backend", "nccl", json=False)
    assert r.returncode == 2
    assert "needs CUDA GPUs" in r.stderr and "Traceback" not in r.stderr


def test_scenario_file_with_syntax_error_or_no_scenario(distcheck, tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def broken(:\n")
    r = distcheck("run", str(bad), json=False)
    assert r.returncode == 2 and "syntax error" in r.stderr and "Traceback" not in r.stderr
    plain = tmp_path / "plain.py"
    plain.write_text("x = 1\n")
    r = distcheck("run", str(plain), json=False)
    assert r.returncode == 2 and "no @scenario" in r.stderr
