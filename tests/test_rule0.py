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
import threading
import time
import traceback
from collections import deque
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from conftest import HARD_TIMEOUT_S, finish_process, free_port
from distcheck.diagnose.coverage import find_coverage_gaps
from distcheck.models import HOOK_LOST, RankOutcome
from distcheck.rank import guard, injected
from distcheck.rank.guard import Hook
from distcheck.rank.numbering import GroupEntry, Mark
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


def test_a_failing_tracer_returns_the_users_result_and_raises_the_users_own_exception(tmp_path, process_group,
                                                                                      hot_path):
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


def test_a_failing_fast_path_returns_the_users_result_and_counts_the_failure(tmp_path, process_group, hot_path):
    # A call like one seen before takes the fast path (in C; the Python path takes the slow one every time):
    # distcheck's errors there, before the call (the group's counter) and after it (the exit record), reach the
    # user as nothing.
    tracer = Tracer(tmp_path / "rank0.trace", 0)
    all_reduce = tracer.wrap("all_reduce", dist.all_reduce)
    assert (type(all_reduce).__name__ == "FastCall") == (hot_path == "c")
    t = torch.arange(3.0)

    def call():
        return all_reduce(t)   # one call site: the second call onwards is a fast one

    slow = (lambda c, total: c) if hot_path == "c" else (lambda c, total: total)
    assert call() is None and tracer.slow_calls == 1
    (entry,) = tracer.numbering.groups.values()
    entry.counter = planted
    assert call() is None and t.tolist() == [0.0, 1.0, 2.0] and tracer.slow_calls == slow(1, 1)   # it failed: not written
    assert guard.failures()["tracer"] == {"count": 1, "error": "Planted: planted"}
    entry.counter = None        # numbered by the tracer's own count from here
    tracer.handles.hold = planted   # an async call's handle cannot be held (after the call)
    works = [all_reduce(t, async_op=True) for _ in range(2)]   # the first a slow call, the second a fast one
    assert all(w.wait() for w in works) and tracer.slow_calls == slow(2, 3)
    assert guard.failures()["tracer"]["count"] == 3
    tracer.close()


def test_a_failing_p2p_wait_record_returns_torchs_own_wait_result(tmp_path, process_group, monkeypatch):
    from distcheck.rank import handles as handles_module
    from distcheck.rank.ops import OPS

    tracer = Tracer(tmp_path / "rank0.trace", 0)
    tracer.install()
    try:
        # an isend's signature issuing a real async call, whose Work stands for the P2P handle (a one-rank
        # group has no peer); the wait's W records are what fails here, before and after torch's wait
        isend = tracer.wrap("isend", lambda tensor, dst=None, group=None, tag=0, group_dst=None:
                            dist.all_reduce(tensor, async_op=True), OPS["isend"], signature_of=dist.isend)
        handle = isend(torch.ones(4), 0)
        monkeypatch.setattr(handles_module, "wait_slots", planted)
        assert handle.wait() is True                      # torch's own result, through the failing wrapper
        assert guard.failures()["tracer"] == {"count": 2, "error": "Planted: planted"}   # the wait's in and out
    finally:
        tracer.uninstall()
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

    # sys.exit: a rank's status that cannot be written (a clean exit notes its line, a failing one its failure)
    class FailingStatus:
        data = type("Data", (), {"pid": os.getpid()})()
        update = staticmethod(planted)

    from distcheck.rank.runtime import PROCESS

    monkeypatch.setattr(PROCESS, "current", type("Runtime", (), {"status": FailingStatus(), "ours": True})())
    exits = []
    for code in (0, 3):
        injected._recording_exit(exits.append)(code)
    assert exits == [0, 3]                        # the exit the user asked for, each time
    assert guard.failures()["rank_end"]["count"] == 4


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


def test_a_failing_group_counter_in_the_numbering_is_counted_and_noted(tmp_path):
    """Each place the numbering reads a group's counter and gives up (the call keeps its number, later ones
    may shift) is a counted failure, so the report's coverage note says the comparison may be off."""
    tracer = Tracer(tmp_path / "rank0.trace", 0)
    numbering = tracer.numbering
    entry = GroupEntry("g", None, 0, planted, 0, deque(), 0, 0, 0)   # the group's counter raises
    numbering.settle(Mark(entry, 0), 1, p2p=True)                  # its skew, then the P2P call's other numbers
    numbering.claim_batch([Mark(entry, 0)])
    numbering._multi = entry
    numbering.resync()
    numbering.group = planted
    numbering._claim_p2p_number(object(), None)
    numbering.groups = None                                        # .get fails in mark
    assert numbering.mark(object()) is None
    assert guard.failures()["numbering"] == {"count": 6, "error": "Planted: planted"}
    (note,) = find_coverage_gaps({0: _outcome(0, guard.failures())})
    assert note.kind == "coverage" and HOOK_LOST[Hook.NUMBERING] in note.summary
    tracer.close()


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


