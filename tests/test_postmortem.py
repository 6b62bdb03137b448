"""distcheck analyze: post-mortem of Flight Recorder dumps and distcheck traces.

The dumps come from a real 4-rank gloo job (tests/fr_job.py) run once per
module, in which rank 0 is the odd one out twice: it alone enters
``all_reduce`` #6 on the world group, and it never enters ``all_reduce`` #2 on
the ``metrics`` group that ranks 1-3 wait in. The run dir comes from a real
``distcheck run``. Everything else is cheap: in-process analysis of copies of
those files, and hand-built dump dicts for the NCCL shapes no CPU machine can
produce.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest

from conftest import REPO, finish_process
from distcheck.torch_features import features
from distcheck.errors import CorruptInputError, ExitCode, UsageError
from distcheck.files.flight_recorder import _load_pickle, load_dump
from distcheck.evidence.postmortem import analyze_paths
from distcheck.report.json_schema import REPORT

JOB = REPO / "tests" / "fr_job.py"
JOB_TIMEOUT_S = 240
WORLD = 4


def _start(args: list[str], env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env={**os.environ, **(env or {})}, cwd=REPO)


def analyze_cli(*args: str) -> subprocess.CompletedProcess:
    return finish_process(_start([sys.executable, "-m", "distcheck", "analyze", *args]), "distcheck analyze", 60)


def flat(text: str) -> str:
    """Terminal output with the line wrapping undone."""
    return " ".join(text.split())


@pytest.fixture(scope="module")
def jobs(tmp_path_factory) -> dict[str, tuple[Path, subprocess.CompletedProcess | None]]:
    """Both real jobs of this module, started together so their waits overlap:
    the 4-rank gloo job that dumps its Flight Recorder buffers, and a
    ``distcheck run`` of the seed hang (when torchmetrics is installed)."""
    base = tmp_path_factory.mktemp("analyze_jobs")
    out, run = base / "fr", base / "run"
    fr = None
    if features().flight_recorder_gloo:   # before torch 2.8 gloo has no recorder to dump
        fr = _start([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(WORLD),
                     str(JOB), "--out", str(out)], env={"TORCH_FR_BUFFER_SIZE": "200", "OMP_NUM_THREADS": "1"})
    dc = None
    if importlib.util.find_spec("torchmetrics") is not None:
        dc = _start([sys.executable, "-m", "distcheck", "run", "auroc_rank0_only_compute", "--nproc-per-node", "2",
                     "--backend", "gloo", "--stall-timeout", "3", "--run-dir", str(run)])
    try:
        fr_done = finish_process(fr, str(out), JOB_TIMEOUT_S) if fr is not None else None
    finally:
        dc_done = finish_process(dc, str(run), JOB_TIMEOUT_S) if dc is not None else None
    return {"dumps": (out, fr_done), "run": (run, dc_done)}


@pytest.fixture(scope="module")
def dumps(jobs) -> Path:
    """DIR/pickle/fr_<rank> and DIR/json/fr_<rank>.json from a real 4-rank gloo job."""
    out, proc = jobs["dumps"]
    if proc is None:
        pytest.skip(features().missing_note("flight_recorder_gloo") + ": no gloo dumps to analyze")
    assert proc.returncode == 0, proc.stderr[-3000:]
    for form, name in (("pickle", "fr_{}"), ("json", "fr_{}.json")):
        for r in range(WORLD):
            assert (out / form / name.format(r)).stat().st_size > 0
    return out


def files(dumps: Path, form: str, order=range(WORLD)) -> list[Path]:
    name = "fr_{}" if form == "pickle" else "fr_{}.json"
    return [dumps / form / name.format(r) for r in order]


def hangs(report) -> dict[str, dict]:
    """group → hang finding (as JSON-ready dicts); the report must fit the JSON schema."""
    jsonschema.validate(json.loads(json.dumps(report.to_dict())), REPORT)
    (scenario,) = report.scenarios
    return {f.group: f.to_dict() for f in scenario.findings if f.kind == "hang"}


# -- real gloo dumps ---------------------------------------------------------------


@pytest.mark.e2e
def test_gloo_dumps_name_the_collective_the_waiting_and_the_missing_ranks(dumps, tmp_path):
    out = tmp_path / "r.json"
    proc = analyze_cli(str(dumps / "pickle"), "--json", str(out))
    assert proc.returncode == ExitCode.FINDINGS, proc.stderr
    report = json.loads(out.read_text())
    jsonschema.validate(report, REPORT)
    assert report["schema"] == "distcheck.report/1" and report["verdict"] == "fail"
    assert report["run"]["backend"] == "gloo" and report["run"]["world_size"] == WORLD
    (scenario,) = report["scenarios"]
    by_group = {f["group"]: f for f in scenario["findings"] if f["kind"] == "hang"}
    assert set(by_group) == {"0:default_pg", "1:metrics"}

    world = by_group["0:default_pg"]
    assert (world["op"], world["seq"]) == ("all_reduce", 6)
    assert world["waiting_ranks"] == [0] and world["absent_ranks"] == [1, 2, 3]
    assert world["odd_ranks"] == [0]
    assert world["callsite"].startswith(str(JOB)) and world["callsite"].endswith(":main")

    metrics = by_group["1:metrics"]
    assert (metrics["op"], metrics["seq"]) == ("all_reduce", 2)
    assert metrics["waiting_ranks"] == [1, 2, 3] and metrics["absent_ranks"] == [0]
    assert metrics["odd_ranks"] == [0]
    assert "rank 0 is the odd one out" in metrics["summary"]

    states = {r["rank"]: (r["state"], r["last_event"]["group"], r["last_event"]["seq"]) for r in scenario["ranks"]}
    assert states == {0: ("stuck", "0:default_pg", 6), **{r: ("stuck", "1:metrics", 2) for r in (1, 2, 3)}}
    # the terminal view says the same, and what a dump cannot tell
    text = flat(proc.stdout)
    assert "rank 0 is the odd one out" in text
    assert "do not record the reduce op" in text and "inferred" in text
    # a post-mortem expected nothing and ran no stall timeout: it says what the dumps show
    assert scenario["end_reason"] == "postmortem" and scenario["script"]
    assert "expected" not in text and "stall-timeout" not in text and "behaved as expected" not in text
    assert "read from the dumps the job left" in text


@pytest.mark.e2e
@pytest.mark.parametrize("form", ["pickle", "json"])
def test_blame_does_not_depend_on_file_order(dumps, form):
    reports = [analyze_paths(files(dumps, form, order)).report
               for order in ([0, 1, 2, 3], [3, 2, 1, 0], [1, 0, 3, 2])]
    found = [hangs(r) for r in reports]
    assert found[0] == found[1] == found[2]
    assert found[0]["0:default_pg"]["odd_ranks"] == [0]
    assert found[0]["1:metrics"]["odd_ranks"] == [0]


@pytest.mark.e2e
def test_rank0_first_on_the_command_line_is_still_blamed(dumps, tmp_path):
    """PyTorch's analyzer takes the first file read as the reference."""
    out = tmp_path / "r.json"
    proc = analyze_cli(*map(str, files(dumps, "json", [0, 3, 2, 1])), "--json", str(out))
    assert proc.returncode == ExitCode.FINDINGS, proc.stderr
    (scenario,) = json.loads(out.read_text())["scenarios"]
    odd = {f["group"]: f["odd_ranks"] for f in scenario["findings"] if f["kind"] == "hang"}
    assert odd == {"0:default_pg": [0], "1:metrics": [0]}
    assert "JSON dumps carry no Python frames" in scenario["description"]


