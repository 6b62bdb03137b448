"""Rule 0 under ``distcheck run -- CMD``: two harms the Lightning lane (``tests/test_public_lightning_e2e.py``) found,
each reduced to a few lines of torch, plainly and under distcheck.

* A rank that finished its work, destroyed its group and exited is finished, not dead: a peer that idles on outside
  every collective (Lightning's conftest joins a thread that polls every 5 s) is not a hang.
* A rank's stdout and stderr stay where the command sent them (a shell's ``>``, pytest's ``capfd`` of the ranks a
  test spawned); only output still going where the whole command's goes is moved to the rank's log.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import finish_process, free_port

pytestmark = pytest.mark.e2e

TIMEOUT_S = 240

RANK_ZERO_IDLE_AFTER_RANK_ONE_LEFT = '''\
import time
import torch.distributed as dist

dist.init_process_group("gloo")
dist.barrier()
if dist.get_rank() == 0:
    time.sleep(8)   # idle, in no collective (a join, a wait on a child or the network): rank 1 has left meanwhile
dist.destroy_process_group()
'''

REDIRECTED_RANK = '''\
import sys
import torch.distributed as dist

dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{sys.argv[1]}", rank=0, world_size=1)
print("result: 42", flush=True)
dist.destroy_process_group()
'''

CAPTURED_SPAWNED_RANKS = '''\
import torch.distributed as dist
import torch.multiprocessing as mp

PORT = {port}


def _rank(rank):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{{PORT}}", rank=rank, world_size=2)
    print(f"rank {{rank}}: result 42", flush=True)
    dist.destroy_process_group()


def test_what_the_spawned_ranks_print_is_captured(capfd):
    mp.spawn(_rank, nprocs=2)
    out = capfd.readouterr().out
    assert "rank 0: result 42" in out and "rank 1: result 42" in out
'''


def _run(tmp_path: Path, argv: list[str], distcheck: bool) -> subprocess.CompletedProcess:
    env = {**os.environ, "DISTCHECK_RUNS_DIR": str(tmp_path / "runs")}
    env.pop("PYTEST_CURRENT_TEST", None)
    prefix = [sys.executable, "-m", "distcheck", "run", "--json", str(tmp_path / "report.json"), "--"] if distcheck \
        else []
    proc = subprocess.Popen(prefix + argv, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    return finish_process(proc, str(tmp_path), TIMEOUT_S)


def test_a_rank_idle_after_its_peer_finished_and_left_is_not_a_hang(tmp_path, no_survivors):
    script = tmp_path / "rank0_idle_after_rank1_left.py"
    script.write_text(RANK_ZERO_IDLE_AFTER_RANK_ONE_LEFT)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    plain = _run(tmp_path, [*torchrun, "--master-port", str(free_port()), str(script)], distcheck=False)
    assert plain.returncode == 0, plain.stderr[-3000:]
    under = _run(tmp_path, [*torchrun, "--master-port", str(free_port()), str(script)], distcheck=True)
    assert under.returncode == 0, under.stdout[-3000:] + under.stderr[-2000:]
    [scenario] = json.loads((tmp_path / "report.json").read_text())["scenarios"]
    assert scenario["observed"] == ["pass"] and scenario["end_reason"] == "completed"
    assert sorted(r["state"] for r in scenario["ranks"]) == ["finished", "finished"]


def test_a_ranks_output_stays_where_a_shell_redirection_sends_it(tmp_path, no_survivors):
    script = tmp_path / "redirected_rank.py"
    script.write_text(REDIRECTED_RANK)
    for mode in ("plain", "distcheck"):
        redirect = f"{sys.executable} {script} {free_port()} > {tmp_path / mode}.txt"
        done = _run(tmp_path, ["bash", "-c", redirect], distcheck=mode == "distcheck")
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
        assert (tmp_path / f"{mode}.txt").read_text() == "result: 42\n", mode


def test_what_spawned_ranks_print_stays_in_pytests_capture(tmp_path, no_survivors):
    (tmp_path / "test_spawned.py").write_text(CAPTURED_SPAWNED_RANKS.format(port=free_port()))
    pytest_command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_spawned.py"]
    for distcheck in (False, True):
        done = _run(tmp_path, pytest_command, distcheck=distcheck)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
        assert "1 passed" in done.stdout
