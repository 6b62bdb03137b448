"""A hang: rank 0 waits on an Event that a (dead) producer thread would have set; the others are in the barrier."""

import threading

import torch.distributed as dist

dist.init_process_group("gloo")
if dist.get_rank() == 0:
    ready = threading.Event()
    ready.wait()   # WAIT
dist.barrier()
