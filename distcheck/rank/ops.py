"""What the tracer records of each collective, and how it reads the arguments.

``OPS`` names the parameters that matter for each public collective and p2p call
of ``torch.distributed``; ``make_extractor`` turns that into a small function per
op, generated once from the op's own signature, that reads them by position or
keyword (no ``inspect.signature(...).bind`` on the hot path).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple


@dataclass(frozen=True)
class OpSpec:
    tensors: tuple[str, ...] = ()        # parameters holding one tensor
    tensor_lists: tuple[str, ...] = ()   # parameters holding a list of tensors
    reduce_op: str | None = None         # parameter holding the ReduceOp
    root: str | None = None              # src/dst parameter (global rank)
    group_root: str | None = None        # group_src/group_dst parameter (group rank)
    p2p: str | None = None               # "send" or "recv": the root is the peer
    shape_unless: str | None = None      # skip shapes when this parameter is set (uneven splits)
    object_list: str | None = None       # parameter holding a list of objects: its length is compared
    # all_to_all(_single): (output, input[, output_split_sizes, input_split_sizes]); new_group: (ranks,).
    # Read on the slow path only: rank i's sends to j must equal what j expects from i.
    extra: tuple[str, ...] = ()


OPS: dict[str, OpSpec] = {
    "all_reduce": OpSpec(tensors=("tensor",), reduce_op="op"),
    "all_reduce_coalesced": OpSpec(tensor_lists=("tensors",), reduce_op="op"),
    "all_gather": OpSpec(tensors=("tensor",)),
    "all_gather_into_tensor": OpSpec(tensors=("input_tensor",)),
    "all_gather_object": OpSpec(object_list="object_list"),
    "all_gather_coalesced": OpSpec(tensor_lists=("input_tensor_list",)),
    "reduce_scatter": OpSpec(tensor_lists=("input_list",), reduce_op="op"),
    "reduce_scatter_tensor": OpSpec(tensors=("input",), reduce_op="op"),
    "reduce": OpSpec(tensors=("tensor",), reduce_op="op", root="dst", group_root="group_dst"),
    "broadcast": OpSpec(tensors=("tensor",), root="src", group_root="group_src"),
    "broadcast_object_list": OpSpec(root="src", group_root="group_src", object_list="object_list"),
    "gather": OpSpec(tensors=("tensor",), root="dst", group_root="group_dst"),
    "gather_object": OpSpec(root="dst", group_root="group_dst"),
    "scatter": OpSpec(tensors=("tensor",), root="src", group_root="group_src"),
    "scatter_object_list": OpSpec(root="src", group_root="group_src", object_list="scatter_object_output_list"),
    "all_to_all": OpSpec(tensor_lists=("input_tensor_list",), extra=("output_tensor_list", "input_tensor_list")),
    "all_to_all_single": OpSpec(tensors=("input",), shape_unless="input_split_sizes",
                                extra=("output", "input", "output_split_sizes", "input_split_sizes")),
    "barrier": OpSpec(),
    "monitored_barrier": OpSpec(),
    "new_group": OpSpec(extra=("ranks", "use_local_synchronization")),
    "send": OpSpec(tensors=("tensor",), root="dst", group_root="group_dst", p2p="send"),
    "isend": OpSpec(tensors=("tensor",), root="dst", group_root="group_dst", p2p="send"),
    "recv": OpSpec(tensors=("tensor",), root="src", group_root="group_src", p2p="recv"),
    "irecv": OpSpec(tensors=("tensor",), root="src", group_root="group_src", p2p="recv"),
    "send_object_list": OpSpec(root="dst", group_root="group_dst", p2p="send"),
    "recv_object_list": OpSpec(root="src", group_root="group_src", p2p="recv"),
}
ASYNC_BY_NATURE = {"isend", "irecv"}
# Calls whose returned handle's ``wait()`` is traced (W records: the rank blocks there, not in the call), as is
# every handle ``batch_isend_irecv`` returns: a pipelining schedule's P2P waits (distcheck.knowledge.library_shapes).
WAITED_HANDLES = {"isend", "irecv"}
# Calls numbered by the group's own collective counter advance it by one, except these:
MULTI_SEQ = {"all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list",
             "monitored_barrier"}          # several collectives inside (sizes, then data)
UNCOUNTED = {"new_group"}                  # no collective at all: numbered in a sequence of their own
NEW_GROUP_KEY = "new_group"                # the job-wide sequence of plain new_group calls
LOCAL_GROUP_PREFIX = "new_group@"          # new_group(ranks, use_local_synchronization=True): one per rank set
NOT_A_MEMBER = LOCAL_GROUP_PREFIX + "-"    # such a call made by a rank it does not name (a no-op in torch)
MAX_NAMED_RANKS = 16


def new_group_sequence(extra: tuple | None, rank: int, world: tuple[int, ...]) -> tuple[str, tuple[int, ...]]:
    """(sequence, its ranks) a new_group call is numbered in.

    A plain ``new_group`` must be entered by every rank of the job, in the same order (torch names
    the group by a job-wide counter): one sequence over the world, compared across every rank. With
    ``use_local_synchronization=True`` only the ranks it names take part, and torch names the group by
    those ranks: its calls are numbered among those ranks alone, so disjoint sets (``[0, 1]`` on ranks 0
    and 1, ``[2, 3]`` on ranks 2 and 3) are never compared with each other. A rank that is not among
    them gets ``None`` back without any exchange: a sequence of its own, compared with no one.
    """
    if not extra or len(extra) < 2 or not extra[1]:
        return NEW_GROUP_KEY, world
    try:
        ranks = tuple(sorted(int(r) for r in extra[0])) if extra[0] is not None else world
    except Exception:   # an argument the call itself will reject: number it with the plain ones
        return NEW_GROUP_KEY, world
    if rank not in ranks:
        return NOT_A_MEMBER, (rank,)
    return local_group_key(ranks), ranks


def local_group_key(ranks: tuple[int, ...]) -> str:
    """A readable name for a rank set: every rank up to 16 of them, else the ends and a digest."""
    if len(ranks) <= MAX_NAMED_RANKS:
        return LOCAL_GROUP_PREFIX + ",".join(map(str, ranks))
    import hashlib
    digest = hashlib.sha1(",".join(map(str, ranks)).encode()).hexdigest()[:8]
    return f"{LOCAL_GROUP_PREFIX}{ranks[0]}..{ranks[-1]}#{digest}"


def reduce_op_name(op: Any) -> str:
    name = getattr(op, "name", None)
    if name:
        return name
    inner = getattr(op, "op", None)   # a ReduceOp object (ReduceOp(MAX), premul_sum): its RedOpType
    if inner is not None and getattr(inner, "name", None):
        return inner.name
    text = str(op)
    return text.rsplit(".", 1)[-1] if "." in text else text


# -- argument extraction ------------------------------------------------------


class CallArgs(NamedTuple):
    """What a traced call was given, as the tracer's slow path reads it (``make_extractor``); None (or empty) where
    the op's signature has no such parameter."""

    group: Any = None                  # the process group (None: the default group)
    tensors: tuple = ()                # each tensor parameter's tensor (``OpSpec.tensors``)
    tensor_lists: tuple = ()           # each tensor-list parameter's list (``OpSpec.tensor_lists``)
    reduce_op: Any = None
    root: Any = None                   # src/dst (global rank), or the peer of a P2P call
    group_root: Any = None             # group_src/group_dst (group rank)
    async_op: Any = None
    shape_unless: Any = None           # ``OpSpec.shape_unless``'s parameter
    object_list: Any = None
    extra: tuple | None = None         # ``OpSpec.extra``'s parameters, read on the slow path only


