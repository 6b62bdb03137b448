"""The determinism lane: the same faulty job gives the same verdict on every run (issue 41).

Every fault scenario of the built-in catalogue (expectation other than pass) and the fault scripts of the
e2e tests run ``REPEATS`` times; the last repetition runs beside CPU hogs. A verdict is the kind of each
finding (errors and warnings, but those that measure time), the ranks it names (odd, waiting, absent, tie) and
its lines, plus the observed kinds; any
difference between runs of one target fails that target's test, with every run's verdict and run dir.

Each repetition starts all of its launches at once (``launch_group.run_together``): the scenarios share
one ``distcheck run`` per rank count, each script has its own. Its own lane: ``pytest -m determinism``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from launch_group import run_together
from load import cpu_hogs

from distcheck.targets.discovery import builtin_scenarios
from distcheck.scenario import skip_reason

pytestmark = [pytest.mark.e2e, pytest.mark.determinism, pytest.mark.xdist_group("determinism")]   # one launch set

REPEATS = 3             # the last one beside CPU hogs
LANE_TIMEOUT_S = 540    # one repetition, all of its launches together
STALL = ("--stall-timeout", "10")
SCRIPTS = Path(__file__).parent / "scripts"
CATALOGUE_RANKS = (4,)   # as the catalogue declares its expectations (tests/test_catalogue.py runs it at 4)

# The e2e tests' fault scripts: name -> `distcheck run` arguments (as the test that expects the finding runs it)
FAULT_SCRIPTS = {
    "rank0_barrier": [str(SCRIPTS / "rank0_barrier.py"), "--nproc-per-node", "3", *STALL],
    "rank0_compute": [str(SCRIPTS / "rank0_compute.py"), "--nproc-per-node", "2", *STALL, "--", "--steps", "12"],
    "object_count": [str(SCRIPTS / "object_count.py"), "--nproc-per-node", "3", *STALL],
    "ddp_uneven": [str(SCRIPTS / "ddp_uneven.py"), "--nproc-per-node", "2", *STALL],
    "monitored_skip": [str(SCRIPTS / "ecosystem" / "monitored_barrier.py"), "--nproc-per-node", "3", *STALL,
                       "--", "--skip", "1"],
    "dtensor_one_rank": [str(SCRIPTS / "ecosystem" / "dtensor_full_tensor.py"), "--nproc-per-node", "3", *STALL,
                         "--", "--only", "0"],
    "mesh_mixed_up": [str(SCRIPTS / "ecosystem" / "devicemesh_mixed_groups.py"), "--nproc-per-node", "4", *STALL,
                      "--", "--odd", "1"],
    "fsdp2_peers_full_tensor": [str(SCRIPTS / "determinism" / "fsdp2_peers_full_tensor.py"), "--nproc-per-node", "3",
                                *STALL],
    "store_wait_alone": [str(SCRIPTS / "store_wait_alone.py"), "--nproc-per-node", "2", *STALL],
    # tests/test_sentences_e2e.py: a root two ranks share; the call every peer left; rows the ranks read
    "object_src_local": [str(SCRIPTS / "sentences" / "object_src_local.py"), "--nproc-per-node", "4", *STALL],
    "confmat_at_8": ["confmat_local_num_classes", "--nproc-per-node", "8", "--backend", "gloo", *STALL],
    "iterable_unsynced_models": [str(SCRIPTS / "sentences" / "iterable_unsynced_models.py"), "--nproc-per-node", "2",
                                 *STALL],
}


def fault_scenarios() -> dict[int, list[str]]:
    """rank count -> the catalogue's fault scenarios that run there on gloo (each at the first count it runs at)."""
    out: dict[int, list[str]] = {n: [] for n in CATALOGUE_RANKS}
    for spec in builtin_scenarios():
        if tuple(spec.expect) == ("pass",):
            continue
        n = next((n for n in CATALOGUE_RANKS if skip_reason(spec, "gloo", n) is None), None)
        if n is not None:
            out[n].append(spec.name)
    return out


def jobs() -> dict[str, list[str]]:
    out = {f"catalogue@{n}": [*names, "--nproc-per-node", str(n), "--backend", "gloo", *STALL]
           for n, names in fault_scenarios().items() if names}
    return out | FAULT_SCRIPTS


def _line(callsite: str | None) -> str | None:
    """file:line of a callsite (the function name left out)."""
    return ":".join(callsite.split(":")[:2]) if callsite else None


