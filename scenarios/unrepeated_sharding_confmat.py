"""The fix of sampler_padding_confmat: shard the evaluation set without padding."""

from _catalogue import eval_dataset, evaluate_confmat, reference_confmat
from sampler_padding_confmat import BATCH, dataset_size

from distcheck import scenario


@scenario(expect="pass", requires=("torchmetrics",))
def unrepeated_sharding_confmat(ctx):
    """Every rank takes samples rank, rank + world_size, ... (shards of unequal length, nothing repeated);
    MulticlassConfusionMatrix syncs sum states, so unequal shards are fine and the matrix is exact."""
    from torch.utils.data import DataLoader

    size = dataset_size(ctx.world_size)
    dataset = eval_dataset(ctx, size)
    shard = list(range(ctx.rank, size, ctx.world_size))   # what Lightning's unrepeated eval sampler does
    confmat = evaluate_confmat(ctx, DataLoader(dataset, batch_size=BATCH, sampler=shard), size)
    ctx.check_close("confusion matrix", confmat, reference_confmat(dataset))
