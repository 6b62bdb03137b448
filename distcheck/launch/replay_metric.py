"""One recorded metric replayed in a single process (runs inside ``python -m distcheck.launch.replay``).

All ranks' updates for the k-th ``compute()`` go, rank by rank, into one fresh
copy: that is the reference. Each rank's updates also go into a copy of its
own, so that each state's declared ``dist_reduce_fx`` can be applied to the
ranks' local states the way torchmetrics' sync does: a state whose reduced
value differs from the single-process state is the one whose reduction is wrong.
"""

from __future__ import annotations

from typing import Any, Callable

from distcheck.rank.metrics import jsonable


def replay_metric(per_rank: dict[int, dict[str, Any]], load: Callable, max_computes: int) -> dict[str, Any]:
    first = per_rank[min(per_rank)]
    note = next((m["note"] for m in per_rank.values() if m.get("note")), None)
    if note or not first.get("fresh"):
        return {"skipped": note or "no copy of the metric was recorded"}
    modules = {first["module"]: first["file"]}
    if "__main__" not in modules:
        modules["__main__"] = None
    ref = _fresh(load(first["fresh"], modules))
    local = {r: _fresh(load(first["fresh"], modules)) for r in per_rank}
    updates = {r: _updates(m["chunks"], load, modules) for r, m in per_rank.items()}
    n = min(min(len(m["computes"]) for m in per_rank.values()), max_computes)
    out: dict[str, Any] = {"computes": [], "reductions": _reductions(ref)}
    state = {"epoch": None, "done": {r: 0 for r in per_rank}, "samples": 0, "counts": None}
    for k in range(n):
        out["computes"].append(_replay_compute(k, per_rank, updates, ref, local, state))
    return out


def _fresh(metric: Any) -> Any:
    metric.reset()
    return metric


def _updates(chunks: list[str], load: Callable, modules: dict) -> dict[int, list[tuple[Any, Any]]]:
    """epoch -> [(args, kwargs)] in the order the rank called update()."""
    by_epoch: dict[int, list[tuple[Any, Any]]] = {}
    for path in chunks:
        for epoch, args, kwargs in load(path, modules):
            by_epoch.setdefault(epoch, []).append((args, kwargs))
    return by_epoch


def _replay_compute(k: int, per_rank: dict[int, dict], updates: dict, ref: Any, local: dict, state: dict) -> dict:
    targets = {r: m["computes"][k] for r, m in per_rank.items()}
    epochs = {t["epoch"] for t in targets.values()}
    if len(epochs) > 1:
        return {"error": "the ranks reached this compute() after different numbers of reset()"}
    epoch = epochs.pop()
    if epoch != state["epoch"]:    # a reset() came between: start from fresh states
        ref.reset()
        for m in local.values():
            m.reset()
        state.update(epoch=epoch, done={r: 0 for r in per_rank}, samples=0, counts=None)
    for r, target in targets.items():
        todo = updates[r].get(epoch, [])[state["done"][r]:target["updates"]]
        if state["done"][r] + len(todo) < target["updates"]:
            return {"error": f"rank {r}'s recorded update() inputs are incomplete"}
        for args, kwargs in todo:
            ref.update(*args, **kwargs)
            local[r].update(*args, **kwargs)
            _count(state, ref, args)
        state["done"][r] = target["updates"]
    return {"reference": jsonable(ref.compute()), "samples": state["samples"], "class_counts": state["counts"],
            "bad_states": _bad_states(ref, local)}


def _count(state: dict, metric: Any, args: tuple) -> None:
    """Samples seen (the first argument's batch size) and, for a classifier, the targets' class counts."""
    import torch

    first = args[0] if args else None
    state["samples"] += int(first.shape[0]) if isinstance(first, torch.Tensor) and first.dim() else 1
    classes = getattr(metric, "num_classes", None)
    target = args[1] if len(args) > 1 else None
    if isinstance(classes, int) and isinstance(target, torch.Tensor) and target.dim() == 1 \
            and not target.is_floating_point():
        t = target[(target >= 0) & (target < classes)]
        counts = torch.bincount(t, minlength=classes).tolist()
        state["counts"] = counts if state["counts"] is None else [a + b for a, b in zip(state["counts"], counts)]


def _metrics_of(obj: Any) -> dict[str, Any]:
    """name -> Metric: the object itself, or a collection's members."""
    items = getattr(obj, "items", None)
    return dict(items()) if callable(items) and not hasattr(obj, "_reductions") else {"": obj}


def _reductions(obj: Any) -> dict[str, str | None]:
    return {f"{name}.{attr}".lstrip("."): _reduce_name(fn)
            for name, m in _metrics_of(obj).items() for attr, fn in getattr(m, "_reductions", {}).items()}


def _reduce_name(fn: Any) -> str | None:
    if fn is None:
        return None
    name = getattr(fn, "__name__", repr(fn))
    return name.removeprefix("dim_zero_")


def _bad_states(ref: Any, local: dict[int, Any]) -> list[dict[str, Any]]:
    """Tensor states whose dist_reduce_fx over the ranks' local states differs from the single-process state."""
    import torch

    bad = []
    locals_ = {r: _metrics_of(m) for r, m in sorted(local.items())}
    for name, metric in _metrics_of(ref).items():
        for attr, fn in getattr(metric, "_reductions", {}).items():
            single = getattr(metric, attr)
            per = [getattr(ms[name], attr) for ms in locals_.values()]
            if fn is None or not isinstance(single, torch.Tensor) or not all(isinstance(p, torch.Tensor) for p in per):
                continue
            synced = fn(torch.stack(per))
            if synced.shape != single.shape or not torch.allclose(synced.double(), single.double(), rtol=1e-4,
                                                                  atol=1e-6):
                bad.append({"state": f"{name}.{attr}".lstrip("."), "reduce": _reduce_name(fn),
                            "synced": jsonable(synced), "single_process": jsonable(single)})
    return bad
