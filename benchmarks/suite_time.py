"""Wall time of the built-in catalogue: ``distcheck run`` against the naive way.

* **distcheck** — one ``python -m distcheck run`` over every built-in
  scenario (whatever the catalogue holds when this runs);
* **naive** — one launch per scenario, each its own process: ``python -m
  distcheck run <scenario>`` for every scenario in turn (the same launcher and
  watchdog, so hang and crash scenarios end too; a bare ``torchrun`` per
  scenario would wait for the backend's 30-minute timeout on every hang).

The two are interleaved over the repeats. Per scenario, from distcheck's own
JSON: wall time, how it ended, and the start-up share (launch start → the
first collective of any rank), which is what running several pass-expected
scenarios in one launch would save.

    python benchmarks/suite_time.py [--nproc-per-node 4] [--repeats 1] [--stall-timeout 5]

``--against CHECKOUT`` compares instead this checkout's ``distcheck run`` of the catalogue, with
default options, against another checkout's (an older commit, ``git worktree add``), the two
interleaved over the repeats, and prints new / old.

    python benchmarks/suite_time.py --against /tmp/old [--repeats 1]

``--scenarios NAME ...`` times those built-in scenarios instead of the whole catalogue; ``--tiny`` two of them
at 2 ranks.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import REPO, conditions, median, parse_args, run_group, table, well_formed  # noqa: E402

# --tiny: one passing and one hanging scenario of the catalogue, 2 ranks, each way once
TINY = {"nproc_per_node": 2, "scenarios": ["collectives_sanity", "uneven_shards_allreduce"]}


def catalogue() -> list[str]:
    from distcheck.targets.discovery import builtin_scenarios

    return [s.name for s in builtin_scenarios()]


def distcheck_run(targets: list[str], args: argparse.Namespace, tag: str, checkout: Path = REPO,
                  defaults: bool = False) -> tuple[float, dict | None, str]:
    """``defaults``: distcheck's own --stall-timeout, not this script's."""
    out = Path(tempfile.mkdtemp(prefix=f"distcheck-suite-{tag}-"))
    timing = () if defaults else ("--stall-timeout", str(args.stall_timeout))
    cmd = [sys.executable, "-m", "distcheck", "run", *targets, "--nproc-per-node", str(args.nproc_per_node),
           "--backend", "gloo", *timing, "--run-dir", str(out / "run"), "--json", str(out / "report.json")]
    t0 = time.perf_counter()
    try:
        (proc,) = run_group([cmd], [{"PYTHONPATH": str(checkout)}], timeout=args.hard_timeout, cwd=out)
        code = str(proc.returncode)
    except subprocess.TimeoutExpired:
        code = "killed (hard timeout)"
    wall = time.perf_counter() - t0
    try:
        report = json.loads((out / "report.json").read_text())
    except (OSError, ValueError):
        report = None
    return wall, report, code


def first_collective(launch_dir: str) -> float | None:
    from distcheck.files.trace_reader import read_trace_dir

    traces = read_trace_dir(Path(launch_dir) / "traces")
    starts = [t.events[0].t_enter for t in traces.values() if t.events]
    return min(starts) if starts else None


def scenario_rows(report: dict | None) -> dict[str, dict]:
    """Per scenario of one ``distcheck run``'s JSON: its expectation, ending, wall time and start-up share."""
    rows = {}
    for s in (report or {}).get("scenarios", []):
        first = first_collective(s["launch_dir"]) if s.get("launch_dir") else None
        rows[s["name"]] = {
            "expected": "/".join(s["expected"]), "end": s.get("end_reason") or "-",
            "ok": s["ok"], "duration": s["duration_s"], "skipped": s.get("skipped"),
            "startup": (first - s["started_at"]) if first and s.get("started_at") else None,
        }
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc-per-node", type=int, default=4)
    p.add_argument("--stall-timeout", type=float, default=5.0)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--hard-timeout", type=float, default=1800.0, help="per distcheck invocation, seconds")
    p.add_argument("--against", type=Path, help="another checkout: compare the catalogue's run, default options")
    p.add_argument("--scenarios", nargs="+", default=[], help="these built-in scenarios, not the whole catalogue")
    args = parse_args(p, TINY)
    if args.against:
        compare_checkouts(args)
        return
    names = args.scenarios or catalogue()
    print(f"conditions: {conditions()}")
    print(f"catalogue: {len(names)} scenarios: {', '.join(names)}", flush=True)
    walls: dict[str, list[float]] = {"distcheck run (all)": [], "naive (one launch per scenario)": []}
    per_scenario: dict[str, dict] = {}
    verdicts = []
    for r in range(args.repeats):
        order = list(walls) if r % 2 == 0 else list(walls)[::-1]
        for mode in order:
            if mode.startswith("distcheck"):
                wall, report, code = distcheck_run(args.scenarios, args, "all")
                walls[mode].append(wall)
                verdicts.append(f"distcheck run: exit {code}, verdict {report and report.get('verdict')}")
                per_scenario.update(scenario_rows(report))
                print(f"  {mode}: {wall:.1f} s (exit {code})", flush=True)
            else:
                total = 0.0
                bad = []
                for name in names:
                    wall, report, code = distcheck_run([name], args, name)
                    total += wall
                    if code not in ("0",):
                        bad.append(f"{name} (exit {code})")
                walls[mode].append(total)
                verdicts.append(f"naive: {len(names) - len(bad)}/{len(names)} exit 0" + (f"; {', '.join(bad)}" if bad else ""))
                print(f"  {mode}: {total:.1f} s", flush=True)
    rows = [[name, s["expected"], s["end"], "skipped" if s["skipped"] else ("ok" if s["ok"] else "NOT OK"),
             f"{s['duration']:.1f}", "-" if s["startup"] is None else f"{s['startup']:.1f}"]
            for name, s in per_scenario.items()]
    print()
    print(table(["scenario", "expected", "ended", "", "wall s", "start-up s (launch → first collective)"], rows,
                title=f"Per scenario, inside one `distcheck run` ({args.nproc_per_node} gloo ranks)"))
    a = median(walls["distcheck run (all)"])
    b = median(walls["naive (one launch per scenario)"])
    passing = [s for s in per_scenario.values() if s["expected"] == "pass" and not s["skipped"]]
    startup_pass = sum(s["startup"] or 0 for s in passing)
    print()
    print(table(["way", "wall s (median)", "runs"], [[k, f"{median(v):.1f}", len(v)] for k, v in walls.items()],
                title=f"{'The chosen scenarios' if args.scenarios else 'Whole catalogue'} ({len(names)} scenarios, {args.nproc_per_node} ranks, --stall-timeout "
                      f"{args.stall_timeout:g}): naive / distcheck = {b / a:.2f}×"))
    print(f"\nstart-up spent in the {len(passing)} pass-expected scenarios: {startup_pass:.1f} s of {a:.1f} s "
          f"(what one shared launch for them could save, minus one start-up)")
    for v in verdicts:
        print(f"  {v}")
    check(names, per_scenario, verdicts, a, b)


