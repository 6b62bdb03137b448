"""What a node says of its ranks' progress to node 0, as the store carries it: ``RankProgress`` packed
(a rank's calls left as runs of one signature, a group's members as runs of ranks) and unpacked, and how
often a node refreshes what is only measured (``refresh_s``)."""

from __future__ import annotations

import functools
from dataclasses import fields, replace
from typing import Any

from distcheck.launch.progress import RankProgress
from distcheck.models import rank_runs, ranks_from_json

REFRESH_S = 1.0
REFRESH_NODES = 64   # up to this many nodes, every REFRESH_S; past it, as much less often as there are more


def refresh_s(nnodes: int) -> float:
    """How often a node sends what is only measured: every REFRESH_S up to REFRESH_NODES nodes, then less often
    (8 s at 512 nodes), so that node 0 reads about as many refreshes per poll as at 64 nodes, not 51 of them."""
    return REFRESH_S * max(1.0, nnodes / REFRESH_NODES)


def judged_part(progress: RankProgress) -> RankProgress:
    """``progress`` less what changes at every poll without changing a verdict: memory, CPU, and the words
    and age of a late rank's progress (whether it shows progress at all stays)."""
    return replace(progress, rss_bytes=None, peak_rss_bytes=None, cpu=None, evidence_age=0.0,
                   evidence=None if progress.evidence is None else "")


def packed(progress: RankProgress) -> dict[str, Any]:
    """A rank's progress as JSON, each call's members as runs ([[0, 4095]]): a waiting rank's members are the
    whole group, and at 4,096 ranks their plain lists made a node's progress 190 KB (97 MB per change at 512
    nodes, 2 s to parse on node 0); as runs it is a few hundred bytes.

    Field by field, not ``dataclasses.asdict``: that deep-copies each member of each call, 29 ms per waiting
    rank at 4,096 ranks, and at 512 nodes sharing two cores it made a node's poll take tens of seconds."""
    data = {f.name: getattr(progress, f.name) for f in fields(progress)}
    data["entered"] = dict(progress.entered)
    data["waits"] = [[group, seq, _runs(members), signature] for group, seq, members, signature in progress.waits]
    data["left"] = _left_runs(progress.left)
    return data


def _left_runs(left: tuple) -> list[list[Any]]:
    """The calls a rank left, ``(group, seq, signature)`` each, as ``[group, first seq, last seq, signature]``
    runs of one signature: a rank keeps its last 32, most of them one step's same call, and at 512 nodes
    they were most of what a node publishes (15 KB for 8 waiting ranks, 3.7 MB for node 0 to read when half
    the job entered the hang at once)."""
    out: list[list[Any]] = []
    for group, seq, signature in left:
        last = out[-1] if out else None
        if last is not None and last[0] == group and last[2] + 1 == seq and last[3] == signature:
            last[2] = seq
        else:
            out.append([group, seq, seq, signature])
    return out


def _left_of(runs: list[list[Any]]) -> tuple:
    return tuple((group, seq, signature) for group, first, last, signature in runs for seq in range(first, last + 1))


@functools.lru_cache(maxsize=64)
def _runs(members: tuple[int, ...]) -> list[list[int]] | Any:
    """One call's members as runs, computed once per call (every rank of a node waiting in it shares them)."""
    return rank_runs(members)


def unpacked(data: dict[str, Any]) -> RankProgress:
    waits = tuple((group, seq, _members(tuple(map(tuple, runs))), signature)
                  for group, seq, runs, signature in data.get("waits", ()))
    left = _left_of(data.get("left", ()))
    return RankProgress(**{**data, "waits": waits, "left": left})


@functools.lru_cache(maxsize=1024)
def _members(runs: tuple[tuple[int, int], ...]) -> tuple[int, ...]:
    """A call's members from their runs, one tuple shared by every rank in the call: at 4,096 ranks waiting
    in one barrier, a tuple each was 16 M entries (about 0.6 GB and seconds of node 0's poll)."""
    return ranks_from_json(runs)
