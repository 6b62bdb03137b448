"""Lightning's Fabric on two CPU ranks that the pytest process spawns (``strategy="ddp_spawn"``, ``launch(fn)``)."""

import torch
import torch.distributed as dist
from lightning.fabric import Fabric

from _trainers import flat_weights


def _train(fabric: Fabric, steps: int) -> dict:
    fabric.seed_everything(7)
    model = fabric.setup_module(torch.nn.Linear(4, 2))
    optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1))
    for _ in range(steps):
        loss = model(torch.randn(8, 4) + fabric.global_rank).sum()
        fabric.backward(loss)
        fabric.clip_gradients(model, optimizer, max_norm=1.0)
        optimizer.step()
        optimizer.zero_grad()
    gathered = fabric.all_gather(flat_weights(model))
    fabric.barrier()
    return {"world": fabric.world_size, "replicas_equal": bool(torch.equal(gathered[0], gathered[1])),
            "rank_sum": fabric.all_reduce(torch.tensor(fabric.global_rank + 1.0), reduce_op="sum").item(),
            "from_rank_0": fabric.broadcast(fabric.global_rank)}


def test_fabric_launch_on_two_spawned_ranks():
    fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp_spawn")
    result = fabric.launch(_train, 2)   # rank 0's return value comes back
    assert result == {"world": 2, "replicas_equal": True, "rank_sum": 3.0, "from_rank_0": 0}
    assert not dist.is_initialized()   # the ranks were the spawned processes, not this one
