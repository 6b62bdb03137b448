"""torchmetrics results against their single-process reference (``launch.replay``). Pure.

Per recorded metric (``results[rank]["metrics"]``) and per ``compute()``:
ranks that got different values from the same call are a finding of their own
(``sync_on_compute=False``, rank-dependent state); otherwise a synced value
that differs from the replay over the same updates is a ``numeric`` error that
names the state whose ``dist_reduce_fx`` is wrong when one is; otherwise one
info line says the metric agrees, over how many samples, with their class counts.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

from distcheck.models import Finding
from distcheck.text import rank_list

RTOL, ATOL = 1e-4, 1e-6


def find_metric_results(results: Mapping[int, Mapping[str, Any]]) -> list[Finding]:
    recorded = {r: {m["id"]: m for m in res.get("metrics", ())} for r, res in sorted(results.items())}
    reference = next((res["metric_reference"] for res in results.values() if "metric_reference" in res), None)
    findings = []
    for key in sorted({k for ms in recorded.values() for k in ms}, key=lambda k: int(k[1:])):
        per_rank = {r: ms[key] for r, ms in recorded.items() if key in ms}
        if not any(m["computes"] for m in per_rank.values()):
            continue
        f = _judge(key, per_rank, reference)
        if f is not None:
            findings.append(f)
    return findings


def _judge(key: str, per_rank: Mapping[int, Mapping[str, Any]], reference: Mapping[str, Any] | None) -> Finding | None:
    first = per_rank[min(per_rank)]
    for k in range(min(len(m["computes"]) for m in per_rank.values())):
        values = {r: m["computes"][k]["value"] for r, m in per_rank.items()}
        if not _all_close(values.values()):
            return _cross_rank(first, k, values)
    if reference is None:
        return None
    if "error" in reference:
        return _note(first, reference["error"])
    replayed = reference.get("metrics", {}).get(key, {})
    if "skipped" in replayed or "error" in replayed:
        return _note(first, replayed.get("skipped") or f"the replay failed: {replayed['error']}")
    for k, ref in enumerate(replayed.get("computes", ())):
        if "error" in ref:
            return _note(first, ref["error"])
        actual = first["computes"][k]["value"]
        if not _close(actual, ref["reference"]):
            return _wrong(first, k, actual, ref, len(per_rank))
    checked = replayed.get("computes") or []
    return _agrees(first, checked[-1], len(per_rank), len(checked)) if checked else None


def _where(m: Mapping[str, Any], k: int) -> str:
    site = m["computes"][k].get("callsite")   # "model.py:41": the file's name and the compute() line
    return f"{m['class']} at {':'.join(site.rsplit('/', 1)[-1].split(':')[:2]) if site else 'an unknown line'}"


def _cross_rank(m: Mapping[str, Any], k: int, values: Mapping[int, Any]) -> Finding:
    groups: dict[str, list[int]] = {}
    for r, v in values.items():
        groups.setdefault(_show(v), []).append(r)
    shown = "; ".join(f"{rank_list(rs)}: {v}" for v, rs in list(groups.items())[:4])
    why = ("sync_on_compute=False: each rank computed over its own updates only"
           if m.get("sync_on_compute") is False else "its state depends on the rank, or it was not synced")
    return Finding(
        kind="numeric", severity="error", odd_ranks=tuple(sorted(values)), callsite=m["computes"][k].get("callsite"),
        summary=(f"{_where(m, k)}: compute() #{k} gave different values on different ranks ({shown}), because "
                 f"{why}. Fix: keep sync_on_compute=True (the default), or log it from one rank only."),
        data={"metric": m["class"], "callsite": m["computes"][k].get("callsite"), "compute": k, "cross_rank": True,
              "values": {str(r): v for r, v in values.items()}, "sync_on_compute": m.get("sync_on_compute")})


def _wrong(m: Mapping[str, Any], k: int, actual: Any, ref: Mapping[str, Any], ranks: int) -> Finding:
    bad = ref.get("bad_states") or []
    states = "; ".join(f"state {b['state']!r} uses dist_reduce_fx={b['reduce']!r}: synced it is {_show(b['synced'])}, "
                       f"over all updates in one process {_show(b['single_process'])}" for b in bad)
    why = f" The wrong reduction: {states}." if bad else ""
    return Finding(
        kind="numeric", severity="error", odd_ranks=(), callsite=m["computes"][k].get("callsite"),
        summary=(f"{_where(m, k)}: the synced compute() gave {_show(actual)}, a single process over the same "
                 f"{ref['samples']:,} samples from the {ranks} ranks gives {_show(ref['reference'])}.{why}"),
        data={"metric": m["class"], "callsite": m["computes"][k].get("callsite"), "compute": k, "actual": actual,
              "reference": ref["reference"], "samples": ref["samples"], "bad_states": bad,
              "state": bad[0]["state"] if bad else None, "dist_reduce_fx": bad[0]["reduce"] if bad else None})


def _agrees(m: Mapping[str, Any], ref: Mapping[str, Any], ranks: int, checked: int) -> Finding:
    k = checked - 1
    counts = ref.get("class_counts")
    by_class = f"; class counts of those samples: {counts}" if counts else ""
    return Finding(
        kind="numeric", severity="info", callsite=m["computes"][k].get("callsite"),
        summary=(f"{_where(m, k)} matches a single-process computation over the {ref['samples']:,} samples the "
                 f"{ranks} ranks saw{by_class}" + (f" ({checked} compute() calls checked)" if checked > 1 else "")),
        data={"metric": m["class"], "callsite": m["computes"][k].get("callsite"), "agrees": True,
              "samples": ref["samples"], "ranks": ranks, "class_counts": counts, "computes_checked": checked,
              "value": ref["reference"]})


def _note(m: Mapping[str, Any], why: str) -> Finding:
    return Finding(kind="numeric", severity="info", summary=f"{m['class']}: not checked against a single process: {why}.",
                   data={"metric": m["class"], "skipped": why})


def _flat(v: Any) -> list[Any]:
    if isinstance(v, dict):
        return [x for key in sorted(v) for x in _flat(v[key])]
    if isinstance(v, list):
        return [x for item in v for x in _flat(item)]
    return [v]


def _close(a: Any, b: Any) -> bool:
    fa, fb = _flat(a), _flat(b)
    if len(fa) != len(fb):
        return False
    for x, y in zip(fa, fb):
        if isinstance(x, (int, float)) and isinstance(y, (int, float)):
            if not (x == y or (math.isnan(x) and math.isnan(y)) or math.isclose(x, y, rel_tol=RTOL, abs_tol=ATOL)):
                return False
        elif x != y:
            return False
    return True


def _all_close(values: Any) -> bool:
    values = list(values)
    return all(_close(values[0], v) for v in values[1:])


def _show(v: Any) -> str:
    flat = _flat(v)
    if len(flat) == 1 and isinstance(flat[0], float):
        return f"{flat[0]:.6g}"
    text = str(v)
    return text if len(text) <= 120 else text[:117] + "..."
