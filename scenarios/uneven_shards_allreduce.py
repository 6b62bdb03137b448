"""Manual sharding of uneven length with a per-batch all_reduce: the longer shards wait forever."""

from distcheck import scenario

SAMPLES = 21        # not a multiple of 2 or 4 ranks
BATCH = 2


@scenario(expect="hang")
def uneven_shards_allreduce(ctx):
    """Contiguous shards of ceil(21 / world_size) samples; the last shard is shorter, so its rank issues
    fewer per-batch all_reduces and the others wait in one it never enters."""
    import math

    import torch
    import torch.distributed as dist

    per_rank = math.ceil(SAMPLES / ctx.world_size)
    shard = range(ctx.rank * per_rank, min(SAMPLES, (ctx.rank + 1) * per_rank))
    data = torch.rand(SAMPLES, generator=ctx.generator_for(0))
    for start in range(0, len(shard), BATCH):
        batch = data[shard[start]:shard[start] + BATCH]
        loss = batch.mean().reshape(1).to(ctx.device)
        dist.all_reduce(loss)   # averaging the loss across ranks every batch
