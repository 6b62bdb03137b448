"""Two "nodes" on one machine (two distcheck processes on loopback), torchrun's flags."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import (free_port, kill_tree, listening_sockets, process_groups_initialized, process_tree, survivors,
                      wait_for)
from distcheck.launch.cluster import SILENT_AFTER_S
from distcheck.launch.node_config import check_endpoint_address, node_address, node_config
from distcheck.errors import LaunchError, UsageError
from distcheck.files.trace_reader import parse_trace
from distcheck.files.trace_window import KEEP_CALLS, WHOLE_UP_TO

pytestmark = [pytest.mark.e2e, pytest.mark.multinode]


def _node(rank: int, port: int, tmp_path, *extra: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    args = [sys.executable, "-m", "distcheck", "run", "--nnodes", "2", "--node-rank", str(rank),
            "--nproc-per-node", "2", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"t{port}",
            "--run-dir", str(tmp_path / f"node{rank}"), "--json", str(tmp_path / f"node{rank}.json"), *extra]
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, cwd=tmp_path, env={**os.environ, **(env or {})})


def _finish(procs: list[subprocess.Popen], timeout: float) -> list[tuple[int, str, str]]:
    deadline = time.monotonic() + timeout
    out = []
    try:
        for p in procs:
            o, e = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            out.append((p.returncode, o, e))
    except subprocess.TimeoutExpired:
        for p in procs:
            kill_tree(p)
        tails = [f"node {n}:\n" + "".join(x[-3000:] for x in p.communicate()) for n, p in enumerate(procs)]
        pytest.fail(f"the nodes did not finish within {timeout:g} s\n" + "\n".join(tails))
    finally:
        for p in procs:
            kill_tree(p)
    return out


def _initialized(tmp_path, launch: str, ranks_of_node: dict[int, list[int]]) -> bool:
    return process_groups_initialized([tmp_path / f"node{n}" / launch / "status" / f"rank{r}.json"
                                       for n, ranks in ranks_of_node.items() for r in ranks])


def test_two_nodes_one_merged_report_with_a_hang_across_nodes(tmp_path):
    port = free_port()
    targets = ["auroc_rank0_only_compute", "collectives_sanity", "--stall-timeout", "5"]
    procs = [_node(0, port, tmp_path, *targets), _node(1, port, tmp_path, *targets)]
    try:
        # While every rank is up: what does the whole job listen on?
        assert wait_for(lambda: _initialized(tmp_path, "auroc_rank0_only_compute", {0: [0, 1], 1: [2, 3]}), 120)
        listening = listening_sockets([p for proc in procs for p in process_tree(proc.pid)])
    finally:
        (rc0, out0, err0), (rc1, out1, err1) = _finish(procs, 240)
    # node 0: rendezvous store and distcheck's store; the workers' store; one gloo listener per rank
    assert len(listening) >= 7, listening
    assert {port, port + 1} <= {p for _, _, p in listening}
    assert all(ip == "127.0.0.1" for _, ip, _ in listening), listening     # nothing on *:PORT
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


LONG_REDUCE = Path(__file__).parent / "scripts" / "long" / "long_reduce.py"


def test_a_long_run_crosses_as_windows_and_a_reduction_mismatched_before_them_is_found_on_its_node(tmp_path):
    """1,500 calls a rank: node 1 sends its ranks' last calls and digests of the rest, keeps the whole traces;
    the last rank's MAX at call #300 (every other rank sums) is found by digest, with where its records are."""
    port = free_port()
    target = [str(LONG_REDUCE), "--stall-timeout", "20"]
    procs = [_node(n, port, tmp_path, *target, env={"PLANT_MAX": "1"}) for n in (0, 1)]
    (rc0, out0, err0), (rc1, out1, err1) = _finish(procs, 240)
    assert rc0 == 1, out0[-3000:] + err0[-2000:]     # the run behaved otherwise than a clean script
    report = json.loads((tmp_path / "node0.json").read_text())
    [s] = report["scenarios"]
    assert s["end_reason"] == "completed" and not s["ok"]
    nodes = {r["rank"]: r["node"] for r in s["ranks"]}
    assert 1500 > WHOLE_UP_TO and nodes[3] != nodes[0]
    [mismatch] = [f for f in s["findings"] if f["severity"] == "error"]
    assert mismatch["kind"] == "mismatch" and mismatch["odd_ranks"] == [3] and "#257-#512" in mismatch["summary"]
    whole = tmp_path / f"node{nodes[3]}" / "long_reduce" / "traces" / "rank3.trace"
    assert f"rank 3 on node {nodes[3]} in {whole}" in mismatch["summary"]
    assert not any("lost" in f["summary"] for f in s["findings"]), s["findings"]
    [note] = [f for f in s["findings"] if f["kind"] == "coverage"]
    assert note["severity"] == "info" and f"#{1500 - KEEP_CALLS + 1} of group 0" in note["summary"]
    # the whole trace stayed on its node; node 0 got its window
    assert len(parse_trace(3, whole.read_bytes()).events) == 1500
    copy = tmp_path / "node0" / "long_reduce" / "traces" / "rank3.trace"
    assert copy.stat().st_size < whole.stat().st_size / 4
    assert s["collectives_compared"] > 0
    # as the finding says: the whole traces copied into node 0's launch dir, `distcheck analyze` names the call
    for trace in whole.parent.glob("rank*.trace"):
        shutil.copy(trace, copy.parent / trace.name)
    analyzed = subprocess.run([sys.executable, "-m", "distcheck", "analyze", str(tmp_path / "node0")],
                              capture_output=True, text=True, timeout=120)
    assert "all_reduce #300 (group 0): rank 3 called it with a different reduce_op" in analyzed.stdout, analyzed.stdout


