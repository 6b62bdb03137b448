"""Two metrics computed in a different order on one rank: same signatures, values silently crossed."""

from distcheck import scenario

STEPS = 3
SPAM_BATCH = 8      # the two heads see different batch sizes, so crossed states change the totals
LANG_BATCH = 4


def _data(ctx, rank):
    import torch

    g = ctx.generator_for(rank)
    for _ in range(STEPS):
        spam = (torch.rand(SPAM_BATCH, generator=g), torch.randint(0, 2, (SPAM_BATCH,), generator=g))
        lang = (torch.randint(0, 2, (LANG_BATCH,), generator=g), torch.randint(0, 2, (LANG_BATCH,), generator=g))
        yield spam, lang


def _reference(ctx):
    import torch
    from torchmetrics.functional.classification import binary_confusion_matrix, multiclass_confusion_matrix

    steps = [step for r in range(ctx.world_size) for step in _data(ctx, r)]
    spam = binary_confusion_matrix(torch.cat([s[0] for s, _ in steps]), torch.cat([s[1] for s, _ in steps]))
    lang = multiclass_confusion_matrix(torch.cat([g[0] for _, g in steps]), torch.cat([g[1] for _, g in steps]),
                                       num_classes=2)
    return {"spam": spam, "lang": lang}


@scenario(expect=("order", "numeric"), requires=("torchmetrics",))
def metrics_computed_in_different_order(ctx):
    """BinaryConfusionMatrix.compute on most ranks meets MulticlassConfusionMatrix(num_classes=2).compute
    on the last rank: the syncs pair up without any error and the two matrices exchange states."""
    from torchmetrics.classification import BinaryConfusionMatrix, MulticlassConfusionMatrix

    metrics = {"spam": BinaryConfusionMatrix().to(ctx.device),
               "lang": MulticlassConfusionMatrix(num_classes=2).to(ctx.device)}
    for (spam_p, spam_t), (lang_p, lang_t) in _data(ctx, ctx.rank):
        metrics["spam"].update(spam_p.to(ctx.device), spam_t.to(ctx.device))
        metrics["lang"].update(lang_p.to(ctx.device), lang_t.to(ctx.device))
    # The last rank walks its metrics in another order (say, a set instead of a list of names).
    order = ["lang", "spam"] if ctx.rank == ctx.world_size - 1 else ["spam", "lang"]
    results = {name: metrics[name].compute() for name in order}
    reference = _reference(ctx)
    for name in ("spam", "lang"):
        ctx.check_close(f"{name} confusion matrix", results[name].cpu(), reference[name])
