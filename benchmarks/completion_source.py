"""What reading completion costs (NCCL's semantics, ``distcheck.rank.completion``), measured side by side in one run:

1. **the hot path**: a traced 1-element call on a group whose calls complete after they return, against the same call
   on a group whose calls are done when they return (the tracer writes the same records for both: completion is read
   by the sidecar, never on the calling thread). One rank, a stand-in collective, blocks of calls interleaved.
2. **the sidecar's read of the Flight Recorder** (NCCL's completion source) at 256 and 20,000 entries: torch's own
   recorder, filled by a 1-rank gloo group (gloo records into the same recorder as NCCL's layout; on a GPU build
   NCCL's dump function is ``_dump_nccl_trace``), read the way the sidecar reads it (entries, no stack traces) and
   turned into each group's completed-through number.
3. **from completion to the call's close**: a 1-rank ``emulated_nccl`` group (calls return at once, complete on its
   stream): the time from the backend's completion hook to the moment the watchdog's reader of the trace sees the
   call closed (the sidecar's poll, the trace, the reader's poll).

Run: python benchmarks/completion_source.py [--calls 20000] [--entries 256 20000] [--closes 40] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import REPO, conditions, free_port, parse_args, table, well_formed  # noqa: E402

TINY = {"calls": 2000, "entries": [64, 512], "closes": 5}


# -- 1. the hot path ------------------------------------------------------------------------------------------


def hot_path(calls: int) -> dict[str, float]:
    import torch

    from distcheck.rank.tracer import Tracer

    class Device:   # a group the completion registry says completes on the device
        def attach(self, pg, key, name=None):
            return True

        def device(self, key):
            return True

    def stand_in(tensor, op=None, group=None, async_op=False):
        return None

    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        tracers = {
            "returns": Tracer(Path(tmp) / "a.trace", 0, group_resolver=lambda pg: ("0", (0, 1)),
                              default_group=lambda: "WORLD"),
            "device": Tracer(Path(tmp) / "b.trace", 0, group_resolver=lambda pg: ("0", (0, 1)),
                             default_group=lambda: "WORLD", completion=Device()),
        }
        wrapped = {k: t.wrap("all_reduce", stand_in) for k, t in tracers.items()}
        t = torch.ones(1)
        times = {k: [] for k in wrapped}
        for _ in range(max(1, calls // 500)):
            for kind, fn in wrapped.items():
                start = time.perf_counter_ns()
                for _ in range(500):
                    fn(t)
                times[kind].append((time.perf_counter_ns() - start) / 500 / 1000)
        for kind in wrapped:
            out[f"hot_path_{kind}_us"] = round(statistics.median(times[kind]), 3)
        for tracer in tracers.values():
            tracer.close()
    return out


# -- 2. the Flight Recorder's read ----------------------------------------------------------------------------


def _fill_recorder(entries: int) -> dict[str, float]:
    """In a process of its own (the recorder's size is read once): fill it, then time the sidecar's read."""
    import torch
    import torch.distributed as dist
    from torch._C import _distributed_c10d as c10d

    from distcheck.rank.completion import done_through

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    t = torch.ones(1)
    for _ in range(entries):
        dist.all_reduce(t)
    reads, parses = [], []
    for _ in range(7):
        start = time.perf_counter()
        dump = pickle.loads(c10d._dump_fr_trace(True, False, False))
        reads.append(time.perf_counter() - start)
        start = time.perf_counter()
        done_through(dump["entries"], {})
        parses.append(time.perf_counter() - start)
    held = len(dump["entries"])
    dist.destroy_process_group()
    return {"entries": held, "dump_ms": statistics.median(reads) * 1000, "parse_ms": statistics.median(parses) * 1000}


def recorder_read(entries: int) -> dict[str, float]:
    code = (f"import json, sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
            f"import completion_source as b; print(json.dumps(b._fill_recorder({entries})))")
    env = {**os.environ, "TORCH_FR_BUFFER_SIZE": str(entries)}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600,
                          cwd=REPO)
    if done.returncode != 0:
        raise SystemExit(f"the recorder's read at {entries} entries failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


# -- 3. from completion to the call's close --------------------------------------------------------------------


def completion_to_close(closes: int) -> list[float]:
    """In a process of its own: a 1-rank emulated_nccl group traced with its sidecar running."""
    code = (f"import json, sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
            f"import completion_source as b; print(json.dumps(b._closes({closes})))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd=REPO)
    if done.returncode != 0:
        raise SystemExit(f"the completion-to-close run failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _closes(closes: int) -> list[float]:
    import threading

    import torch
    import torch.distributed as dist

    from distcheck.files.trace_tail import TraceTail
    from distcheck.rank import native
    from distcheck.rank.tracer import install
    from distcheck.testing import emulated_nccl

    emulated_nccl.register()
    dist.init_process_group("emulated_nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    completed: dict[int, float] = {}
    hold = threading.Event()
    with tempfile.TemporaryDirectory() as tmp:
        tracer = install(Path(tmp) / "rank0.trace", 0)
        watcher = native.NativeWatcher(tracer, main_thread=threading.get_ident())
        sidecar = native.start(watcher)
        dist.group.WORLD._register_on_completion_hook(lambda info: completed.setdefault(info.seq, time.time()))
        tail = TraceTail(Path(tmp) / "rank0.trace")
        out = []
        for i in range(closes):
            dist.all_reduce(torch.ones(1))
            seq = dist.group.WORLD._get_sequence_number_for_group()
            while seq not in completed or tail.read().open:
                hold.wait(0.001)   # the reader's own poll interval: 1 ms
            out.append(time.time() - completed[seq])
        sidecar.stop()
        tracer.uninstall()
        tracer.close()
    dist.destroy_process_group()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--entries", type=int, nargs="+", default=[256, 20000])
    parser.add_argument("--closes", type=int, default=40)
    parser.add_argument("--json", default=None)
    args = parse_args(parser, TINY)
    print(f"distcheck's completion source ({conditions()})")
    hot = hot_path(args.calls)
    print(table(["group", "µs per traced call (median of blocks of 500)"],
                [["done when it returns (gloo)", hot["hot_path_returns_us"]],
                 ["completes on the device (NCCL)", hot["hot_path_device_us"]]], "1. the hot path"))
    reads = [recorder_read(n) for n in args.entries]
    print(table(["entries asked", "entries held", "dump (ms)", "to completed-through (ms)", "per poll (ms)"],
                [[n, r["entries"], f"{r['dump_ms']:.2f}", f"{r['parse_ms']:.2f}",
                  f"{r['dump_ms'] + r['parse_ms']:.2f}"] for n, r in zip(args.entries, reads)],
                "2. the sidecar's read of the Flight Recorder (at most every 0.05 s and 20x its cost, only while a call waits)"))
    closes = completion_to_close(args.closes)
    q = statistics.quantiles(closes, n=10) if len(closes) >= 2 else closes * 9
    print(table(["calls", "median (s)", "p90 (s)", "max (s)"],
                [[len(closes), f"{statistics.median(closes):.3f}", f"{q[-1]:.3f}", f"{max(closes):.3f}"]],
                "3. from the backend's completion to the call's close in the watchdog's reader"))
    figures = {**hot, **{f"fr_poll_ms_{n}": r["dump_ms"] + r["parse_ms"] for n, r in zip(args.entries, reads)},
               "close_median_s": statistics.median(closes), "close_max_s": max(closes)}
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2))
    well_formed(figures, {"every call closed within a second": max(closes) < 1.0})


if __name__ == "__main__":
    main()