def test_a_node_whose_distcheck_is_killed_mid_run_ends_the_run_with_the_report_so_far(tmp_path):
    port = free_port()
    targets = ["auroc_rank0_only_compute", "collectives_sanity", "--stall-timeout", "5", "--rdzv-timeout", "30"]
    procs = [_node(0, port, tmp_path, *targets), _node(1, port, tmp_path, *targets)]
    try:
        assert wait_for(lambda: _initialized(tmp_path, "auroc_rank0_only_compute", {0: [0, 1], 1: [2, 3]}), 120)
        procs[1].kill()                                       # node 1's distcheck; its ranks die with it
    finally:
        [(rc0, out0, err0), _] = _finish(procs, 180)
    assert rc0 == 3, out0[-2000:] + err0[-2000:]
    assert "node 1 went silent during auroc_rank0_only_compute" in err0 and "1 scenario did not run" in err0
    assert "Traceback" not in err0 and "waitForInput" not in err0
    report = json.loads((tmp_path / "node0" / "report.json").read_text())
    [scenario] = report["scenarios"]
    assert scenario["name"] == "auroc_rank0_only_compute" and scenario["observed"] == ["hang"]
    assert not survivors(str(tmp_path))


IDLE_WHILE_NODE_1_COMPUTES = '''
import time

import torch
import torch.distributed as dist

from distcheck import scenario


@scenario(expect="pass")
def node_1_computes_long(ctx):
    dist.all_reduce(torch.ones(4))
    if ctx.rank >= 2:
        time.sleep(3600)      # node 1's ranks compute; node 0's are done and idle: nobody waits
'''


def _node_1_killed_once_its_ranks_started(tmp_path, source: str, name: str, stall_timeout: str
                                         ) -> tuple[int, str, str, dict]:
    """Both nodes run ``source``; node 1's distcheck is killed once all 4 ranks started. Node 0's exit
    code, output and error output, and its report's scenario."""
    script = tmp_path / f"{name}.py"
    script.write_text(source)
    port = free_port()
    targets = [str(script), "--stall-timeout", stall_timeout]
    procs = [_node(0, port, tmp_path, *targets), _node(1, port, tmp_path, *targets)]
    try:
        assert wait_for(lambda: _initialized(tmp_path, name, {0: [0, 1], 1: [2, 3]}), 120)
        procs[1].kill()
    finally:
        [(rc0, out0, err0), _] = _finish(procs, 120)       # without heartbeats: no end at all
    assert (tmp_path / "node0" / "report.json").exists(), out0[-2000:] + err0[-2000:]
    [scenario] = json.loads((tmp_path / "node0" / "report.json").read_text())["scenarios"]
    return rc0, out0, err0, scenario


