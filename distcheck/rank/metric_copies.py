"""What the torchmetrics recorder keeps of a metric, as values: a copy pickled *by value* (the classes of the
user's own code travel with it, so the replay never runs the user's script) and a ``compute()`` result as JSON."""

from __future__ import annotations

import pickle
import sys
from typing import Any

MAX_VALUE_ELEMENTS = 65_536    # larger compute() results are compared by shape only


def elements(value: Any) -> int:
    """How many numbers a compute() result holds, as ``jsonable`` keeps it (a large tensor: its shape only)."""
    numel = getattr(value, "numel", None)
    if callable(numel):
        n = numel()
        return n if n <= MAX_VALUE_ELEMENTS else 1
    if isinstance(value, dict):
        return sum(elements(v) for v in value.values()) + 1
    if isinstance(value, (list, tuple)):
        return sum(elements(v) for v in value) + 1
    return 1


def _user_modules(obj: Any) -> list[Any]:
    """Modules of the user's own code that define the classes ``obj`` is made of."""
    from distcheck.files.stacks import USER, classify_file, torch_dir

    tdir = torch_dir()
    found = {}
    parts = list(obj.modules()) if hasattr(obj, "modules") else [obj]
    for part in parts:
        for cls in type(part).__mro__:
            mod = sys.modules.get(cls.__module__)
            file = getattr(mod, "__file__", None)
            if mod is not None and mod.__name__ not in found and file and classify_file(file, tdir) == USER:
                found[mod.__name__] = mod
    return list(found.values())


def pickler(f: Any) -> pickle.Pickler:
    """A pickler that takes the user's classes by value (cloudpickle), and drops process groups."""
    try:
        import cloudpickle
    except ImportError:
        base: type = pickle.Pickler
    else:
        base = cloudpickle.CloudPickler
    group = _process_group_type()

    tensor = getattr(sys.modules.get("torch"), "Tensor", None)

    class Pickler(base):
        def reducer_override(self, obj: Any) -> Any:
            if group is not None and isinstance(obj, group):
                return type(None), ()   # a process group means nothing in the replay
            if tensor is not None and isinstance(obj, tensor) and obj.device.type not in ("cpu", "meta"):
                # The replay runs on the CPU, with the CPU copies of the inputs.
                return obj.detach().cpu().__reduce_ex__(pickle.HIGHEST_PROTOCOL)
            parent = getattr(super(), "reducer_override", None)
            return parent(obj) if parent is not None else NotImplemented

    return Pickler(f, protocol=pickle.HIGHEST_PROTOCOL)


def _process_group_type() -> type | None:
    c10d = sys.modules.get("torch._C._distributed_c10d")
    return getattr(c10d, "ProcessGroup", None)


def dumps_by_value(obj: Any) -> bytes:
    """``obj`` pickled with the classes of the user's own code by value, so that loading it runs
    none of that code: a script's top level (no main guard, ``init_process_group`` there), a class
    defined inside a function, a module loaded from a path all load in a bare process."""
    import io

    try:
        import cloudpickle
    except ImportError:
        cloudpickle = None
    modules = _user_modules(obj)
    if cloudpickle is None:
        if modules:
            raise RuntimeError(f"its class comes from {modules[0].__name__} (the user's code), and pickling it by "
                               f"value needs cloudpickle: pip install cloudpickle")
        return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    registered = []
    for mod in modules:
        name = mod.__name__
        if sys.modules.get(name) is mod and name not in ("__main__",):
            try:
                cloudpickle.register_pickle_by_value(mod)
                registered.append(mod)
            except (ValueError, TypeError):
                pass   # already registered, or not importable by name: cloudpickle takes it by value anyway
    try:
        buf = io.BytesIO()
        pickler(buf).dump(obj)
        return buf.getvalue()
    finally:
        for mod in registered:
            cloudpickle.unregister_pickle_by_value(mod)


def jsonable(value: Any) -> Any:
    """A compute() result as JSON: tensors as nested lists (large ones by shape only)."""
    import torch

    if isinstance(value, torch.Tensor):
        if value.numel() > MAX_VALUE_ELEMENTS:
            return {"shape": list(value.shape), "too_large": True}
        return value.detach().cpu().double().tolist() if value.is_floating_point() else value.detach().cpu().tolist()
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, (int, float, bool)) or value is None:
        return value
    return repr(value)[:200]


def compute_record(c: tuple) -> dict[str, Any]:
    """A kept compute() as ``files.metric_records`` reads it."""
    epoch, updates, callsite, value, sync = c
    if sync is not None:
        ranks, seq, after, group_rank, rank, t0, t1 = sync
        sync = {"ranks": list(ranks), "seq": seq, "after": after, "group_rank": group_rank, "rank": rank,
                "t0": t0, "t1": t1}
    return {"epoch": epoch, "updates": updates, "callsite": callsite, "value": value, "sync": sync}
