"""What user code sees of its own process, written as JSON to argv[1] (one file per rank): every signal's
disposition (Python's and the kernel's SigCgt mask), the warnings filters, faulthandler's state and the
modules loaded. Run plainly and under distcheck, the two must agree but for distcheck's own modules."""

import faulthandler
import json
import os
import signal
import sys
import warnings

import torch
import torch.distributed as dist


def caught_signals() -> list[int]:
    with open("/proc/self/status", encoding="ascii") as f:
        mask = next(int(line.split()[1], 16) for line in f if line.startswith("SigCgt:"))
    return [s for s in range(1, 65) if mask >> (s - 1) & 1]


def main() -> None:
    dist.init_process_group("gloo")
    dist.all_reduce(torch.ones(1))
    rank = dist.get_rank()
    seen = {
        "handlers": {s.name: repr(signal.getsignal(s)) for s in signal.valid_signals()
                     if isinstance(s, signal.Signals)},
        "caught": caught_signals(),
        "warning_filters": [repr(f) for f in warnings.filters],
        "faulthandler": faulthandler.is_enabled(),
        "modules": sorted(sys.modules),
    }
    with open(f"{sys.argv[1]}.rank{rank}.json", "w", encoding="utf-8") as f:
        json.dump(seen, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
