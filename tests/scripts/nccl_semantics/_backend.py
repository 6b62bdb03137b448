"""The backend these scripts run on: ``emulated_nccl`` (NCCL's host view over gloo) unless
``DISTCHECK_TEST_BACKEND`` names another (``gloo``: the same job with calls that block)."""

import os

import torch.distributed as dist

BACKEND = os.environ.get("DISTCHECK_TEST_BACKEND", "emulated_nccl")


def init() -> None:
    if BACKEND == "emulated_nccl":
        from distcheck.testing import emulated_nccl
        emulated_nccl.register()
    dist.init_process_group(BACKEND)


def sync() -> None:
    """The host waits for the device (torch.cuda.synchronize()); on gloo the calls already did."""
    if BACKEND == "emulated_nccl":
        from distcheck.testing import emulated_nccl
        emulated_nccl.synchronize()