def check(names: list[str], per_scenario: dict[str, dict], verdicts: list[str], a: float, b: float) -> None:
    """The run's figures are numbers, every scenario ended as expected, and every naive launch exited 0."""
    well_formed({"distcheck_s": a, "naive_s": b, "naive_over_distcheck": b / a},
                {"every scenario as expected in distcheck run": len(per_scenario) == len(names)
                 and all(s["ok"] or s["skipped"] for s in per_scenario.values()),
                 "every naive launch exited 0": all(v.startswith(f"naive: {len(names)}/") for v in verdicts
                                                    if v.startswith("naive"))})


def compare_checkouts(args: argparse.Namespace) -> None:
    """This checkout's catalogue run against another's, default options, interleaved."""
    print(f"conditions: {conditions()}")
    sides = {"this checkout": REPO, f"against {args.against}": args.against.resolve()}
    walls: dict[str, list[float]] = {name: [] for name in sides}
    for r in range(args.repeats):
        for name in (list(sides) if r % 2 == 0 else list(sides)[::-1]):
            wall, report, code = distcheck_run(args.scenarios, args, name.split()[0], checkout=sides[name],
                                               defaults=True)
            walls[name].append(wall)
            ok = sum(s["ok"] for s in (report or {}).get("scenarios", []))
            print(f"  {name}: {wall:.1f} s, exit {code}, {ok} scenarios as expected", flush=True)
    new, old = (median(v) for v in walls.values())
    print()
    print(table(["checkout", "wall s (median)", "runs"], [[k, f"{median(v):.1f}", len(v)] for k, v in walls.items()],
                title=f"The catalogue at {args.nproc_per_node} ranks, default options: this / against = "
                      f"{new / old:.2f}×"))
    well_formed({"this_s": new, "against_s": old, "this_over_against": new / old})


if __name__ == "__main__":
    main()
