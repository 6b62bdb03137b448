"""Memory of a rank over a long pre-flight (issue 41): the same 2-rank gloo job plainly and under distcheck.

The job: DDP training steps over a DistributedSampler, then many evaluation passes, each with a new
DataLoader (a DistributedSampler over a map-style set) and a MulticlassAccuracy updated, synced with
compute() and reset. Rank 0 samples its own memory every few passes: RSS (anonymous and file-backed
apart: distcheck's trace file is a shared mapping, counted in RssFile), and, with tracemalloc (one frame),
the bytes still held that distcheck's own code allocated. Verdict: "flat" when distcheck's own bytes grow
by less than ``FLAT_KIB_PER_1000`` KiB per 1,000 evaluation passes over the second half of the run, and the
anonymous RSS grows no more under distcheck than plainly (within ``RSS_SLACK_MB``).

Run: python benchmarks/recorder_memory.py [--evals 2000] [--tiny] [--json out.json]
     [--distcheck-path CHECKOUT]   (another distcheck checkout to measure, e.g. an older one)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import REPO, conditions, free_port, parse_args, table, well_formed  # noqa: E402

FLAT_KIB_PER_1000 = 256
RSS_SLACK_MB = 16.0
TINY = {"steps": 5, "evals": 40, "every": 10}
FULL = {"steps": 200, "evals": 2000, "every": 200}


# -- the job (each rank) ------------------------------------------------------------------------------------


def _status() -> dict[str, float]:
    fields = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "RssAnon", "RssFile"):
                fields[key] = int(value.split()[0]) / 1024
    return fields


def _sample(label: int, tracemalloc) -> dict[str, float | int | None]:
    s = _status()
    own = sum(t.size for t in _own(tracemalloc).traces) / 2**20 if tracemalloc.is_tracing() else None
    return {"evals": label, "rss_mb": s.get("VmRSS"), "anon_mb": s.get("RssAnon"), "file_mb": s.get("RssFile"),
            "distcheck_mb": own}


def _own(tracemalloc):
    return tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(True, "*/distcheck/*")])


def _holders(before, after, top: int = 5) -> list[str]:
    """The lines of distcheck whose bytes grew the most between two snapshots."""
    return [f"{d.traceback[0].filename.split('/distcheck/')[-1]}:{d.traceback[0].lineno} {d.size_diff / 1024:+.1f} KiB"
            for d in after.compare_to(before, "lineno")[:top] if d.size_diff > 0]


def job(args: argparse.Namespace) -> None:
    import tracemalloc

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
    from torchmetrics.classification import MulticlassAccuracy

    dist.init_process_group("gloo")
    g = torch.Generator().manual_seed(0)
    train = TensorDataset(torch.randn(512, 16, generator=g), torch.randint(0, 4, (512,), generator=g))
    val = TensorDataset(torch.randn(64, 16, generator=g), torch.randint(0, 4, (64,), generator=g))
    model = DistributedDataParallel(torch.nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    steps = 0
    while steps < args.steps:
        for x, y in DataLoader(train, batch_size=16, sampler=DistributedSampler(train)):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            steps += 1
            if steps == args.steps:
                break
    metric = MulticlassAccuracy(num_classes=4)
    tracemalloc.start(1)   # from here: tracing torch's import and DDP's set-up would take minutes
    samples = [_sample(0, tracemalloc)]
    halfway = None
    for p in range(1, args.evals + 1):
        if p == args.evals // 2:
            halfway = _own(tracemalloc)
        with torch.no_grad():
            for x, y in DataLoader(val, batch_size=16, sampler=DistributedSampler(val, shuffle=False)):
                metric.update(model(x), y)
        metric.compute()
        metric.reset()
        if p % args.every == 0:
            samples.append(_sample(p, tracemalloc))
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps({"samples": samples, "holders": _holders(halfway, _own(tracemalloc))}))
    dist.destroy_process_group()


# -- the runner ---------------------------------------------------------------------------------------------


def _run(kind: str, cfg: dict, work: Path, checkout: Path) -> dict:
    out = work / f"{kind}.json"
    job_args = ["--job", "--out", str(out), "--steps", str(cfg["steps"]), "--evals", str(cfg["evals"]),
                "--every", str(cfg["every"])]
    me = str(Path(__file__).resolve())
    if kind == "plain":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
               str(free_port()), me, *job_args]
    else:
        cmd = [sys.executable, "-m", "distcheck", "run", me, "--nproc-per-node", "2", "--backend", "gloo",
               "--run-dir", str(work / "run"), "--", *job_args]
    env = {**os.environ, "PYTHONPATH": str(checkout), "OMP_NUM_THREADS": "1"}
    t0 = time.monotonic()
    done = subprocess.run(cmd, env=env, cwd=work, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0 or not out.exists():
        raise SystemExit(f"{kind} run failed (exit {done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    written = json.loads(out.read_text())
    samples = written["samples"]
    return {"samples": samples, "seconds": round(time.monotonic() - t0, 1), "holders": written["holders"],
            "tracemalloc_distcheck_mb": samples[-1]["distcheck_mb"]}


def _growth(samples: list[dict], key: str) -> tuple[float, int]:
    """(growth of ``key`` in MiB over the second half of the evaluation passes, passes it spans)."""
    half = samples[len(samples) // 2]
    last = samples[-1]
    if half[key] is None or last[key] is None:
        return 0.0, 0
    return last[key] - half[key], last["evals"] - half["evals"]


def verdict(runs: dict[str, dict]) -> tuple[str, dict[str, float]]:
    own, span = _growth(runs["distcheck"]["samples"], "distcheck_mb")
    anon, _ = _growth(runs["distcheck"]["samples"], "anon_mb")
    plain_anon, _ = _growth(runs["plain"]["samples"], "anon_mb")
    per_1000 = own * 1024 * 1000 / span if span else 0.0
    figures = {"distcheck_kib_per_1000_evals": round(per_1000, 1), "anon_growth_mb": round(anon, 2),
               "plain_anon_growth_mb": round(plain_anon, 2)}
    flat = per_1000 < FLAT_KIB_PER_1000 and anon - plain_anon < RSS_SLACK_MB
    return ("flat" if flat else "growing"), figures


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--job", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--steps", type=int, default=FULL["steps"])
    p.add_argument("--evals", type=int, default=FULL["evals"])
    p.add_argument("--every", type=int, default=FULL["every"])
    p.add_argument("--json", help="write the samples and the verdict here")
    p.add_argument("--distcheck-path", default=str(REPO), help="the distcheck checkout to measure")
    args = parse_args(p, TINY)
    if args.job:
        return job(args)
    cfg = {"steps": args.steps, "evals": args.evals, "every": args.every}
    with tempfile.TemporaryDirectory() as tmp:
        runs = {kind: _run(kind, cfg, Path(tmp), Path(args.distcheck_path)) for kind in ("plain", "distcheck")}
    rows = []
    for a, b in zip(runs["plain"]["samples"], runs["distcheck"]["samples"]):
        rows.append([a["evals"], f"{a['rss_mb']:.1f}", f"{a['anon_mb']:.1f}", f"{b['rss_mb']:.1f}",
                     f"{b['anon_mb']:.1f}", f"{b['file_mb']:.1f}", f"{b['distcheck_mb']:.3f}"])
    print(table(["evals", "plain RSS", "plain anon", "distcheck RSS", "anon", "file", "distcheck's own"], rows,
                title=f"rank 0 memory in MiB, {cfg['steps']} training steps then {cfg['evals']} evaluation passes "
                      f"(plain {runs['plain']['seconds']} s, under distcheck {runs['distcheck']['seconds']} s)"))
    word, figures = verdict(runs)
    print(f"verdict: {word} — distcheck's own allocations {figures['distcheck_kib_per_1000_evals']} KiB per 1,000 "
          f"evaluation passes over the second half; anonymous RSS +{figures['anon_growth_mb']} MiB under distcheck, "
          f"+{figures['plain_anon_growth_mb']} MiB plainly")
    print("where distcheck's own bytes grew over the second half: " + "; ".join(runs["distcheck"]["holders"][:3]))
    print(f"conditions: {conditions()}")
    if args.json:
        Path(args.json).write_text(json.dumps({"config": cfg, "runs": runs, "verdict": word, **figures}, indent=1))
    sampled = {f"{kind}: 3 samples or more, each with its RSS": len(run["samples"]) >= 3
               and all(x["rss_mb"] and x["rss_mb"] > 0 for x in run["samples"]) for kind, run in runs.items()}
    well_formed({**figures, "distcheck_own_mb": runs["distcheck"]["tracemalloc_distcheck_mb"],
                 "seconds": {kind: run["seconds"] for kind, run in runs.items()}}, sampled)


if __name__ == "__main__":
    main()
