"""Data shared by several catalogue scenarios, so a broken case and its fix see the same samples.

Not a scenario file (the leading underscore keeps discovery out); the worker puts this folder on
``sys.path``, so scenarios import it as ``_catalogue``.
"""

from __future__ import annotations

NUM_CLASSES = 3


def rank_predictions(ctx, rank: int):
    """(preds, target) of one rank: rank 0 has 2 samples, both right; every other rank 6 samples, 3 right.

    The counts are fixed rather than drawn, so a mean of per-rank means differs from the accuracy over all
    samples for every seed and world size.
    """
    import torch

    g = ctx.generator_for(rank)
    n, right = (2, 2) if rank == 0 else (6, 3)
    target = torch.randint(0, 2, (n,), generator=g)
    correct = torch.zeros(n, dtype=torch.bool)
    correct[torch.randperm(n, generator=g)[:right]] = True
    return torch.where(correct, target, 1 - target), target


def global_accuracy(ctx):
    """The single-process reference: accuracy over every rank's samples."""
    import torch

    pairs = [rank_predictions(ctx, r) for r in range(ctx.world_size)]
    return (torch.cat([p for p, _ in pairs]) == torch.cat([t for _, t in pairs])).double().mean()


def eval_dataset(ctx, size: int):
    """A labelled evaluation set identical on every rank: (ids, preds, target) tensors."""
    import torch
    from torch.utils.data import TensorDataset

    g = torch.Generator()
    g.manual_seed(ctx.seed)
    target = torch.randint(0, NUM_CLASSES, (size,), generator=g)
    preds = torch.randint(0, NUM_CLASSES, (size,), generator=g)
    return TensorDataset(torch.arange(size), preds, target)


def reference_confmat(dataset):
    """The single-process confusion matrix over the whole dataset, each sample once."""
    from torchmetrics.functional.classification import multiclass_confusion_matrix

    _, preds, target = dataset.tensors
    return multiclass_confusion_matrix(preds, target, num_classes=NUM_CLASSES)


def evaluate_confmat(ctx, loader, dataset_size: int, max_batches: int | None = None):
    """Run MulticlassConfusionMatrix over a loader on this rank, record the sample ids, compute on every rank."""
    from torchmetrics.classification import MulticlassConfusionMatrix

    metric = MulticlassConfusionMatrix(num_classes=NUM_CLASSES).to(ctx.device)
    seen = []
    for i, (ids, preds, target) in enumerate(loader):
        if max_batches is not None and i >= max_batches:
            break
        metric.update(preds.to(ctx.device), target.to(ctx.device))
        seen.extend(ids.tolist())
    ctx.record_samples(seen, dataset_size=dataset_size, dataset="eval set")
    return metric.compute().cpu()


def ddp_model(ctx, features: int = 4):
    """A tiny DDP-wrapped model on the scenario's device (DDP's init broadcasts run here, from C++)."""
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(ctx.seed)   # the same initial weights on every rank
    model = torch.nn.Linear(features, 1).to(ctx.device)
    device_ids = [ctx.device.index] if ctx.device.type == "cuda" else None
    return DDP(model, device_ids=device_ids)


def train_steps(ctx, model, steps: int, features: int = 4) -> None:
    """Plain training steps: forward, backward (DDP's reducer all_reduces the gradients), SGD step."""
    import torch

    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(steps):
        x = torch.randn(8, features, generator=ctx.generator).to(ctx.device)
        loss = model(x).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()


