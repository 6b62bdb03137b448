"""The torch versions users run (issue 23): a floor refused below it, features probed once, and
results judged by what is true on the installed torch.

The whole file runs twice in CI: in the main suite (the newest torch) and in the smoke stage on
the floor version (``.ci/run``, torch 2.6 from PyPI in a venv of its own). Every expectation that
differs between them is taken from ``torch_features.features()``, and that module's claims are
checked here against what the installed torch does.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import REPO, finish_process
from distcheck import torch_features
from distcheck.diagnose.backend_error import OLD_SIZE_TEXT, SIZE_TEXT, SIZE_TEXTS, find_backend_mismatches
from distcheck.models import Event, RankOutcome
from distcheck.scenario import ScenarioSpec, skip_reason
from distcheck.torch_features import MIN_TORCH, TorchFeatures, features, floor_problem, release

SCRIPTS = Path(__file__).parent / "scripts"
STALL = 5
FEATURES = features()


# -- the floor ------------------------------------------------------------------------------

@pytest.mark.parametrize("version, parts", [("2.6.0+cu124", (2, 6, 0)), ("2.13.0+cpu", (2, 13, 0)),
                                            ("2.10.0a0+git1234", (2, 10, 0)), ("2.4", (2, 4, 0))])
def test_release_reads_a_torch_version(version, parts):
    assert release(version) == parts


@pytest.mark.parametrize("version", ["2.4.1", "2.5.1+cu124", "1.13.1"])
def test_below_the_floor_is_one_line_naming_both_versions(version):
    problem = floor_problem(version)
    assert problem and "\n" not in problem
    assert version in problem and "2.6" in problem


@pytest.mark.parametrize("version", ["2.6.0", "2.6.0+cu124", "2.9.1", "2.13.0+cpu", "3.0.0"])
def test_the_floor_and_above_are_supported(version):
    assert floor_problem(version) is None


def test_the_floor_is_the_one_pyproject_declares():
    text = (REPO / "pyproject.toml").read_text()
    assert f'"torch>={MIN_TORCH[0]}.{MIN_TORCH[1]}"' in text


def _fake_torch(tmp_path: Path, version: str) -> Path:
    """A site directory that holds only the metadata of an installed torch ``version``: what
    ``pip install torch==VERSION`` leaves for ``importlib.metadata``. Nothing here imports it."""
    site = tmp_path / "site"
    info = site / f"torch-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: torch\nVersion: {version}\n")
    return site


@pytest.mark.parametrize("argv", [["run"], ["run", "auroc_rank0_only_compute", "--nproc-per-node", "2"]])
def test_distcheck_run_refuses_an_old_torch_with_one_line_and_exit_2(tmp_path, argv):
    site = _fake_torch(tmp_path, "2.4.1")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(REPO)])}
    proc = subprocess.Popen([sys.executable, "-m", "distcheck", *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path, start_new_session=True)
    done = finish_process(proc, str(tmp_path), timeout=60)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert "torch 2.4.1 is installed" in lines[0] and "torch 2.6 or newer" in lines[0]


# -- what features() says, and that it is true ------------------------------------------------

def test_features_are_probed_once():
    assert features() is FEATURES


def test_every_feature_has_a_line_and_a_missing_one_says_which_torch_has_it():
    f = TorchFeatures(version="2.6.0", flight_recorder=True, sequence_counter=True)
    lines = f.lines()
    assert len(lines) == len(torch_features.LABELS)
    assert "Flight Recorder on gloo: no (torch 2.8 or newer has it)" in lines
    assert "Flight Recorder: yes" in lines
    assert f.missing_note("flight_recorder_gloo") == "torch 2.6.0 has no Flight Recorder on gloo (torch 2.8 or newer has it)"
    assert TorchFeatures.from_dict({**f.to_dict(), "future_feature": True}) == f


def test_the_store_features_are_what_a_bound_store_gets():
    from distcheck.launch.rendezvous import bound_tcp_store

    store = bound_tcp_store("127.0.0.1", 0, timeout_s=5)   # raised on torch < 2.8 before issue 23
    store.set("k", "v")
    assert store.get("k") == b"v"
    assert store.libuvBackend == FEATURES.libuv_listen_fd
    assert FEATURES.libuv_store   # every torch distcheck supports has it; only the bound socket varies


def test_the_flight_recorder_claims_hold_on_a_real_gloo_group(tmp_path):
    """One gloo rank in a subprocess (a recorder entry in this process would be the tests' own)."""
    code = textwrap.dedent(f"""
        import datetime, json, pickle, torch, torch.distributed as dist
        from distcheck import torch_features
        dist.init_process_group("gloo", init_method="file://{tmp_path / 'store'}", rank=0, world_size=1,
                                timeout=datetime.timedelta(seconds=30))
        before = dist.group.WORLD._get_sequence_number_for_group()
        dist.all_reduce(torch.ones(3))
        after = dist.group.WORLD._get_sequence_number_for_group()
        dump = torch_features.fr_dump_function()
        entries = pickle.loads(dump(True, False, False)).get("entries", []) if dump else []
        print(json.dumps({{"counted": after - before, "names": [e.get("profiling_name") for e in entries]}}))
        dist.destroy_process_group()   # without it, gloo's threads abort the exit now and then (torch's own)
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "TORCH_FR_BUFFER_SIZE": "16"}, start_new_session=True)
    done = finish_process(proc, str(tmp_path), timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert FEATURES.sequence_counter and seen["counted"] == 1
    assert ("gloo:all_reduce" in seen["names"]) == FEATURES.flight_recorder_gloo
    assert FEATURES.flight_recorder   # NCCL's at least, on every supported torch


def test_fsdp2_on_cpu_is_what_the_cpu_stream_offers():
    import torch

    assert FEATURES.fully_shard and FEATURES.functional_collectives
    assert FEATURES.fully_shard_cpu == hasattr(torch.cpu.Stream, "record_event")
    from torch.distributed.fsdp import fully_shard   # noqa: F401  (the probe found it without importing it)


# -- gating scenarios by what torch offers -----------------------------------------------------

def test_a_scenario_needing_a_torch_feature_is_skipped_exactly_where_it_is_missing():
    fsdp = ScenarioSpec(name="s", file="s.py", requires=("torch:fully_shard",))
    recorder = ScenarioSpec(name="r", file="r.py", requires=("torch:flight_recorder",))
    on_cpu = skip_reason(fsdp, "gloo", 4)
    assert (on_cpu is None) == FEATURES.fully_shard_cpu
    if on_cpu:
        assert "FSDP2 on CPU tensors" in on_cpu and "torch 2.7 or newer" in on_cpu
    assert skip_reason(fsdp, "nccl", 4) is None            # CUDA tensors: fully_shard itself is enough
    assert (skip_reason(recorder, "gloo", 4) is None) == FEATURES.flight_recorder_gloo
    assert skip_reason(recorder, "nccl", 4) is None
    assert "unknown torch feature" in skip_reason(ScenarioSpec(name="u", file="u.py", requires=("torch:warp",)),
                                                   "gloo", 4)


# -- a C++-issued call without a recorder: the stack is the evidence ----------------------------

def _frames(*files: str) -> list[tuple[str, int, str]]:
    return [(f, 1, "f") for f in files]


def test_without_a_recorder_a_rank_counts_as_waiting_only_while_torch_code_inside_the_issuer_is_innermost():
    from distcheck.files.stacks import torch_dir
    from distcheck.rank.native import inside_issuer, unknown_call_label

    t = torch_dir()
    backward = _frames(f"{t}autograd/graph.py", f"{t}_tensor.py", "/home/u/train.py")
    assert inside_issuer(backward)
    assert not inside_issuer(_frames("<frozen importlib._bootstrap>", f"{t}nn/parallel/distributed.py"))  # an import
    assert not inside_issuer(_frames("/home/u/hooks.py", f"{t}autograd/graph.py"))      # the user's hook runs
    assert not inside_issuer(_frames(f"{t}nn/functional.py", "/home/u/train.py"))     # torch, but no issuer
    assert not inside_issuer([])
    assert unknown_call_label(backward, recorder=False) == (
        "DDP's reducer in backward() (a collective issued from C++; without a Flight Recorder nothing says which)")
    assert unknown_call_label(backward, recorder=True) == (   # the issuer from the stack all the same
        "DDP's reducer in backward() (a collective issued from C++; the Flight Recorder has no entry for it)")


# -- older gloo's words ------------------------------------------------------------------------

OLD_ABORT = "[enforce fail at /pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:446] op.preamble.length <= op.nbytes. 388 vs 4"


def test_older_gloos_size_abort_is_read_like_the_newer_one():
    recv = Event(rank=0, group="p2p:any>0", seq=3, op="recv", shapes=((1,),), dtypes=("float32",),
                 group_ranks=(0,), t_enter=1.0)
    sends = {r: [Event(rank=r, group=f"p2p:{r}>0", seq=1, op="send", shapes=((97,) if r == 3 else (1,),),
                       dtypes=("float32",), root=0, group_ranks=(r, 0), t_enter=1.0, t_exit=1.1)] for r in (1, 2, 3)}
    outcomes = {0: RankOutcome(rank=0, state="crashed", signal="SIGABRT", exception=OLD_ABORT, last_event=recv),
                **{r: RankOutcome(rank=r, state="finished") for r in (1, 2, 3)}}
    [m] = find_backend_mismatches(outcomes, {0: [recv], **sends})
    assert m.data["receivers"] == {"0": {"received": 388, "expected": 4}} and m.odd_ranks == (3,)
    assert f'("{OLD_SIZE_TEXT}")' in m.summary
    assert SIZE_TEXTS == (SIZE_TEXT, OLD_SIZE_TEXT)


# -- end to end, judged by the installed torch ---------------------------------------------------

def _hang(report: dict) -> dict:
    [s] = report["scenarios"]
    [hang] = [f for f in s["findings"] if f["kind"] == "hang"]
    return hang


@pytest.mark.e2e
def test_the_seed_hang_is_named(distcheck):
    r = distcheck("run", "auroc_rank0_only_compute", "--nproc-per-node", "2", "--stall-timeout", str(STALL))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    hang = _hang(r.report)
    assert (hang["waiting_ranks"], hang["absent_ranks"], hang["label"]) == ([0], [1], "BinaryAUROC.compute")
    assert r.report["run"]["torch_version"] == FEATURES.version


@pytest.mark.e2e
@pytest.mark.parametrize("recorder", ["--flight-recorder", "--no-flight-recorder"])
def test_a_hang_in_ddps_cpp_reducer_is_named_within_a_second_of_the_stall_timeout(distcheck, recorder):
    """With a recorder for gloo the call is named (op, bucket size); without one (torch < 2.8, or
    --no-flight-recorder) the rank's stack says DDP's reducer issued it, and a coverage note says why."""
    r = distcheck("run", "ddp_uneven_inputs", "--nproc-per-node", "2", "--stall-timeout", str(STALL), recorder)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    [s] = r.report["scenarios"]
    hang = _hang(r.report)
    assert (hang["waiting_ranks"], hang["absent_ranks"]) == ([0], [1])
    assert hang["detected_after_s"] <= STALL + 1
    assert hang["callsite"].split(":")[0].endswith("_catalogue.py")   # the loss.backward() line
    watched = recorder == "--flight-recorder" and FEATURES.flight_recorder_gloo
    notes = [f["summary"] for f in s["findings"] if f["kind"] == "coverage"]
    if watched:
        assert (hang["op"], hang["label"]) == ("all_reduce", "DDP gradient all_reduce, bucket of 5 elements")
        assert notes == []
    else:
        assert hang["label"].startswith("DDP's reducer in backward() (a collective issued from C++")
        why = (FEATURES.missing_note("flight_recorder_gloo") if not FEATURES.flight_recorder_gloo
               else "the Flight Recorder is off")   # the torch's own lack comes first
        assert len(notes) == 1 and why in notes[0], notes


def _torchrun(*args: str) -> tuple[str, ...]:
    return (sys.executable, "-m", "torch.distributed.run", "--standalone", *args)


@pytest.mark.e2e
def test_a_rank0_only_barrier_under_torchrun_is_named(distcheck):
    script = SCRIPTS / "rank0_barrier.py"
    r = distcheck("run", "--stall-timeout", str(STALL), "--", *_torchrun("--nproc-per-node", "2", str(script)))
    assert r.returncode == 1, r.stdout[-3000:] + r.stderr[-2000:]
    hang = _hang(r.report)
    assert (hang["op"], hang["waiting_ranks"], hang["absent_ranks"]) == ("barrier", [0], [1])
    line = next(i for i, text in enumerate(script.read_text().splitlines(), 1) if "# BARRIER" in text)
    assert hang["callsite"].startswith(f"{script}:{line}:")


@pytest.mark.e2e
def test_a_healthy_script_runs_clean(distcheck):
    r = distcheck("run", str(SCRIPTS / "rank0_barrier.py"), "--nproc-per-node", "2", "--stall-timeout", str(STALL),
                  "--", "--all")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    [s] = r.report["scenarios"]
    assert s["ok"] and s["findings"] == [] and s["collectives_compared"] >= 1


def test_every_report_lists_the_torch_features():
    from rich.console import Console

    from distcheck.models import Report, RunInfo
    from distcheck.report import html_timeline, json_report, junit, terminal

    flags = TorchFeatures(version="2.6.0", libuv_store=True, flight_recorder=True, sequence_counter=True).flags()
    run = RunInfo(backend="gloo", world_size=2, nnodes=1, nproc_per_node=2, torch_version="2.6.0",
                  distcheck_version="0.1.0", command="distcheck run", run_dir="/r", seed=0, duration_s=1.0,
                  started_at="2026-12-01T00:00:00", torch_features=flags)
    report = Report(run=run, scenarios=())
    console = Console(width=400, record=True)
    console.print(terminal.summary_line(report, verbose=True))   # the torch line is -v's (and distcheck env's)
    line = console.export_text()
    assert "torch 2.6.0 · yes: libuv TCPStore, Flight Recorder, group sequence counter · no: " in line
    assert "Flight Recorder on gloo (torch 2.8+)" in line
    assert 'name="torch feature: Flight Recorder on gloo" value="no"' in junit.render(report)
    assert "Flight Recorder on gloo (torch 2.8+)" in html_timeline.render(report, {})
    saved = json.loads(json_report.render(report))
    assert saved["run"]["torch_features"]["flight_recorder_gloo"] is False
    assert Report.from_dict(saved).run.torch_features == flags


def test_env_lists_what_this_torch_offers(distcheck):
    r = distcheck("env", "--json", json=False)
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["torch_features"] == FEATURES.flags() and info["torch_problem"] is None
    text = distcheck("env", json=False).stdout
    [row] = [line for line in text.splitlines() if line.startswith("Flight Recorder on gloo ")]
    assert row.split()[4:] == (["yes"] if FEATURES.flight_recorder_gloo else ["no", "(torch", "2.8", "or", "newer)"])


def test_a_store_that_cannot_be_bound_names_the_port(tmp_path):
    """The legacy store (torch < 2.8) and libuv both refuse a port in use the same way: before any rank."""
    import socket

    from distcheck.errors import LaunchError
    from distcheck.launch.rendezvous import bound_tcp_store

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    try:
        with pytest.raises(LaunchError, match="already in use"):
            bound_tcp_store("127.0.0.1", taken.getsockname()[1], timeout_s=5)
    finally:
        taken.close()

