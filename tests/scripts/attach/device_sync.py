"""A plain torchrun job (no distcheck inside) on ``emulated_nccl``, the backend the host sees as NCCL's: rank 0
all_reduces (the call returns at once, its work waits on the "stream" for a peer that never comes) and then blocks
in ``emulated_nccl.synchronize()``, as ``torch.cuda.synchronize()`` would block it on NCCL; rank 1 never calls it
and sleeps in a loop. No Flight Recorder: nothing says which call rank 0 waits in.

Each rank writes ``<dir>/ready<rank>`` (its pid) when it stands where the test wants it; rank 1 leaves once
``<dir>/release`` exists, rank 0 is killed by the test.
"""

import datetime
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from distcheck.testing import emulated_nccl


def ready(folder: Path, rank: int) -> None:
    (folder / f"ready{rank}").write_text(str(os.getpid()))


def main() -> None:
    folder = Path(sys.argv[1])
    emulated_nccl.register()
    dist.init_process_group("emulated_nccl", timeout=datetime.timedelta(seconds=300))
    rank = dist.get_rank()
    if rank == 0:
        dist.all_reduce(torch.ones(4))   # returns at once: its work waits on the stream for rank 1
        ready(folder, rank)
        emulated_nccl.synchronize()   # the host blocks here, in the device sync
    else:
        ready(folder, rank)
        while not (folder / "release").exists():
            time.sleep(0.05)   # rank 1: outside any collective
    os._exit(0)


if __name__ == "__main__":
    main()
