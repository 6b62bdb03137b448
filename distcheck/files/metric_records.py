"""What ``rank.metrics`` records about torchmetrics objects, and how records of different
ranks are put together (read by the replay, ``launch.replay``, and the judge,
``diagnose.metrics``). Pure.

Each rank's ``results["metrics"]`` is a list of recorded objects; each object has its
``computes``. A compute that synced carries ``sync``: the process group's global ranks,
its sequence number before and after the call, this rank's rank in that group and
the wall-clock interval of the call. The sync collectives of one ``compute()`` have the
same (group, seq) on every rank and overlap in time, whatever order the ranks created
their metrics in and whatever rank a worker had when its process group was made again
(a pool re-initializing per test): that is how computes are paired (a *joint* compute).

Joint computes of the same objects form a *chain* (one metric across the ranks over
the run); the replay walks a chain in order and checks a spread of its computes.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, NamedTuple

MAX_CHECKED = 20        # per chain: first, last and an even spread between
CLOCK_SKEW_S = 0.5      # ranks on different nodes read different clocks

Member = tuple[int, str]            # (rank whose files hold the record, recorded object's id)


class PackedTensor(NamedTuple):
    """A recorded tensor as its raw bytes: pickling a tensor itself costs a torch.save per tensor
    (about 0.5 ms for a batch of 64 labels), bytes cost nothing."""

    dtype: str
    shape: tuple[int, ...]
    data: bytes


def pack(t: Any) -> PackedTensor:
    """A CPU copy of ``t``'s values as bytes. The caller's tensor is only read: never changed, never made
    contiguous in place, never viewed by the copy. torch only (numpy is no dependency of distcheck)."""
    import ctypes

    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    # A strided tensor (a column slice, a transpose, an expanded one) is copied into a new contiguous
    # tensor; a contiguous one is read where it lies (data_ptr counts its storage offset).
    c = t.resolve_conj().resolve_neg().contiguous()
    nbytes = c.numel() * c.element_size()
    data = ctypes.string_at(c.data_ptr(), nbytes) if nbytes else b""
    return PackedTensor(str(t.dtype).removeprefix("torch."), tuple(t.shape), data)


def unpack(x: Any) -> Any:
    """Recorded arguments or states with every packed tensor made a tensor again."""
    import torch

    if isinstance(x, PackedTensor):
        dtype = getattr(torch, x.dtype)
        if not x.data:
            return torch.empty(x.shape, dtype=dtype)
        return torch.frombuffer(bytearray(x.data), dtype=torch.uint8).view(dtype).reshape(x.shape)
    if type(x) in (list, tuple):
        return type(x)(unpack(v) for v in x)
    if isinstance(x, dict):
        return {k: unpack(v) for k, v in x.items()}
    return x


def _computes(recorded: Mapping[int, Iterable[Mapping[str, Any]]]) -> Iterable[tuple[int, Mapping, int, Mapping]]:
    for rank, entries in sorted(recorded.items()):
        for entry in entries:
            for k, c in enumerate(entry.get("computes", ())):
                yield rank, entry, k, c


def _cluster(items: list[tuple[float, float, int, Any]], size: int, complete: bool = True) -> list[list[Any]]:
    """Items (t0, t1, group rank, payload) of one (group, seq) split into sets that ran together:
    one item per group rank, every interval overlapping the others (only the sets with every
    group rank, or with ``complete=False`` only the others)."""
    clusters: list[tuple[float, set[int], list[Any]]] = []   # (earliest end, group ranks, payloads)
    for t0, t1, grank, payload in sorted(items, key=lambda x: x[0]):
        if clusters:
            end, granks, payloads = clusters[-1]
            if grank not in granks and len(granks) < size and t0 <= end + CLOCK_SKEW_S:
                granks.add(grank)
                payloads.append((grank, payload))
                clusters[-1] = (min(end, t1), granks, payloads)
                continue
        clusters.append((t1, {grank}, [(grank, payload)]))
    return [[p for _, p in sorted(payloads, key=lambda x: x[0])] for _, granks, payloads in clusters
            if (len(granks) == size) == complete]


def _synced_by_point(recorded: Mapping[int, Iterable[Mapping[str, Any]]]) -> dict[tuple, list]:
    by_point: dict[tuple, list] = {}
    for rank, entry, k, c in _computes(recorded):
        s = c.get("sync")
        if not s or s["after"] <= s["seq"]:
            continue
        key = (tuple(s["ranks"]), s["seq"])
        by_point.setdefault(key, []).append((s["t0"], s["t1"], s["group_rank"], (rank, entry["id"], k, s)))
    return by_point


def unpaired_computes(recorded: Mapping[int, Iterable[Mapping[str, Any]]]) -> list[tuple[int, str, int]]:
    """Synced compute() calls whose partners on the other ranks of the group were not recorded."""
    return [(r, key, k) for (ranks, _), items in _synced_by_point(recorded).items()
            for cluster in _cluster(items, len(ranks), complete=False) for r, key, k, _ in cluster]


def joint_computes(recorded: Mapping[int, Iterable[Mapping[str, Any]]]) -> list[dict[str, Any]]:
    """Every synced compute() that all ranks of its group made together, in time order.

    Each: ``members`` [(rank, object id, compute index)] in group-rank order,
    ``ranks`` the global ranks they had then, ``group`` and ``seq``.
    """
    by_point = _synced_by_point(recorded)
    joints = []
    for (ranks, seq), items in by_point.items():
        for cluster in _cluster(items, len(ranks)):
            joints.append({"group": list(ranks), "seq": seq, "t0": min(p[3]["t0"] for p in cluster),
                           "members": [[r, key, k] for r, key, k, _ in cluster],
                           "ranks": [s["rank"] for *_, s in cluster]})
    joints.sort(key=lambda j: j["t0"])
    return joints


def unsynced_computes(recorded: Mapping[int, Iterable[Mapping[str, Any]]]) -> list[list[tuple[int, Mapping, int]]]:
    """compute() calls of ``sync_on_compute=False`` metrics made at the same point by every rank of the
    group (same class, line and group sequence number, overlapping or near in time)."""
    by_point: dict[tuple, list] = {}
    for rank, entry, k, c in _computes(recorded):
        s = c.get("sync")
        if entry.get("sync_on_compute") is not False or not s or s["after"] > s["seq"]:
            continue
        key = (entry["qualname"], c.get("callsite"), tuple(s["ranks"]), s["seq"])
        by_point.setdefault(key, []).append((s["t0"], s["t1"] + 1.0, s["group_rank"], (rank, entry, k)))
    return [cluster for (_, _, ranks, _), items in by_point.items() for cluster in _cluster(items, len(ranks))]


def chains(joints: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Joint computes grouped by the objects that made them, each with the ones to check marked."""
    out: dict[tuple, dict[str, Any]] = {}
    for j in joints:
        key = tuple((r, key) for r, key, _ in j["members"])
        chain = out.setdefault(key, {"members": [list(m) for m in key], "joints": []})
        chain["joints"].append({"computes": [k for *_, k in j["members"]], "ranks": j["ranks"],
                                "group": j["group"], "seq": j["seq"]})
    for chain in out.values():
        checked = spread(len(chain["joints"]))
        for i, j in enumerate(chain["joints"]):
            j["check"] = i in checked
    return list(out.values())