# A finding's rows for the ranks it does not blame: which of them a row lists depends on how far each one's
# record got before distcheck stopped it (bounded by the launcher's survivor-sync wait), not on the verdict.
BYSTANDERS = ("majority", "peer")


# Findings whose presence is a measurement of time, not of what the job did: a straggler is a rank later than a
# bound, a health note is the node's measured speed, a coverage note says what distcheck's own records caught
# before it stopped the job (how far each rank's record got is the machine's timing). Every other kind, errors and
# warnings alike, must be the same on every run; info notes are context, not findings.
TIMED_KINDS = ("straggler", "health", "coverage")


def verdict(s: dict) -> tuple:
    """What must be the same on every run: observed kinds (but the ``TIMED_KINDS``), and each finding's (errors and warnings, but the
    ``TIMED_KINDS``) severity, kind, the ranks it blames (odd, tie, waiting, absent) and its line, with the line
    of every blamed rank's row. A crash the report calls a consequence of a mismatch (gloo aborts every rank that
    receives a buffer of the wrong size, and which of them it aborts first is the machine's timing) is judged by
    that cause."""
    findings = sorted([(f["severity"], *_finding(f)) for f in s["findings"]
                       if f["severity"] in ("error", "warning") and f["kind"] not in TIMED_KINDS],
                      key=repr)   # None beside a line: order by the text, never compare them
    observed = tuple(kind for kind in s["observed"] if kind not in TIMED_KINDS)
    return observed, tuple(findings)


def _finding(f: dict) -> tuple:
    cause = (f.get("data") or {}).get("caused_by")
    if f["kind"] == "crash" and cause and cause.get("kind") == "mismatch":
        # by kind and group: which of a receive-from-any-source's calls aborted first is timing too
        return ("crash", ("caused by", cause["kind"], cause.get("group")), False, (), (), None, ())
    return (f["kind"], tuple(f.get("odd_ranks") or ()), bool(f.get("tie")), tuple(f.get("waiting_ranks") or ()),
            tuple(f.get("absent_ranks") or ()), _line(f.get("callsite")),
            tuple(sorted((d["rank"], _line(d.get("callsite"))) for d in f.get("ranks", ())
                         if d.get("callsite") and d.get("role") not in BYSTANDERS)))


@pytest.fixture(scope="module")
def repetitions(tmp_path_factory) -> list[dict[str, dict[str, tuple]]]:
    """Per repetition: target ("job/scenario") -> (verdict, run dir)."""
    reps = []
    for i in range(REPEATS):
        def folder(name: str, i: int = i) -> Path:
            return tmp_path_factory.mktemp(f"rep{i}-{name.replace('@', '_')}")
        if i == REPEATS - 1:
            with cpu_hogs():
                runs = run_together(jobs(), folder, LANE_TIMEOUT_S)
        else:
            runs = run_together(jobs(), folder, LANE_TIMEOUT_S)
        reps.append({_target(job, s["name"]): (verdict(s), str(run.run_dir))
                     for job, run in runs.items() for s in run.report["scenarios"]})
    return reps


def _target(job: str, scenario: str) -> str:
    """A catalogue scenario by its job and name; a script by its job (one script, one result)."""
    return f"{job}/{scenario}" if job.startswith("catalogue") else job


def targets() -> list[str]:
    return [_target(job, name) for job, args in jobs().items()
            for name in (args[:args.index("--nproc-per-node")] if job.startswith("catalogue") else [job])]


@pytest.mark.timeout(REPEATS * (LANE_TIMEOUT_S + 60))
@pytest.mark.parametrize("target", targets())
def test_the_same_faulty_job_gives_the_same_verdict_on_every_run(repetitions, target):
    seen = []
    for i, rep in enumerate(repetitions):
        assert target in rep, f"{target} missing from repetition {i}: {sorted(rep)}"
        seen.append(rep[target])
    verdicts = {v for v, _ in seen}
    assert len(verdicts) == 1, f"{target}: {len(verdicts)} different verdicts in {len(seen)} runs:\n" + "\n".join(
        f"  run {i}{' (beside CPU hogs)' if i == REPEATS - 1 else ''}: {v}\n    {d}" for i, (v, d) in enumerate(seen))
    (observed, _), = verdicts
    assert observed != ("pass",), f"{target} found nothing: a fault script or scenario must give a finding"