def test_a_metric_call_the_recorder_failed_on_is_not_replayed_against_the_metric(tmp_path):
    """One update() the recorder could not copy: the metric's result is its own, and the record that no
    longer explains its state is marked, so the report says distcheck could not check it instead of
    blaming the metric (a replay without that update would differ)."""
    code = """
import json, sys
from pathlib import Path
import torch
from distcheck.rank import guard, metrics
metrics.install(Path(sys.argv[1]))
from torchmetrics.aggregation import SumMetric
copy_inputs, calls = metrics.RECORDER._copy_inputs, []
def first_fails(*args, **kwargs):
    calls.append(1)
    if len(calls) == 1:
        raise RuntimeError("planted")
    return copy_inputs(*args, **kwargs)
metrics.RECORDER._copy_inputs = first_fails
m = SumMetric()
m.update(torch.tensor(1.0))
m.update(torch.tensor(2.0))
value = m.compute().item()
[info] = metrics.RECORDER.drain()
print(json.dumps({"value": value, "note": info["note"], "computes": len(info["computes"]), **guard.failures()}))
"""
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    seen = json.loads(done.stdout)
    assert (seen["value"], seen["computes"], seen["metrics"]["count"]) == (3.0, 1, 1)
    assert seen["note"] == "distcheck could not record one of its calls (RuntimeError: planted)"


def test_a_broken_distcheck_import_leaves_the_users_process_as_it_was(tmp_path):
    """The injected sitecustomize runs in every Python process of ``distcheck run -- CMD``: a distcheck
    that cannot even be imported there (here: a broken one first on the path) changes nothing. It is imported
    once the program imports torch.distributed."""
    broken = tmp_path / "broken" / "distcheck"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text("raise ImportError('a broken distcheck install')\n")
    program = "import sys, torch.distributed; print('the user', sys.argv[1:]); sys.exit(3)"
    plain = subprocess.run([sys.executable, "-c", program, "a"], capture_output=True, text=True, timeout=60,
                           cwd=tmp_path)
    env = {**os.environ, "PYTHONPATH": f"{INJECT}{os.pathsep}{broken.parent}",
           "DISTCHECK_LAUNCH_DIR": str(tmp_path / "launch")}
    # from tmp_path: `-c` puts the working directory first on the path, and this checkout's is a working distcheck
    under = subprocess.run([sys.executable, "-c", program, "a"], capture_output=True, text=True, timeout=60, env=env,
                           cwd=tmp_path)
    assert (under.returncode, under.stdout) == (plain.returncode, plain.stdout) == (3, "the user ['a']\n")
    assert "distcheck: not tracing process" in under.stderr


def test_the_injected_start_up_imports_nothing_of_distcheck_until_torch_distributed_is_imported(tmp_path):
    """pytest loads distcheck's pytest11 plugin itself and rewrites its asserts: a distcheck package already
    imported at start-up would make it warn (and fail under -W error). The injection arms at the import of
    torch.distributed, and the user's init_process_group is then distcheck's."""
    program = ("import sys\n"
               "def ours(): return sorted(m for m in sys.modules if m == 'distcheck' or m.startswith('distcheck.'))\n"
               "print(ours())\n"
               "import torch.distributed as dist\n"
               "print('distcheck.rank.injected' in ours(), getattr(dist.init_process_group, '__distcheck__', False))\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(INJECT), os.environ.get("PYTHONPATH", "")]),
           "DISTCHECK_LAUNCH_DIR": str(tmp_path / "launch")}
    run = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120, env=env)
    assert (run.returncode, run.stdout, run.stderr) == (0, "[]\nTrue True\n", "")


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


def test_a_failing_flight_recorder_sidecar_thread_is_counted_and_prints_nothing(process_group, tmp_path, monkeypatch,
                                                                                  capfd):
    """The task that dumps the Flight Recorder on the launcher's request: its own error ends it quietly
    (a thread's uncaught exception would be printed into the user's output), on a thread the job never sees."""
    from distcheck import torch_features
    from distcheck.files.launch_dir import LaunchFiles
    from distcheck.rank.runtime import FLIGHT_RECORDER_TASK, start_flight_recorder_sidecar
    from distcheck.rank.ticker import TICKER

    files = LaunchFiles(tmp_path)
    files.flight_recorder_request.touch()
    monkeypatch.setattr(torch_features, "fr_dump_json_function", planted)
    before = threading.enumerate()
    start_flight_recorder_sidecar(files, 0)
    assert threading.enumerate() == before
    deadline = time.monotonic() + 30
    while TICKER.has(FLIGHT_RECORDER_TASK) and time.monotonic() < deadline:   # one request, one dump
        time.sleep(0.01)
    assert not TICKER.has(FLIGHT_RECORDER_TASK)
    assert guard.failures()["sidecar"] == {"count": 1, "error": "Planted: planted"}
    assert not files.flight_recorder(0).exists()
    assert capfd.readouterr().err == ""


