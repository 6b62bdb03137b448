"""How fast a hang is detected, reported and cleaned up, at 2, 4, 8 and 16 ranks.

Runs the real CLI (``python -m distcheck run``: launcher, watchdog, analysis,
report) on ``benchmarks/hang_scenario.py`` — rank 0 alone enters an
all_reduce — and, with ``--hang cpp``, on ``benchmarks/hang_scenario_cpp.py`` —
rank 0 alone runs a DDP backward(), so it waits in an all_reduce issued from
C++ by DDP's reducer — with ``--stall-timeout S``, world sizes interleaved
over the repeats, and reads the run's JSON report:

* **stall onset** — the watchdog's last observed progress (``stall_onset``);
* **detected** — the watchdog's decision (``detected_at``; the finding's
  ``detected_after_s``);
* **torn down** — the launch returned with every rank process gone
  (``ended_at``);
* **report written** — ``report.json`` on disk (after teardown and analysis).

The hang is *reported* (the finding and its ``detected_after_s``) at
detection; the report file is written once the job is torn down.

Each run has a hard timeout and its whole process group is killed afterwards;
a process left behind is reported as a failure.

    python benchmarks/detection_latency.py [--sizes 2 4 8 16] [--stall-timeout 30] [--repeats 3]
        [--hang python cpp dead cycle stuck] [--load K] [--tiny]

``--tiny``: every hang once, at 2 ranks, ``--stall-timeout 2`` (the runs of every ``hang_scenario*.py``).

Certain hangs (peers finished or dead, a cycle) are judged against 1 s, whatever the stall timeout;
the uncertain one (a silent rank) against the stall timeout + 1 s.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import REPO, conditions, median, parse_args, run_group, table, well_formed  # noqa: E402

sys.path.insert(0, str(REPO / "tests"))
from load import cpu_hogs  # noqa: E402

HERE = Path(__file__).resolve().parent
# name: (scenario file, certain?, what is certain about it)
SCENARIOS = {"python": (HERE / "hang_scenario.py", True, "finished peers"),
             "cpp": (HERE / "hang_scenario_cpp.py", True, "finished peers, a C++-issued call"),
             "dead": (HERE / "hang_scenario_dead.py", True, "a dead peer"),
             "cycle": (HERE / "hang_scenario_cycle.py", True, "a send/send cycle"),
             "stuck": (HERE / "hang_scenario_stuck.py", False, "a silent rank (the stall timeout's case)")}


def survivors(marker: str) -> list[psutil.Process]:
    found = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        try:
            if marker in " ".join(p.info["cmdline"] or []):
                found.append(p)
        except psutil.Error:
            continue
    return found


def one_run(world: int, stall_timeout: float, hard_timeout: float, scenario: Path, hang: str) -> dict:
    run_dir = Path(tempfile.mkdtemp(prefix=f"distcheck-latency-{world}-"))
    json_path = run_dir / "out.json"
    cmd = [sys.executable, "-m", "distcheck", "run", str(scenario), "--nproc-per-node", str(world),
           "--backend", "gloo", "--stall-timeout", str(stall_timeout), "--run-dir", str(run_dir / "run"),
           "--json", str(json_path)]
    try:
        (proc,) = run_group([cmd], [{"PYTHONPATH": str(REPO)}], timeout=hard_timeout)
    except subprocess.TimeoutExpired:
        return {"world": world, "error": f"no result within {hard_timeout:.0f} s (killed)"}
    left = survivors(str(run_dir))
    for p in left:
        p.kill()
    result: dict = {"world": world, "survivors": len(left)}
    try:
        report = json.loads(json_path.read_text())
        s = report["scenarios"][0]
        found = next(f for f in s["findings"] if f["kind"] in ("hang", "crash"))
        reported_at = os.stat(run_dir / "run" / "report.json").st_mtime
    except (OSError, ValueError, KeyError, StopIteration) as exc:
        return {**result, "error": f"{type(exc).__name__}: {exc}; exit {proc.returncode}; {proc.stderr[-500:]}"}
    ranks = {x["rank"]: x for x in s["ranks"]}
    began = max(x["last_event"]["t_enter"] for x in ranks.values() if x["last_event"])   # the newest call
    onset = s["stall_onset"] or began        # a dead peer: the agent ends the job, the trace says when
    detected_at = s["detected_at"] or s["ended_at"]
    result.update(
        since_call=detected_at - began, ok=s["ok"] and proc.returncode == 0 and _named_right(hang, found, world),
        detected=detected_at - onset, detected_after_s=found.get("detected_after_s"),
        torn_down=s["ended_at"] - onset, reported=reported_at - onset,
        startup=onset - s["started_at"], total=s["ended_at"] - s["started_at"],
    )
    shutil.rmtree(run_dir, ignore_errors=True)
    return result


def _named_right(hang: str, found: dict, world: int) -> bool:
    if hang == "dead":
        return found["kind"] == "crash" and found["odd_ranks"] == [world - 1]
    if hang == "cycle":
        return found["waiting_ranks"] == list(range(world)) and found["absent_ranks"] == []
    if hang == "stuck":
        return found["waiting_ranks"] == list(range(1, world)) and found["absent_ranks"] == [0]
    return found["waiting_ranks"] == [0] and found["absent_ranks"] == list(range(1, world))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[2, 4, 8, 16])
    p.add_argument("--stall-timeout", type=float, default=5.0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--hard-timeout", type=float, default=400.0, help="per run, seconds")
    p.add_argument("--hang", choices=sorted(SCENARIOS), nargs="+", default=["python", "dead", "cycle", "stuck"],
                   help="python / cpp: rank 0 waits for peers that finished (a Python-issued all_reduce / DDP's "
                        "reducer all_reduce, issued from C++); dead: for a peer that died; cycle: every rank sends "
                        "before it receives; stuck: rank 0 blocks on an Event (uncertain: the stall timeout's case)")
    p.add_argument("--load", type=int, default=0, help="CPU hogs (busy loops) running beside the job")
    args = parse_args(p, {"sizes": [2], "repeats": 1, "stall_timeout": 2.0, "hang": sorted(SCENARIOS),
                          "hard_timeout": 120.0})
    print(f"conditions: {conditions()}")
    figures, found = {}, {}
    with (cpu_hogs(args.load) if args.load else contextlib.nullcontext()):
        for hang in args.hang:
            figures[hang], found[f"{hang}: every run named it right, no survivor"] = measure(args, hang)
    well_formed(figures, found)


def measure(args: argparse.Namespace, hang: str) -> tuple[dict[str, float], bool]:
    """Runs one kind of hang at every size, prints its table; the median seconds from onset to detection at
    each size, and whether every run named it right and left no process behind."""
    scenario, certain, what = SCENARIOS[hang]
    runs: dict[int, list[dict]] = {w: [] for w in args.sizes}
    for r in range(args.repeats):
        sizes = args.sizes if r % 2 == 0 else args.sizes[::-1]   # interleave sizes over repeats
        for world in sizes:
            res = one_run(world, args.stall_timeout, args.hard_timeout, scenario, hang)
            runs[world].append(res)
            status = res.get("error") or (f"detected +{res['detected']:.2f} s, torn down +{res['torn_down']:.2f} s, "
                                          f"reported +{res['reported']:.2f} s, survivors {res['survivors']}")
            print(f"  run {r + 1}/{args.repeats}, {world} ranks: {status}", flush=True)
    s = args.stall_timeout
    bound = 1.0 if certain else s + 1   # a certain hang needs no timeout at all
    rows = []
    for world, rs in runs.items():
        good = [x for x in rs if "error" not in x]
        if not good:
            rows.append([world, f"0/{len(rs)}", "-", "-", "-", "-", "-", "-"])
            continue
        det, down, rep, call = ([x[k] for x in good] for k in ("detected", "torn_down", "reported", "since_call"))
        rows.append([
            world, f"{sum(bool(x['ok']) for x in good)}/{len(rs)}",
            f"{median(x['startup'] for x in good):.1f}",
            f"{median(det):.2f} (max {max(det):.2f})",
            f"{median(call):.2f} (max {max(call):.2f})",
            f"{median(rep):.2f} (max {max(rep):.2f})",
            f"{median(down):.2f} (max {max(down):.2f})",
            "yes" if max(det) <= bound else "NO", "yes" if max(down) <= bound + 2 else "NO",
            "yes" if max(rep) <= bound + 2 else "no",
        ])
    print()
    print(table(["ranks", "correct", "start-up s", "detected s (JSON detected_after_s)",
                 "detected s after the stuck call began", "report.json written s",
                 "torn down s", f"detected ≤ {bound:g} s", f"torn down ≤ {bound + 2:g} s",
                 f"report written ≤ {bound + 2:g} s"], rows,
                title=f"{hang} hang ({'certain' if certain else 'uncertain'}: {what}): onset → detected / reported / "
                      f"torn down, --stall-timeout {s:g}, load {args.load} hogs, {args.repeats} runs per size "
                      f"(medians, max)"))
    every = [x for rs in runs.values() for x in rs]
    if any(x.get("survivors") for x in every):
        print("\nWARNING: processes survived some runs (killed by this script).")
    detected = {f"{world} ranks": median(x["detected"] for x in rs if "error" not in x) for world, rs in runs.items()}
    return detected, all("error" not in x and x["ok"] and not x["survivors"] for x in every)


if __name__ == "__main__":
    main()
