"""The NCCL-semantics lane (``pytest -m nccl_semantics``): the fault catalogue and the e2e tests' fault scripts run
on gloo and on ``emulated_nccl`` (the backend the host sees as NCCL's: calls return at once, complete later), and
give the same verdict — the kinds, the ranks each finding blames and their lines (``test_determinism_e2e.verdict``)
— or the verdict NCCL gives, stated here with its reason. Only the backend is swapped: the scripts ask for gloo and
run on the emulated backend through ``tests/nccl_lane/sitecustomize.py``; the scenarios take ``--backend``.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from launch_group import run_together
from test_determinism_e2e import FAULT_SCRIPTS, STALL, fault_scenarios, verdict

pytestmark = [pytest.mark.e2e, pytest.mark.nccl_semantics, pytest.mark.xdist_group("nccl_lane")]

LANE = Path(__file__).parent / "nccl_lane"
LANE_TIMEOUT_S = 900
RANKS = 4

# Where NCCL's verdict is not gloo's, and why (the lane checks the emulated run observes one of these kinds).
NCCL_VERDICTS = {
    # monitored_barrier is gloo's alone: torch raises on any other backend, as on NCCL, inside the call the skipping
    # rank paired with another op: the crash, or the mismatch it follows from (the crash then linked to it)
    "monitored_barrier_skipped_by_one_rank": ("crash", "mismatch"),
    "monitored_skip": ("crash", "mismatch"),
    # DDP's extra step on rank 0 against the others' barrier, at one number: NCCL runs both (no size check) and
    # the ranks hang, each in its own call; over gloo the emulation aborts on the size, or is decided first. The
    # odd rank is named on NCCL from the Flight Recorder's entry for DDP's C++-issued call, which a backend
    # written in Python has none of
    "ddp_extra_step_then_barrier": ("mismatch", "hang"),
    # the cycle of stages 0 and 1 is named at once, before stages 2 and 3 reached their waits (on NCCL their
    # posts return at once); on gloo they were already waiting, and get findings of their own
    "pipeline_stage_splits_differently": ("hang",),
    # 7 ranks' 3x3 confusion matrices against rank 7's 4x4 in one all_reduce: NCCL checks no size, the 7 return
    # and finish, rank 7 waits (the mismatch, a certain hang). Over gloo whether its ring lets the 3x3 ranks
    # through is its timing: on a loaded machine all 8 stayed in the call, a hang besides the mismatch
    "confmat_at_8": ("mismatch",),
}
# What the emulation cannot carry, and why: these run on gloo only.
NOT_EMULATED = {
    # DTensor's redistribution, FSDP2 and functional collectives reach the backend through c10d's C++ ops
    # (ProcessGroup::getBackend(device)), which torch offers to backends written in C++ only
    "dtensor_full_tensor_one_rank": "functional collectives take a C++ backend",
    "fsdp2_peers_full_tensor_one_rank": "functional collectives take a C++ backend",
    "fsdp2_extra_step": "functional collectives take a C++ backend",
    "dtensor_one_rank": "functional collectives take a C++ backend",
    "fsdp2_peers_full_tensor": "functional collectives take a C++ backend",
    "functional_collective_subset": "functional collectives take a C++ backend",
    "devicemesh_group_mixed_up": "functional collectives take a C++ backend",
    "mesh_mixed_up": "functional collectives take a C++ backend",
}


def _jobs() -> tuple[dict[str, list[str]], dict[str, dict[str, str]]]:
    names = [n for n in fault_scenarios()[RANKS] if n not in NOT_EMULATED]
    jobs, env = {}, {}
    for backend in ("gloo", "emulated_nccl"):
        jobs[f"catalogue@{backend}"] = [*names, "--nproc-per-node", str(RANKS), "--backend", backend, *STALL]
        for name, args in FAULT_SCRIPTS.items():
            if name in NOT_EMULATED:
                continue
            jobs[f"{name}@{backend}"] = list(args)
            if backend == "emulated_nccl":
                env[f"{name}@{backend}"] = {"DISTCHECK_LANE_BACKEND": "emulated_nccl", "PYTHONPATH": os.pathsep.join(
                    [str(LANE), *filter(None, [os.environ.get("PYTHONPATH")])])}
    return jobs, env


@pytest.fixture(scope="module")
def lane(tmp_path_factory) -> dict[str, dict[str, tuple]]:
    """target -> backend -> (verdict, run dir)."""
    jobs, env = _jobs()
    runs = run_together(jobs, lambda name: tmp_path_factory.mktemp(name.replace("@", "_")), LANE_TIMEOUT_S, env=env)
    out: dict[str, dict[str, tuple]] = {}
    for job, run in runs.items():
        target, backend = job.split("@")
        for s in run.report["scenarios"]:
            name = s["name"] if target == "catalogue" else target
            out.setdefault(name, {})[backend] = (lane_verdict(s), str(run.run_dir))
    return out


def lane_verdict(s: dict) -> tuple:
    """The determinism lane's verdict, less what only gloo's blocking or timing decides: gloo aborts a rank that
    receives a buffer of the wrong size (NCCL checks no size: the mismatch is the verdict on both), and a straggler
    warning (how late a rank is depends on when each call returned)."""
    observed, findings = verdict(s)   # each finding: (severity, kind, blamed, ...)
    findings = tuple(f for f in findings if not (f[1] == "crash" and f[2] and f[2][0] == "caused by"))
    kinds = {kind for kind in observed if kind != "straggler"}
    if not any(f[1] == "crash" for f in findings):
        kinds.discard("crash")
    return tuple(sorted(kinds)), findings


def _targets() -> list[str]:
    names = [n for n in fault_scenarios()[RANKS] if n not in NOT_EMULATED]
    return names + [n for n in FAULT_SCRIPTS if n not in NOT_EMULATED]


@pytest.mark.timeout(LANE_TIMEOUT_S + 120)
@pytest.mark.parametrize("target", _targets())
def test_on_nccl_semantics_a_fault_gets_the_gloo_verdict_or_the_stated_nccl_one(lane, target):
    seen = lane[target]
    (gloo, gloo_dir), (emulated, emulated_dir) = seen["gloo"], seen["emulated_nccl"]
    if target in NCCL_VERDICTS:
        assert set(NCCL_VERDICTS[target]) & set(emulated[0]), f"{target}: {emulated} ({emulated_dir})"
        return
    assert emulated == gloo, (f"{target}: gloo and NCCL's semantics disagree\n  gloo:     {gloo}\n    {gloo_dir}\n"
                              f"  emulated: {emulated}\n    {emulated_dir}")
