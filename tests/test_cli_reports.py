"""End to end: reports from a real run, saved runs, env, and error exit codes.

One real 2-rank gloo hang (stall timeout 3 s) produces JSON on stdout, JUnit, a
Chrome trace and the HTML timeline; ``distcheck report`` then re-renders it from
the run dir without re-running, and ``distcheck runs`` lists it. The other tests
start no ranks.
"""

from __future__ import annotations

import json

import jsonschema
import pytest
from junitparser import JUnitXml
from typer.testing import CliRunner

from distcheck.cli import app
from distcheck.report import json_schema

HANG = "auroc_rank0_only_compute"


@pytest.mark.e2e
def test_hang_run_writes_every_format_and_rerenders_from_the_run_dir(distcheck, tmp_path):
    junit_path, trace_path = tmp_path / "junit.xml", tmp_path / "trace.json"
    r = distcheck("run", HANG, "--nproc-per-node", "2", "--backend", "gloo", "--stall-timeout", "3",
                  "--json", "-", "--junit-xml", str(junit_path), "--chrome-trace", str(trace_path), timeout=150)
    assert r.returncode == 0, r.stderr[-3000:]

    # --json -: stdout is nothing but the JSON report; the human view (plain lines: not a tty) is on stderr
    doc = json.loads(r.stdout)
    jsonschema.validate(doc, json_schema.REPORT)
    [hang] = doc["scenarios"][0]["findings"]
    assert (hang["kind"], hang["waiting_ranks"], hang["absent_ranks"]) == ("hang", [0], [1])
    assert f"RUN  {HANG}  [1/1]" in r.stderr
    # a certain hang (rank 1 finished): named at once, saying why, with where each rank was
    assert "Decided: certain: rank 1 finished." in r.stderr and "barrier #1 [BinaryAUROC.compute]" in r.stderr
    assert f"OK   {HANG}  expected hang, observed hang" in r.stderr
    assert (r.run_dir / "report.json").exists()

    # JUnit: one passing testcase (the hang was expected), the diagnosis in system-out
    suite = next(iter(JUnitXml.fromfile(str(junit_path))))
    [case] = list(suite)
    assert case.name == HANG and case.is_passed and suite.tests == 1 and suite.failures == 0
    assert "Rank 0 is waiting in barrier #1" in case.system_out
    assert {p.name: p.value for p in suite.properties()}["seed"] == "0"

    # Chrome trace: one lane per rank, the stuck barrier marked on rank 0, rank 1 flagged as absent
    trace = json.loads(trace_path.read_text())["traceEvents"]
    assert all({"ph", "ts", "pid", "tid"} <= e.keys() for e in trace)
    lanes = sorted(e["tid"] for e in trace if e["ph"] == "M" and e["name"] == "thread_name")
    assert lanes == [0, 1]
    [stuck] = [e for e in trace if e.get("cat") == "distcheck.stuck"]
    assert stuck["tid"] == 0 and stuck["name"].startswith("barrier #1 BinaryAUROC.compute")
    assert stuck["args"]["callsite"].split(":")[0].endswith(f"{HANG}.py")
    assert [e["tid"] for e in trace if e.get("cat") == "distcheck.absent"] == [1]

    # the HTML timeline is in the run dir, self-contained
    page = (r.run_dir / "timeline.html").read_text()
    assert "m-stuck" in page and "never entered barrier #1" in page and "<script" not in page

    # re-render from the run dir: same JSON, same JUnit, the same terminal view, the run's own exit code
    junit_again, html_again = tmp_path / "again.xml", tmp_path / "again.html"
    again = distcheck("report", str(r.run_dir), "--json", "-", "--junit-xml", str(junit_again),
                      "--html", str(html_again))
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout) == doc
    assert junit_again.read_text() == junit_path.read_text()
    # only files were asked for: the verdict and where they went, not the whole view again
    assert "PASS  1/1 scenarios behaved as expected" in again.stderr
    assert f"wrote {junit_again}" in again.stderr and f"wrote {html_again}" in again.stderr
    assert "barrier #1 [BinaryAUROC.compute]" not in again.stderr and len(again.stderr.splitlines()) <= 6   # + the torch features line
    view = distcheck("report", str(r.run_dir), json=False)
    assert f"OK   {HANG}  expected hang, observed hang" in view.stdout
    assert "barrier #1 [BinaryAUROC.compute]" in view.stdout

    listed = distcheck("runs", "--dir", str(tmp_path), "--json")
    assert listed.returncode == 0, listed.stderr
    [run] = json.loads(listed.stdout)
    assert (run["id"], run["verdict"], run["names"], run["backend"], run["world_size"]) == \
        ("run", "pass", [HANG], "gloo", 2)
    table = distcheck("runs", "--dir", str(tmp_path))
    assert "PASS" in table.stdout and "gloo × 2" in table.stdout and f"1/1 ok: {HANG}" in table.stdout


