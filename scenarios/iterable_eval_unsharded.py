"""An evaluation over an IterableDataset that does not split its stream by rank: every rank sees every sample."""

from distcheck import scenario

SAMPLES = 60
FEATURES = 5
CLASSES = 3
BATCH = 8


def _stream(seed: int):
    """The evaluation set as a stream: (features, label) pairs, the same on every rank that reads it."""
    import torch
    from torch.utils.data import IterableDataset

    class EvalStream(IterableDataset):
        def __iter__(self):   # no get_worker_info / rank split: every rank reads the whole stream
            g = torch.Generator()
            g.manual_seed(seed)
            for _ in range(SAMPLES):
                yield torch.randn(FEATURES, generator=g), torch.randint(0, CLASSES, (), generator=g)

    return EvalStream()


@scenario(expect="duplicates", requires=("torchmetrics",))
def iterable_eval_unsharded(ctx):
    """A model evaluated with MulticlassAccuracy over an IterableDataset stream of 60 samples that every rank
    reads whole: no sampler draws its samples, so only the rows each rank fed the metric show that the synced
    accuracy counts world_size x 60 rows for 60 samples."""
    import torch
    from torch.utils.data import DataLoader
    from torchmetrics.classification import MulticlassAccuracy

    g = torch.Generator()
    g.manual_seed(ctx.seed)
    model = torch.nn.Linear(FEATURES, CLASSES)   # the same weights on every rank, as after DDP's broadcast
    with torch.no_grad():
        model.weight.copy_(torch.randn(CLASSES, FEATURES, generator=g))
        model.bias.zero_()
    metric = MulticlassAccuracy(num_classes=CLASSES).to(ctx.device)
    with torch.no_grad():
        for x, y in DataLoader(_stream(ctx.seed), batch_size=BATCH):
            metric.update(model(x).to(ctx.device), y.to(ctx.device))
    metric.compute()
