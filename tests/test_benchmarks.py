"""Every benchmark's tiny configuration runs, so none drifts from the code it measures (issue 45).

Each script under ``benchmarks/`` runs with ``--tiny`` (``benchmarks/_common.parse_args``) in a process of
its own, in a session of its own, with a hard timeout: the real code path end to end at the smallest sizes,
and its own check of its output (``_common.well_formed``: every figure a finite number, every planted fault
found) must pass. The list comes from the folder, so a new benchmark without a tiny configuration fails here.
Those that launch ranks or a process group even tiny take seconds each and run in the benchmarks lane
(``pytest -m benchmarks``, which ``.ci/run`` runs); the rest in the quick lane, among them the simulated-cluster
benchmarks' tiny runs (``cluster_scale``, and ``attach``'s simulated nodes). ``hang_scenario*.py`` are scenarios, not benchmarks: ``detection_latency.py --tiny`` runs each of them.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import shutil
import subprocess
import sys

import psutil
import pytest

from conftest import HARD_TIMEOUT_S, REPO, kill_tree, survivors

BENCHMARKS = REPO / "benchmarks"
SCENARIO_PREFIX = "hang_scenario"
# They launch multi-rank jobs (torchrun, `distcheck run`, simulated nodes) or gloo process groups even tiny: seconds
# to a minute each.
LAUNCHING = {"attach", "comm_health_overhead", "completion_source", "detection_latency", "recorder_memory", "soak",
             "suite_time", "tracer_overhead"}
NEEDS = {"attach": "py-spy"}   # a tool on PATH, else the benchmark is skipped


def benchmark_names() -> list[str]:
    return sorted(p.stem for p in BENCHMARKS.glob("*.py")
                  if not p.stem.startswith("_") and not p.stem.startswith(SCENARIO_PREFIX))


def _param(name: str):
    # a benchmark that launches jobs: the benchmarks lane (pytest -m benchmarks)
    marks = [pytest.mark.e2e, pytest.mark.benchmarks] if name in LAUNCHING else []
    if name in NEEDS:
        marks.append(pytest.mark.skipif(shutil.which(NEEDS[name]) is None, reason=f"needs {NEEDS[name]}"))
    return pytest.param(name, marks=marks, id=name)


def _common():
    spec = importlib.util.spec_from_file_location("bench_common", BENCHMARKS / "_common.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _session_left(sid: int) -> list[psutil.Process]:
    """Live processes of the benchmark's session (it started them all in it, or in sessions below it that
    its own teardown ends)."""
    left = []
    for p in psutil.process_iter(["pid"]):
        try:
            if os.getsid(p.pid) == sid and p.status() != psutil.STATUS_ZOMBIE:
                left.append(p)
        except (psutil.Error, OSError):
            continue
    return left


def _described(procs: list[psutil.Process]) -> list[str]:
    out = []
    for p in procs:
        try:
            out.append(f"{p.pid}: {' '.join(p.cmdline())}")
        except psutil.Error:   # gone meanwhile
            continue
    return out


def _finite(value) -> bool:
    if isinstance(value, dict):
        return bool(value) and all(_finite(v) for v in value.values())
    if isinstance(value, list):
        return bool(value) and all(_finite(v) for v in value)
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@pytest.mark.timeout(HARD_TIMEOUT_S + 60)
@pytest.mark.parametrize("name", [_param(n) for n in benchmark_names()])
def test_tiny_configuration_runs_and_checks_its_output(name, tmp_path):
    _tiny_runs_well_formed(name, tmp_path)


@pytest.mark.timeout(HARD_TIMEOUT_S + 60)
def test_attach_across_simulated_nodes_tiny_runs_in_the_quick_lane(tmp_path):
    """attach's tiny run reads a real job with py-spy (the e2e lane); its simulated nodes alone (``--ranks`` with no
    count: recorded stack samples, no reader) run here: node 0's attach names the stalled TP group's ranks."""
    said = _tiny_runs_well_formed("attach", tmp_path, "--ranks")
    assert said["found"] and all("nodes" in name for name in said["found"]), said


def _tiny_runs_well_formed(name, tmp_path, *extra):
    # TMPDIR: every folder the benchmark makes is under tmp_path, and so is any command line that names one
    proc = subprocess.Popen([sys.executable, str(BENCHMARKS / f"{name}.py"), "--tiny", *extra], cwd=tmp_path,
                            env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1",
                                 "TMPDIR": str(tmp_path)},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=HARD_TIMEOUT_S)
        left = _described(_session_left(proc.pid) + survivors(str(tmp_path)))
    finally:
        kill_tree(proc)
        for p in survivors(str(tmp_path)):
            p.kill()
    assert proc.returncode == 0, f"exit {proc.returncode}\n{out[-3000:]}\n{err[-3000:]}"
    assert not left, left
    lines = [line for line in out.splitlines() if line.startswith("well formed: ")]
    assert len(lines) == 1, out[-3000:]
    said = json.loads(lines[0].removeprefix("well formed: "))
    assert said["figures"] and all(_finite(v) for v in said["figures"].values()), said
    assert all(ok is True for ok in said["found"].values()), said
    return said


def test_every_hang_scenario_is_one_detection_latency_runs():
    """The helper jobs are covered by the benchmark that runs them: each is in its table (and --tiny runs
    every entry of that table)."""
    spec = importlib.util.spec_from_file_location("bench_detection_latency", BENCHMARKS / "detection_latency.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    scenarios = {p.resolve() for p in BENCHMARKS.glob(f"{SCENARIO_PREFIX}*.py")}
    assert scenarios and scenarios == {path.resolve() for path, _, _ in module.SCENARIOS.values()}


def test_cluster_scale_judges_with_node_0s_own_code():
    """Issue 45: cluster_scale once copied ``judged_across_nodes`` and measured its copy. Node 0 (``_node0``) calls
    the real one (the tiny run shows it names the planted faults); no copy of it lives in the benchmark."""
    import ast

    defined, imported = set(), set()
    for path in [BENCHMARKS / "cluster_scale.py", *BENCHMARKS.glob("_*.py")]:
        tree = ast.parse(path.read_text(encoding="utf-8"))
        defined |= {node.name for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.ClassDef))}
        if path.name == "_node0.py":
            imported = {(node.module, alias.name) for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                        for alias in node.names}
    assert "judged_across_nodes" not in defined
    assert ("distcheck.targets.launching", "judged_across_nodes") in imported


@pytest.mark.e2e
@pytest.mark.benchmarks
@pytest.mark.timeout(HARD_TIMEOUT_S + 60)
@pytest.mark.parametrize("args", [
    ["--fault", "barrier_absent,node_lost,straggler_node"],
    # a pipeline of 4 stages (8 nodes of 2 ranks): with 2, the skipped micro-batch makes one cycle of every rank,
    # and the verdict's first finding is the world's all_reduce in it, not the pipeline's transfers
    ["--fault", "pp_skip_microbatch", "--mesh", "tp=2,pp=4", "--nodes", "8"],
], ids=["barrier-lost-straggler", "pp-skip"])
def test_cluster_scale_names_every_fault_it_plants(tmp_path, args):
    """The tiny configuration runs the faults the quick lane's run leaves out (a lost node waits out its 10 s of
    silence; each row is three processes that import torch): each is named by node 0's verdict as ``_faults`` says
    it must be."""
    proc = subprocess.Popen([sys.executable, str(BENCHMARKS / "cluster_scale.py"), "--tiny", *args], cwd=tmp_path,
                            env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp_path)},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=HARD_TIMEOUT_S)
    finally:
        kill_tree(proc)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{out[-3000:]}\n{err[-3000:]}"


def _mesh_modules():
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import _faults
        import _mesh
        import _mesh_traces
    finally:
        sys.path.remove(str(BENCHMARKS))
    return _mesh, _mesh_traces, _faults


def test_a_mesh_ranks_derived_trace_is_the_real_tracers(tmp_path):
    """cluster_scale traces one rank per pipeline stage for real and derives every other rank's trace from it (its
    groups and peers moved): on a small mesh, every rank's derived trace reads as the real tracer's run as that rank
    (the same groups, members, numbers, ops, peers and lines)."""
    from distcheck.files.trace_reader import parse_trace

    mesh_mod, traces, _ = _mesh_modules()
    mesh, model = mesh_mod.Mesh.parse("tp=2,pp=3", 12), mesh_mod.Model(layers=2, micro_batches=4, eval_every=3)
    info = traces.write_templates(mesh, model, 200, None, tmp_path / "tpl")

    def calls(trace):
        return [(e.group, e.seq, e.op, e.group_ranks, e.root, e.callsite, e.shapes) for e in trace.events]

    for rank in range(mesh.world):
        stage = mesh.stage(rank)
        template = traces.Template.load(tmp_path / "tpl", f"stage{stage}", mesh, stage)
        real = tmp_path / f"rank{rank}.trace"
        traces.trace_rank(mesh, traces.schedule(mesh, model, info["steps"], stage), rank, real)
        derived = parse_trace(rank, template.chunk(rank, 0, template.index["end"]))
        assert calls(derived) == calls(parse_trace(rank, real.read_bytes())), rank
        assert {e.group for e in derived.events} >= {"0", mesh.group_name("dp", rank), mesh.group_name("tp", rank)}


def test_the_mesh_model_completes_healthy_and_stands_where_a_fault_leaves_it():
    mesh_mod, _, faults = _mesh_modules()
    mesh, model = mesh_mod.Mesh.parse("tp=2,pp=4", 32), mesh_mod.Model(layers=2, micro_batches=4)
    ops = {r: model.step_ops(mesh, mesh.stage(r), evaluate=True) for r in range(mesh.world)}
    assert all(at == len(ops[r]) for r, at in mesh_mod.standstill(mesh, ops).items())   # 1F1B pairs every transfer
    assert len(ops[0]) < len(ops[mesh.rank(0, 1, 0)])                                   # stages differ in calls
    stall = faults.plan("tp_group_stall", mesh, model, rpn=2)
    assert stall.ranks == [30, 31] and all(stall.where(r) == (stall.where(30)[0], True) for r in stall.ranks)
    assert all(stall.where(r)[0] < len(ops[r]) for r in range(mesh.world))   # nobody finishes the step
    skip = faults.plan("pp_skip_microbatch", mesh, model, rpn=2)
    assert skip.skipping == [mesh.rank(3, 1, 0), mesh.rank(3, 1, 1)]
    absent = faults.plan("barrier_absent", mesh, model, rpn=2)
    assert absent.finished == [31] and all(absent.where(r)[1] for r in range(31))


def test_a_figure_that_is_no_number_or_a_missed_fault_ends_the_run(capsys):
    common = _common()
    common.well_formed({"ratio": 1.02, "per_op": {"all_reduce": [3.0, 4.5]}}, {"hang": True})
    line = capsys.readouterr().out.strip()
    assert json.loads(line.removeprefix(common.WELL_FORMED))["figures"]["ratio"] == 1.02
    for figures, found, why in (({"ratio": float("nan")}, {}, "ratio is nan, not a number"),
                                ({"ratio": "1.0"}, {}, "ratio is '1.0', not a number"),
                                ({"rows": []}, {}, "rows is [], not a number"),
                                ({"ratio": 1.0}, {"hang": False}, "hang: no"),
                                ({}, {}, "no figure measured")):
        with pytest.raises(SystemExit) as ended:
            common.well_formed(figures, found)
        assert ended.value.code == common.NOT_WELL_FORMED
        assert why in capsys.readouterr().out


def test_tiny_sets_defaults_that_explicit_options_override(monkeypatch):
    import argparse

    common = _common()

    def parsed(*argv: str) -> argparse.Namespace:
        parser = argparse.ArgumentParser()
        parser.add_argument("--ranks", type=int, default=1024)
        parser.add_argument("--rounds", type=int, default=5)
        monkeypatch.setattr(sys, "argv", ["bench", *argv])
        return common.parse_args(parser, {"ranks": 8, "rounds": 1})

    assert (parsed().ranks, parsed().rounds) == (1024, 5)
    assert (parsed("--tiny").ranks, parsed("--tiny").rounds) == (8, 1)
    assert (parsed("--tiny", "--ranks", "16").ranks, parsed("--tiny", "--ranks", "16").rounds) == (16, 1)