def spread(n: int, most: int = MAX_CHECKED) -> set[int]:
    """Indices to check out of ``n``: all of them, or the first, the last and an even spread between."""
    if n <= most:
        return set(range(n))
    step = (n - 1) / (most - 1)
    return {round(i * step) for i in range(most)}


def chain_key(chain: Mapping[str, Any]) -> str:
    return ",".join(f"{r}:{key}" for r, key in chain["members"])


# -- compute records a long run wrote out as it went (``rank.metrics``), read back with the rank's status ----------


def spill_name(key: str) -> str:
    """The file, in the launch's metrics folder, that one recorded object's earlier compute records go to."""
    return f"{key}-computes.jsonl"


def append_computes(path: Path, records: Iterable[Mapping[str, Any]]) -> None:
    with open(path, "a", encoding="utf-8") as f:
        f.write("".join(json.dumps(r) + "\n" for r in records))


def with_spilled_computes(results: Mapping[str, Any], metrics_dir: Path) -> Mapping[str, Any]:
    """A rank's results with every recorded object's written-out compute records back in front of the kept ones.
    A file that cannot be read or parsed leaves its records out, with a note on that object (no replay of it)."""
    metrics = results.get("metrics")
    if not metrics or not any(isinstance(m, dict) and m.get("computes_file") for m in metrics):
        return results
    return {**results, "metrics": [_unspilled(m, metrics_dir) for m in metrics]}


def _unspilled(entry: Mapping[str, Any], metrics_dir: Path) -> Mapping[str, Any]:
    rel = entry.get("computes_file") if isinstance(entry, dict) else None
    if not rel:
        return entry
    folders = [metrics_dir, *([Path(entry["written_in"])] if entry.get("written_in") else [])]
    for folder in folders:
        try:
            lines = (folder / rel).read_text(encoding="utf-8").splitlines()
        except OSError:
            continue
        try:
            spilled = [json.loads(line) for line in lines]
        except ValueError:
            break
        return {**entry, "computes": spilled + list(entry.get("computes") or ())}
    note = entry.get("note") or f"its earlier compute() records ({rel}) could not be read back"
    return {**entry, "note": note}


def entries_by_rank(results: Mapping[int, Mapping[str, Any]]) -> dict[int, dict[str, Mapping[str, Any]]]:
    return {r: {m["id"]: m for m in res.get("metrics", ())} for r, res in sorted(results.items()) if res.get("metrics")}


REPLAY_IN, REPLAY_OUT = "replay-in.json", "replay-out.json"   # in the launch's metrics folder


def saved_reference(metrics_dir: Path) -> dict[str, Any] | None:
    """The replay's answer kept in a launch dir (``distcheck analyze`` shows the check again)."""
    try:
        saved = json.loads((metrics_dir / REPLAY_OUT).read_text())
    except (OSError, ValueError):
        return None
    return saved if isinstance(saved, dict) else None


def with_saved_reference(results: Mapping[int, Mapping[str, Any]], metrics_dir: Path) -> dict[int, Mapping[str, Any]]:
    """``results`` with the saved replay's answer under the lowest recording rank, as the run had it."""
    out = dict(results)
    recording = [r for r, res in results.items() if res.get("metrics")]
    saved = saved_reference(metrics_dir) if recording else None
    if saved is not None and not any("metric_reference" in res for res in results.values()):
        out[min(recording)] = {**results[min(recording)], "metric_reference": saved}
    return out
