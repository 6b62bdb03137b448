"""``distcheck attach`` on a plain torchrun job with a planted hang (rank 0 in an all_reduce, the others
polling for a file): the time from ``distcheck attach`` to its verdict at 2, 8 and 32 ranks on one node, and
how long each way of reading stops a rank, side by side with a plain ``py-spy dump`` of the same ranks.

The stop is measured from inside each rank (tests/scripts/attach/job.py --ticks: a thread that sleeps 5 ms
at a time logs every gap): the gaps while the reader runs, less the gaps of an equal window with no reader
(the machine's own scheduling noise), summed per rank.

With ``--native``: how long one native read stops a rank hung in DDP's reducer (the C++ all_reduce attach reads
native frames for), py-spy's ``--native`` beside pystack's ``remote --native`` and their Python-only reads.

    python benchmarks/attach.py [--ranks 2 8 32] [--repeat 2] [--tiny] [--native]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import REPO, conditions, kill_tree, median, parse_args, table, well_formed  # noqa: E402

TINY = {"ranks": [2], "repeat": 1}
JOB = REPO / "tests" / "scripts" / "attach" / "job.py"


def start_job(folder: Path, ranks: int, mode: str = "allreduce") -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                             str(ranks), str(JOB), mode, str(folder), "--ticks"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 600
    while not all((folder / f"ready{r}").exists() for r in range(ranks)):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"the {ranks}-rank job did not start")
        time.sleep(0.2)
    time.sleep(2.0)   # the ranks settle into their waits before the baseline window
    return proc


def end_job(folder: Path, proc: subprocess.Popen) -> None:
    (folder / "release").touch()
    kill_tree(proc)   # its ranks too: a loaded rank may not see the release before the folder goes


def stopped(folder: Path, ranks: int, t0: float, t1: float) -> list[float]:
    """Seconds each rank was stopped (gaps over 10 ms) between wall times t0 and t1."""
    out = []
    for r in range(ranks):
        total = 0.0
        for line in (folder / f"ticks{r}").read_text().splitlines() if (folder / f"ticks{r}").exists() else []:
            at, gap = map(float, line.split())
            total += gap if t0 <= at <= t1 + 0.5 else 0.0
        out.append(total)
    return out


def timed(cmd: list[str], env: dict | None = None) -> tuple[float, float, float, int]:
    t0 = time.time()
    start = time.monotonic()
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    return time.monotonic() - start, t0, time.time(), done.returncode


def pids(folder: Path, ranks: int) -> list[int]:
    return [int((folder / f"ready{r}").read_text()) for r in range(ranks)]


def one(ranks: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        proc = start_job(folder, ranks)
        try:
            t0 = time.time()
            time.sleep(1.5)
            noise = max(stopped(folder, ranks, t0, time.time()))
            env = {**os.environ, "PYTHONPATH": str(REPO)}
            verdict_s, a0, a1, rc = timed([sys.executable, "-m", "distcheck", "attach", str(proc.pid),
                                           "--run-dir", str(folder / "run")], env)
            attach_stop = max(stopped(folder, ranks, a0, a1)) - noise
            plain = []
            for mode in ([], ["--nonblocking"], ["--native"]):
                p0 = time.time()
                spy_s = sum(timed(["py-spy", "dump", "--pid", str(pid), *mode])[0] for pid in pids(folder, ranks))
                plain.append((spy_s, max(stopped(folder, ranks, p0, time.time())) - noise))
        finally:
            end_job(folder, proc)
    return {"verdict_s": verdict_s, "rc": rc, "attach_stop_ms": 1000 * max(0.0, attach_stop),
            "noise_ms": 1000 * noise, "spy_s": plain[0][0], "spy_stop_ms": 1000 * max(0.0, plain[0][1]),
            "nonblock_stop_ms": 1000 * max(0.0, plain[1][1]), "native_stop_ms": 1000 * max(0.0, plain[2][1])}


NATIVE_READERS = {"py-spy dump --native": ["py-spy", "dump", "--native", "--pid"],
                  "pystack remote --native": ["pystack", "remote", "--native"],
                  "py-spy dump --nonblocking": ["py-spy", "dump", "--nonblocking", "--pid"],
                  "pystack remote": ["pystack", "remote"]}


def native_reads(repeat: int) -> None:
    """Rank 0 of a 2-rank DDP job hung in the reducer's all_reduce, read by each reader ``repeat`` times."""
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        proc = start_job(folder, 2, "ddp")
        try:
            pid = pids(folder, 1)[0]
            rows = []
            for name, cmd in NATIVE_READERS.items():
                took, stop = [], []
                for _ in range(repeat):
                    t0 = time.time()
                    took.append(timed([*cmd, str(pid)])[0])
                    time.sleep(0.3)   # the ticker logs the gap when it wakes
                    stop.append(stopped(folder, 1, t0, time.time())[0])
                rows.append([name, f"{median(took):.2f}", f"{1000 * median(stop):.0f}", f"{1000 * max(stop):.0f}"])
        finally:
            end_job(folder, proc)
    print(table(["reader", "took s", "rank stopped ms (median)", "worst ms"], rows,
                title=f"one read of a rank hung in DDP's reducer ({repeat} reads each; the ticker's gaps)"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 8, 32])
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--native", action="store_true", help="measure the native readers instead")
    args = parse_args(ap, TINY)
    if args.native:
        print(conditions())
        native_reads(max(3, args.repeat))
        return
    rows, figures, named = [], {}, {}
    for ranks in args.ranks:
        runs = [one(ranks) for _ in range(args.repeat)]
        m = {k: median(r[k] for r in runs) for k in runs[0]}
        figures[f"{ranks} ranks"] = {k: v for k, v in m.items() if k != "rc"}
        named[f"{ranks} ranks: attach exited 1 (the hang)"] = all(r["rc"] == 1 for r in runs)
        exits = ",".join(str(int(r["rc"])) for r in runs)
        rows.append([ranks, f"{m['verdict_s']:.2f}", exits, f"{m['attach_stop_ms']:.1f}", f"{m['spy_s']:.2f}",
                     f"{m['spy_stop_ms']:.1f}", f"{m['nonblock_stop_ms']:.1f}", f"{m['native_stop_ms']:.1f}",
                     f"{m['noise_ms']:.1f}"])
    print(conditions())
    print(table(["ranks", "attach→verdict s", "exit (each run)", "attach: worst rank stopped ms", "py-spy dump all s",
                 "py-spy dump: stopped ms", "--nonblocking: ms", "--native: ms", "noise ms"], rows,
                title="distcheck attach vs py-spy by hand (planted hang; median; stops: the worst rank, "
                      "noise subtracted)"))
    well_formed(figures, named)


if __name__ == "__main__":
    main()