@pytest.mark.e2e
def test_pickle_and_json_forms_agree(dumps):
    def essentials(report):
        return {g: (f["op"], f["seq"], f["waiting_ranks"], f["absent_ranks"], f["odd_ranks"])
                for g, f in hangs(report).items()}

    assert essentials(analyze_paths(files(dumps, "pickle")).report) == \
        essentials(analyze_paths(files(dumps, "json")).report)


@pytest.mark.e2e
def test_missing_rank_is_left_out_not_blamed(dumps, tmp_path):
    for r in (0, 1, 3):
        shutil.copy(dumps / "pickle" / f"fr_{r}", tmp_path)
    report = analyze_paths([tmp_path], world_size=WORLD).report
    (scenario,) = report.scenarios
    world = hangs(report)["0:default_pg"]
    assert world["waiting_ranks"] == [0] and world["absent_ranks"] == [1, 3] and world["odd_ranks"] == [0]
    assert "Rank 2 left no dump" in world["summary"]
    assert "Rank 2 left no dump" in scenario.description
    assert [o.rank for o in scenario.ranks] == [0, 1, 3]


@pytest.mark.e2e
def test_missing_highest_rank_needs_world_size(dumps, tmp_path):
    for r in (0, 1, 2):
        shutil.copy(dumps / "pickle" / f"fr_{r}", tmp_path)
    (scenario,) = analyze_paths([tmp_path]).report.scenarios
    assert "World size taken as 3" in scenario.description and "--world-size" in scenario.description
    with pytest.raises(UsageError, match="--world-size 2"):
        analyze_paths([tmp_path], world_size=2)


