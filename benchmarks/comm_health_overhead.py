"""The node check's own timing against a plain torch timing loop of the same call, side by side.

In one set of ranks (one process group), round by round and in alternating order:

* **harness**: ``distcheck.rank.sweep.measure``, the code ``comm_health`` times every row with
  (warm-up, barrier, timed loop, then the result check outside the timed loop, time averaged over ranks);
* **plain**: a loop written here from torch alone: the same call on buffers of the same size,
  ``time.perf_counter()`` around ``iters`` calls, averaged over ranks the same way.

Printed per op: both medians (µs per call), the ratio harness / plain (the median of each round's
pair; target ≤ 1.05), the plain loop's own round-to-round noise (median deviation from its median),
and both busbw values from nccl-tests' formula. ``--json`` writes the same numbers.

    python benchmarks/comm_health_overhead.py                      # 4 gloo ranks, 4 MiB
    python benchmarks/comm_health_overhead.py --ranks 2 --size 1M --ops all_gather
    python benchmarks/comm_health_overhead.py --nccl --ranks 1     # one rank on a GPU
    python benchmarks/comm_health_overhead.py --tiny               # one gloo rank, 4 KiB, one round: seconds
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

OPS = ("all_gather", "all_reduce", "all_to_all")


def plain_call(op: str, per_rank: int, n: int, dev):
    """The op on buffers of its own, from torch alone: what a user's own timing loop would call."""
    import torch
    import torch.distributed as dist

    if op == "all_gather":
        inp, out = torch.ones(per_rank, device=dev), torch.empty(per_rank * n, device=dev)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        return lambda: gather(out, inp)
    if op == "all_reduce":
        buf = torch.ones(per_rank, device=dev)
        return lambda: dist.all_reduce(buf)
    inp, out = torch.ones(per_rank * n, device=dev), torch.empty(per_rank * n, device=dev)
    return lambda: dist.all_to_all_single(out, inp)


def plain_seconds(run, warmup: int, iters: int, dev) -> float:
    import torch
    import torch.distributed as dist

    for _ in range(warmup):
        run()
    if dev.type == "cuda":
        torch.cuda.synchronize()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        run()
    if dev.type == "cuda":
        torch.cuda.synchronize()
    t = torch.tensor([(time.perf_counter() - start) / iters], dtype=torch.float64, device=dev)
    dist.all_reduce(t)
    return t.item() / dist.get_world_size()


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from distcheck.knowledge import nccl_tests
    from distcheck.rank import sweep

    dist.init_process_group("nccl" if args.nccl else "gloo")
    rank, n = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", 0) if args.nccl else torch.device("cpu")
    if args.nccl:
        torch.cuda.set_device(dev)
    result = {}
    for op in args.ops:
        c = nccl_tests.counts(op, args.size, sweep.ELEMENT_SIZE, n)
        harness_call = sweep.build(op, False, c, rank, n, dev)
        plain = plain_call(op, c.param, n, dev)
        times = {"harness": [], "plain": [], "wrong": 0}
        for round_ in range(args.rounds):
            order = ("harness", "plain") if round_ % 2 == 0 else ("plain", "harness")
            for mode in order:
                if mode == "harness":
                    t = sweep.measure(harness_call, args.warmup, args.iters, dev)
                    times["harness"].append(t.seconds)
                    times["wrong"] += t.wrong
                else:
                    times["plain"].append(plain_seconds(plain, args.warmup, args.iters, dev))
        result[op] = {"size": nccl_tests.size_column(c, sweep.ELEMENT_SIZE), "count": c.param, **times}
    if rank == 0:
        Path(args.out).write_text(json.dumps({"ranks": n, "ops": result}))
    dist.destroy_process_group()


def launch(args: argparse.Namespace) -> dict:
    out = os.path.join(tempfile.mkdtemp(prefix="distcheck-bench-"), "result.json")
    cmd = [python(), __file__, "--worker", "--out", out, "--size", str(args.size), "--iters", str(args.iters),
           "--warmup", str(args.warmup), "--rounds", str(args.rounds), "--ops", *args.ops] + (
        ["--nccl"] if args.nccl else [])
    port = free_port()
    envs = [{"RANK": str(r), "WORLD_SIZE": str(args.ranks), "LOCAL_RANK": str(r), "MASTER_ADDR": "127.0.0.1",
             "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)} for r in range(args.ranks)]
    results = run_group([cmd] * args.ranks, envs, timeout=args.timeout)
    if not os.path.exists(out):
        for r in results:
            sys.stderr.write(r.stderr[-3000:])
        raise SystemExit(f"the {args.ranks}-rank run failed")
    return json.loads(Path(out).read_text())


def summarize(raw: dict) -> list[dict]:
    from distcheck.knowledge import nccl_tests
    from distcheck.rank.sweep import ELEMENT_SIZE

    n, rows = raw["ranks"], []
    for op, r in raw["ops"].items():
        harness, plain = median(r["harness"]), median(r["plain"])
        # The ratio of each round's pair (measured back to back), then their median: a drift of the
        # machine's load between rounds cancels out. The plain loop's own spread is the noise.
        paired = median(h / p for h, p in zip(r["harness"], r["plain"]))
        noise = median(abs(p / plain - 1) for p in r["plain"])
        rows.append({"op": op, "size": r["size"], "count": r["count"], "harness_us": harness * 1e6,
                     "plain_us": plain * 1e6, "ratio": paired, "plain_noise": noise, "wrong": r["wrong"],
                     "harness_busbw": nccl_tests.busbw(op, r["count"], ELEMENT_SIZE, harness, n),
                     "plain_busbw": nccl_tests.busbw(op, r["count"], ELEMENT_SIZE, plain, n)})
    return rows


def main() -> None:
    from distcheck.knowledge.nccl_tests import parse_size

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--size", type=parse_size, default=4 << 20, help="nccl-tests' size (bytes, or 1M, 1G)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--ops", nargs="+", default=list(OPS), choices=OPS)
    p.add_argument("--nccl", action="store_true", help="NCCL on cuda:0 (one rank per GPU; --ranks 1 on one GPU)")
    p.add_argument("--timeout", type=float, default=300)
    p.add_argument("--json", help="write the rows here")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = parse_args(p, {"ranks": 1, "size": 4096, "iters": 2, "warmup": 1, "rounds": 1})
    if args.worker:
        worker(args)
        return
    rows = summarize(launch(args))
    backend = "nccl, cuda" if args.nccl else "gloo, cpu"
    print(conditions())
    print(table(["op", "size", "count", "harness µs", "plain µs", "harness / plain", "plain's noise",
                 "harness busbw", "plain busbw", "#wrong"],
                [[r["op"], r["size"], r["count"], f"{r['harness_us']:.1f}", f"{r['plain_us']:.1f}",
                  f"{r['ratio']:.3f}", f"±{r['plain_noise']:.1%}", f"{r['harness_busbw']:.4g}",
                  f"{r['plain_busbw']:.4g}", r["wrong"]]
                 for r in rows],
                title=f"comm_health timing vs a plain torch loop ({args.ranks} ranks, {backend}; medians of "
                      f"{args.rounds} alternating rounds of {args.iters} calls after {args.warmup} warm-up; "
                      "busbw in GB/s; target harness / plain <= 1.05)"))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    well_formed({r["op"]: {k: r[k] for k in ("harness_us", "plain_us", "ratio", "harness_busbw", "plain_busbw")}
                 for r in rows}, {f"{r['op']}: every timed result right": r["wrong"] == 0 for r in rows})


if __name__ == "__main__":
    main()
