"""Pass stays pass on suites nobody here wrote: each suite ships inside a package users have, runs
plainly and under ``distcheck run -- CMD`` in the same test, and must have the same outcome, with no
error-level finding where the plain run passed. Where the plain run hangs, distcheck must say so.

Slow (each case starts several multi-rank jobs): ``pytest -m public``. Every test prints its wall time.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import kill_everything_below

pytestmark = [pytest.mark.e2e, pytest.mark.public, pytest.mark.timeout(1800)]   # several jobs per test

ROOT = Path(__file__).resolve().parent.parent
PUBLIC = ROOT / "tests" / "scripts" / "public"
SUITE_TIMEOUT_S = 600
ACCELERATE_LAUNCH = ["-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
                     "--mixed_precision", "no", "--num_machines", "1", "--dynamo_backend", "no"]
# torch's DistributedTest on 2 gloo ranks: collectives, groups, and barriers one rank enters alone
# with a time-out (the test expects the time-out and catches it).
TORCH_SUBSET = ["test_barrier", "test_barrier_full_group", "test_barrier_timeout_global",
                "test_barrier_timeout_full_group", "test_all_reduce_sum", "test_broadcast", "test_all_gather",
                "test_gather", "test_scatter", "test_get_backend", "test_monitored_barrier_gloo_subgroup"]


def _accelerate_script(name: str) -> Path:
    accelerate = pytest.importorskip("accelerate")
    return Path(accelerate.__file__).parent / "test_utils" / "scripts" / name


def _run(cmd: list[str], cwd: Path, env: dict[str, str], timeout: float) -> tuple[int | None, str]:
    """(exit code, output); None when it ran past ``timeout`` and its whole tree was killed."""
    proc = subprocess.Popen(cmd, cwd=cwd, env={**os.environ, **env}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
        return proc.returncode, out
    except subprocess.TimeoutExpired:
        kill_everything_below(proc)
        out, _ = proc.communicate()
        return None, out
    finally:
        kill_everything_below(proc)


def _side_by_side(tmp_path: Path, cmd: list[str], env: dict[str, str] | None = None, cwd: Path = ROOT,
                  distcheck_args: tuple[str, ...] = ()) -> tuple[tuple[int | None, str], tuple[int | None, str], dict]:
    """The command plainly, then under ``distcheck run``: both outcomes and distcheck's JSON report."""
    env = env or {}
    t0 = time.time()
    plain = _run([sys.executable, *cmd], cwd, env, SUITE_TIMEOUT_S)
    t1 = time.time()
    report = tmp_path / "report.json"
    under = _run([sys.executable, "-m", "distcheck", "run", "--run-dir", str(tmp_path / "run"), "--json",
                  str(report), *distcheck_args, "--", sys.executable, *cmd], cwd, env, SUITE_TIMEOUT_S + 60)
    print(f"plain {t1 - t0:.1f} s, under distcheck {time.time() - t1:.1f} s")

    return plain, under, json.loads(report.read_text()) if report.exists() else {}


def _findings(report: dict) -> list[dict]:
    return [f for s in report.get("scenarios", ()) for f in s.get("findings", ())]


def _errors(report: dict) -> list[str]:
    return [f"{f['kind']}: {f['summary'][:300]}" for f in _findings(report) if f.get("severity") == "error"]


def _same_pass(plain: tuple[int | None, str], under: tuple[int | None, str], report: dict) -> None:
    assert plain[0] == 0, plain[1][-3000:]
    assert under[0] == 0, under[1][-4000:]
    assert _errors(report) == [], _errors(report)


def test_pytorch_object_collectives_on_disjoint_local_subgroups(tmp_path):
    cmd = ["-m", "pytest", "-q", str(PUBLIC / "test_object_subgroups.py"), "--rootdir", str(PUBLIC),
           "-c", str(PUBLIC / "pytest.ini")]
    plain, under, report = _side_by_side(tmp_path, cmd)
    _same_pass(plain, under, report)
    assert "3 passed" in plain[1] and "3 passed" in under[1]
    assert not any(f["kind"] == "mismatch" for f in _findings(report))


