"""Every rank evaluates the same batches: the confusion matrix total is right, its rows are wrong."""

from _catalogue import eval_dataset, evaluate_confmat, reference_confmat

from distcheck import scenario

BATCH = 4
LIMIT_BATCHES = 2      # like Lightning's limit_val_batches=2


@scenario(expect=("duplicates", "numeric"), requires=("torchmetrics",))
def unsharded_eval_data(ctx):
    """A plain DataLoader without a DistributedSampler, limited to 2 batches of 4: every rank evaluates the same
    8 samples, so world_size x 8 counts add up to the dataset size while most samples are never seen."""
    from torch.utils.data import DataLoader

    size = BATCH * LIMIT_BATCHES * ctx.world_size
    dataset = eval_dataset(ctx, size)
    confmat = evaluate_confmat(ctx, DataLoader(dataset, batch_size=BATCH), size, max_batches=LIMIT_BATCHES)
    ctx.check_close("confusion matrix", confmat, reference_confmat(dataset))
