"""The fix of the seed case: every rank calls compute(), rank 0 prints."""

from distcheck import scenario

STEPS = 30
COMPUTE_AT = 10
BATCH = 16


def _batches(ctx, rank):
    import torch

    g = ctx.generator_for(rank)
    for _ in range(STEPS):
        yield torch.rand(BATCH, generator=g), torch.randint(0, 2, (BATCH,), generator=g)


@scenario(expect="pass", requires=("torchmetrics",))
def auroc_all_ranks_compute(ctx):
    """Every rank calls BinaryAUROC.compute(); the result equals a single-process AUROC over all ranks' data."""
    import torch
    from torchmetrics.classification import BinaryAUROC
    from torchmetrics.functional.classification import binary_auroc

    metric = BinaryAUROC(thresholds=600).to(ctx.device)
    for it, (preds, target) in enumerate(_batches(ctx, ctx.rank)):
        metric(preds=preds.to(ctx.device), target=target.to(ctx.device))
        if it == COMPUTE_AT:
            value = metric.compute()  # every rank joins the sync
            if ctx.rank == 0:
                print(value)
            seen = [list(_batches(ctx, r))[: COMPUTE_AT + 1] for r in range(ctx.world_size)]
            preds_all = torch.cat([p for batches in seen for p, _ in batches])
            target_all = torch.cat([t for batches in seen for _, t in batches])
            ctx.check_close("BinaryAUROC(thresholds=600)", value.cpu(),
                            binary_auroc(preds_all, target_all, thresholds=600))
