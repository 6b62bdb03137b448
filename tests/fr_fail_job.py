"""A torchrun-style gloo job whose collective fails, dumping its Flight Recorder
buffer in a ``finally:`` as docs/reports.md advises: the dumps a user has after
a real hang ended in an error.

Launched by tests/test_postmortem.py as
``python -m torch.distributed.run --standalone --nproc-per-node N tests/fr_fail_job.py --mode MODE --out DIR``
with ``TORCH_FR_BUFFER_SIZE`` set. Every rank runs two ``all_reduce``\\ s, then:

* ``timeout``: rank 0 alone enters a ``barrier``; the process group's time-out
  is short, so it raises there (gloo: "Timed out waiting … for recv"). The
  other ranks never call it: they wait (bounded, on the store) until rank 0
  has dumped, then dump and leave.
* ``peer-exit``: rank 1 dumps and leaves without calling the ``barrier`` the
  others enter; theirs fails ("Connection closed by peer").

gloo retires an entry whether its call succeeded or failed, so the failed
``barrier`` shows ``retired: True`` in the dumps: the case ``analyze`` must not
take for a completed call. Each rank writes ``DIR/pickle/fr_<rank>`` and
``DIR/json/fr_<rank>.json`` and prints how its barrier ended.
"""

from __future__ import annotations

import argparse
import datetime
import os

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _dump_fr_trace, _dump_fr_trace_json

from fr_job import _last_record_id, _wait_retired, _write

PG_TIMEOUT = {"timeout": datetime.timedelta(seconds=3), "peer-exit": datetime.timedelta(seconds=20)}
STORE_WAIT = datetime.timedelta(seconds=60)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=sorted(PG_TIMEOUT), required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    dist.init_process_group("gloo", timeout=PG_TIMEOUT[args.mode])
    rank = dist.get_rank()
    store = dist.distributed_c10d._get_default_store()
    t = torch.ones(4)
    for _ in range(2):
        dist.all_reduce(t)                                        # #1, #2 on every rank
    _wait_retired(_last_record_id())
    enters = rank == 0 if args.mode == "timeout" else rank != 1
    outcome = "never called the barrier"
    try:
        if enters:
            dist.barrier()                                        # #3: never completes
            outcome = "barrier returned"
        elif args.mode == "timeout":
            store.wait(["fr_fail_job/dumped/0"], STORE_WAIT)       # stay until rank 0 timed out and dumped
    except RuntimeError as exc:
        outcome = f"barrier raised: {str(exc).splitlines()[0][:120]}"
        # gloo retires the failed entry on its worker thread just after the caller's exception (seen late on a
        # loaded node): the case under test is a dump of the retired entry, the usual one.
        _wait_retired(_last_record_id())
    finally:
        _dump(args.out, rank)
        store.set(f"fr_fail_job/dumped/{rank}", "1")
    print(f"rank {rank}: {outcome}", flush=True)
    os._exit(0)   # the process group is broken: no teardown that could wait on it


def _dump(out: str, rank: int) -> None:
    os.makedirs(os.path.join(out, "pickle"), exist_ok=True)
    os.makedirs(os.path.join(out, "json"), exist_ok=True)
    _write(os.path.join(out, "pickle", f"fr_{rank}"), _dump_fr_trace())
    _write(os.path.join(out, "json", f"fr_{rank}.json"), _dump_fr_trace_json())


if __name__ == "__main__":
    main()
