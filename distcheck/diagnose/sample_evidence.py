"""What the samples' own records say about a duplicates claim before it is made, from a map-style pass's records
(``rank.samples``). Pure.

* the rows behind the indices the ranks share (``index_rows``): ranks that each index a dataset of their own (a
  shard, indexed from 0 on every rank) draw the same indices of different samples, which is no duplicate;
* the shard each rank's ``DistributedSampler`` was told (``sampler_rank``, ``sampler_replicas``) and the line that
  made it (``sampler_site``): a sampler told a rank that is not the process's own is the line to change.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from typing import Any

from distcheck.text import site as short_site


def different_rows_at_the_same_indices(recs: Mapping[int, Mapping[str, Any]]) -> bool:
    """Whether the rows the ranks read at the indices they share differ, every one the records let us compare
    (``index_rows``: the first rows of a pass digested beside their indices): the ranks index datasets of their
    own, so their indices say nothing of duplicates. False where no shared index was digested on two ranks."""
    by_index: dict[str, set[int]] = defaultdict(set)
    seen: dict[str, int] = defaultdict(int)
    for rec in recs.values():
        for index, digest in (rec.get("index_rows") or {}).items():
            by_index[index].add(digest)
            seen[index] += 1
    compared = [index for index, ranks in seen.items() if ranks > 1]
    return bool(compared) and all(len(by_index[index]) == seen[index] for index in compared)   # no two alike


def told_a_wrong_rank(recs: Mapping[int, Mapping[str, Any]], world_size: int) -> tuple[str, str] | None:
    """(cause, fix) where the ranks' DistributedSamplers split the whole world (``num_replicas`` = the world size)
    but were told a ``rank=`` that is not the rank's own (``args.local_rank``, a constant): the line that made
    the sampler is the one to change. None where every sampler was told its own rank, or none says."""
    told = {r: rec["sampler_rank"] for r, rec in recs.items()
            if rec.get("sampler_replicas") == world_size and isinstance(rec.get("sampler_rank"), int)}
    wrong = {r: t for r, t in sorted(told.items()) if t != r}
    if not wrong:
        return None
    shown = ", ".join(f"rank {r} was told rank={t}" for r, t in list(wrong.items())[:4])
    shown += ", ..." if len(wrong) > 4 else ""
    made_at = next((rec["sampler_site"] for rec in recs.values() if rec.get("sampler_site")), None)
    where = f" at {short_site(made_at)}" if made_at else ""
    return (f"the DistributedSampler{where} was told a rank that is not the process's own ({shown}), so ranks "
            f"drew the same shard",
            f"make it with rank=dist.get_rank() (or leave rank= and num_replicas= out){where}")
