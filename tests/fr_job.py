"""A tiny torchrun-style gloo job that leaves real Flight Recorder dumps behind.

Launched by tests/test_postmortem.py as
``python -m torch.distributed.run --standalone --nproc-per-node 4 tests/fr_job.py --out DIR``
with ``TORCH_FR_BUFFER_SIZE`` set. Every rank runs the same collectives on three
groups — the world, ``metrics`` (all ranks) and ``tail`` (ranks 1..N-1) — and
then rank 0 is the odd one out twice:

* on the world group it alone issues one more ``all_reduce`` (#6);
* on ``metrics`` the others issue one more ``all_reduce`` (#2) and rank 0 never does.

Both odd collectives are issued with ``async_op=True`` so no rank blocks in them.
Each rank then writes its Flight Recorder buffer in both forms PyTorch offers
(``_dump_fr_trace`` → pickle bytes, ``_dump_fr_trace_json`` → JSON bytes) to
``DIR/pickle/fr_<rank>`` and ``DIR/json/fr_<rank>.json``, tells the others
through the c10d store that it is done, waits (bounded) until all are, and
exits at once with ``os._exit`` — never waiting on the pending collective, so
the job cannot hang. Peers stay alive until every rank has dumped: a peer that
exits early would fail the pending collective and gloo would mark it retired.
"""

from __future__ import annotations

import argparse
import datetime
import os
import pickle
import time

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _dump_fr_trace, _dump_fr_trace_json

WAIT = datetime.timedelta(seconds=30)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    dist.init_process_group("gloo", timeout=WAIT)
    rank, world = dist.get_rank(), dist.get_world_size()
    metrics = dist.new_group(list(range(world)), group_desc="metrics")
    tail = dist.new_group(list(range(1, world)), group_desc="tail")

    t = torch.ones(4)
    for _ in range(3):
        dist.all_reduce(t)                                       # world #1-3
    dist.barrier()                                               # world #4
    out = [torch.zeros(2, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(out, torch.full((2,), rank, dtype=torch.int64))  # world #5
    dist.all_reduce(torch.ones(3), group=metrics)                # metrics #1
    if rank != 0:
        dist.all_reduce(torch.ones(2, 3), group=tail)            # tail #1
    last_common = _last_record_id()
    _wait_retired(last_common)

    if rank == 0:
        pending = dist.all_reduce(t, async_op=True)              # world #6: rank 0 only
    else:
        pending = dist.all_reduce(torch.ones(3), group=metrics, async_op=True)  # metrics #2: not rank 0

    os.makedirs(os.path.join(args.out, "pickle"), exist_ok=True)
    os.makedirs(os.path.join(args.out, "json"), exist_ok=True)
    _write(os.path.join(args.out, "pickle", f"fr_{rank}"), _dump_fr_trace())
    _write(os.path.join(args.out, "json", f"fr_{rank}.json"), _dump_fr_trace_json())

    store = dist.distributed_c10d._get_default_store()
    store.set(f"fr_job/dumped/{rank}", "1")
    store.wait([f"fr_job/dumped/{r}" for r in range(world)], WAIT)
    print(f"rank {rank} dumped; pending: {pending is not None}", flush=True)
    os._exit(0)


def _last_record_id() -> int:
    entries = pickle.loads(_dump_fr_trace())["entries"]  # our own dump: trusted
    return entries[-1]["record_id"]


def _wait_retired(record_id: int, limit_s: float = 10.0) -> None:
    """gloo retires an entry on its worker thread just *after* waking the caller:
    wait until the last common collective shows as retired, so the dump does not
    catch it in that instant."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        entries = pickle.loads(_dump_fr_trace())["entries"]
        if all(e["retired"] for e in entries if e["record_id"] <= record_id):
            return
        time.sleep(0.001)
    raise SystemExit(f"entry {record_id} never retired")


def _write(path: str, data: bytes) -> None:
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


if __name__ == "__main__":
    main()