def test_a_silent_node_counts_as_dead_even_when_nobody_waits_for_it(tmp_path):
    rc0, out0, err0, scenario = _node_1_killed_once_its_ranks_started(tmp_path, IDLE_WHILE_NODE_1_COMPUTES,
                                                                      "node_1_computes_long", "5")
    assert rc0 == 3, out0[-2000:] + err0[-2000:]
    assert "node 1 went silent during node_1_computes_long" in err0
    # Ranks 0 and 1 returned from the all_reduce once ranks 2 and 3 entered it (a stall: nobody waits), or,
    # where node 1 went before its ranks entered it, failed in it (a crash, as a reaction): either way only
    # ranks 2 and 3's records are lost, and the run is not a pass.
    assert not scenario["ok"]
    [finding] = scenario["findings"]
    assert "the records of ranks 2, 3 went with their lost node" in finding["summary"], finding
    assert not finding["waiting_ranks"] and not finding["absent_ranks"]
    assert not survivors(str(tmp_path))


NODE_1_GOES_BEFORE_ITS_RANKS_CALL = '''
import time

import torch
import torch.distributed as dist

from distcheck import scenario


@scenario(expect="pass")
def node_1_goes_first(ctx):
    if ctx.rank >= 2:
        time.sleep(3600)      # node 1's ranks are still busy when their node goes
    dist.all_reduce(torch.ones(4))
'''


def test_a_lost_node_whose_peers_only_failed_in_reaction_is_not_a_pass(tmp_path):
    # Node 1 goes while its ranks have not called the all_reduce that ranks 0 and 1 wait in: theirs fails
    # ("Connection closed by peer", a reaction), the launch ends as a crash, and nothing left says what
    # ranks 2 and 3 did. That read as a pass with no finding.
    rc0, out0, err0, scenario = _node_1_killed_once_its_ranks_started(tmp_path, NODE_1_GOES_BEFORE_ITS_RANKS_CALL,
                                                                      "node_1_goes_first", "30")
    assert rc0 == 3, out0[-2000:] + err0[-2000:]
    assert not scenario["ok"] and scenario["observed"] != ["pass"], scenario["findings"]
    assert any("the records of ranks 2, 3 went with their lost node" in f["summary"] for f in scenario["findings"]), scenario
    assert not survivors(str(tmp_path))


def test_a_node_that_starts_later_than_the_silence_limit_still_joins_and_passes(tmp_path):
    # A node started late (a SLURM step starting later) has sent no heartbeat yet: not a lost node.
    port = free_port()
    targets = ["collectives_sanity", "--stall-timeout", "5"]
    procs = [_node(0, port, tmp_path, *targets)]
    try:
        assert procs[0].stdout.readline().startswith("distcheck ")
        assert "RUN  collectives_sanity" in procs[0].stdout.readline()   # node 0 now waits in the rendezvous
        # past the silence limit, and the 5 s a stall with dead ranks waits
        assert not wait_for(lambda: procs[0].poll() is not None, SILENT_AFTER_S + 8)
        procs.append(_node(1, port, tmp_path, *targets))
    finally:
        results = _finish(procs, 180)
    [(rc0, out0, err0), (rc1, out1, err1)] = results
    assert rc0 == 0, out0[-2000:] + err0[-2000:]
    assert rc1 == 0, out1[-2000:] + err1[-2000:]
    assert json.loads((tmp_path / "node0.json").read_text())["scenarios"][0]["ok"]
    assert not survivors(str(tmp_path))