def test_env_json_redacts_secrets(distcheck):
    secrets = {"TORCH_FAKE_API_TOKEN": "tok-s3cr3t-value",
               "TORCHELASTIC_RDZV_ENDPOINT": "https://alice:hunter2@rdzv.example:29400",
               "MASTER_ADDR": "10.1.2.3", "NCCL_DEBUG": "INFO", "SLURM_JOB_ID": "4242"}
    r = distcheck("env", "--json", env=secrets)
    assert r.returncode == 0, r.stderr
    for leaked in ("tok-s3cr3t-value", "hunter2", "alice"):
        assert leaked not in r.stdout
    info = json.loads(r.stdout)
    assert info["env"]["TORCH_FAKE_API_TOKEN"] == "***"
    assert info["env"]["TORCHELASTIC_RDZV_ENDPOINT"] == "https://***@rdzv.example:29400"
    assert info["env"]["MASTER_ADDR"] == "10.1.2.3" and info["context"]["slurm"].startswith("job 4242")
    assert info["backends"]["gloo"] is True and info["torch"].startswith("2.")
    assert "torchmetrics" in info["libraries"]
    human = distcheck("env", env=secrets)
    assert human.returncode == 0 and "hunter2" not in human.stdout and "tok-s3cr3t" not in human.stdout
    assert "TORCH_FAKE_API_TOKEN" in human.stdout and "gloo" in human.stdout


def test_bogus_run_dirs_are_one_line_errors_with_distinct_codes(distcheck, tmp_path):
    missing = distcheck("report", str(tmp_path / "no-such-run"))
    assert missing.returncode == 2
    assert missing.stderr.startswith("distcheck: error: no run directory at") and "Traceback" not in missing.stderr
    torn = tmp_path / "torn"
    torn.mkdir()
    (torn / "report.json").write_text('{"schema": "distcheck.report/1", "scen')
    corrupt = distcheck("report", str(torn))
    assert corrupt.returncode == 5 and "not valid JSON" in corrupt.stderr and "Traceback" not in corrupt.stderr
    (torn / "report.json").unlink()
    (torn / "scenario" / "traces").mkdir(parents=True)
    unfinished = distcheck("report", str(torn))
    assert unfinished.returncode == 5 and "did not finish" in unfinished.stderr
    assert distcheck("runs", "--limit", "0").returncode == 2
    empty = distcheck("runs", "--dir", str(tmp_path / "nothing"))
    assert empty.returncode == 0 and "no saved runs" in empty.stdout


def test_run_help_is_typers_rich_help_with_option_groups_and_h():
    runner = CliRunner()
    result = runner.invoke(app, ["run", "-h"], terminal_width=200)
    assert result.exit_code == 0, result.output
    for panel in ("What to run", "Launch", "Limits", "Reports", "Multi-node"):
        assert f"─ {panel} " in result.output, panel
    assert "--nproc-per-node" in result.output and " N " in result.output and "<int>" not in result.output
    assert " ".join(result.output.split()).count("Exit codes: 0") == 1
    root = runner.invoke(app, ["--help"], terminal_width=200)
    assert "--install-completion" in root.output and " ".join(root.output.split()).count("Exit codes: 0") == 1


