"""Tests in PyTorch's own style (torch.testing._internal.common_distributed.MultiProcessTestCase):
every test spawns 2 fresh processes, which init a gloo group on a FileStore of their own.

PLANT_BARRIER=1 adds a test where only rank 0 calls barrier().
"""

import os
import unittest

import torch
import torch.distributed as dist
from torch.testing._internal.common_distributed import MultiProcessTestCase


class TestCollectives(MultiProcessTestCase):
    @property
    def world_size(self):
        return 2

    def setUp(self):
        super().setUp()
        self._spawn_processes()

    def _init(self):
        store = dist.FileStore(self.file_name, self.world_size)
        dist.init_process_group("gloo", store=store, rank=self.rank, world_size=self.world_size)

    def test_all_reduce(self):
        self._init()
        t = torch.ones(2)
        dist.all_reduce(t)
        self.assertEqual(t.tolist(), [2.0, 2.0])

    @unittest.skipUnless(os.environ.get("PLANT_BARRIER") == "1", "planted only with PLANT_BARRIER=1")
    def test_barrier_on_rank0_only(self):
        self._init()
        if self.rank == 0:
            dist.barrier()   # planted: rank 1 never calls it

    def test_gather_then_destroy(self):
        self._init()
        out = [torch.zeros(1) for _ in range(self.world_size)]
        dist.all_gather(out, torch.tensor([float(self.rank)]))
        dist.destroy_process_group()
