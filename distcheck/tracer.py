"""The per-rank collective tracer.

Wraps every public collective and p2p call of ``torch.distributed`` (the
``torch.distributed`` attribute and ``distributed_c10d``), and records for each
call an *enter* record before the backend sees it and an *exit* record after.
torchmetrics and Lightning call collectives through the module attribute, so
installing the tracer before user code runs sees their calls too.

Hot path rules: no locks, no store round trips, one ``os.write`` per record.
"""

from __future__ import annotations

import functools
import inspect
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from distcheck.callsite import CallsiteResolver
from distcheck.tracefile import NONE, TraceWriter, clean, encode_shapes


@dataclass(frozen=True)
class OpSpec:
    tensors: tuple[str, ...] = ()        # parameters holding one tensor
    tensor_lists: tuple[str, ...] = ()   # parameters holding a list of tensors
    reduce_op: str | None = None         # parameter holding the ReduceOp
    root: str | None = None              # src/dst parameter (global rank)
    group_root: str | None = None        # group_src/group_dst parameter (group rank)
    p2p: str | None = None               # "send" or "recv": the root is the peer
    shape_unless: str | None = None      # skip shapes when this parameter is set (uneven splits)


OPS: dict[str, OpSpec] = {
    "all_reduce": OpSpec(tensors=("tensor",), reduce_op="op"),
    "all_reduce_coalesced": OpSpec(tensor_lists=("tensors",), reduce_op="op"),
    "all_gather": OpSpec(tensors=("tensor",)),
    "all_gather_into_tensor": OpSpec(tensors=("input_tensor",)),
    "all_gather_object": OpSpec(),
    "all_gather_coalesced": OpSpec(tensor_lists=("input_tensor_list",)),
    "reduce_scatter": OpSpec(tensor_lists=("input_list",), reduce_op="op"),
    "reduce_scatter_tensor": OpSpec(tensors=("input",), reduce_op="op"),
    "reduce": OpSpec(tensors=("tensor",), reduce_op="op", root="dst", group_root="group_dst"),
    "broadcast": OpSpec(tensors=("tensor",), root="src", group_root="group_src"),
    "broadcast_object_list": OpSpec(root="src", group_root="group_src"),
    "gather": OpSpec(tensors=("tensor",), root="dst", group_root="group_dst"),
    "gather_object": OpSpec(root="dst", group_root="group_dst"),
    "scatter": OpSpec(tensors=("tensor",), root="src", group_root="group_src"),
    "scatter_object_list": OpSpec(root="src", group_root="group_src"),
    "all_to_all": OpSpec(tensor_lists=("input_tensor_list",)),
    "all_to_all_single": OpSpec(tensors=("input",), shape_unless="input_split_sizes"),
    "barrier": OpSpec(),
    "monitored_barrier": OpSpec(),
    "new_group": OpSpec(),
    "send": OpSpec(tensors=("tensor",), root="dst", group_root="group_dst", p2p="send"),
    "isend": OpSpec(tensors=("tensor",), root="dst", group_root="group_dst", p2p="send"),
    "recv": OpSpec(tensors=("tensor",), root="src", group_root="group_src", p2p="recv"),
    "irecv": OpSpec(tensors=("tensor",), root="src", group_root="group_src", p2p="recv"),
    "send_object_list": OpSpec(root="dst", group_root="group_dst", p2p="send"),
    "recv_object_list": OpSpec(root="src", group_root="group_src", p2p="recv"),
}
ASYNC_BY_NATURE = {"isend", "irecv"}


def _reduce_op_name(op: Any) -> str:
    name = getattr(op, "name", None)
    if name:
        return name
    text = str(op)
    return text.rsplit(".", 1)[-1] if "." in text else text


def _shape(t: Any) -> tuple[int, ...]:
    return tuple(t.shape)


