"""PyTorch's object-collective and sub-group tests, the same shape as PyTorch's own
test/distributed/test_c10d_object_collectives.py (not shipped in the wheel): a
MultiProcessTestCase on 4 gloo ranks, disjoint subgroups made with
dist.new_group(ranks, use_local_synchronization=True), and object collectives on them;
plus new_subgroups() and new_subgroups_by_enumeration(), which every rank calls."""

import torch
import torch.distributed as dist
from torch.testing._internal.common_distributed import MultiProcessTestCase


class TestObjectSubgroups(MultiProcessTestCase):
    @property
    def world_size(self):
        return 4

    def setUp(self):
        super().setUp()
        self._spawn_processes()

    def _init(self):
        store = dist.FileStore(self.file_name, self.world_size)
        dist.init_process_group("gloo", store=store, rank=self.rank, world_size=self.world_size)

    def _pair(self):
        base = self.rank - self.rank % 2
        ranks = [base, base + 1]
        return ranks, dist.new_group(ranks, use_local_synchronization=True)

    def test_all_gather_object(self):
        self._init()
        out = [None] * self.world_size
        dist.all_gather_object(out, {"rank": self.rank})
        self.assertEqual([o["rank"] for o in out], list(range(self.world_size)))

    def test_subpg_object_collectives(self):
        # PyTorch's test_subpg_* tests, one process start for all of them
        self._init()
        ranks, pg = self._pair()
        out = [None]
        dist.scatter_object_list(out, ranks if self.rank == ranks[0] else None, src=ranks[0], group=pg)
        self.assertEqual(out[0], self.rank)
        gathered = [None] * 2
        dist.all_gather_object(gathered, self.rank, group=pg)
        self.assertEqual(gathered, ranks)
        at_root = [None] * 2 if self.rank == ranks[0] else None
        dist.gather_object(self.rank, at_root, dst=ranks[0], group=pg)
        if self.rank == ranks[0]:
            self.assertEqual(at_root, ranks)
        obj = [self.rank]
        dist.broadcast_object_list(obj, src=ranks[0], group=pg)
        self.assertEqual(obj[0], ranks[0])
        others = [r for r in range(self.world_size) if r not in ranks]
        self.assertIsNone(dist.new_group(others, use_local_synchronization=True))   # not a member: no group
        t = torch.ones(1)
        dist.all_reduce(t, group=pg)
        self.assertEqual(t.item(), 2.0)

    def test_new_subgroups(self):   # every rank creates every subgroup
        self._init()
        mine, _ = dist.new_subgroups(group_size=2)
        t = torch.ones(1)
        dist.all_reduce(t, group=mine)
        self.assertEqual(t.item(), 2.0)

        by_enumeration, _ = dist.new_subgroups_by_enumeration([[0, 2], [1, 3]])
        t = torch.tensor([float(self.rank)])
        dist.all_reduce(t, group=by_enumeration)
        self.assertEqual(t.item(), float(self.rank % 2 * 2 + 2))
