"""What a job can see of its own world, during a collective job and after its process group is destroyed, written as
JSON to argv[1] (one file per rank): the threads the ``threading`` module knows, the threads with a Python frame,
the open file descriptors (what each points at), the files under its working directory, and its environment.
Run plainly and under distcheck, the two must agree but for what docs/rule0.md lists."""

import json
import os
import sys
import threading

import torch
import torch.distributed as dist


def open_files() -> dict[str, str]:
    out = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            out[fd] = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:   # the listing's own descriptor, closed by now
            pass
    return out


def frames() -> list[int]:
    """Threads with a Python frame, less a tick of distcheck's own thread caught under way (it holds a frame only
    while it ticks, a fraction of a millisecond in every 50)."""
    ticker = sys.modules.get("distcheck.rank.ticker")
    ours = ticker.TICKER.ident if ticker is not None else 0
    return sorted(i for i in sys._current_frames() if i != ours)


def seen() -> dict:
    return {
        "threads": sorted(t.name for t in threading.enumerate()),
        "active_count": threading.active_count(),
        "frames": len(frames()),
        "files": open_files(),
        "tree": sorted(str(p) for p in os.listdir(".")),
        "env": sorted(os.environ),
    }


def main() -> None:
    dist.init_process_group("gloo")
    dist.all_reduce(torch.ones(1))
    during = seen()
    dist.barrier()
    dist.destroy_process_group()
    after = seen()
    rank = os.environ.get("RANK", "0")
    with open(f"{sys.argv[1]}.rank{rank}.json", "w", encoding="utf-8") as f:
        json.dump({"during": during, "after": after}, f)


if __name__ == "__main__":
    main()
