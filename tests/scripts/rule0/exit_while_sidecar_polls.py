"""A one-rank gloo job that exits without destroy_process_group while distcheck's C++-collective sidecar polls
its groups' counters without pause (argv[1]: a folder for the store and the trace). Its exit must be clean."""

import sys
import threading
from pathlib import Path

import torch.distributed as dist

from distcheck.rank import native
from distcheck.rank.tracer import Tracer

folder = Path(sys.argv[1])
dist.init_process_group("gloo", init_method=f"file://{folder / 'store'}", rank=0, world_size=1)
groups = [dist.new_group([0]) for _ in range(64)]   # each poll reads every group's counter
tracer = Tracer(folder / "rank0.trace", 0)
tracer.install()
native.start(native.NativeWatcher(tracer, main_thread=threading.main_thread().ident), poll_s=0.0)
dist.barrier()
print("done", flush=True)
