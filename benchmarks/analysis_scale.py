"""Analysis and trace parsing at 1,000+ ranks, on synthetic traces.

1. ``diagnose.rules.analyze`` over 1,024 ranks × 1,000 collectives (about 1M
   events) with one planted hang (rank 0 alone enters the last collective)
   and one planted mismatch (one rank uses MAX where the others use SUM):
   wall time, peak memory of the call (tracemalloc, in a second run, since
   tracing slows allocation) and the process's peak RSS; both findings must
   be found.
2. ``distcheck.files.trace_reader.parse_trace`` speed in events/s on a rank file
   written by the real tracer; ``read_trace_dir`` over 1,024 files of 1,000
   calls each, and the watchdog's ``TraceTail`` over the same files. The cost
   of building the ``Event`` objects alone is shown as the floor. Target:
   1M events/s or more for each.

    python benchmarks/analysis_scale.py [--ranks 1024] [--collectives 1000] [--profile] [--tiny]
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import pstats
import resource
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import conditions, median, parse_args, table, well_formed  # noqa: E402

# The smallest run that still plants both findings (the mismatch's call, 20 // 2 + 1, is an all_reduce).
TINY = {"ranks": 8, "collectives": 20, "parse_calls": 400, "parse_rounds": 1}
SITES = [(f"/home/user/train.py:{100 + i}:evaluate", f"/site-packages/torchmetrics/utilities/distributed.py:{90 + i}:gather",
          "BinaryAUROC.compute") for i in range(4)]


def synthetic(ranks: int, collectives: int) -> tuple[dict, dict]:
    """Events and outcomes: everyone completes collectives-1 calls; rank 0 alone enters the last one;
    one rank calls collective #collectives//2 with MAX instead of SUM."""
    from distcheck.models import Event, RankOutcome

    members = tuple(range(ranks))
    shapes = ((1024,),)
    dtypes = ("float32",)
    odd_rank, odd_seq = ranks // 2 + 1, collectives // 2 + 1   # an all_reduce (every 10th call is a barrier)
    t0 = 1_700_000_000.0
    traces = {}
    for r in range(ranks):
        evs = []
        n = collectives if r == 0 else collectives - 1
        for s in range(1, n + 1):
            op = "barrier" if s % 10 == 0 else "all_reduce"
            site = SITES[s % 4]
            reduce_op = None if op == "barrier" else ("MAX" if (r == odd_rank and s == odd_seq) else "SUM")
            t = t0 + s * 0.01 + r * 1e-6
            evs.append(Event(rank=r, group="0", seq=s, op=op, reduce_op=reduce_op,
                             shapes=() if op == "barrier" else shapes, dtypes=() if op == "barrier" else dtypes,
                             device=None if op == "barrier" else "cpu", group_ranks=members, t_enter=t,
                             t_exit=None if s == collectives else t + 0.001, callsite=site[0],
                             library_callsite=site[1], label=site[2]))
        traces[r] = evs
    outcomes = {r: RankOutcome(rank=r, state="stuck" if r == 0 else "finished", collectives=len(traces[r]),
                               last_event=traces[r][-1]) for r in range(ranks)}
    return traces, outcomes


def run_analysis(traces, outcomes, ranks):
    from distcheck.diagnose.rules import RunFacts, analyze

    facts = RunFacts(world_size=ranks, end_reason="stall", stall_onset=1.0, detected_at=6.0)
    return analyze(traces, outcomes, facts, {})


