"""A rank held in its start-up (an import that takes long on a loaded node, a slow file system): it has not called
init_process_group when --timeout comes. argv[1]: "import" (every rank slow to import) or "endpoint" (rank 1 dials a
rendezvous endpoint nobody listens on; rank 0 starts normally)."""

import datetime
import os
import sys
import time

mode = sys.argv[1] if len(sys.argv) > 1 else "import"
if mode == "import":
    time.sleep(3600)   # IMPORTING

import torch.distributed as dist  # noqa: E402

if os.environ.get("RANK") == "1":
    # an address nobody answers on (TEST-NET-1, RFC 5737): the store's connect waits
    dist.init_process_group("gloo", init_method="tcp://192.0.2.1:29500", rank=1, world_size=2,
                            timeout=datetime.timedelta(seconds=300))   # ENDPOINT
else:
    dist.init_process_group("gloo")
dist.barrier()