def test_losing_node_0_mid_run_stops_the_other_node_at_once_with_a_clear_error(tmp_path):
    port = free_port()
    targets = ["auroc_rank0_only_compute", "--stall-timeout", "60"]
    procs = [_node(0, port, tmp_path, *targets), _node(1, port, tmp_path, *targets)]
    try:
        assert wait_for(lambda: _initialized(tmp_path, "auroc_rank0_only_compute", {0: [0, 1], 1: [2, 3]}), 120)
        procs[0].kill()
        killed = time.monotonic()
    finally:
        [_, (rc1, out1, err1)] = _finish(procs, 120)
    assert time.monotonic() - killed < 30                    # not the 60 s stall timeout, nor a store timeout
    assert rc1 == 3, out1[-2000:] + err1[-2000:]
    assert "lost node 0's distcheck mid-run" in err1 and "distcheck analyze" in err1
    assert "Traceback" not in err1 and "frame #" not in err1   # no C++ backtraces from c10d either
    assert sorted(p.name for p in (tmp_path / "node1" / "auroc_rank0_only_compute" / "traces").iterdir()) == [
        "rank2.trace", "rank3.trace"]
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


def test_a_node_waiting_for_node_0_stops_at_once_on_sigterm(tmp_path):
    # Node 1 alone: it waits for node 0's distcheck. That wait is a C call; one long call
    # would hold off the signal handler for the whole --rdzv-timeout.
    node = _node(1, free_port(), tmp_path, "collectives_sanity", "--rdzv-timeout", "200")
    try:
        lines = []
        while not any("waiting for node 0's distcheck" in line for line in lines):
            line = node.stdout.readline()
            assert line, "".join(lines) + node.stderr.read()
            lines.append(line)
        signalled = time.monotonic()
        node.send_signal(signal.SIGTERM)
        node.communicate(timeout=60)
        took = time.monotonic() - signalled
    finally:
        kill_tree(node)
    assert node.returncode == 130
    assert took < 10, took
    assert not survivors(str(tmp_path))


def test_node_address_is_local_addr_or_the_route_to_the_endpoint():
    def config(**kw):
        return node_config(2, 1, kw.pop("endpoint", "127.0.0.1:29500"), "job", "c10d", 300, None, None, None, env={}, **kw)

    assert node_address(config()) == "127.0.0.1"
    assert node_address(config(local_addr="10.1.2.3")) == "10.1.2.3"
    assert node_address(node_config(None, None, None, None, "c10d", 300, None, None, None, env={})) == "127.0.0.1"


def test_node_0_refuses_an_endpoint_name_that_resolves_to_loopback():
    def check(endpoint, node_rank=0, resolved=("127.0.1.1",)):
        cfg = node_config(2, node_rank, endpoint, "job", "c10d", 300, None, None, None, env={})
        check_endpoint_address(cfg, resolve=lambda host: list(resolved))

    with pytest.raises(LaunchError, match="'node-a' resolves to 127.0.1.1 on node 0, which the other nodes cannot"):
        check("node-a:29500")
    check("node-a:29500", resolved=("10.0.0.5",))          # a real address
    check("node-a:29500", node_rank=1)                       # only node 0 listens there
    check("127.0.0.1:29500")                                 # asked for loopback in so many words
    check("localhost:29500")


@pytest.mark.parametrize("kwargs, message", [
    ({"nnodes": 2, "node_rank": 2}, "--node-rank must be between 0 and 1"),
    ({"nnodes": 2, "node_rank": 0}, "needs --rdzv-endpoint"),
    ({"nnodes": 2, "node_rank": 0, "rdzv_endpoint": "h:1"}, "needs --rdzv-id"),
    ({"rdzv_backend": "etcd"}, "unsupported --rdzv-backend 'etcd'"),
    ({"rdzv_backend": "static"}, "unsupported --rdzv-backend 'static': distcheck runs on torch's c10d"),
])
def test_bad_node_flags_are_usage_errors(kwargs, message):
    args = {"nnodes": None, "node_rank": None, "rdzv_endpoint": None, "rdzv_id": None, "rdzv_backend": "c10d",
            "rdzv_timeout": 300, "master_addr": None, "master_port": None, "store_port": None, "env": {}}
    args.update(kwargs)
    with pytest.raises(UsageError, match=message):
        node_config(**args)
