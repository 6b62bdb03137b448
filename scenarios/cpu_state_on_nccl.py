"""A metric left on the CPU under NCCL: its sync hands CPU tensors to a CUDA-only process group."""

from distcheck import scenario


@scenario(expect="crash", requires=("torchmetrics",), backends=("nccl",), min_world_size=1)
def cpu_state_on_nccl(ctx):
    """BinaryAccuracy() is never moved to the GPU (no .to(device)); compute() all_gathers its CPU states on an
    NCCL group, which has no CPU backend: every rank fails in the metric's sync."""
    import torch
    from torchmetrics.classification import BinaryAccuracy

    metric = BinaryAccuracy()                 # the bug: stays on the CPU
    preds = torch.rand(16, generator=ctx.generator)
    target = torch.randint(0, 2, (16,), generator=ctx.generator)
    metric.update(preds, target)              # CPU inputs, so the update itself works
    metric.compute()
