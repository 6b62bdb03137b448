"""A rank that catches its own failure and exits with a code of its own, as MultiProcessTestCase
does (exit 10): distcheck names the exception it handled, at its line."""
import sys
import tempfile

import torch.distributed as dist

dist.init_process_group("gloo", init_method=f"file://{tempfile.mktemp()}", rank=0, world_size=1)
try:
    assert 1 + 1 == 3, "the rank's own check"
except AssertionError:
    sys.exit(10)
