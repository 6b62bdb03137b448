"""Process groups as the tracer sees them: name, members, and the group's collective counter."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from operator import attrgetter
from typing import Any


def c10d_default_group() -> Callable[[], Any]:
    """Returns the current default group, or None before init_process_group. Called on every traced call
    without ``group=``: it reads the attribute behind ``_World.default_pg`` in C (no Python frame), where
    the installed torch has it."""
    import torch.distributed.distributed_c10d as c10d

    world = c10d._world
    if "_default_pg" in vars(world):
        return partial(attrgetter("_default_pg"), world)
    return lambda: world.default_pg


def counter_of(pg: Any) -> Callable[[], int] | None:
    """The group's collective counter: it counts C++-issued calls too, so Python and C++ calls share
    one numbering that matches the Flight Recorder's. None for a backend without one."""
    counter = getattr(pg, "_get_sequence_number_for_group", None)
    if counter is None:   # a backend that does not count
        return None
    try:
        counter()
    except Exception:   # a stand-in group, or a backend that does not count
        return None
    return counter


def default_group_facts() -> dict[str, Any]:
    """What the rank's status says of its default group once it exists: the backend and its timeout (the
    backend's own end of a hang: NCCL's watchdog aborts past it)."""
    import torch
    import torch.distributed as dist

    pg = dist.group.WORLD
    facts: dict[str, Any] = {"backend": str(dist.get_backend(pg))}
    for device in ("cuda", "cpu"):
        try:
            facts["pg_timeout_s"] = pg._get_backend(torch.device(device)).options._timeout.total_seconds()
            break
        except Exception:   # no backend for that device (or a backend without options): the next one
            continue
    return facts


def members_of(pg: Any) -> tuple[int, ...]:
    try:
        import torch.distributed.distributed_c10d as c10d
        return tuple(c10d.get_process_group_ranks(pg))
    except Exception:
        return ()


def process_groups() -> list[tuple[str, Any]]:
    """(name, process group) of every group this rank belongs to (none before init)."""
    try:
        import torch.distributed.distributed_c10d as c10d
        world = c10d._world
    except Exception:
        return []
    if world.default_pg is None:
        return []
    return [(name, pg) for pg, name in list(world.pg_names.items()) if pg is not None]


def group_counters() -> list[tuple[str, Callable[[], int]]]:
    """(name, counter) of every process group of this rank that counts its collectives."""
    out = []
    for name, pg in process_groups():
        counter = counter_of(pg)
        if counter is not None:
            out.append((name, counter))
    return out


def c10d_group(pg: Any) -> tuple[str | None, tuple[int, ...]]:
    import torch.distributed.distributed_c10d as c10d

    key = c10d._world.pg_names.get(pg) or getattr(pg, "group_name", None)
    return key, tuple(c10d.get_process_group_ranks(pg))