def make_extractor(name: str, spec: OpSpec, params: list[inspect.Parameter]) -> Callable[[tuple, dict], CallArgs]:
    """A function ``(args, kwargs) -> CallArgs`` specialised to one op's signature.

    Generated once per op (like ``collections.namedtuple``), so a call reads
    each argument by position or keyword without binding the whole signature.
    """
    read, namespace = arg_reader(params)
    fields = {
        "group": "None" if name == "new_group" else read("group"),
        "tensors": "(" + "".join(f"{read(p)}, " for p in spec.tensors) + ")",
        "tensor_lists": "(" + "".join(f"{read(p)}, " for p in spec.tensor_lists) + ")",
        "reduce_op": read(spec.reduce_op), "root": read(spec.root), "group_root": read(spec.group_root),
        "async_op": read("async_op"), "shape_unless": read(spec.shape_unless), "object_list": read(spec.object_list),
        "extra": "(" + "".join(f"{read(p)}, " for p in spec.extra) + ")" if spec.extra else "None",
    }
    # tuple.__new__ called straight from C: no Python frame of the named tuple's own per call
    namespace.update(_new=tuple.__new__, CallArgs=CallArgs)
    lines = [f"def extract_{name}(args, kwargs):", "    n = len(args)",
             f"    return _new(CallArgs, ({', '.join(fields[f] for f in CallArgs._fields)}))"]
    exec("\n".join(lines), namespace)  # noqa: S102 - generated from the op's own signature
    return namespace[f"extract_{name}"]