def test_failing_exit_site_and_fork_hooks_change_nothing_and_are_counted(tmp_path, monkeypatch, capfd):
    """Where a rank called sys.exit (read from its SystemExit), and the tracer's hook in a forked child."""
    from distcheck.rank import callsite
    from distcheck.rank.exit_site import exit_site, exit_site_of_caller

    monkeypatch.setattr(callsite, "classify_file", planted)
    try:
        sys.exit(4)
    except SystemExit as exc:
        assert exit_site(exc) is None and exc.code == 4
    assert exit_site_of_caller(sys._getframe()) is None
    assert guard.failures()["rank_end"] == {"count": 2, "error": "Planted: planted"}

    tracer = Tracer(tmp_path / "rank0.trace", 0)
    tracer._after_fork = planted
    pid = os.fork()
    if pid == 0:   # the child: its hook failed, counted; it goes on (and says so by its exit code)
        os._exit(0 if guard.failures().get("tracer", {}).get("count") == 1 else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert "tracer" not in guard.failures()   # the parent's hook is the child's, not its own
    assert capfd.readouterr().err == ""
    tracer.close()


def test_failing_init_hooks_of_distchecks_own_rank_and_its_store_wait_leave_the_users_calls_as_they_were(
        tmp_path, monkeypatch, capfd):
    """distcheck's worker notes the user's init_process_group in the rank's status; a rank of the user's
    command waits in the job's store for its generation's number. Failing (a status that cannot be written,
    the wait's own time-out), the user's init returns its result and the rank is traced alone; and the one
    wrapper distcheck put there is taken back by ``disarm``."""
    import torch.distributed.distributed_c10d as c10d

    from distcheck.files.launch_dir import LaunchFiles
    from distcheck.rank.runtime import RankProcess

    calls = []

    def users_init(*args, **kwargs):   # stands in for torch's, which the module's process group holds
        calls.append((args, kwargs))
        return "the init's own result"

    class FailingStatus:
        update = staticmethod(planted)

    monkeypatch.setattr(c10d, "init_process_group", users_init)
    monkeypatch.setattr(dist, "init_process_group", users_init)
    process = RankProcess()
    process.on_init.append(lambda: FailingStatus.update(phase="running"))
    process.wrap_process_group_calls()
    assert dist.init_process_group is not users_init and c10d.init_process_group is not users_init
    assert dist.init_process_group("gloo", rank=0) == "the init's own result"
    assert calls == [(("gloo",), {"rank": 0})]
    assert guard.failures()["rank_setup"] == {"count": 1, "error": "Planted: planted"}
    process.disarm()
    assert dist.init_process_group is users_init and c10d.init_process_group is users_init

    store = dist.HashStore()
    store.add(injected.ARRIVALS_KEY, 1)   # another rank arrived first, and never names the generation
    launch = LaunchFiles(tmp_path / "launch")
    assert injected.generation_on(store, launch, world=2, wait_s=0.2) == 0   # a generation of its own
    assert guard.failures()["rank_setup"]["count"] == 2
    assert "never named it within 0.2 s" in capfd.readouterr().err


def test_a_first_rank_that_cannot_name_its_generation_costs_the_others_no_more_than_the_stall_timeout(
        tmp_path, monkeypatch, capfd):
    """Rank 0's store.set of the generation key fails (planted): it keeps its generation and says so; a peer
    then waits for the key no longer than the launch's stall timeout (passed to ranks in the environment)."""
    from distcheck.files.launch_dir import LaunchFiles

    class UnwritableStore(dist.HashStore):   # a real store whose set of distcheck's key fails
        def set(self, key, value):
            raise Planted("planted")

    store = UnwritableStore()
    launch = LaunchFiles(tmp_path / "launch")
    assert injected.generation_on(store, launch, world=2) == 0
    assert guard.failures()["rank_setup"]["count"] == 1
    assert "could not name this rank's generation" in capfd.readouterr().err

    monkeypatch.setenv(injected.STALL_TIMEOUT_ENV, "0.5")
    assert injected._start_up_wait() == 0.5
    started = time.monotonic()
    assert injected.generation_on(store, launch, world=2, wait_s=injected._start_up_wait()) == 1
    assert time.monotonic() - started < 5
    assert "never named it within 0.5 s" in capfd.readouterr().err
    monkeypatch.setenv(injected.STALL_TIMEOUT_ENV, "600")
    assert injected._start_up_wait() == injected.GENERATION_WAIT_S


def test_a_failing_status_publisher_is_not_the_hooks_failure():
    guard.set_publisher(planted)
    guard.failed(Hook.TRACER, ValueError("x"))   # the count stays; the status goes out with the next one
    assert guard.failures()["tracer"]["count"] == 1


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
    assert expected["rank1.json"]["recv"] == [5.0, 6.0] and expected["rank0.json"]["batch_isend_irecv"] == [11.0] * 3

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
    assert set(notes) == {"stack_dumps", "tracer", "sidecar", "samples", "metrics", "rank_setup"}, s["findings"]
    for hook, note in notes.items():
        assert note["severity"] == "info" and note["odd_ranks"] == [0, 1], note
        assert "Planted" in note["data"]["error"] or "PlantedFault" in note["data"]["error"], note
        assert note["data"]["lost"] == HOOK_LOST[Hook(hook)]
    assert [f for f in s["findings"] if f["severity"] == "error"] == []


@pytest.mark.e2e
def test_failing_init_destroy_exit_and_atexit_hooks_change_nothing_in_a_rank_and_are_reported(tmp_path):
    """One process, its group made twice: distcheck's init_process_group and destroy_process_group hooks
    fail for the first, its sys.exit and atexit hooks for the second. The job's results and exit code are
    its own; the report has the crash the job is (it exits 3) and a coverage note per failing hook."""
    script = SCRIPTS / "rule0_rank_end.py"

    def job(name: str, *, distcheck: bool, broken: bool = False) -> tuple[int, dict | None, dict]:
        out, report = tmp_path / f"{name}.json", tmp_path / f"{name}-report.json"
        cmd = [sys.executable, str(script)]
        if distcheck:
            cmd = [sys.executable, "-m", "distcheck", "run", "--run-dir", str(tmp_path / f"{name}-run"), "--json",
                   str(report), "--stall-timeout", "20", "--", *cmd]
        env = {**os.environ, "RULE0_OUT": str(out), "RULE0_BREAK": "1" if broken else "0"}
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True, cwd=tmp_path, env=env)
        done = finish_process(proc, str(tmp_path / f"{name}-run"), HARD_TIMEOUT_S)
        scenarios = json.loads(report.read_text())["scenarios"] if distcheck else []
        findings = [f for sc in scenarios for f in sc["findings"]]
        return done.returncode, json.loads(out.read_text()) if out.exists() else None, {
            "findings": findings, "output": done.stdout[-3000:] + done.stderr[-2000:]}

    code, expected, plain = job("plain", distcheck=False)
    if code < 0:   # once in a loaded suite run the plain job, without distcheck, died by SIGABRT at its exit
        code, expected, plain = job("plain-again", distcheck=False)
    assert code == 3 and expected["first"]["all_reduce"] == [0.0, 1.0, 2.0], (code, plain["output"])
    assert expected["initialized_after_destroy"] is False
    assert expected["left_main"] == "SystemExit: 3"
    code, seen, traced = job("traced", distcheck=True)
    assert (code, seen) == (1, expected), traced["output"]
    kinds = sorted((f["kind"], f["severity"]) for f in traced["findings"])
    assert kinds == [("crash", "error")], traced["findings"]   # the job's own failure, named

    code, seen, broken = job("broken", distcheck=True, broken=True)
    assert (code, seen) == (1, expected), broken["output"]
    notes = {f["data"]["hook"]: f for f in broken["findings"] if f["kind"] == "coverage" and "hook" in f["data"]}
    assert set(notes) == {"rank_setup", "rank_end"}, broken["findings"]
    assert "init_process_group hook" in notes["rank_setup"]["data"]["error"]
    assert notes["rank_end"]["data"]["count"] >= 2   # destroy's, then sys.exit's (atexit's is the third)
    assert [(f["kind"], f["severity"]) for f in broken["findings"] if f["kind"] != "coverage"] == [("crash", "error")]


@pytest.mark.e2e   # three processes of a few seconds each
def test_a_job_that_exits_without_destroying_its_group_exits_cleanly_while_the_sidecar_polls(tmp_path):
    # The C++-collective sidecar reads each group's counter through torch's C++ API, which lets go of the GIL.
    # A daemon thread inside that call when the interpreter finalized aborted the process ("terminate called
    # without an active exception", exit 134): seen twice in mp.spawn jobs under `distcheck run -- python`.
    # The script polls 64 groups without pause, which made 4 of 5 exits abort before the sidecar stopped at exit.
    script = SCRIPTS / "rule0" / "exit_while_sidecar_polls.py"
    for attempt in range(3):
        folder = tmp_path / str(attempt)
        folder.mkdir()
        done = subprocess.run([sys.executable, str(script), str(folder)], capture_output=True, text=True,
                              timeout=HARD_TIMEOUT_S)
        assert done.returncode == 0 and done.stdout == "done\n", (attempt, done.returncode, done.stderr[-2000:])
        assert "terminate called" not in done.stderr
