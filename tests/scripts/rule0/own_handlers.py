"""A job that handles SIGUSR1 and SIGUSR2 itself, installed after init_process_group (as Lightning's
SLURMEnvironment does for its auto-requeue): each handler writes a marker file. Rank 0 is late (busy
in its own loop) and then stuck in user code (asleep); rank 1 waits in a barrier. distcheck must name
the hang with both lines and never fire either handler."""

import os
import signal
import sys
import time

import torch.distributed as dist


def handler(signum, frame):
    with open(f"{sys.argv[1]}.fired", "a", encoding="utf-8") as f:
        f.write(f"{os.getpid()} {signal.Signals(signum).name}\n")


def main() -> None:
    dist.init_process_group("gloo")
    signal.signal(signal.SIGUSR1, handler)
    signal.signal(signal.SIGUSR2, handler)
    if dist.get_rank() == 0:
        deadline = time.monotonic() + float(sys.argv[2])
        while time.monotonic() < deadline:   # BUSY: late, not hung
            sum(range(1000))
        time.sleep(3600)   # ASLEEP
    dist.barrier()   # BARRIER


if __name__ == "__main__":
    main()
