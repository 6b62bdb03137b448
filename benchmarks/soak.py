"""Soak under load: N runs each of healthy and faulty scripts beside CPU hogs, counting false alarms,
misses and detection latency (issue 24: target 0 false alarms and 0 misses in 100 runs of each).

Healthy scripts (a false alarm is any error or warning, a non-zero exit, or unequal per-rank counts):
the DDP recipe (4 ranks), DDP + Join (3), FSDP2 (2), a batch_isend_irecv ring (4). Faulty scripts (a
miss is anything but the right finding on the right ranks): DDP with uneven inputs (a C++-issued hang),
a rank-0-only ``dcp.save`` (a hang on the save line), the OOM-skip (a shape mismatch, odd rank 1).
Runs go one at a time, healthy and faulty interleaved, each with a hard timeout and a
no-survivor check.

    python benchmarks/soak.py [--runs 100] [--load 4] [--stall-timeout 5] [--only ddp_recipe ...]
    python benchmarks/soak.py --tiny    # one run each of a healthy and a faulty 2-rank script, no hogs
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import REPO, conditions, median, parse_args, run_group, table, well_formed  # noqa: E402

sys.path.insert(0, str(REPO / "tests"))
from load import cpu_hogs  # noqa: E402

RECORDS = REPO / "tests" / "scripts" / "records"
# name: (script, ranks, healthy?, check of the one scenario's JSON for a faulty one)
CASES = {
    "ddp_recipe": (RECORDS / "ddp_recipe.py", 4, True, None),
    "ddp_join": (RECORDS / "ddp_join.py", 3, True, None),
    "fsdp2_train": (RECORDS / "fsdp2_train.py", 2, True, None),
    "p2p_ring": (RECORDS / "p2p_ring.py", 4, True, None),
    "ddp_uneven": (REPO / "tests" / "scripts" / "ddp_uneven.py", 2, False,
                   lambda f: f["kind"] == "hang" and f["waiting_ranks"] == [0] and f["absent_ranks"] == [1]),
    "dcp_save_rank0": (RECORDS / "dcp_save_rank0.py", 3, False,
                       lambda f: f["kind"] == "hang" and f["waiting_ranks"] == [0] and f["absent_ranks"] == [1, 2]),
    "ddp_oom_skip": (RECORDS / "ddp_oom_skip.py", 3, False,
                     lambda f: f["kind"] == "mismatch" and f["odd_ranks"] == [1] and f["fields"] == ["shape"]),
}


def one_run(name: str, stall_timeout: float, hard_timeout: float) -> dict:
    script, world, healthy, check = CASES[name]
    work = Path(tempfile.mkdtemp(prefix=f"distcheck-soak-{name}-"))
    cmd = [sys.executable, "-m", "distcheck", "run", str(script), "--nproc-per-node", str(world),
           "--stall-timeout", str(stall_timeout), "--run-dir", str(work / "run"), "--json", str(work / "out.json"),
           "--", str(work / "ckpt")]
    started = time.monotonic()
    try:
        (proc,) = run_group([cmd], [{"PYTHONPATH": str(REPO)}], timeout=hard_timeout)
    except subprocess.TimeoutExpired:
        return {"ok": False, "why": f"no result within {hard_timeout:.0f} s"}
    try:
        [s] = json.loads((work / "out.json").read_text())["scenarios"]
    except (OSError, ValueError) as exc:
        return {"ok": False, "why": f"no report ({exc}); exit {proc.returncode}: {proc.stderr[-3000:]}"}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    said = [f for f in s["findings"] if f["severity"] in ("error", "warning")]
    out = {"seconds": time.monotonic() - started}
    if healthy:
        counts = {x["collectives"] for x in s["ranks"]}
        ok = proc.returncode == 0 and not said and len(counts) == 1
        return {**out, "ok": ok, "why": None if ok else f"exit {proc.returncode}, counts {sorted(counts)}, "
                                                         f"{[f['summary'][:160] for f in said]}"}
    right = [f for f in said if check(f)]
    ok = proc.returncode == 1 and bool(right)
    latency = right[0].get("detected_after_s") if right else None
    return {**out, "ok": ok, "latency": latency,
            "why": None if ok else f"exit {proc.returncode}: {[f['summary'][:160] for f in said]}"}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=100, help="runs of each script")
    p.add_argument("--load", type=int, default=4, help="CPU hogs beside the jobs (0: a quiet machine)")
    p.add_argument("--stall-timeout", type=float, default=5.0)
    p.add_argument("--hard-timeout", type=float, default=300.0)
    p.add_argument("--only", nargs="+", choices=sorted(CASES), default=sorted(CASES))
    args = parse_args(p, {"runs": 1, "load": 0, "only": ["fsdp2_train", "ddp_uneven"]})
    print(f"conditions: {conditions()}; {args.load} CPU hogs beside the jobs")
    results: dict[str, list[dict]] = {name: [] for name in args.only}
    with (cpu_hogs(args.load) if args.load else contextlib.nullcontext()):
        for i in range(args.runs):
            for name in args.only:
                res = one_run(name, args.stall_timeout, args.hard_timeout)
                results[name].append(res)
                if not res["ok"]:
                    print(f"  run {i + 1}, {name}: {'FALSE ALARM' if CASES[name][2] else 'MISS'}: {res['why']}",
                          flush=True)
            print(f"  round {i + 1}/{args.runs} done", flush=True)
    rows = []
    for name, rs in results.items():
        healthy = CASES[name][2]
        bad = sum(not r["ok"] for r in rs)
        lat = [r["latency"] for r in rs if r.get("latency") is not None]
        rows.append([name, "healthy" if healthy else "faulty", len(rs), bad if healthy else "-",
                     "-" if healthy else bad, f"{median(lat):.2f} (max {max(lat):.2f})" if lat else "-",
                     f"{median(r.get('seconds', 0) for r in rs):.1f}"])
    print()
    print(table(["script", "kind", "runs", "false alarms", "misses", "detected s after onset", "run s (median)"],
                rows, title=f"soak: {args.runs} runs each, {args.load} CPU hogs, --stall-timeout {args.stall_timeout:g}"))
    well_formed({name: median(r.get("seconds", float("nan")) for r in rs) for name, rs in results.items()},
                {f"{name}: no {'false alarm' if CASES[name][2] else 'miss'}": all(r["ok"] for r in rs)
                 for name, rs in results.items()})


if __name__ == "__main__":
    main()
