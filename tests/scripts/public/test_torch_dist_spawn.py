"""PyTorch's own DistributedTest (torch/testing/_internal/distributed/distributed_test.py, shipped in
the wheel), driven the way PyTorch's test/distributed/test_distributed_spawn.py drives it (that file
is not in the wheel). Needs BACKEND=gloo, WORLD_SIZE, TEMP_DIR and INIT_METHOD=file://... in the
environment before import; pick tests with -k."""

import os

import torch
from torch.testing._internal.distributed.distributed_test import DistributedTest, TestDistBackend

BACKEND = os.environ["BACKEND"]


class TestDistBackendWithSpawn(TestDistBackend, DistributedTest._DistTestBase):
    def setUp(self):
        super().setUp()
        self._spawn_processes()
        torch.backends.cudnn.flags(enabled=True, allow_tf32=False).__enter__()