@pytest.mark.e2e
@pytest.mark.parametrize("form", ["pickle", "json"])
def test_truncated_dump_is_read_as_far_as_it_goes(dumps, tmp_path, form):
    src = files(dumps, form)
    for p in src:
        shutil.copy(p, tmp_path)
    cut = tmp_path / src[1].name
    data = cut.read_bytes()
    cut.write_bytes(data[: int(len(data) * 0.6)])
    partial = load_dump(cut)
    assert partial.truncated and 0 < len(partial.entries) < len(load_dump(src[1]).entries)

    report = analyze_paths([tmp_path]).report
    (scenario,) = report.scenarios
    assert f"rank 1: {cut.name} is cut short after {len(partial.entries)} whole entries" in scenario.description
    assert next(o for o in scenario.ranks if o.rank == 1).collectives == len(partial.entries)
    world = hangs(report)["0:default_pg"]
    assert world["waiting_ranks"] == [0] and world["absent_ranks"] == [2, 3] and world["odd_ranks"] == [0]
    assert "Rank 1 left a dump that is cut short" in world["summary"]


@pytest.mark.e2e
def test_dump_cut_before_its_first_entry_counts_as_missing(dumps, tmp_path):
    for p in files(dumps, "pickle"):
        shutil.copy(p, tmp_path)
    (tmp_path / "fr_2").write_bytes((tmp_path / "fr_2").read_bytes()[:20])
    (scenario,) = analyze_paths([tmp_path]).report.scenarios
    assert "rank 2: fr_2 is cut short before its first entry" in scenario.description
    assert 2 not in [o.rank for o in scenario.ranks]


# -- untrusted and broken input ----------------------------------------------------


class _Evil:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


class _EvalEvil:
    def __reduce__(self):
        return (eval, ("1+1",))


@pytest.mark.e2e
def test_malicious_pickle_is_refused_without_running_it(dumps, tmp_path):
    marker = tmp_path / "PWNED"
    evil_dir = tmp_path / "dumps"
    evil_dir.mkdir()
    for p in files(dumps, "pickle"):
        shutil.copy(p, evil_dir)
    (evil_dir / "fr_2").write_bytes(pickle.dumps({"version": "2.10", "entries": [_Evil(marker)]}))
    proc = analyze_cli(str(evil_dir))
    assert proc.returncode == ExitCode.USAGE
    assert not marker.exists()
    lines = proc.stderr.strip().splitlines()
    assert lines[0].startswith("distcheck: error: ") and "fr_2" in lines[0] and "refused" in lines[0]
    assert "system" in lines[0] and "Traceback" not in proc.stderr
    assert len(lines) <= 2   # the message and its hint


@pytest.mark.parametrize("payload", [
    pickle.dumps(_Evil(Path("/nonexistent/x")), protocol=0),           # GLOBAL + REDUCE
    pickle.dumps(_Evil(Path("/nonexistent/x")), protocol=4),           # STACK_GLOBAL
    b"(S'true'\nios\nsystem\n.",                                      # INST
    pickle.dumps({"entries": [_EvalEvil()]}, protocol=2),               # builtins.eval
])
def test_restricted_unpickler_resolves_no_global(payload, tmp_path):
    path = tmp_path / "fr_0"
    path.write_bytes(payload)
    with pytest.raises(UsageError, match="refused"):
        load_dump(path)


