"""One record write, two paths: the tracer's hot path in C and its Python wrapper write the same trace, byte for byte
but for the times. Random call streams — ops with and without a fast path, two groups, positional and keyword
arguments, async handles, calls that raise, collectives nested inside traced ones, several call sites — go through a
tracer on each path, and the two files are compared slot by slot with every time field masked."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from distcheck.files.trace import CHECK, SLOT, SLOT_STRUCT, TAG_D, TAG_E, TAG_W, TAG_X, TAG_Y, used_bytes
from distcheck.rank.tracer import Tracer

pytestmark = pytest.mark.skipif(__import__("importlib").util.find_spec("distcheck.rank._hot_path_c") is None,
                                reason="the C hot path is not built here")

TIMED = (TAG_E, TAG_X, TAG_W, TAG_D)   # their third word is a time


class Group:
    """A stand-in process group: a counter the stand-in collectives advance, as a backend's does."""

    def __init__(self, name: str) -> None:
        self.name, self.seq = name, 0

    def _get_sequence_number_for_group(self) -> int:
        return self.seq


class Handle:
    def wait(self) -> bool:
        return True


def _stand_ins(world: Group, tracer_of: dict) -> dict[str, Any]:
    """Collectives with torch's signatures that advance their group's counter, raise on request, and (``nested``)
    call another traced collective inside themselves."""
    def run(group: Group | None, async_op: bool, tensor: Any = None) -> Any:
        group = group or world
        group.seq += 1
        if isinstance(tensor, torch.Tensor) and tensor.numel() == 7:
            raise ValueError("the user's own error")
        return Handle() if async_op else None

    def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        return run(group, async_op, tensor)

    def broadcast(tensor, src, group=None, async_op=False, group_src=None):
        return run(group, async_op, tensor)

    def barrier(group=None, async_op=False, device_ids=None):
        if tracer_of.get("nested"):
            tracer_of["wrapped"]["all_reduce"](torch.ones(1), group=group)   # a collective inside a traced one
        return run(group, async_op)

    def all_gather(tensor_list, tensor, group=None, async_op=False):
        return run(group, async_op, tensor)

    return {"all_reduce": all_reduce, "broadcast": broadcast, "barrier": barrier, "all_gather": all_gather}


def _trace(path: Path, stream: list[tuple], monkeypatch: pytest.MonkeyPatch, hot_path: str) -> bytes:
    if hot_path == "python":
        monkeypatch.setenv("DISTCHECK_HOT_PATH", "python")
    else:
        monkeypatch.delenv("DISTCHECK_HOT_PATH", raising=False)
    world, other = Group("w"), Group("g1")
    state: dict = {}
    tracer = Tracer(path, 0, group_resolver=lambda pg: (pg.name, (0, 1)), default_group=lambda: world)
    assert (tracer.c_path is not None) == (hot_path == "c")
    stand_ins = _stand_ins(world, state)
    wrapped = {name: tracer.wrap(name, fn, signature_of=getattr(dist, name)) for name, fn in stand_ins.items()}
    state["wrapped"] = wrapped
    sites = [_site_a, _site_b, _site_c]
    for op, site, group, keyword, async_op, numel, nested in stream:
        state["nested"] = nested
        pg = other if group else None
        try:
            sites[site](wrapped[op], op, pg, keyword, async_op, numel)
        except ValueError:
            pass   # the user's own error, raised through the wrapper as it was
    tracer.close()
    return path.read_bytes()


# Three call sites: a call's site is part of what the fast path knows it by.
def _site_a(fn, op, pg, keyword, async_op, numel):
    return _call(fn, op, pg, keyword, async_op, numel)


def _site_b(fn, op, pg, keyword, async_op, numel):
    return _call(fn, op, pg, keyword, async_op, numel)


def _site_c(fn, op, pg, keyword, async_op, numel):
    for _ in range(2):   # one site, twice in a row: the C path's remembered last call
        result = _call(fn, op, pg, keyword, async_op, numel)
    return result


def _call(fn, op, pg, keyword, async_op, numel):
    t = torch.ones(numel)
    if op == "all_reduce":
        return fn(t, group=pg, async_op=async_op) if keyword else fn(t, dist.ReduceOp.SUM, pg, async_op)
    if op == "broadcast":
        return fn(t, src=0, group=pg, async_op=async_op) if keyword else fn(t, 0, pg, async_op)
    if op == "barrier":
        return fn(group=pg, async_op=async_op) if keyword else fn(pg, async_op)
    return fn([torch.ones(numel), torch.ones(numel)], t, group=pg, async_op=async_op)


def _masked(data: bytes) -> list[tuple[int, int, int]]:
    """The file's slots with every time field zeroed (the check word follows from the other three)."""
    out = []
    for i in range(0, used_bytes(data), SLOT):
        w0, w1, w2, w3 = SLOT_STRUCT.unpack_from(data, i)
        assert w0 ^ w1 ^ w2 ^ CHECK == w3, f"a torn slot at {i}"
        tag = w0 & 0xFF
        if tag == TAG_Y:
            continue   # the sync record: the sidecar's, not the calls'
        out.append((w0, w1, 0 if tag in TIMED else w2))
    return out


def _stream(rng: random.Random, n: int) -> list[tuple]:
    ops = ["all_reduce", "all_reduce", "broadcast", "barrier", "all_gather"]
    return [(rng.choice(ops), rng.randrange(3), rng.random() < 0.3, rng.random() < 0.5, rng.random() < 0.2,
             rng.choice([1, 2, 4, 7]) if rng.random() < 0.1 else rng.choice([1, 2, 4]), rng.random() < 0.05)
            for _ in range(n)]


@pytest.mark.parametrize("seed", range(8))
def test_both_hot_paths_write_the_same_trace(tmp_path, monkeypatch, seed):
    stream = _stream(random.Random(seed), 300)
    c = _trace(tmp_path / "c.trace", stream, monkeypatch, "c")
    python = _trace(tmp_path / "python.trace", stream, monkeypatch, "python")
    c_slots, python_slots = _masked(c), _masked(python)
    assert len(c_slots) > 300
    first = next((i for i, (a, b) in enumerate(zip(c_slots, python_slots)) if a != b), None)
    assert first is None and len(c_slots) == len(python_slots), (
        f"the paths differ at slot {first}: C {c_slots[first] if first is not None else None}, "
        f"Python {python_slots[first] if first is not None else None}")
