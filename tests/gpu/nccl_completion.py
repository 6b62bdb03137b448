"""The completion source on real NCCL, one rank (one GPU holds one NCCL rank): a kernel holds the stream, an
all_reduce is enqueued behind it and returns at once; distcheck's record must show the call open until the stream
frees, and closed soon after (target: <= 0.1 s after the stream ran it). Also the Flight Recorder read's cost.

Prints one JSON line: {"returned_s", "open_while_held", "closed_after_s", "fr_read_ms", "ok"}; exit 0 when ok.
Usage (on a GPU machine, from the repo root): python tests/gpu/nccl_completion.py [--hold-s 2] [--fill N]
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import tempfile
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

TARGET_CLOSE_S = 0.1


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--hold-s", type=float, default=2.0)
    p.add_argument("--fill", type=int, default=3, help="all_reduces before the held one (fills the ring)")
    args = p.parse_args()
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", "256")
    from distcheck.files.trace_tail import TraceTail
    from distcheck.rank import native
    from distcheck.rank.tracer import install

    dist.init_process_group("nccl", init_method="tcp://127.0.0.1:29699", rank=0, world_size=1)
    torch.cuda.set_device(0)
    t = torch.ones(1 << 20, device="cuda")
    with tempfile.TemporaryDirectory() as tmp:
        tracer = install(Path(tmp) / "rank0.trace", 0)
        sidecar = native.start(native.NativeWatcher(tracer, main_thread=threading.get_ident()))
        tail = TraceTail(Path(tmp) / "rank0.trace")
        for _ in range(args.fill):
            dist.all_reduce(t)
        torch.cuda.synchronize()
        # the GPU's clock rate in cycles per second, for a kernel that holds the stream hold_s
        cycles = int(torch.cuda.get_device_properties(0).clock_rate * 1000 * args.hold_s) if hasattr(
            torch.cuda.get_device_properties(0), "clock_rate") else int(1.5e9 * args.hold_s)
        torch.cuda._sleep(cycles)
        start = time.time()
        dist.all_reduce(t)                      # enqueued behind the kernel: returns at once
        returned = time.time() - start
        done = torch.cuda.Event()
        done.record()
        open_while_held = True
        while not done.query():
            open_while_held &= bool(tail.read().open) or time.time() - start < 0.3   # the sidecar's first poll
            time.sleep(0.005)
        ran_at = time.time()
        while tail.read().open and time.time() - ran_at < 5:
            time.sleep(0.002)
        closed_after = time.time() - ran_at
        sidecar.stop()
        tracer.uninstall()
        tracer.close()
    from torch._C import _distributed_c10d as c10d
    reads = []
    for _ in range(5):
        s = time.perf_counter()
        pickle.loads(c10d._dump_nccl_trace(True, False, False))
        reads.append((time.perf_counter() - s) * 1000)
    dist.destroy_process_group()
    ok = returned < 0.05 and open_while_held and closed_after <= TARGET_CLOSE_S
    print(json.dumps({"returned_s": round(returned, 4), "open_while_held": open_while_held,
                      "closed_after_s": round(closed_after, 3), "fr_read_ms": round(sorted(reads)[2], 3), "ok": ok}))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