def test_unreadable_files_are_one_line_errors(tmp_path):
    (tmp_path / "fr_0").write_bytes(b"\x80\x02garbage")
    (tmp_path / "fr_1.json").write_text("not json at all")
    (tmp_path / "dump").write_bytes(pickle.dumps({"entries": []}))
    with pytest.raises(CorruptInputError):
        load_dump(tmp_path / "fr_0")
    with pytest.raises(CorruptInputError):
        load_dump(tmp_path / "fr_1.json")
    with pytest.raises(UsageError, match="cannot tell which rank"):
        load_dump(tmp_path / "dump")
    with pytest.raises(UsageError, match="no such file"):
        analyze_paths([tmp_path / "nope"])
    proc = analyze_cli(str(tmp_path / "fr_0"))
    assert proc.returncode == ExitCode.CORRUPT_INPUT
    assert proc.stderr.startswith("distcheck: error: ") and "Traceback" not in proc.stderr


def test_salvage_keeps_only_whole_entries():
    dump = {"version": "2.10", "pg_config": {}, "entries": [
        {"record_id": i, "process_group": ("0", "default_pg"), "collective_seq_id": i + 1, "p2p_seq_id": 0,
         "is_p2p": False, "profiling_name": "gloo:all_reduce", "input_sizes": [[4, 4]],
         "input_dtypes": ["Float"], "state": "scheduled", "retired": True, "time_created_ns": 10**18 + i}
        for i in range(5)]}
    data = pickle.dumps(dump, protocol=2)
    whole, truncated = _load_pickle(data)
    assert not truncated and whole == dump
    for cut in range(len(data) // 3, len(data) - 1, 7):
        got, truncated = _load_pickle(data[:cut])
        assert truncated
        assert got["entries"] == dump["entries"][: len(got["entries"])]   # whole entries only, in order


# -- hand-built NCCL-shaped dumps (no CPU machine writes these) ------------------------


def _nccl_entry(record_id, seq, name, state, *, pg=("0", "default_pg"), p2p_seq=0, sizes=((8,),), dtype="Float"):
    return {"record_id": record_id, "pg_id": 0, "process_group": pg, "collective_seq_id": 0 if p2p_seq else seq,
            "p2p_seq_id": p2p_seq, "op_id": record_id + 1, "profiling_name": name, "time_created_ns": 10**18 + record_id,
            "input_sizes": [list(s) for s in sizes], "input_dtypes": [dtype] * len(sizes),
            "output_sizes": [list(s) for s in sizes], "output_dtypes": [dtype] * len(sizes), "state": state,
            "time_discovered_started_ns": None, "time_discovered_completed_ns": None, "retired": state == "completed",
            "timeout_ms": 600000, "is_p2p": bool(p2p_seq), "frames": [
                {"name": "all_reduce", "filename": "/opt/conda/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py", "line": 2501},
                {"name": "compute", "filename": "/opt/conda/lib/python3.11/site-packages/torchmetrics/metric.py", "line": 630},
                {"name": "evaluate", "filename": "/home/u/train.py", "line": 42},
            ]}


def _write_nccl(tmp_path: Path, per_rank: dict[int, list[dict]], world: int) -> list[Path]:
    paths = []
    for rank, entries in per_rank.items():
        dump = {"version": "2.4", "pg_config": {"0": {"name": "0", "desc": "default_pg",
                                                      "ranks": json.dumps(list(range(world)))}},
                "pg_status": {}, "comm_lib_version": "2.21.5", "entries": entries}
        path = tmp_path / f"nccl_trace_rank_{rank}"
        path.write_bytes(pickle.dumps(dump, protocol=2))
        paths.append(path)
    return paths


def test_nccl_shaped_dumps_mismatch_and_started_state(tmp_path):
    ok = lambda i, seq: _nccl_entry(i, seq, "nccl:all_reduce", "completed")   # noqa: E731
    per_rank = {
        r: [ok(0, 1), ok(1, 2), _nccl_entry(2, 3, "nccl:all_reduce", "started",
                                            sizes=((16,),) if r == 2 else ((8,),))]
        for r in range(4)
    }
    report = analyze_paths(_write_nccl(tmp_path, per_rank, 4)).report
    assert report.run.backend == "nccl" and report.run.versions["comm_lib"] == "2.21.5"
    (scenario,) = report.scenarios
    kinds = {f.kind: f for f in scenario.findings}
    assert kinds["mismatch"].odd_ranks == (2,) and kinds["mismatch"].fields in (("shape",), ("shapes",))
    assert kinds["hang"].waiting_ranks == (0, 1, 2, 3)   # all entered #3, none completed
    assert kinds["hang"].callsite == "/home/u/train.py:42:evaluate"
    assert scenario.ranks[0].last_event.library_callsite.endswith("torchmetrics/metric.py:630:compute")


def test_nccl_p2p_and_group_local_ranks(tmp_path):
    per_rank = {
        0: [_nccl_entry(0, 0, "nccl:send 0->1", "completed", p2p_seq=1),
            _nccl_entry(1, 0, "nccl:send 0->1", "scheduled", p2p_seq=2)],
        1: [_nccl_entry(0, 0, "nccl:recv 1<-0", "completed", p2p_seq=1)],
    }
    (scenario,) = analyze_paths(_write_nccl(tmp_path, per_rank, 2)).report.scenarios
    (hang,) = [f for f in scenario.findings if f.kind == "hang"]
    assert (hang.group, hang.seq, hang.op, hang.waiting_ranks, hang.absent_ranks) == ("p2p:0>1", 2, "send", (0,), (1,))


def test_sequence_gaps_do_not_hide_a_hang(tmp_path):
    """gloo's monitored_barrier uses collective_seq_ids it never records."""
    def entry(i, seq, retired):
        return {"record_id": i, "process_group": ["0", "default_pg"], "collective_seq_id": seq, "p2p_seq_id": 0,
                "is_p2p": False, "profiling_name": "gloo:all_reduce", "input_sizes": [[2]], "input_dtypes": ["Float"],
                "state": "scheduled", "retired": retired, "time_created_ns": 10**18 + i}
    for rank in range(3):
        entries = [entry(0, 1, True)] + ([entry(1, 4, False)] if rank == 0 else [])
        (tmp_path / f"fr_{rank}.json").write_text(json.dumps({"version": "2.10", "pg_config": {}, "entries": entries}))
    (scenario,) = analyze_paths([tmp_path]).report.scenarios
    (hang,) = [f for f in scenario.findings if f.kind == "hang"]
    assert hang.waiting_ranks == (0,) and hang.absent_ranks == (1, 2) and hang.odd_ranks == (0,)
    assert "collective_seq_id 4" in scenario.description


@pytest.mark.e2e
def test_two_dumps_for_one_rank_is_a_usage_error(dumps):
    with pytest.raises(UsageError, match="two dumps for rank 0"):
        analyze_paths([*files(dumps, "pickle"), dumps / "json" / "fr_0.json"])


# -- distcheck's own run dirs ------------------------------------------------------------


@pytest.fixture(scope="module")
def run_dir(jobs) -> Path:
    run, proc = jobs["run"]
    if proc is None:
        pytest.skip("needs torchmetrics (pip install 'distcheck[metrics]')")
    assert proc.returncode == ExitCode.OK, proc.stderr[-3000:]
    return run


@pytest.mark.e2e
def test_analyze_a_distcheck_run_dir(run_dir, tmp_path):
    out = tmp_path / "r.json"
    proc = analyze_cli(str(run_dir), "--json", str(out))
    assert proc.returncode == ExitCode.OK, proc.stderr   # the scenario expects this hang
    report = json.loads(out.read_text())
    jsonschema.validate(report, REPORT)
    (scenario,) = report["scenarios"]
    assert scenario["name"] == "auroc_rank0_only_compute" and scenario["ok"]
    (hang,) = [f for f in scenario["findings"] if f["kind"] == "hang"]
    assert hang["waiting_ranks"] == [0] and hang["absent_ranks"] == [1]
    assert hang["label"] == "BinaryAUROC.compute" and hang["op"] in ("barrier", "all_gather")


@pytest.mark.e2e
def test_analyze_a_bare_trace_dir(run_dir, tmp_path):
    """Traces alone (no report.json, no status): still the same hang; expected is 'pass'."""
    traces = tmp_path / "traces"
    shutil.copytree(run_dir / "auroc_rank0_only_compute" / "traces", traces)
    report = analyze_paths([traces]).report
    (scenario,) = report.scenarios
    assert not scenario.ok and scenario.expected == ("pass",)
    (hang,) = [f for f in scenario.findings if f.kind == "hang"]
    assert hang.waiting_ranks == (0,) and hang.absent_ranks == (1,) and hang.label == "BinaryAUROC.compute"
