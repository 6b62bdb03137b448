"""Rule 0: distcheck never changes the program it watches (issue 29).

Each hook distcheck runs inside the user's process meets a real error of its own (one of distcheck's
internal functions replaced by one that raises), and the user's program runs on untouched: the same
results, its own exceptions unchanged, and a ``coverage`` note in the report naming what was not
recorded. One launch breaks every hook that runs on a rank (tests/rule0_faults.py); the others are
broken in this process, on a real gloo group.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from conftest import HARD_TIMEOUT_S, finish_process, free_port
from distcheck.diagnose.coverage import find_coverage_gaps
from distcheck.models import HOOK_LOST, RankOutcome
from distcheck.rank import guard, injected
from distcheck.rank.guard import Hook
from distcheck.rank.tracer import Tracer

SCRIPTS = Path(__file__).parent / "scripts"
INJECT = Path(injected.__file__).parent / "inject"


class Planted(RuntimeError):
    """distcheck's own error, planted in one of its functions."""


def planted(*args, **kwargs):
    raise Planted("planted")


@pytest.fixture(autouse=True)
def fresh_counts():
    guard.reset()
    guard.set_publisher(None)
    yield
    guard.reset()


def _outcome(rank: int, failures: dict | None) -> RankOutcome:
    return RankOutcome(rank=rank, state="finished", hook_failures=failures)


# -- in this process ---------------------------------------------------------------------------------


def test_a_failing_tracer_returns_the_users_result_and_raises_the_users_own_exception(tmp_path, process_group):
    tracer = Tracer(tmp_path / "rank0.trace", 0)
    all_reduce = tracer.wrap("all_reduce", dist.all_reduce)
    broadcast = tracer.wrap("broadcast", dist.broadcast)
    tracer._define = planted          # every call seen first fails to be recorded
    t = torch.arange(3.0)
    assert all_reduce(t) is None and t.tolist() == [0.0, 1.0, 2.0]
    assert guard.failures()["tracer"]["count"] == 1
    assert guard.failures()["tracer"]["error"] == "Planted: planted"

    del tracer._define                # recorded now; its exit record fails to be written
    tracer._exit = planted
    with pytest.raises(Exception) as plain:
        dist.broadcast(t, src=7)      # the user's mistake: no rank 7
    with pytest.raises(Exception) as traced:
        broadcast(t, src=7)
    assert type(traced.value) is type(plain.value) and str(traced.value) == str(plain.value)
    assert traced.value.__context__ is None and traced.value.__cause__ is None
    assert traceback.extract_tb(traced.value.__traceback__)[-1][:3] == traceback.extract_tb(plain.value.__traceback__)[-1][:3]
    assert guard.failures()["tracer"]["count"] == 2
    tracer.close()


def test_a_failing_rank_end_hook_lets_the_users_exception_through_unchanged(monkeypatch):
    monkeypatch.setattr(injected, "_record", planted)
    error = KeyError("the user's own")

    def rank_body():
        raise error

    with pytest.raises(KeyError) as raised:
        injected._recording(rank_body)()           # what torch.multiprocessing.spawn runs
    assert raised.value is error and raised.value.__context__ is None
    seen = []
    injected._recording_excepthook(lambda *a: seen.append(a))(KeyError, error, None)
    assert seen == [(KeyError, error, None)]      # the previous excepthook still prints the user's error
    assert guard.failures()["rank_end"]["count"] == 2


def test_a_failing_post_import_hook_leaves_the_users_import_as_it_was():
    """The hooks that patch torchmetrics and Lightning run right after their import: failing, the import
    still gives the user the module, whole."""
    from distcheck.rank.integrations import _PostImportHook

    sys.modules.pop("colorsys", None)
    hook = _PostImportHook({"colorsys": planted}, Hook.METRICS)
    sys.meta_path.insert(0, hook)
    try:
        import colorsys
    finally:
        sys.meta_path.remove(hook)
    assert colorsys.rgb_to_hsv(1.0, 0.0, 0.0) == (0.0, 1.0, 1.0)
    assert guard.failures()["metrics"] == {"count": 1, "error": "Planted: planted"}


def test_counts_reach_the_status_at_the_first_second_fourth_failure():
    sent = []
    guard.set_publisher(sent.append)
    for _ in range(5):
        guard.failed(Hook.SAMPLES, ValueError("bad\nsecond line"))
    assert [s["samples"]["count"] for s in sent] == [1, 2, 4]
    assert guard.failures() == {"samples": {"count": 5, "error": "ValueError: bad"}}


def test_hook_failures_are_one_coverage_note_per_hook_naming_what_was_not_recorded():
    outcomes = {0: _outcome(0, {"tracer": {"count": 3, "error": "OSError: disk full"}}),
                1: _outcome(1, {"tracer": {"count": 1, "error": "OSError: disk full"},
                                "metrics": {"count": 2, "error": "TypeError: x"}}),
                2: _outcome(2, None)}
    found = {f.data["hook"]: f for f in find_coverage_gaps(outcomes)}
    assert set(found) == {"tracer", "metrics"}
    tracer = found["tracer"]
    assert (tracer.kind, tracer.severity, tracer.odd_ranks, tracer.data["count"]) == ("coverage", "info", (0, 1), 4)
    assert "OSError: disk full" in tracer.summary and HOOK_LOST[Hook.TRACER] in tracer.summary
    assert "not affected" in tracer.summary
    assert found["metrics"].odd_ranks == (1,)