class Place(NamedTuple):
    """Where a call's argument is read from: ``args[index]`` where there are more than ``index`` (-1: the
    parameter is keyword-only), else ``kwargs.get(name, default)``."""

    index: int   # type: ignore[assignment]  # the field's name, though tuple.index is a method: read as a field
    name: str
    default: Any   # None where the parameter has none


def arg_places(params: list[inspect.Parameter]) -> dict[str, Place]:
    """Where each parameter of a signature is read from."""
    return {p.name: Place(i if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) else -1, p.name,
                          None if p.default is p.empty else p.default) for i, p in enumerate(params)}


def arg_reader(params: list[inspect.Parameter]) -> tuple[Callable[[str | None], str], dict[str, Any]]:
    """(``read``, its namespace) for generated code: ``read(param)`` is an expression that reads ``param`` as
    ``arg_places`` says (``n = len(args)``; its default a name bound in the namespace); "None" for a parameter the
    signature does not have."""
    places = arg_places(params)
    namespace: dict[str, Any] = {}

    def read(param: str | None) -> str:
        if param is None or param not in places:
            return "None"
        place = places[param]
        var = f"d_{len(namespace)}"
        namespace[var] = place.default
        if place.index >= 0:
            return f"(args[{place.index}] if n > {place.index} else kwargs.get({param!r}, {var}))"
        return f"kwargs.get({param!r}, {var})"

    return read, namespace


def extra_fields(name: str, extra: tuple | None, pg: Any) -> tuple[tuple | None, tuple[int, ...] | None]:
    """(splits, members) of an all_to_all(_single) or new_group call; (None, None) for any other."""
    if not extra:
        return None, None
    try:
        if name == "new_group":
            ranks = extra[0]   # extra[1]: use_local_synchronization, read by new_group_sequence
            return None, tuple(sorted(int(r) for r in ranks)) if ranks is not None else tuple(range(pg.size()))
        if name == "all_to_all":
            out, inp = extra
            return (tuple(t.numel() for t in inp), tuple(t.numel() for t in out)), None
        out, inp, out_splits, in_splits = extra
        n = pg.size()
        return (_elements(inp, in_splits, n), _elements(out, out_splits, n)), None
    except Exception:   # an argument the call itself will reject: record nothing extra
        return None, None


def _elements(t: Any, split_sizes: Any, n: int) -> tuple[int, ...]:
    """Elements per group rank of an all_to_all_single buffer: rows of dim 0 times the row's size."""
    row = 1
    for d in tuple(t.shape)[1:]:
        row *= int(d)
    rows = [int(s) for s in split_sizes] if split_sizes is not None and len(split_sizes) else [t.shape[0] // n] * n
    return tuple(r * row for r in rows)
