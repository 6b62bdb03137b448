"""A plain torchrun job (no distcheck inside) that ``distcheck attach`` diagnoses from outside.

Modes: ``allreduce`` rank 0 waits in an all_reduce while the others poll for a file;
``auroc`` rank 0 alone calls BinaryAUROC.compute() (the first seed's bug); ``ddp`` rank 0 runs one more
DDP backward (the reducer's C++ all_reduce) than the others; ``frdump`` rank 0 alone issues an async all_reduce
(#6) and waits on it, every rank having written its Flight Recorder dump to ``TORCH_FR_DUMP_TEMP_FILE<rank>``; ``busy`` rank 0 waits in an all_reduce while
rank 1 computes in Python (late, not stuck); ``barrier`` rank 0 alone enters a barrier while the others poll;
``healthy`` every rank runs all_reduce steps and exits 0.
Each rank writes ``<dir>/ready<rank>`` when it stands where the test wants it; every waiting rank
leaves once ``<dir>/release`` exists (the test's own clean-up), so the job never outlives its test.
"""

import argparse
import datetime
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist


def ready(folder: Path, rank: int) -> None:
    (folder / f"ready{rank}").write_text(str(os.getpid()))


def poll_for(release: Path) -> None:
    while not release.exists():
        time.sleep(0.05)   # the user's line the hang report names for ranks 1, 2


def busy_until(release: Path) -> float:
    total = 0.0
    while not release.exists():   # computing in Python: a late rank, not a stuck one
        for i in range(200_000):
            total += i * 0.5
    return total


def ticker(path: Path) -> None:
    """benchmarks/attach.py: how long this process was stopped, seen from inside. A thread sleeps 5 ms at a
    time and appends every gap over 10 ms (time, seconds) to ``path``: a reader that stops the process
    shows as a gap; scheduling on a busy machine too, which the benchmark measures alone as its baseline."""
    import threading

    def run() -> None:
        last = time.monotonic()
        with open(path, "a", buffering=1) as f:
            while True:
                time.sleep(0.005)
                now = time.monotonic()
                if now - last > 0.010:
                    f.write(f"{time.time():.6f} {now - last - 0.005:.6f}\n")
                last = now

    threading.Thread(target=run, daemon=True).start()


def wait_retired(limit_s: float = 30.0) -> None:
    """gloo retires a Flight Recorder entry on its worker thread just after waking the caller: wait until every
    entry so far is retired, so the dump does not catch a finished call in that instant."""
    import pickle

    from torch._C._distributed_c10d import _dump_fr_trace

    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if all(e["retired"] for e in pickle.loads(_dump_fr_trace())["entries"]):   # our own dump: trusted
            return
        time.sleep(0.001)


def dump_flight_recorder(rank: int) -> None:
    """What PyTorch writes on a time-out, written by the job itself: ``TORCH_FR_DUMP_TEMP_FILE<rank>``."""
    from torch._C._distributed_c10d import _dump_fr_trace

    path = os.environ["TORCH_FR_DUMP_TEMP_FILE"] + str(rank)
    with open(path + ".tmp", "wb") as f:
        f.write(_dump_fr_trace())
    os.replace(path + ".tmp", path)


def dump_later(folder: Path, rank: int, after_s: float) -> None:
    """A thread that writes the dump (then ``ready``) once the main thread has been waiting ``after_s``."""
    import threading

    def run() -> None:
        time.sleep(after_s)
        dump_flight_recorder(rank)
        ready(folder, rank)

    threading.Thread(target=run, daemon=True).start()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode")
    ap.add_argument("folder", type=Path)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--ticks", action="store_true", help="record this rank's stops in <folder>/ticks<rank>")
    ap.add_argument("--backend", default="gloo", help="nccl: tensors on cuda:<local rank> (tests/gpu)")
    args = ap.parse_args()
    if args.ticks:
        ticker(args.folder / f"ticks{os.environ['RANK']}")
    release = args.folder / "release"
    dist.init_process_group(args.backend, timeout=datetime.timedelta(seconds=120))
    dev = torch.device("cpu")
    if args.backend == "nccl":
        dev = torch.device("cuda", int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count())
        torch.cuda.set_device(dev)
    rank = dist.get_rank()
    if args.mode == "healthy":
        total = torch.zeros(1)
        for step in range(args.steps):
            t = torch.ones(1)
            dist.all_reduce(t)
            total += t
            if step == 2:
                ready(args.folder, rank)
            time.sleep(0.05)
        print(f"rank {rank} total {total.item():.0f}", flush=True)
    elif args.mode in ("allreduce", "busy"):
        ready(args.folder, rank)
        if rank == 0:
            dist.all_reduce(torch.ones(4, device=dev))   # waits for ranks that never come
        elif args.mode == "busy":
            busy_until(release)
        else:
            poll_for(release)
    elif args.mode == "barrier":
        ready(args.folder, rank)
        if rank == 0:
            dist.barrier()   # only rank 0 enters the barrier
        else:
            poll_for(release)
    elif args.mode == "auroc":
        from torchmetrics.classification import BinaryAUROC

        metric = BinaryAUROC()
        metric.update(torch.tensor([0.1, 0.9]), torch.tensor([0, 1]))
        ready(args.folder, rank)
        if rank == 0:
            print(metric.compute(), flush=True)   # only rank 0 computes: its sync waits for the others
        else:
            poll_for(release)
    elif args.mode == "frdump":
        t = torch.ones(4, device=dev)
        for _ in range(5):
            dist.all_reduce(t)   # the default group's #1-#5, on every rank
        wait_retired()
        work = dist.all_reduce(t, async_op=True) if rank == 0 else None   # #6: rank 0 alone
        dump_flight_recorder(rank)
        ready(args.folder, rank)
        if rank == 0:
            work.wait()   # waits in all_reduce #6, which its Python stack does not show
            if dev.type == "cuda":
                torch.cuda.synchronize()   # NCCL: wait() returned at once, the GPU waits; the thread waits here
        else:
            poll_for(release)
    elif args.mode == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
        for _ in range(2):   # the second step rebuilds the buckets; from the third on only the reducer syncs
            model(torch.ones(2, 4)).sum().backward()
        dumps = "TORCH_FR_DUMP_TEMP_FILE" in os.environ   # then every rank leaves its Flight Recorder dump
        if dumps:
            wait_retired()
        if rank == 0:
            if dumps:   # dumped while the reducer waits, as PyTorch's own dump on a time-out would be
                dump_later(args.folder, rank, 2.0)
            else:
                ready(args.folder, rank)
            model(torch.ones(2, 4)).sum().backward()   # one step more: the reducer's all_reduce waits
        else:
            if dumps:
                dump_flight_recorder(rank)
            ready(args.folder, rank)
            poll_for(release)
    os._exit(0) if args.mode != "healthy" else dist.destroy_process_group()


if __name__ == "__main__":
    main()