@pytest.mark.parametrize("args, line", [
    (("--nproc-per-node", "abc"), "--nproc-per-node: 'abc' is not a whole number (e.g. --nproc-per-node 4)"),
    (("--stall-timeout=soon",), "--stall-timeout: 'soon' is not a number (e.g. --stall-timeout 30)"),
    (("-v", "-q", "collectives_sanity"), "--verbose and --quiet cannot be used together"),
])
def test_a_bad_value_is_one_line_and_exit_2(distcheck, args, line):
    r = distcheck("run", *args, json=False)
    assert r.returncode == 2 and r.stdout == "", (r.stdout, r.stderr)
    assert r.stderr.splitlines()[0] == f"distcheck: error: {line}", r.stderr
    assert "Usage:" not in r.stderr and "Input should be" not in r.stderr and "Traceback" not in r.stderr


def test_an_unknown_scenario_name_gets_a_did_you_mean(distcheck):
    r = distcheck("run", "auroc_rank0_only_compte", json=False)
    assert r.returncode == 2
    assert r.stderr.splitlines()[0] == ("distcheck: error: unknown scenario or file: 'auroc_rank0_only_compte'; "
                                        "did you mean 'auroc_rank0_only_compute' or 'auroc_all_ranks_compute'?")
    far = distcheck("list", "zzz_nothing_like_it", json=False)
    assert far.returncode == 2 and "did you mean" not in far.stderr and "built-in scenarios:" in far.stderr


@pytest.mark.e2e
@pytest.mark.docs   # the README's first command, as written: the docs lane's (pytest -m docs), beside its sample
@pytest.mark.timeout(600)
@pytest.mark.parametrize("nproc", [4])   # at 2 ranks: tests/test_catalogue.py's whole-catalogue run checks the same
def test_the_builtins_pass_at_every_rank_count_a_node_has_in_one_screen(distcheck, nproc):
    """The README's first command (every built-in on gloo) at 4 ranks: exit 0, one screen, no [error]
    line for a finding a scenario expected; the two odd-one-out scenarios expect a mismatch."""
    r = distcheck("run", "--nproc-per-node", str(nproc), "--backend", "gloo", timeout=560)
    assert r.returncode == 0, r.stdout[-5000:] + r.stderr[-3000:]
    lines = r.stdout.splitlines()
    assert len(lines) <= 60, r.stdout
    assert not [line for line in lines if "[error]" in line], r.stdout
    [verdict] = [line for line in lines if line.startswith(("PASS", "FAIL"))]
    assert verdict.startswith("PASS  ") and "scenarios behaved as expected" in verdict, r.stdout
    ran = {s["name"]: s for s in r.report["scenarios"] if not s["skipped"]}
    odd_one_out = ("ddp_extra_step_then_barrier", "monitored_barrier_skipped_by_one_rank")
    for name in odd_one_out:
        assert ran[name]["expected"] == (["hang"] if nproc == 2 else ["mismatch"]), ran[name]



SCRIPT = '''
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank = dist.get_rank()
t = torch.ones(2)
dist.all_reduce(t)
print(f"sum {t[0].item():g} on rank {rank}", flush=True)
if rank == 1:
    raise ValueError("rank 1 gives up")
'''


@pytest.mark.e2e
@pytest.mark.timeout(200)
def test_a_scripts_own_output_reaches_the_terminal_with_rank_prefixes(distcheck, tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    r = distcheck("run", str(script), "--nproc-per-node", "2", "--stall-timeout", "5", timeout=150)
    assert r.returncode == 1, r.stdout[-3000:] + r.stderr[-3000:]
    assert "[rank0]:sum 2 on rank 0" in r.stdout and "[rank1]:sum 2 on rank 1" in r.stdout
    assert "[rank1]:ValueError: rank 1 gives up" in r.stdout
    shown = [line for line in r.stdout.splitlines() if line.startswith("[rank1]:")]
    assert any('train.py", line' in line for line in shown), shown
    assert not any("worker.py" in line or "runpy" in line for line in shown), shown   # distcheck's frames: out
    log = (r.run_dir / "train" / "logs" / "rank1.log").read_text()
    assert "sum 2 on rank 1" in log and "worker.py" in log          # the log keeps every frame
    quiet = distcheck("run", str(script), "--nproc-per-node", "2", "--stall-timeout", "5", "--quiet-ranks",
                      timeout=150)
    assert quiet.returncode == 1 and "[rank" not in quiet.stdout, quiet.stdout