def test_pytorch_distributed_test_subset_on_gloo(tmp_path):
    (tmp_path / "tmp").mkdir()
    env = {"BACKEND": "gloo", "WORLD_SIZE": "2", "TEMP_DIR": str(tmp_path / "tmp"),
           "INIT_METHOD": f"file://{tmp_path / 'init'}"}
    # Node ids, not -k: a -k of these names also selects their _cuda, _complex, _coalesced... variants (41 tests)
    suite = PUBLIC / "test_torch_dist_spawn.py"
    cmd = ["-m", "pytest", "-q", "-rA", *(f"{suite}::TestDistBackendWithSpawn::{t}" for t in TORCH_SUBSET),
           "--rootdir", str(PUBLIC), "-c", str(PUBLIC / "pytest.ini")]
    plain, under, report = _side_by_side(tmp_path, cmd, env)
    _same_pass(plain, under, report)
    outcome = lambda out: sorted(re.findall(r"^(PASSED|FAILED|SKIPPED|ERROR) \S+::(\w+)", out, re.M))  # noqa: E731
    # distcheck keeps the command's own output in its run dir (and shows only its last lines)
    [log] = (tmp_path / "run").glob("*/logs/command.log")
    assert outcome(plain[1]) == outcome(log.read_text(errors="replace")) and len(outcome(plain[1])) == len(TORCH_SUBSET)
    assert not any("please report" in f["summary"] for f in _findings(report))
    alone = [f for f in _findings(report) if f["kind"] == "count" and f["op"] == "barrier"]
    assert all(f["severity"] == "info" and "alone" in f["summary"] for f in alone)


@pytest.mark.parametrize("script", ["test_script.py", "test_sync.py"])
def test_accelerate_shipped_scripts_on_two_cpu_ranks(tmp_path, script):
    cmd = [*ACCELERATE_LAUNCH, str(_accelerate_script(script))]
    plain, under, report = _side_by_side(tmp_path, cmd, {"ACCELERATE_USE_CPU": "1"})
    _same_pass(plain, under, report)
    dups = [f for f in _findings(report) if f["kind"] == "duplicates"]
    assert all("DistributedSampler" not in f["summary"] or "accelerate" not in (f["data"].get("sampler") or "")
               for f in dups)


def test_a_gather_planted_on_the_main_process_of_accelerates_script_is_named_at_its_line(tmp_path):
    source = _accelerate_script("test_script.py").read_text()
    planted = ("    from accelerate import Accelerator as _Planted\n"
               "    _accelerator = _Planted()\n"
               "    if _accelerator.is_main_process:\n"
               "        _accelerator.gather(torch.ones(1))   # planted: the other rank never calls it\n"
               "    state.destroy_process_group()\n\n\nif __name__")
    assert source.count("    state.destroy_process_group()\n\n\nif __name__") == 1
    script = tmp_path / "planted_script.py"
    script.write_text(source.replace("    state.destroy_process_group()\n\n\nif __name__", planted))
    line = script.read_text().splitlines().index(
        "        _accelerator.gather(torch.ones(1))   # planted: the other rank never calls it") + 1
    report_path = tmp_path / "report.json"
    t0 = time.time()
    code, out = _run([sys.executable, "-m", "distcheck", "run", "--run-dir", str(tmp_path / "run"), "--json",
                      str(report_path), "--", sys.executable, *ACCELERATE_LAUNCH, str(script)],
                     ROOT, {"ACCELERATE_USE_CPU": "1"}, SUITE_TIMEOUT_S)
    print(f"under distcheck {time.time() - t0:.1f} s")
    assert code not in (0, None), out[-3000:]

    hangs = [f for f in _findings(json.loads(report_path.read_text())) if f["kind"] == "hang"]
    assert hangs and f"planted_script.py:{line}" in (hangs[0].get("callsite") or hangs[0]["summary"]), hangs


def test_accelerates_data_loop_script_that_hangs_plainly_is_a_hang_under_distcheck(tmp_path):
    cmd = [*ACCELERATE_LAUNCH, str(_accelerate_script("test_distributed_data_loop.py"))]
    t0 = time.time()
    plain = _run([sys.executable, *cmd], ROOT, {"ACCELERATE_USE_CPU": "1"}, 90)
    assert plain[0] is None, f"expected the plain run to hang; it exited {plain[0]}: {plain[1][-2000:]}"
    t1 = time.time()
    report_path = tmp_path / "report.json"
    code, out = _run([sys.executable, "-m", "distcheck", "run", "--run-dir", str(tmp_path / "run"), "--json",
                      str(report_path), "--", sys.executable, *cmd], ROOT, {"ACCELERATE_USE_CPU": "1"}, SUITE_TIMEOUT_S)
    print(f"plain (killed) {t1 - t0:.1f} s, under distcheck {time.time() - t1:.1f} s")
    assert code not in (0, None), out[-3000:]

    assert any(f["kind"] == "hang" for f in _findings(json.loads(report_path.read_text()))), out[-3000:]
