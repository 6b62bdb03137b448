"""What the distcheck tracer costs per collective, measured side by side.

Two parts, both printed as tables of medians and ratios:

1. **Hot path in isolation** (in-process, no process group): the tracer's own
   wrapper (``Tracer.wrap``, the code path ``install`` uses) around a no-op
   function with the collective's signature, against the bare no-op. The
   difference is exactly the µs distcheck adds to every call (its two trace
   records included). Also from 40 frames deeper and from inside an
   ``nn.Module`` method (where the label must be resolved). Targets: ≤ 2 µs,
   and ≤ +1 µs from 40 frames deeper.

2. **Real collectives on gloo** at 2 and 4 ranks: all_reduce (1 element and
   1 MiB), all_gather (1 element per rank) and barrier, in one table, each
   comparison inside one set of processes, its modes interleaved round by round
   in short blocks (8 calls), each round's order rotated:

   * untraced (the original torch function, and torch's own ``Work.wait``), the
     tracer, and a control (each call wrapped in plain busy work as long as the
     tracer's own CPU time from part 1);
   * untraced and the tracer with PyTorch's Flight Recorder (256 entries, as
     ``distcheck run`` sets it) and distcheck's sidecar that reads it (the
     recorder is process-wide);
   * untraced and ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` (a process group created at
     debug level DETAIL, i.e. wrapped in PyTorch's ProcessGroupWrapper).

   Why apart: what a mode leaves behind lands on the mode after it. DETAIL's
   wrapper group runs checks of its own on threads of its own, and the calls
   just after a DETAIL block are slower; interleaved with the others it slowed
   whichever mode followed it most (untraced: the tracer and the control then
   read 2–4% *under* 1). Why short blocks: the machine's own interference comes
   in bursts of milliseconds, and blocks of 40 calls let one mode take a burst
   another did not (a launch's ratio then moved ±4%; ±1% in blocks of 8).

   Each set of processes is launched ``--launches`` times (3): a launch's
   ratios carry an offset of their own, the same for every mode in it (where
   its code and objects fell in memory), which more calls in one launch do
   not average away. The table gives the median of the launches' ratios, and
   the 1-element all_reduce's ratio in each launch beside it.

The tracer's hot path is the C one where it is built (``distcheck.rank._hot_path_c``), else the Python wrapper;
the first line says which. ``DISTCHECK_HOT_PATH=python`` measures the Python wrapper.

``--nccl`` runs part 2 with one rank on NCCL and CUDA tensors instead
(single-GPU machine; two NCCL ranks cannot share one GPU). Target: ≤ 1.10×.

    python benchmarks/tracer_overhead.py                 # both parts, 2 and 4 ranks
    python benchmarks/tracer_overhead.py --hot-only
    python benchmarks/tracer_overhead.py --nccl          # on a machine with a GPU
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import REPO, conditions, free_port, median, parse_args, python, run_group, table, well_formed  # noqa: E402

# --tiny: part 1 and part 2 once each, part 2 on one gloo rank (the same worker, modes and Flight Recorder set)
TINY = {"ranks": [1], "rounds": 1, "block": 4, "hot_rounds": 1, "hot_block": 50, "launches": 1}

# -- part 1: the hot path in isolation ------------------------------------------------


def _deep(depth: int, fn, *args):
    if depth == 0:
        return fn(*args)
    return _deep(depth - 1, fn, *args)


def hot_path(rounds: int, block: int) -> list[list]:
    import torch
    from torch.distributed import ReduceOp

    from distcheck.rank.tracer import Tracer

    fake_world = object()
    trace_dir = Path(tempfile.mkdtemp(prefix="distcheck-bench-"))
    tracer = Tracer(trace_dir / "rank0.trace", 0, group_resolver=lambda pg: ("0", (0, 1)),
                    default_group=lambda: fake_world)

    def all_reduce(tensor, op=ReduceOp.SUM, group=None, async_op=False):
        return None

    def all_gather(tensor_list, tensor, group=None, async_op=False):
        return None

    def barrier(group=None, async_op=False, device_ids=None, timeout=None):
        return None

    traced = {f.__name__: tracer.wrap(f.__name__, f) for f in (all_reduce, all_gather, barrier)}
    plain = {f.__name__: f for f in (all_reduce, all_gather, barrier)}
    t1 = torch.ones(1)
    gathered = [torch.zeros(1), torch.zeros(1)]

    class Metric(torch.nn.Module):
        def compute(self, fn):
            return self._sync(fn)

        def _sync(self, fn):
            return fn(t1)

    metric = Metric()
    record = b"E\t0\t123456\t3\t1700000000123456\n"
    fd = os.open(trace_dir / "write-probe", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)

    def loop_write(n):
        for _ in range(n):
            os.write(fd, record)

    cases = {
        "all_reduce(1 elem)": lambda f, n: [f(t1) for _ in range(n)],
        "all_reduce(op=MAX, kw)": lambda f, n: [f(t1, op=ReduceOp.MAX) for _ in range(n)],
        "all_gather": lambda f, n: [f(gathered, t1) for _ in range(n)],
        "barrier": lambda f, n: [f() for _ in range(n)],
        "all_reduce, 40 frames deeper": lambda f, n: [_deep(40, f, t1) for _ in range(n)],
        "all_reduce in nn.Module method": lambda f, n: [metric.compute(f) for _ in range(n)],
    }
    op_of = {name: ("all_gather" if "gather" in name else "barrier" if "barrier" in name else "all_reduce")
             for name in cases}
    samples: dict[tuple[str, str], list[float]] = {}
    write_samples = []
    for r in range(rounds + 1):                      # round 0 is warm-up
        for name, run in cases.items():
            order = ("plain", "traced") if r % 2 else ("traced", "plain")
            for mode in order:
                fn = plain[op_of[name]] if mode == "plain" else traced[op_of[name]]
                w0, c0 = time.perf_counter_ns(), time.thread_time_ns()
                run(fn, block)
                c1, w1 = time.thread_time_ns(), time.perf_counter_ns()
                if r:
                    samples.setdefault((name, mode), []).append((w1 - w0) / block / 1000)
                    samples.setdefault((name, mode + " cpu"), []).append((c1 - c0) / block / 1000)
        w0, c0 = time.perf_counter_ns(), time.thread_time_ns()
        loop_write(block)
        c1, w1 = time.thread_time_ns(), time.perf_counter_ns()
        if r:
            write_samples.append(((w1 - w0) / block / 1000, (c1 - c0) / block / 1000))
    tracer.close()
    os.close(fd)
    recorded = tracer.count
    expected = (rounds + 1) * len(cases) * block
    if recorded != expected:   # a call the tracer could not record costs less and would flatter the figures
        raise SystemExit(f"the tracer recorded {recorded} of {expected} calls")
    rows = []
    for name in cases:
        p, t = median(samples[(name, "plain")]), median(samples[(name, "traced")])
        pc, tc = median(samples[(name, "plain cpu")]), median(samples[(name, "traced cpu")])
        rows.append([name, f"{p:.2f}", f"{t:.2f}", f"{t - p:.2f}", f"{tc - pc:.2f}"])
    rows.append(["(reference: one os.write of a record)", "", f"{median(w for w, _ in write_samples):.2f}", "",
                 f"{median(c for _, c in write_samples):.2f}"])
    return rows


# -- part 2: real collectives -------------------------------------------------------------

OPS = ("all_reduce 1 elem", "all_reduce 1 MiB", "all_gather", "barrier")
# Each comparison in processes of its own (see the module's docstring): set -> its modes.
MODE_SETS = {"plain": ("untraced", "distcheck", "control"), "recorder": ("untraced", "distcheck"),
             "detail": ("untraced", "DETAIL")}


def _spinner(us: float):
    """Wraps a call in ``us`` of plain busy work, half before and half after, as the tracer's own is."""
    half = int(us * 500)

    def spin(fn):
        def call(*args, **kwargs):
            end = time.perf_counter_ns() + half
            while time.perf_counter_ns() < end:
                pass
            result = fn(*args, **kwargs)
            end = time.perf_counter_ns() + half
            while time.perf_counter_ns() < end:
                pass
            return result
        return call
    return spin


