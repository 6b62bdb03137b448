"""One chain of joint computes replayed in a single process (runs inside ``python -m distcheck.launch.replay``).

A chain is one metric across the ranks (``files.metric_records``): the objects the
ranks synced together, compute after compute. Walking it in order:

* each rank's own updates go into a copy of its own; that copy must come out with
  the local state the rank had when it called ``compute()``. If it does not, the
  recorded updates do not explain that state (a wrapper such as ``Running``
  restored it) and there is no single-process reference to give: *unexplained*.
* all ranks' updates, in the order of their ranks in the group, go into one
  copy: the single-process reference for that compute.
* each state's declared ``dist_reduce_fx`` applied to the ranks' local states,
  the way torchmetrics' sync does, set beside the single-process state: a state
  whose reduction is wrong is named, with the reduction that would be right.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from distcheck.files.metric_records import unpack
from distcheck.rank.metric_copies import jsonable
from distcheck.rank.metric_sync import metrics_of

RTOL, ATOL = 1e-4, 1e-6


def replay_chain(chain: dict[str, Any], members: Sequence[dict[str, Any]], load: Callable[[str], Any]) -> dict:
    note = next((m["note"] for m in members if m.get("note")), None)
    if note or not all(m.get("fresh") for m in members):
        return {"skipped": note or "no copy of the metric was recorded"}
    ref = _fresh(load(members[0]["fresh"]))
    local = [_fresh(load(m["fresh"])) for m in members]
    records = [_records(m["chunks"], load) for m in members]
    out: dict[str, Any] = {"checks": [], "reductions": _reductions(ref)}
    state: dict[str, Any] = {"epochs": None, "done": [0] * len(members), "samples": 0, "counts": None,
                             "fresh": lambda i: _fresh(load(members[i]["fresh"]))}
    for index, joint in enumerate(chain["joints"]):
        result = _replay_joint(joint, members, records, ref, local, state)
        if joint["check"] or "error" in result:
            out["checks"].append({"joint": index, **result})
        if "error" in result:
            break
    return out


def _fresh(metric: Any) -> Any:
    """The recorded copy, on the CPU (its tensors were pickled there), with its initial states."""
    to = getattr(metric, "to", None)
    if callable(to):
        metric = to("cpu")
    metric.reset()
    return metric


def _records(chunks: list[str], load: Callable) -> dict[str, dict]:
    """{"updates": epoch -> [(args, kwargs)] in call order, "states": compute index -> local state}."""
    updates: dict[int, list] = {}
    states: dict[int, dict] = {}
    for rel in chunks:
        for record in load(rel):
            if record[0] == "u":
                updates.setdefault(record[1], []).append((unpack(record[2]), unpack(record[3])))
            else:
                states[record[1]] = unpack(record[2])
    return {"updates": updates, "states": states}


def _replay_joint(joint: dict, members: Sequence[dict], records: list, ref: Any, local: list, state: dict) -> dict:
    computes = [m["computes"][k] for m, k in zip(members, joint["computes"])]
    epochs = [c["epoch"] for c in computes]
    if epochs != state["epochs"] or any(c["updates"] < d for c, d in zip(computes, state["done"])):
        ref.reset()   # a reset() came between: start again from fresh states
        for m in local:
            m.reset()
        state.update(epochs=epochs, done=[0] * len(members), samples=0, counts=None)
    for i, c in enumerate(computes):
        todo = records[i]["updates"].get(c["epoch"], [])[state["done"][i]:c["updates"]]
        if state["done"][i] + len(todo) < c["updates"]:
            return {"error": f"rank {joint['ranks'][i]}'s recorded update() inputs are incomplete"}
        for args, kwargs in todo:
            ref.update(*args, **kwargs)
            local[i].update(*args, **kwargs)
            _count(state, ref, args)
        state["done"][i] = c["updates"]
    if not joint["check"]:
        return {}
    recorded = [records[i]["states"].get(k) for i, k in enumerate(joint["computes"])]
    offs = [_unexplained(local[i], snapshot) for i, snapshot in enumerate(recorded)]
    if any(off is not None for off in offs):
        return _restored(joint, computes, records, recorded, offs, state)
    return {"reference": jsonable(ref.compute()), "samples": state["samples"], "class_counts": state["counts"],
            "bad_states": _bad_states(ref, recorded)}


MAX_EPOCHS_BACK = 64


def _restored(joint: dict, computes: list, records: list, recorded: list, offs: list, state: dict) -> dict:
    """A state its updates since the last reset() do not give: a wrapper (``Running``) restored it
    from earlier windows. Credit it with the updates of the fewest recent reset-epochs that give
    exactly that state on every rank; without such epochs there is no reference."""
    state["epochs"] = None   # the incremental copies no longer follow the ranks: start again next time
    credited = []
    for i, c in enumerate(computes):
        updates = records[i]["updates"]
        found = None
        for back in range(0, min(c["epoch"], MAX_EPOCHS_BACK) + 1):
            todo = [u for e in range(c["epoch"] - back, c["epoch"]) for u in updates.get(e, [])]
            todo += updates.get(c["epoch"], [])[:c["updates"]]
            copy = state["fresh"](i)
            for args, kwargs in todo:
                copy.update(*args, **kwargs)
            if _unexplained(copy, recorded[i]) is None:
                found = todo
                break
        if found is None:
            return {"unexplained": {"rank": joint["ranks"][i], "state": offs[i] or _unexplained(copy, recorded[i]),
                                    "updates": c["updates"]}}
        credited.append(found)
    ref = state["fresh"](0)
    counts: dict[str, Any] = {"samples": 0, "counts": None}
    for todo in credited:
        for args, kwargs in todo:
            ref.update(*args, **kwargs)
            _count(counts, ref, args)
    return {"reference": jsonable(ref.compute()), "samples": counts["samples"], "class_counts": counts["counts"],
            "bad_states": _bad_states(ref, recorded), "restored": True}


def _unexplained(metric: Any, snapshot: dict[str, Any] | None) -> str | None:
    """The first state the replayed updates do not reproduce (None: all of them, or nothing to compare)."""
    if snapshot is None:
        return None
    for name, m in metrics_of(metric).items():
        for attr in getattr(m, "_defaults", {}):
            key = f"{name}.{attr}".lstrip(".")
            if key in snapshot and not _same(getattr(m, attr), snapshot[key]):
                return key
    return None


def _same(a: Any, b: Any) -> bool:
    import torch

    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if a.shape != b.shape:
            return False
        if not (a.is_floating_point() or b.is_floating_point() or a.is_complex()):
            return bool(torch.equal(a.cpu(), b.cpu()))
        return bool(torch.allclose(a.cpu().double(), b.cpu().double(), rtol=RTOL, atol=ATOL, equal_nan=True))
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    try:
        return bool(a == b)
    except Exception:   # objects without a truth value for ==: take them as equal, nothing to say
        return True


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


def _reductions(obj: Any) -> dict[str, str | None]:
    return {f"{name}.{attr}".lstrip("."): reduce_name(fn)
            for name, m in metrics_of(obj).items() for attr, fn in getattr(m, "_reductions", {}).items()}


def reduce_name(fn: Any) -> str | None:
    if fn is None:
        return None
    if isinstance(fn, str):
        return fn
    name = getattr(fn, "__name__", repr(fn))
    return name.removeprefix("dim_zero_")


# What a state is, when one standard reduction of the ranks' states gives the single-process state.
_STANDARD = ("sum", "max", "min", "mean")


def _bad_states(ref: Any, recorded: list[dict[str, Any] | None]) -> list[dict[str, Any]]:
    """Tensor states whose dist_reduce_fx over the ranks' local states differs from the single-process state."""
    import torch

    if any(r is None for r in recorded):
        return []
    bad = []
    for name, metric in metrics_of(ref).items():
        for attr, fn in getattr(metric, "_reductions", {}).items():
            key = f"{name}.{attr}".lstrip(".")
            single = getattr(metric, attr)
            per = [r.get(key) for r in recorded if r is not None]   # none is None (above)
            if fn is None or not callable(fn) or not isinstance(single, torch.Tensor) \
                    or not all(isinstance(p, torch.Tensor) and p.shape == single.shape for p in per):
                continue
            stacked = torch.stack([p.to(single.dtype) for p in per if p is not None])   # all tensors (above)
            synced = fn(stacked)
            if not _same(synced, single):
                bad.append({"state": key, "reduce": reduce_name(fn), "synced": jsonable(synced),
                            "single_process": jsonable(single), "right": _right_reduction(stacked, single),
                            "integer": not single.is_floating_point()})
    return bad


def _right_reduction(stacked: Any, single: Any) -> str | None:
    """The standard reduction of the ranks' states that gives the single-process state, if one does."""
    import torch

    for name in _STANDARD:
        try:
            value = getattr(torch, name)(stacked.double(), dim=0)
            value = value[0] if isinstance(value, tuple) else value   # max/min: (values, indices)
        except RuntimeError:
            continue
        if _same(value, single.double()):
            return name
    return None