class Tracer:
    """Records collectives of one rank into its trace file."""

    def __init__(self, path: Path, rank: int) -> None:
        self.rank = rank
        self.writer = TraceWriter(path)
        self.resolver = CallsiteResolver()
        self._seq: dict[str, int] = {}
        self._groups: dict[int, tuple[str, Any]] = {}   # id(pg) -> (key, pg) ; pg kept alive
        self._sites: dict[tuple, str] = {}
        self._local = threading.local()
        self._originals: dict[str, Callable] = {}
        self._world_key: str | None = None
        self.count = 0

    # -- installation -------------------------------------------------------

    def install(self) -> None:
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        for name, spec in OPS.items():
            original = getattr(c10d, name, None)
            if original is None:
                continue
            self._originals[name] = original
            wrapper = self._wrap(name, spec, original)
            setattr(c10d, name, wrapper)
            if getattr(dist, name, None) is original:
                setattr(dist, name, wrapper)
        original = getattr(c10d, "batch_isend_irecv", None)
        if original is not None:
            self._originals["batch_isend_irecv"] = original
            wrapper = self._wrap_batch(original)
            c10d.batch_isend_irecv = wrapper
            dist.batch_isend_irecv = wrapper

    def uninstall(self) -> None:
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        for name, original in self._originals.items():
            setattr(c10d, name, original)
            setattr(dist, name, original)
        self._originals.clear()

    def close(self) -> None:
        self.writer.close()

    # -- wrapping -----------------------------------------------------------

    def _wrap(self, name: str, spec: OpSpec, original: Callable) -> Callable:
        params = tuple(inspect.signature(original).parameters)
        local = self._local

        @functools.wraps(original)
        def traced(*args: Any, **kwargs: Any) -> Any:
            if getattr(local, "active", False):
                return original(*args, **kwargs)   # a collective inside a traced one
            local.active = True
            try:
                try:
                    key = self._enter(name, spec, params, args, kwargs)
                except Exception:                  # never break the user's call
                    key = None
                try:
                    result = original(*args, **kwargs)
                except BaseException as exc:
                    if key is not None:
                        self._exit(key, exc)
                    raise
                if key is not None:
                    self._exit(key, None)
                return result
            finally:
                local.active = False

        traced.__distcheck_original__ = original  # type: ignore[attr-defined]
        return traced

    def _wrap_batch(self, original: Callable) -> Callable:
        local = self._local

        @functools.wraps(original)
        def traced(p2p_op_list: list, *args: Any, **kwargs: Any) -> Any:
            if getattr(local, "active", False):
                return original(p2p_op_list, *args, **kwargs)
            local.active = True
            try:
                keys = []
                for p2p in p2p_op_list:
                    try:
                        keys.append(self._enter_p2p_op(p2p))
                    except Exception:
                        pass
                result = original(p2p_op_list, *args, **kwargs)
                for key in keys:
                    self._exit(key, None)
                return result
            finally:
                local.active = False

        return traced

    # -- records ------------------------------------------------------------

    def _group(self, pg: Any) -> str:
        import torch.distributed.distributed_c10d as c10d

        if pg is None:
            if self._world_key is not None:
                return self._world_key
            pg = c10d._get_default_group()
        entry = self._groups.get(id(pg))
        if entry is not None and entry[1] is pg:
            return entry[0]
        key = c10d._world.pg_names.get(pg) or getattr(pg, "group_name", None) or str(len(self._groups))
        ranks = c10d.get_process_group_ranks(pg)
        self._groups[id(pg)] = (key, pg)
        self.writer.write(f"G\t{clean(key)}\t{','.join(map(str, ranks))}\n")
        if pg is c10d.GroupMember.WORLD:
            self._world_key = clean(key)
        return clean(key)

    def _site(self) -> str:
        # frames: _site <- _enter <- traced <- caller
        site = self.resolver.resolve(sys._getframe(3))
        site_id = self._sites.get(site)
        if site_id is None:
            site_id = self._sites[site] = str(len(self._sites))
            self.writer.write(f"S\t{site_id}\t{clean(site[0])}\t{clean(site[1])}\t{clean(site[2])}\n")
        return site_id

    def _next_seq(self, key: str) -> int:
        seq = self._seq.get(key, 0) + 1
        self._seq[key] = seq
        return seq

    def _enter(self, name: str, spec: OpSpec, params: tuple, args: tuple, kwargs: dict) -> tuple[str, int]:
        bound = dict(zip(params, args))
        if kwargs:
            bound.update(kwargs)
        tensors = [bound[p] for p in spec.tensors if bound.get(p) is not None]
        for p in spec.tensor_lists:
            tensors.extend(bound.get(p) or ())
        pg = None if name == "new_group" else bound.get("group")
        root = bound.get(spec.root) if spec.root else None
        if root is None and spec.group_root and bound.get(spec.group_root) is not None:
            import torch.distributed as dist
            root = dist.get_global_rank(pg if pg is not None else dist.group.WORLD, bound[spec.group_root])
        if spec.p2p:
            src, dst = (self.rank, root) if spec.p2p == "send" else (root, self.rank)
            group = f"p2p:{'any' if src is None else src}>{dst}"
            if group not in self._seq:
                members = ",".join(str(r) for r in (src, dst) if r is not None)
                self.writer.write(f"G\t{group}\t{members}\n")
        else:
            group = self._group(pg)
        reduce_op = _reduce_op_name(bound[spec.reduce_op]) if spec.reduce_op and spec.reduce_op in bound else (
            "SUM" if spec.reduce_op else NONE)
        if spec.shape_unless and bound.get(spec.shape_unless) is not None:
            shapes = NONE
        else:
            shapes = encode_shapes(tuple(_shape(t) for t in tensors))
        dtypes = ";".join(str(t.dtype).removeprefix("torch.") for t in tensors) or NONE
        device = tensors[0].device.type if tensors else NONE
        is_async = name in ASYNC_BY_NATURE or bool(bound.get("async_op"))
        seq = self._next_seq(group)
        self.writer.write(
            f"E\t{group}\t{seq}\t{name}\t{reduce_op}\t{shapes}\t{dtypes}\t{device}\t"
            f"{NONE if root is None else root}\t{int(is_async)}\t{time.time():.6f}\t{self._site()}\n"
        )
        self.count += 1
        return group, seq

    def _enter_p2p_op(self, p2p: Any) -> tuple[str, int]:
        op_name = getattr(p2p.op, "__name__", str(p2p.op))
        spec = OPS.get(op_name, OPS["isend"])
        kwargs = {"tensor": p2p.tensor, "group": p2p.group}
        kwargs[spec.root] = p2p.peer
        return self._enter(op_name, spec, (), (), kwargs)

    def _exit(self, key: tuple[str, int], exc: BaseException | None) -> None:
        error = NONE if exc is None else clean(f"{type(exc).__name__}: {exc}"[:300])
        self.writer.write(f"X\t{key[0]}\t{key[1]}\t{time.time():.6f}\t{error}\n")


def install(path: Path, rank: int) -> Tracer:
    tracer = Tracer(path, rank)
    tracer.install()
    return tracer