def test_the_metric_recorder_copies_strided_states_without_numpy_or_touching_them():
    code = """
import sys
sys.modules["numpy"] = None      # numpy is no dependency of distcheck
import torch
from distcheck.files.metric_records import pack, unpack
x = torch.randn(10, 5)
before, views = x.clone(), [x[:, 0], x.t()[1], x.t(), x[2:4], torch.ones(1).expand(3), torch.arange(6)[::2]]
strides = [v.stride() for v in views]
for v in views:
    assert torch.equal(unpack(pack(v)), v)
assert torch.equal(x, before) and [v.stride() for v in views] == strides
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


def test_a_broken_distcheck_import_leaves_the_users_process_as_it_was(tmp_path):
    """The injected sitecustomize runs in every Python process of ``distcheck run -- CMD``: a distcheck
    that cannot even be imported there (here: a broken one first on the path) changes nothing."""
    broken = tmp_path / "broken" / "distcheck"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text("raise ImportError('a broken distcheck install')\n")
    program = "import sys; print('the user', sys.argv[1:]); sys.exit(3)"
    plain = subprocess.run([sys.executable, "-c", program, "a"], capture_output=True, text=True, timeout=60)
    env = {**os.environ, "PYTHONPATH": f"{INJECT}{os.pathsep}{broken.parent}",
           "DISTCHECK_LAUNCH_DIR": str(tmp_path / "launch")}
    under = subprocess.run([sys.executable, "-c", program, "a"], capture_output=True, text=True, timeout=60, env=env)
    assert (under.returncode, under.stdout) == (plain.returncode, plain.stdout) == (3, "the user ['a']\n")
    assert "distcheck: not tracing process" in under.stderr


@pytest.mark.e2e   # importing Lightning takes seconds
def test_a_failing_lightning_attribution_leaves_self_log_as_it_was(monkeypatch):
    import warnings

    from lightning.pytorch import LightningModule
    import lightning.pytorch.core.module as module

    from distcheck.rank import integrations

    original = LightningModule.log, LightningModule.log_dict
    with warnings.catch_warnings(record=True) as plain:
        warnings.simplefilter("always")
        expected = (LightningModule().log("loss", 1.0), LightningModule().log_dict({"a": 1.0}))
    integrations._patch_lightning_log(module)
    try:
        monkeypatch.setattr(integrations, "_caller_site", planted)
        with warnings.catch_warnings(record=True) as under:
            warnings.simplefilter("always")
            got = (LightningModule().log("loss", 1.0), LightningModule().log_dict({"a": 1.0}))
    finally:
        LightningModule.log, LightningModule.log_dict = original
    assert got == expected
    assert [str(w.message) for w in under] == [str(w.message) for w in plain]
    assert guard.failures()["lightning"]["count"] == 3   # log, log_dict, and the self.log log_dict makes


# -- on real ranks -------------------------------------------------------------------------------------


def _torchrun(*script_args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
            "--master-port", str(free_port()), str(SCRIPTS / "rule0_job.py"), *script_args]


def _job(tmp_path: Path, name: str, *, distcheck: bool, broken: bool = False) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / name
    env = {**os.environ, "RULE0_OUT": str(out), "RULE0_BREAK": "1" if broken else "0"}
    run_dir = tmp_path / f"{name}-run"
    cmd = ([sys.executable, "-m", "distcheck", "run", "--run-dir", str(run_dir), "--json", str(tmp_path / f"{name}.json"),
            "--stall-timeout", "20", "--", *_torchrun()] if distcheck else _torchrun())
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            cwd=tmp_path, env=env)
    done = finish_process(proc, str(run_dir), HARD_TIMEOUT_S)
    seen = {p.name: json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))}
    return done, seen


@pytest.mark.e2e
def test_every_hook_on_a_rank_failing_changes_nothing_in_the_job_and_is_reported(tmp_path):
    plain, expected = _job(tmp_path, "plain", distcheck=False)
    assert plain.returncode == 0 and len(expected) == 2, plain.stderr[-3000:]
    # torchmetrics' non-contiguous states, and the user's own errors, as the user sees them
    assert expected["rank0.json"]["state_strides"] == [[5], [5]]
    assert expected["rank0.json"]["sampler_error"] == "LookupError: the user's sampler ran dry"
    assert expected["rank0.json"]["metric_update_error"] == "ValueError: the user's update needs a tensor"

    traced, seen = _job(tmp_path, "traced", distcheck=True)
    assert traced.returncode == 0 and seen == expected, traced.stdout[-3000:] + traced.stderr[-2000:]
    report = json.loads((tmp_path / "traced.json").read_text())
    [s] = report["scenarios"]
    assert [f for f in s["findings"] if f["severity"] == "error" or "hook" in f.get("data", {})] == []
    assert s["collectives_compared"] >= 3   # recorded, the strided states included

    broken, seen = _job(tmp_path, "broken", distcheck=True, broken=True)
    assert broken.returncode == 0 and seen == expected, broken.stdout[-3000:] + broken.stderr[-2000:]
    report = json.loads((tmp_path / "broken.json").read_text())
    [s] = report["scenarios"]
    notes = {f["data"]["hook"]: f for f in s["findings"] if f["kind"] == "coverage" and "hook" in f["data"]}
    assert set(notes) == {"stack_dumps", "tracer", "sidecar", "samples", "metrics"}, s["findings"]
    for hook, note in notes.items():
        assert note["severity"] == "info" and note["odd_ranks"] == [0, 1], note
        assert "Planted" in note["data"]["error"] or "PlantedFault" in note["data"]["error"], note
        assert note["data"]["lost"] == HOOK_LOST[Hook(hook)]
    assert [f for f in s["findings"] if f["severity"] == "error"] == []