def fsdp2_steps(ctx, steps: int) -> None:
    """Train a two-layer model sharded with FSDP2's fully_shard for ``steps`` steps."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(ctx.seed)
    mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1)).to(ctx.device)
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(steps):
        loss = model(torch.randn(4, 8, generator=ctx.generator).to(ctx.device)).sum()
        loss.backward()
        opt.step()
        opt.zero_grad()


def accumulate_steps(ctx, model, steps: int, skip_sync) -> None:
    """Training steps where ``skip_sync(step)`` runs backward() under model.no_sync() (gradient
    accumulation: DDP's reducer does not all_reduce that step) and leaves the optimizer step out."""
    import contextlib

    import torch

    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(steps):
        x = torch.randn(8, 4, generator=ctx.generator).to(ctx.device)
        skip = skip_sync(step)
        with model.no_sync() if skip else contextlib.nullcontext():
            model(x).sum().backward()
        if not skip:
            opt.step()
            opt.zero_grad()


MOE_HIDDEN = 64
MOE_TOKENS_PER_PEER = 2     # tokens every rank routes to each expert rank
MOE_BUSY_RANK_TOKENS = 5    # the last rank's batch is bigger: it routes this many to each peer


def moe_routed(ctx):
    """(tokens, input_split_sizes): how many rows of the hidden states this rank sends to each rank."""
    import torch

    per_peer = MOE_BUSY_RANK_TOKENS if ctx.rank == ctx.world_size - 1 else MOE_TOKENS_PER_PEER
    splits = [per_peer] * ctx.world_size
    tokens = torch.full((sum(splits), MOE_HIDDEN), float(ctx.rank), device=ctx.device)
    return tokens, splits


WORKER_RESULT_SLOTS = 1     # the result size rank 0 allocates for every worker
WORKER_BIG_RESULT = 97      # the last worker found this many entries


def worker_result(ctx):
    import torch

    n = WORKER_BIG_RESULT if ctx.rank == ctx.world_size - 1 else WORKER_RESULT_SLOTS
    return torch.full((n,), float(ctx.rank), device=ctx.device)


def pair_and_world(ctx, dist, pair_first: bool):
    """(pair group of ranks 0 and 1, a group of every rank), created in the given order."""
    everyone = list(range(ctx.world_size))
    if pair_first:
        pair = dist.new_group([0, 1])
        world = dist.new_group(everyone)
    else:
        world = dist.new_group(everyone)
        pair = dist.new_group([0, 1])
    return pair, world


def dtensor_then_metrics(ctx, gathers: bool) -> None:
    """A tensor sharded over a DeviceMesh of every rank, gathered back with DTensor's ``full_tensor()`` where
    ``gathers``, then every rank gathers its metrics with ``all_gather_into_tensor`` (DTensor issues its
    all_gather from C++: no call of torch.distributed's Python API)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    world = ctx.world_size
    mesh = init_device_mesh("cpu", (world,))
    weights = distribute_tensor(torch.arange(8 * world * 11, dtype=torch.float32).reshape(8 * world, 11), mesh,
                                [Shard(0)])
    if gathers:
        full = weights.full_tensor()
        ctx.check_close("full_tensor", full, torch.arange(8 * world * 11, dtype=torch.float32).reshape(8 * world, 11))
    metrics = torch.zeros(world * 100)
    dist.all_gather_into_tensor(metrics, torch.full((100,), float(ctx.rank)))


def fsdp2_export_between_steps(ctx, exports: bool) -> None:
    """Two training steps of a two-layer model sharded with FSDP2's ``fully_shard``; between them, where
    ``exports``, the first layer's weight is gathered with DTensor's ``full_tensor()`` (exporting weights
    from the main process). Both FSDP2's pre-forward all_gather and ``full_tensor()`` are issued from C++."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(ctx.seed)
    mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1)).to(ctx.device)
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(2):
        if step == 1 and exports:
            weight = model[0].weight.full_tensor()
            ctx.check_close("exported weight shape", torch.tensor(weight.shape), torch.tensor([8, 8]))
        model(torch.ones(4, 8, device=ctx.device)).sum().backward()
        opt.step()
        opt.zero_grad()


def mesh_steps(ctx, loss_dim_of) -> None:
    """Two steps on a (2, world / 2) DeviceMesh ("dp", "tp"): the loss all-reduced over ``loss_dim_of(rank)``,
    then the activations over "tp" (both of one shape, so a group mixed up pairs them silently)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, ctx.world_size // 2), mesh_dim_names=("dp", "tp"))
    for _ in range(2):
        loss, act = torch.ones(4), torch.ones(4)
        dist.all_reduce(loss, group=mesh.get_group(loss_dim_of(ctx.rank)))
        dist.all_reduce(act, group=mesh.get_group("tp"))


def monitored_barrier_then_collectives(ctx, skips: bool) -> None:
    """gloo's monitored_barrier between two steps, then collectives of different kinds: on gloo it is P2P
    with rank 0, which moves the group's counter by different amounts on different ranks. ``skips``: this
    rank goes straight to the next all_reduce instead."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    t = torch.ones(4)
    dist.all_reduce(t)
    if not skips:
        # a time-out of its own well above any stall timeout: distcheck, not gloo, ends a wrong run
        dist.monitored_barrier(timeout=timedelta(seconds=300))
    dist.all_reduce(t)
    dist.broadcast(torch.zeros(3), src=0)
    dist.all_reduce(torch.ones(7))
    dist.barrier()


PIPELINE_BATCH, PIPELINE_WIDTH = 8, 16
PIPELINE_BUDGET_ROWS = 4    # the rows of one microbatch that fit in a stage's memory


def pipeline_steps(ctx, budget_rows: int, steps: int = 3) -> None:
    """A torch.distributed.pipelining job, one PipelineStage per rank under ScheduleGPipe; each stage derives
    n_microbatches from its own memory budget (``budget_rows``)."""
    import torch
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    torch.manual_seed(ctx.seed + ctx.rank)
    stage = PipelineStage(torch.nn.Linear(PIPELINE_WIDTH, PIPELINE_WIDTH).to(ctx.device), ctx.rank,
                          ctx.world_size, ctx.device)
    n_microbatches = max(1, PIPELINE_BATCH // budget_rows)
    schedule = ScheduleGPipe(stage, n_microbatches, loss_fn=lambda out, y: ((out - y) ** 2).mean())
    x = torch.randn(PIPELINE_BATCH, PIPELINE_WIDTH, generator=ctx.generator).to(ctx.device)
    y = torch.randn(PIPELINE_BATCH, PIPELINE_WIDTH, generator=ctx.generator).to(ctx.device)
    for _ in range(steps):
        if ctx.rank == 0:
            schedule.step(x)
        elif ctx.rank == ctx.world_size - 1:
            schedule.step(target=y, losses=[])
        else:
            schedule.step()