def worker(args: argparse.Namespace) -> None:
    import datetime

    import torch
    import torch.distributed as dist
    from torch._C._distributed_c10d import DebugLevel

    from distcheck.rank.tracer import Tracer

    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    backend = "nccl" if args.nccl else "gloo"
    dev = torch.device("cuda", 0) if args.nccl else torch.device("cpu")
    if args.nccl:
        torch.cuda.set_device(0)
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=120))
    world_pg = dist.group.WORLD
    detail_pg = None
    if args.set == "detail":   # what TORCH_DISTRIBUTED_DEBUG=DETAIL does to every group it creates
        dist.set_debug_level(DebugLevel.DETAIL)
        detail_pg = dist.new_group(list(range(world)), backend=backend)
        dist.set_debug_level(DebugLevel.OFF)
    tracer = Tracer(Path(args.trace_dir) / f"rank{rank}.trace", rank)
    tracer.install()
    if args.set == "recorder":   # distcheck run's default: the sidecar polls as in a rank
        import threading

        from distcheck.rank import native
        native.start(native.NativeWatcher(tracer, main_thread=threading.main_thread().ident))
    orig = tracer._originals
    spin = _spinner(args.spin_us)

    small = torch.ones(1, device=dev)
    big = torch.ones(256 * 1024, device=dev)           # 1 MiB of float32
    outs = [torch.zeros(1, device=dev) for _ in range(world)]
    calls = {
        "all_reduce 1 elem": lambda ar, ag, b, g: ar(small, group=g),
        "all_reduce 1 MiB": lambda ar, ag, b, g: ar(big, group=g),
        "all_gather": lambda ar, ag, b, g: ag(outs, small, group=g),
        "barrier": lambda ar, ag, b, g: b(group=g),
    }
    fns = {
        "untraced": (orig["all_reduce"], orig["all_gather"], orig["barrier"], world_pg),
        "distcheck": (dist.all_reduce, dist.all_gather, dist.barrier, world_pg),
        "control": (spin(orig["all_reduce"]), spin(orig["all_gather"]), spin(orig["barrier"]), world_pg),
        "DETAIL": (orig["all_reduce"], orig["all_gather"], orig["barrier"], detail_pg),
    }
    assert dist.all_reduce is not orig["all_reduce"]
    sync = torch.cuda.synchronize if args.nccl else (lambda: None)
    modes = list(MODE_SETS[args.set])
    samples: dict[str, dict[str, list[float]]] = {op: {m: [] for m in modes} for op in OPS}
    for op in OPS:
        block = max(1, args.block // 8) if "MiB" in op else args.block
        for r in range(args.rounds + 1):            # round 0 is warm-up
            order = modes[r % len(modes):] + modes[:r % len(modes)]   # rotate which mode goes first
            for mode in order:
                fn = calls[op]
                a = fns[mode]
                sync()
                if args.nccl:
                    t0 = time.perf_counter_ns()
                    for _ in range(block):
                        fn(*a)
                    per = [(time.perf_counter_ns() - t0) / block / 1000]   # host side (enqueue)
                    sync()
                else:
                    per = []
                    for _ in range(block):
                        t0 = time.perf_counter_ns()
                        fn(*a)
                        per.append((time.perf_counter_ns() - t0) / 1000)
                if r:
                    samples[op][mode].extend(per)
    # Every blocking collective calls its handle's wait() from Python: distcheck's wrapper of Work.wait is in
    # place only while an async call's handle is held (none here), so no mode, untraced included, paid for it.
    if hasattr(dist.Work.wait, "__distcheck_original__"):
        raise SystemExit("distcheck's Work.wait was in place while the modes were measured")
    tracer.uninstall()
    gathered = [None] * world
    dist.all_gather_object(gathered, samples)
    if rank == 0:
        Path(args.out).write_text(json.dumps(gathered))
    dist.barrier()
    dist.destroy_process_group()


def run_world(world: int, args: argparse.Namespace, which: str) -> dict[str, dict[str, float]]:
    """{op: {mode: median µs per call}} of the set of modes ``which`` (``MODE_SETS``), every rank's calls pooled
    (a collective is one event seen from each rank)."""
    trace_dir = tempfile.mkdtemp(prefix="distcheck-bench-")
    out = os.path.join(trace_dir, "result.json")
    port = free_port()
    cmd = [python(), __file__, "--worker", "--rounds", str(args.rounds), "--block", str(args.block),
           "--trace-dir", trace_dir, "--out", out, "--spin-us", str(args.spin_us), "--set", which] + \
          (["--nccl"] if args.nccl else [])
    envs = [{"RANK": str(r), "WORLD_SIZE": str(world), "LOCAL_RANK": str(r), "MASTER_ADDR": "127.0.0.1",
             "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO),
             **({"TORCH_FR_BUFFER_SIZE": "256"} if which == "recorder" else {})} for r in range(world)]
    results = run_group([cmd] * world, envs, timeout=args.timeout)
    if not os.path.exists(out):
        for r in results:
            sys.stderr.write(r.stderr[-3000:])
        raise SystemExit(f"the {world}-rank run ({which}) failed")
    per_rank = json.loads(Path(out).read_text())
    return {op: {mode: median(x for rank in per_rank for x in rank[op][mode]) for mode in per_rank[0][op]}
            for op in OPS}


def _launch_ratios(sets: dict[str, dict], op: str) -> dict[str, float]:
    """One launch's figures for ``op``: each mode against the untraced time of its own set of processes."""
    m = sets["plain"][op]
    base = m["untraced"]
    out = {"untraced": base, "tracer": m["distcheck"] / base, "control": m["control"] / base,
           "adds": m["distcheck"] - base}
    if "recorder" in sets:
        fr = sets["recorder"][op]
        out["fr"] = fr["distcheck"] / base
        out["fr alone"] = fr["distcheck"] / fr["untraced"]
    if "detail" in sets:
        detail = sets["detail"][op]
        out["DETAIL"] = detail["DETAIL"] / detail["untraced"]
    return out


def side_by_side(worlds: list[int], args: argparse.Namespace) -> list[list]:
    """Part 2: tracer off / on / on with the Flight Recorder, the control, and DETAIL, in one table: the median of
    ``args.launches`` launches' ratios."""
    wanted = ["plain"] if args.nccl else list(MODE_SETS)
    rows = []
    for world in worlds:
        launches = [{which: run_world(world, args, which) for which in wanted} for _ in range(args.launches)]
        for op in OPS:
            each = [_launch_ratios(sets, op) for sets in launches]
            m = {key: median(launch[key] for launch in each) for key in each[0]}
            row = [world, op, f"{m['untraced']:.1f}", f"{m['tracer']:.3f}"]
            if "fr" in m:
                row += [f"{m['fr']:.3f}", f"{m['fr alone']:.3f}"]
            row += [f"{m['control']:.3f}"] + ([f"{m['DETAIL']:.2f}"] if "DETAIL" in m else []) + \
                   [f"{m['adds']:+.1f}", " ".join(f"{launch['tracer']:.3f}" for launch in each)]
            rows.append(row)
    headers = ["ranks", "op", "untraced µs", "tracer ×"]
    if not args.nccl:
        headers += ["tracer+FR+sidecar ×", "(on FR alone ×)"]
    headers += ["control ×"] + ([] if args.nccl else ["DETAIL ×"]) + ["tracer adds µs", "tracer × by launch"]
    backend = "NCCL, one rank, CUDA tensors, host-side µs per call (enqueue)" if args.nccl else "gloo, CPU tensors"
    print()
    print(table(headers, rows, title=(
        f"Per-call medians, {backend}; modes interleaved round by round ({args.rounds} rounds x {args.block} "
        f"calls per mode, 1 MiB: {max(1, args.block // 8)});\n"
        f"  each ratio the median of {args.launches} launches' (fresh processes each), the tracer's by launch at the end.\n"
        "  tracer, control: one set of processes; tracer+FR+sidecar (distcheck run's default): a second set (the\n"
        "  Flight Recorder is process-wide), divided by the first set's untraced time, in brackets by its own\n"
        "  set's, which leaves the recorder's own cost out; DETAIL: a third set, against its own untraced time.\n"
        f"  control: each call wrapped in {args.spin_us:.2f} µs of plain busy work (the tracer's CPU time per call,\n"
        "  part 1), i.e. what any work that long on the calling thread costs here.")))
    return rows


def _hot_path_in_use() -> str:
    from distcheck.rank import hot_path

    return "C (distcheck.rank._hot_path_c)" if hot_path.c_hot_path() is not None else "Python"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    p.add_argument("--rounds", type=int, default=150, help="interleaved rounds per op (after one warm-up round)")
    p.add_argument("--block", type=int, default=8, help="calls per mode per round (1 MiB: block/8)")
    p.add_argument("--hot-rounds", type=int, default=30)
    p.add_argument("--hot-block", type=int, default=2000)
    p.add_argument("--hot-only", action="store_true")
    p.add_argument("--nccl", action="store_true", help="one rank, NCCL, CUDA tensors (needs one GPU)")
    p.add_argument("--spin-us", type=float, help="the control's busy work per call (default: part 1's all_reduce)")
    p.add_argument("--launches", type=int, default=3, help="fresh sets of processes per rank count (median taken)")
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--trace-dir", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--set", choices=list(MODE_SETS), default="plain", help=argparse.SUPPRESS)
    args = parse_args(p, TINY)
    if args.worker:
        worker(args)
        return
    print(f"conditions: {conditions()}; tracer hot path: {_hot_path_in_use()}")
    rows = hot_path(args.hot_rounds, args.hot_block)
    print()
    print(table(["case (no-op collective, in-process)", "bare µs/call", "traced µs/call", "added µs",
                 "added µs (thread CPU time)"], rows,
                title=f"Tracer hot path in isolation: medians of {args.hot_rounds} interleaved rounds × "
                      f"{args.hot_block} calls"))
    figures = {"hot_added_us": {row[0]: float(row[3]) for row in rows if row[3]}}
    if not args.hot_only:
        if args.spin_us is None:   # the control burns what the tracer costs an all_reduce here
            args.spin_us = float(rows[0][3])
        real = side_by_side([1] if args.nccl else args.ranks, args)
        figures["ratios"] = [float(cell) for row in real for cell in row[3:-2]]
    well_formed(figures)


if __name__ == "__main__":
    main()
