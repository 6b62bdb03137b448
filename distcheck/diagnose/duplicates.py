"""Duplicated or missed samples: the DataLoader passes every rank recorded,
per dataset, with the likely cause in plain words. Pure.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from typing import Any, Iterable, Mapping, Sequence

from distcheck.models import Finding
from distcheck.text import id_list, plural


def find_duplicates(results: Mapping[int, Mapping[str, Any]], world_size: int) -> list[Finding]:
    """Samples counted more than once or never, per dataset, with the likely cause in plain words."""
    per_dataset: dict[str, dict[int, list[int]]] = defaultdict(lambda: defaultdict(list))
    sizes: dict[str, int] = {}
    for rank, res in sorted(results.items()):
        for rec in res.get("samples", ()):
            per_dataset[rec["dataset"]][rank].extend(rec["ids"])
            sizes[rec["dataset"]] = rec["dataset_size"]
    findings = []
    for dataset, by_rank in per_dataset.items():
        f = _sample_finding(dataset, sizes[dataset], by_rank, world_size)
        if f is not None:
            findings.append(f)
    return findings


def sample_accounting(size: int, by_rank: Mapping[int, Sequence[int]]) -> dict[str, Any]:
    counts = Counter(i for ids in by_rank.values() for i in ids)
    seen_by: dict[int, list[int]] = defaultdict(list)
    for r, ids in sorted(by_rank.items()):
        for i in ids:
            seen_by[i].append(r)
    duplicated = {i: seen_by[i] for i, c in sorted(counts.items()) if c > 1}
    missing = sorted(set(range(size)) - set(counts))
    return {"counts": counts, "duplicated": duplicated, "missing": missing, "total": sum(counts.values())}


def _times(n: int) -> str:
    return {2: "twice", 3: "three times"}.get(n, f"{n} times")


def _sample_cause(size: int, by_rank: Mapping[int, Sequence[int]], world_size: int,
                  acc: Mapping[str, Any]) -> tuple[str, str]:
    """(why samples were duplicated or missed, what to do about it), in plain words."""
    ranks = sorted(by_rank)
    duplicated, missing, total = acc["duplicated"], acc["missing"], acc["total"]
    if world_size > 1 and len(ranks) == world_size and len({tuple(sorted(by_rank[r])) for r in ranks}) == 1:
        seen = sorted(by_rank[ranks[0]])
        return (f"every rank evaluated the same {plural(len(seen), 'sample')} (ids {id_list(seen)}): the data is "
                f"not sharded across the {world_size} ranks",
                "shard it with a DistributedSampler (Lightning: keep use_distributed_sampler=True)")
    padded_to = math.ceil(size / world_size) * world_size
    if duplicated and not missing and total == padded_to and padded_to > size:
        return (f"DistributedSampler padded {size} samples to {padded_to} for {world_size} ranks by repeating "
                f"{plural(padded_to - size, 'sample')}",
                "shard evaluation data without padding (an unrepeated sampler), or use drop_last=True where "
                "losing samples is acceptable")
    if missing and not duplicated and total == (size // world_size) * world_size:
        return (f"DistributedSampler(drop_last=True) dropped {plural(len(missing), 'sample')} so that "
                f"{world_size} ranks get equal shards", "evaluate with an unrepeated sampler instead")
    if duplicated:
        return "the ranks' shards overlap", "give every rank a disjoint shard"
    return "the ranks' shards do not cover the dataset", "make the shards cover every sample"


def _sample_finding(dataset: str, size: int, by_rank: Mapping[int, Sequence[int]], world_size: int) -> Finding | None:
    acc = sample_accounting(size, by_rank)
    duplicated, missing = acc["duplicated"], acc["missing"]
    if not duplicated and not missing:
        return None
    cause, fix = _sample_cause(size, by_rank, world_size, acc)
    counted = _how_counted(duplicated, missing)
    shown = ", ".join(f"id {i} (ranks {', '.join(map(str, rs))})" for i, rs in list(duplicated.items())[:10])
    same_everywhere = cause.startswith("every rank evaluated")
    # Who saw which duplicate — unless it is "everyone saw everything", which the cause already says.
    detail = f" — {shown}" + (", ..." if len(duplicated) > 10 else "") if duplicated and not same_everywhere else ""
    summary = f"Dataset {dataset!r} ({plural(size, 'sample')}): {counted}{detail}; because {cause}. Fix: {fix}."
    extra = acc["total"] - (size - len(missing))
    return Finding(
        kind="duplicates", severity="error", summary=summary,
        odd_ranks=tuple(sorted({r for rs in duplicated.values() for r in rs})),
        data={"dataset": dataset, "dataset_size": size, "duplicated": {str(i): rs for i, rs in duplicated.items()},
              "missing": missing, "extra": extra, "cause": cause, "counted": counted,
              "same_on_every_rank": same_everywhere,
              "per_rank": {str(r): sorted(ids) for r, ids in sorted(by_rank.items())}},
    )


def _ids(ids: Iterable[int]) -> str:
    ids = list(ids)
    return f"id {ids[0]}" if len(ids) == 1 else f"ids {id_list(ids)}"


def _how_counted(duplicated: Mapping[int, list[int]], missing: Sequence[int]) -> str:
    """'samples 0, 1 were counted twice and 24 samples (ids 8-31) were never seen'."""
    parts = []
    if duplicated:
        most = max(len(rs) for rs in duplicated.values())
        how = _times(most) if all(len(rs) == most for rs in duplicated.values()) else "more than once"
        n = len(duplicated)
        parts.append(f"{plural(n, 'sample')} ({_ids(duplicated)}) {'was' if n == 1 else 'were'} counted {how}")
    if missing:
        n = len(missing)
        parts.append(f"{plural(n, 'sample')} ({_ids(missing)}) {'was' if n == 1 else 'were'} never seen")
    return " and ".join(parts)
