"""A one-process job for rule 0's rank setup and end hooks (tests/test_rule0.py), run plainly and under
``distcheck run -- python``.

It creates its process group twice (init, destroy, init again, as a test harness does), then ends the
way ``MultiProcessTestCase`` does: ``sys.exit(3)`` from the ``except`` block that caught the test's
error, without destroying its second group. It writes what it saw to RULE0_OUT, the same with and
without distcheck.

With RULE0_BREAK=1, when distcheck traces this process, ``rule0_faults`` breaks distcheck's own
``init_process_group`` and ``destroy_process_group`` hooks for the first group, and its ``sys.exit``
and ``atexit`` hooks for the second: the job must not notice.
"""

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

BREAK = os.environ.get("RULE0_BREAK") == "1" and "distcheck.rank.injected" in sys.modules
if BREAK:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))   # tests/, for rule0_faults
    import rule0_faults


def one_group(seen: dict, name: str) -> None:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    t = torch.arange(3.0)
    dist.all_reduce(t)
    seen[name] = {"all_reduce": t.tolist(), "rank": dist.get_rank(), "world": dist.get_world_size()}


def main(seen: dict) -> None:
    restore = rule0_faults.break_rank_setup() if BREAK else None
    one_group(seen, "first")
    dist.destroy_process_group()
    seen["initialized_after_destroy"] = dist.is_initialized()
    if BREAK:
        restore()
        rule0_faults.break_rank_end()
    one_group(seen, "second")
    try:
        raise KeyError("the test's own error")
    except KeyError:
        sys.exit(3)   # the harness's exit code, from the except block


if __name__ == "__main__":
    seen: dict = {}
    try:
        main(seen)
    except BaseException as exc:   # what leaves the program, as its own code sees it
        seen["left_main"] = f"{type(exc).__name__}: {getattr(exc, 'code', exc)}"
        raise
    finally:
        Path(os.environ["RULE0_OUT"]).write_text(json.dumps(seen, sort_keys=True))