def planted(findings, ranks, collectives) -> dict[str, bool]:
    """Whether each planted finding was named, on the ranks and at the call it was planted at."""
    hang = [f for f in findings if f.kind == "hang"]
    mism = [f for f in findings if f.kind == "mismatch"]
    ok_hang = bool(hang) and hang[0].waiting_ranks == (0,) and len(hang[0].absent_ranks) == ranks - 1 \
        and hang[0].seq == collectives
    ok_mism = bool(mism) and mism[0].odd_ranks == (ranks // 2 + 1,) and mism[0].seq == collectives // 2 + 1 \
        and "reduce_op" in mism[0].fields
    return {"hang": ok_hang, "mismatch": ok_mism}


def check(findings, ranks, collectives) -> str:
    found = planted(findings, ranks, collectives)
    said = ", ".join(f"{kind} {'found' if ok else 'MISSED'}" for kind, ok in found.items())
    return f"{said} (kinds: {sorted({f.kind for f in findings})})"


# -- parsing ---------------------------------------------------------------------------------


def real_trace_file(path: Path, calls: int) -> None:
    """A rank file written by the real tracer: a loop of metric-style calls from four lines."""
    import torch
    from torch.distributed import ReduceOp

    from distcheck.rank.tracer import Tracer

    world = object()
    tracer = Tracer(path, 0, group_resolver=lambda pg: ("0", tuple(range(8))), default_group=lambda: world)

    def all_reduce(tensor, op=ReduceOp.SUM, group=None, async_op=False):
        return None

    def barrier(group=None, async_op=False, device_ids=None, timeout=None):
        return None

    ar, b = tracer.wrap("all_reduce", all_reduce), tracer.wrap("barrier", barrier)
    t = torch.ones(1024)
    for i in range(calls // 4):
        ar(t)
        ar(t, op=ReduceOp.MAX)
        b()
        ar(t)
    tracer.close()


def parse_rates(calls: int, rounds: int, files: int, per_file: int) -> tuple[list[list], dict[str, float]]:
    """The table's rows, and each rate in events (or calls) per second."""
    from distcheck.models import Event
    from distcheck.files.trace_reader import parse_trace, read_trace_dir
    from distcheck.files.trace_tail import TraceTail

    tmp = Path(tempfile.mkdtemp(prefix="distcheck-bench-"))
    real_trace_file(tmp / "one.trace", calls)
    whole = (tmp / "one.trace").read_bytes()
    n = len(parse_trace(0, whole).events)
    assert n == calls
    proto = parse_trace(0, whole).events[0]
    args = tuple(proto)
    res: dict[str, list[float]] = {"trace file": [], "Event objects only": []}
    for r in range(rounds + 1):
        for name in (list(res) if r % 2 else list(res)[::-1]):
            gc.collect()
            t0 = time.perf_counter()
            if name == "Event objects only":   # as the parser builds them: tuple.__new__, no cycle collector
                gc.disable()
                new = tuple.__new__
                [new(Event, args) for _ in range(n)]
                gc.enable()
            else:
                parse_trace(0, whole)
            if r:
                res[name].append(n / (time.perf_counter() - t0))
    rows = [[name, f"{n:,}", f"{median(v) / 1e6:.2f} M/s", f"{len(whole) / n:.0f}" if name == "trace file" else ""]
            for name, v in res.items()]
    rates = {"parse_trace_per_s": median(res["trace file"]), "event_objects_per_s": median(res["Event objects only"])}
    # a run dir of `files` ranks, each with `per_file` calls written by the real tracer
    real_trace_file(tmp / "small.trace", per_file)
    one = (tmp / "small.trace").read_bytes()
    trace_dir = tmp / "traces"
    trace_dir.mkdir()
    for rank in range(files):
        (trace_dir / f"rank{rank}.trace").write_bytes(one)
    gc.collect()
    t0 = time.perf_counter()
    traces = read_trace_dir(trace_dir)
    dt = time.perf_counter() - t0
    total = sum(len(t.events) for t in traces.values())
    rows.append([f"read_trace_dir, {files} files", f"{total:,}", f"{total / dt / 1e6:.2f} M/s ({dt:.1f} s)", ""])
    rates["read_trace_dir_per_s"] = total / dt
    # the watchdog's view: one TraceTail per rank, each file read as far as it goes
    gc.collect()
    t0 = time.perf_counter()
    tails = [TraceTail(trace_dir / f"rank{rank}.trace").read() for rank in range(files)]
    dt = time.perf_counter() - t0
    calls = sum(t.records for t in tails) // 2   # an enter and an exit record per call
    rows.append([f"TraceTail.read (watchdog), {files} files", f"{calls:,}", f"{calls / dt / 1e6:.2f} M/s ({dt:.1f} s)",
                 ""])
    rates["trace_tail_calls_per_s"] = calls / dt
    return rows, rates


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=1024)
    p.add_argument("--collectives", type=int, default=1000)
    p.add_argument("--parse-calls", type=int, default=100_000)
    p.add_argument("--parse-rounds", type=int, default=5)
    p.add_argument("--profile", action="store_true", help="print where analyze spends its time")
    args = parse_args(p, TINY)
    print(f"conditions: {conditions()}")
    t0 = time.perf_counter()
    traces, outcomes = synthetic(args.ranks, args.collectives)
    n = sum(len(v) for v in traces.values())
    build_s = time.perf_counter() - t0
    gc.collect()
    t0 = time.perf_counter()
    findings = run_analysis(traces, outcomes, args.ranks)
    analyze_s = time.perf_counter() - t0
    verdict = check(findings, args.ranks, args.collectives)
    found = planted(findings, args.ranks, args.collectives)
    rss_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    gc.collect()
    tracemalloc.start()
    run_analysis(traces, outcomes, args.ranks)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    rows = [[f"{args.ranks} ranks × {args.collectives} collectives", f"{n:,}", f"{analyze_s:.2f} s",
             f"{peak / 2**30:.2f} GiB", f"{rss_gib:.2f} GiB", verdict]]
    print()
    print(table(["analyze()", "events", "time", "peak (tracemalloc, analyze only)", "process peak RSS", "findings"],
                rows, title=f"Analysis at scale (building the events took {build_s:.1f} s, not counted)"))
    if args.profile:
        prof = cProfile.Profile()
        prof.enable()
        run_analysis(traces, outcomes, args.ranks)
        prof.disable()
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(18)
        print("\nprofile of analyze() (cumulative):")
        print("\n".join(out.getvalue().splitlines()[4:34]))
    del traces, outcomes, findings
    gc.collect()
    rows, rates = parse_rates(args.parse_calls, args.parse_rounds, args.ranks, args.collectives)
    print()
    print(table(["parse_trace", "events", "rate (median)", "bytes/event"], rows,
                title=f"Trace parsing: the same {args.parse_calls:,} calls written by the real tracer, "
                      f"{args.parse_rounds} interleaved rounds"))
    well_formed({"analyze_s": analyze_s, "events": n, "peak_gib": peak / 2**30, **rates}, found)


if __name__ == "__main__":
    main()
