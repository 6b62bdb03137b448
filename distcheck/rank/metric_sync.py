"""Which torchmetrics objects a compute() is judged for, the user's line it was called at, and the sync point
(process group and its sequence number) by which ``files.metric_records`` pairs it with the other ranks' computes;
which of a metric's methods a recorded call was."""

from __future__ import annotations

import enum
import functools
import sys
from types import FrameType
from typing import Any


class MetricCall(str, enum.Enum):
    """Which of a metric's methods a recorded call was (``forward`` records as an update)."""

    UPDATE = "update"
    COMPUTE = "compute"
    RESET = "reset"


def _is_collection(obj: Any) -> bool:
    return type(obj).__name__ == "MetricCollection" or any(c.__name__ == "MetricCollection"
                                                           for c in type(obj).__mro__)


@functools.cache
def _judged_class(cls: type) -> bool:
    """Whether compute() of this class syncs through ``Metric._wrap_compute`` (a composite's or a
    wrapper's does not: their inner metrics sync, and are recorded themselves)."""
    if any(c.__name__ == "MetricCollection" for c in cls.__mro__):
        return True
    return getattr(getattr(cls, "_wrap_compute", None), "__distcheck__", False)


def _judged(obj: Any) -> bool:
    """A collection is judged as a whole only when each member is: a collection of wrappers (a
    ``Running`` window) has no single-process equivalent as a whole, its members' metrics have."""
    cls: type = type(obj)
    if not _judged_class(cls):
        return False
    return not _is_collection(obj) or all(_judged(m) for m in obj._modules.values())


def metrics_of(obj: Any) -> dict[str, Any]:
    """name -> Metric: the object itself, or a collection's members as it holds them (no state copies)."""
    if _is_collection(obj):
        return dict(obj._modules.items())
    return {"": obj}


def _sync_on_compute(obj: Any) -> bool | None:
    if _is_collection(obj):
        flags = {getattr(m, "sync_on_compute", None) for m in obj._modules.values()}
        return flags.pop() if len(flags) == 1 else None
    return getattr(obj, "sync_on_compute", None)


def _sync_point(obj: Any) -> tuple[Any, list[int], int, int, int] | None:
    """(group, its global ranks, its sequence number, this rank's rank in it, global rank), or None
    without a process group."""
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is None or not dist.is_available() or not dist.is_initialized():
            return None
        pg = next((getattr(m, "process_group", None) for m in metrics_of(obj).values()
                   if getattr(m, "process_group", None) is not None), None) or dist.group.WORLD
        ranks = dist.get_process_group_ranks(pg)
        return pg, list(ranks), pg._get_sequence_number_for_group(), dist.get_rank(pg), dist.get_rank()
    except Exception:   # a group this torch cannot count: the compute is not paired
        return None


def _seq(pg: Any, default: int) -> int:
    try:
        return pg._get_sequence_number_for_group()
    except Exception:   # the group was destroyed inside compute()
        return default


def user_callsite() -> str | None:
    """file:line:function of the innermost frame of the user's own code."""
    from distcheck.files.stacks import USER, classify_file, torch_dir

    tdir = torch_dir()
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        if classify_file(frame.f_code.co_filename, tdir) == USER:
            return f"{frame.f_code.co_filename}:{frame.f_lineno}:{frame.f_code.co_name}"
        frame = frame.f_back
    return None
