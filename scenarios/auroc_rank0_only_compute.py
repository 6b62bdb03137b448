"""The seed case: only rank 0 calls BinaryAUROC.compute() in the middle of an eval loop."""

from distcheck import scenario

STEPS = 30
COMPUTE_AT = 10
BATCH = 16


@scenario(expect="hang", requires=("torchmetrics",))
def auroc_rank0_only_compute(ctx):
    """Only rank 0 calls BinaryAUROC.compute(); the others never join its barrier/all_gather."""
    import torch
    from torchmetrics.classification import BinaryAUROC

    metric = BinaryAUROC(thresholds=600).to(ctx.device)
    for it in range(STEPS):
        preds = torch.rand(BATCH, generator=ctx.generator).to(ctx.device)
        target = torch.randint(0, 2, (BATCH,), generator=ctx.generator).to(ctx.device)
        current_auc = metric(preds=preds, target=target)
        if ctx.rank == 0:
            print(current_auc)
            if it == COMPUTE_AT:
                print(metric.compute())  # only rank 0 calls compute(): the bug
