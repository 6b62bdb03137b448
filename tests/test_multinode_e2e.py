"""Two "nodes" on one machine (two distcheck processes on loopback), torchrun's flags."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from conftest import kill_tree, survivors
from distcheck.cluster import node_config
from distcheck.errors import UsageError
from distcheck.launcher import free_port

pytestmark = pytest.mark.e2e


def _node(rank: int, port: int, tmp_path, *extra: str) -> subprocess.Popen:
    args = [sys.executable, "-m", "distcheck", "run", "--nnodes", "2", "--node-rank", str(rank),
            "--nproc-per-node", "2", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"t{port}",
            "--run-dir", str(tmp_path / f"node{rank}"), "--json", str(tmp_path / f"node{rank}.json"), *extra]
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, cwd=tmp_path)


def _finish(procs: list[subprocess.Popen], timeout: float) -> list[tuple[int, str, str]]:
    deadline = time.monotonic() + timeout
    out = []
    try:
        for p in procs:
            o, e = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            out.append((p.returncode, o, e))
    finally:
        for p in procs:
            kill_tree(p)
    return out


def test_two_nodes_one_merged_report_with_a_hang_across_nodes(tmp_path):
    port = free_port()
    targets = ["auroc_rank0_only_compute", "collectives_sanity", "--stall-timeout", "5"]
    procs = [_node(0, port, tmp_path, *targets), _node(1, port, tmp_path, *targets)]
    (rc0, out0, err0), (rc1, out1, err1) = _finish(procs, 240)
    assert rc0 == 0, out0[-2000:] + err0[-2000:]
    assert rc1 == 0, out1[-2000:] + err1[-2000:]
    report = json.loads((tmp_path / "node0.json").read_text())
    assert report["run"]["nnodes"] == 2 and report["run"]["world_size"] == 4
    hang_scenario, sanity = report["scenarios"]
    [hang] = [f for f in hang_scenario["findings"] if f["kind"] == "hang"]
    assert hang["waiting_ranks"] == [0] and hang["absent_ranks"] == [1, 2, 3]
    assert hang["label"] == "BinaryAUROC.compute"
    nodes = {r["rank"]: r["node"] for r in hang_scenario["ranks"]}
    assert len(set(nodes.values())) == 2, nodes             # the ranks really ran on two launcher nodes
    assert any(nodes[a] != nodes[0] for a in hang["absent_ranks"])
    assert sorted(p.name for p in (tmp_path / "node0" / "auroc_rank0_only_compute" / "traces").iterdir()) == [
        f"rank{i}.trace" for i in range(4)]
    assert sanity["ok"] and sanity["collectives_compared"] > 0
    assert "node 0 wrote the full report" in out1
    assert not survivors(str(tmp_path))


def test_a_node_that_never_arrives_is_a_clear_rendezvous_error(tmp_path):
    port = free_port()
    start = time.monotonic()
    [(rc, out, err)] = _finish([_node(0, port, tmp_path, "collectives_sanity", "--rdzv-timeout", "5")], 120)
    assert rc == 3, err[-2000:]
    assert "timed out after 5 s waiting for 2 node(s)" in err and "never arrived" in err
    assert "Traceback" not in err
    assert time.monotonic() - start < 60
    assert not survivors(str(tmp_path))


def test_slurm_environment_gives_the_node_layout():
    env = {"SLURM_JOB_ID": "4242", "SLURM_NNODES": "4", "SLURM_NODEID": "2", "MASTER_ADDR": "node-a"}
    cfg = node_config(None, None, None, None, "c10d", 300, None, None, None, env=env)
    assert (cfg.nnodes, cfg.node_rank, cfg.rdzv_id) == (4, 2, "slurm-4242")
    assert cfg.rdzv_endpoint == "node-a:29500" and cfg.store_address == ("node-a", 29501)


@pytest.mark.parametrize("kwargs, message", [
    ({"nnodes": 2, "node_rank": 2}, "--node-rank must be between 0 and 1"),
    ({"nnodes": 2, "node_rank": 0}, "needs --rdzv-endpoint"),
    ({"nnodes": 2, "node_rank": 0, "rdzv_endpoint": "h:1"}, "needs --rdzv-id"),
    ({"rdzv_backend": "etcd"}, "unsupported --rdzv-backend 'etcd'"),
])
def test_bad_node_flags_are_usage_errors(kwargs, message):
    args = {"nnodes": None, "node_rank": None, "rdzv_endpoint": None, "rdzv_id": None, "rdzv_backend": "c10d",
            "rdzv_timeout": 300, "master_addr": None, "master_port": None, "store_port": None, "env": {}}
    args.update(kwargs)
    with pytest.raises(UsageError, match=message):
        node_config(**args)
