"""torchmetrics results against their single-process reference (``launch.replay``). Pure.

Computes are paired across ranks by the collectives they synced with
(``files.metric_records``), never by the order each rank created its metrics.
Per chain (one metric across the ranks):

* ranks that got different values from one synced compute are an ``error`` (their
  states were crossed with another metric's, or the value depends on the rank);
* a synced value that differs from the replay over the same updates is an ``error``
  naming the metric, the state whose ``dist_reduce_fx`` is wrong, both values, the
  user's ``compute()`` line and the reduction that would be right;
* a check that could not run is a ``warning`` that says why; one that agrees is
  one ``info`` line, over how many samples, with their class counts.

``sync_on_compute=False`` metrics whose ranks got different values are a
``warning``: each rank computed over its own updates, as asked.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from distcheck.files.metric_records import (chain_key, chains, entries_by_rank, joint_computes, unpaired_computes,
                                            unsynced_computes)
from distcheck.models import Finding, Kind, Severity
from distcheck.text import rank_list

RTOL, ATOL = 1e-4, 1e-6


def find_metric_results(results: Mapping[int, Mapping[str, Any]], finished: frozenset[int] | None = None,
                        reference: Mapping[str, Any] | None = None) -> list[Finding]:
    """``finished``: the ranks that ended normally (None: all). A compute() whose partner rank did not finish
    (crashed, killed, stuck) leaves no pair to check, and the finding about that rank already says why.
    ``reference``: the single-process replay's answer (``RunFacts.metric_reference``; None: no replay ran)."""
    recorded = entries_by_rank(results)
    if not recorded:
        return []
    findings = []
    for chain in chains(joint_computes({r: list(ms.values()) for r, ms in recorded.items()})):
        members = [recorded[r][key] for r, key in chain["members"]]
        f = _judge(chain, members, reference)
        if f is not None:
            findings.append(f)
    return findings + _unsynced(recorded) + _unpaired(recorded, finished)


def _judge(chain: Mapping[str, Any], members: list[Mapping[str, Any]], reference: Mapping[str, Any] | None
           ) -> Finding | None:
    for joint in chain["joints"]:
        values = {r: m["computes"][k]["value"] for r, m, k in zip(joint["ranks"], members, joint["computes"])}
        if len({m["qualname"] for m in members}) > 1:
            return _crossed(members, joint)
        if not _all_close(values.values()):
            return _cross_rank(members[0], joint["computes"][0], values)
    if reference is None:
        return None
    first, ranks = members[0], len(members)
    replayed = reference.get("chains", {}).get(chain_key(chain))
    if replayed is None:
        return _unchecked(first, reference.get("error") or "the replay gave no answer for it")
    if "skipped" in replayed or "error" in replayed:
        return _unchecked(first, replayed.get("skipped") or f"the replay failed: {replayed['error']}")
    checks = replayed.get("checks") or []
    for check in checks:
        k = chain["joints"][check["joint"]]["computes"][0]
        if "error" in check:
            return _unchecked(first, check["error"], k)
        if "unexplained" in check:
            return _unexplained(first, k, check["unexplained"])
    wrong = [c for c in checks if not _close(first["computes"][chain["joints"][c["joint"]]["computes"][0]]["value"],
                                             c["reference"])]
    if wrong:
        k = chain["joints"][wrong[0]["joint"]]["computes"][0]
        return _wrong(first, k, wrong[0], ranks, len(wrong), len(checks), len(chain["joints"]))
    if not checks:
        return None
    k = chain["joints"][checks[-1]["joint"]]["computes"][0]
    return _agrees(first, k, checks[-1], ranks, len(checks), len(chain["joints"]))


def _where(m: Mapping[str, Any], k: int) -> str:
    return f"{m['class']} at {_line(m['computes'][k].get('callsite'))}"


def _line(site: str | None) -> str:
    """"model.py:41": the file's name and the compute() line."""
    return ":".join(site.rsplit("/", 1)[-1].split(":")[:2]) if site else "an unknown line"


def _crossed(members: list[Mapping[str, Any]], joint: Mapping[str, Any]) -> Finding:
    by_class: dict[str, list[int]] = {}
    for r, m in zip(joint["ranks"], members):
        by_class.setdefault(m["class"], []).append(r)
    shown = " with ".join(f"{cls}.compute() on {rank_list(rs)}" for cls, rs in by_class.items())
    k = joint["computes"][0]
    return Finding(
        kind=Kind.NUMERIC, severity=Severity.ERROR, odd_ranks=tuple(sorted(joint["ranks"])),
        callsite=members[0]["computes"][k].get("callsite"),
        summary=(f"{shown} synced together (group {joint['group']}, call #{joint['seq']}): the two metrics "
                 f"exchanged their states, so neither value is right. Fix: compute the metrics in the same order on "
                 f"every rank."),
        data={"metric": members[0]["class"], "crossed": {c: rs for c, rs in by_class.items()},
              "callsite": members[0]["computes"][k].get("callsite"), "compute": k})


def _cross_rank(m: Mapping[str, Any], k: int, values: Mapping[int, Any]) -> Finding:
    shown = _by_value(values)
    return Finding(
        kind=Kind.NUMERIC, severity=Severity.ERROR, odd_ranks=tuple(sorted(values)),
        callsite=m["computes"][k].get("callsite"),
        summary=(f"{_where(m, k)}: one synced compute() gave different values on different ranks ({shown}): the "
                 f"value depends on the rank (compute() reads something local that the sync does not cover). Fix: "
                 f"compute from the metric's synced states only."),
        data={"metric": m["class"], "callsite": m["computes"][k].get("callsite"), "compute": k, "cross_rank": True,
              "values": {str(r): v for r, v in values.items()}, "sync_on_compute": m.get("sync_on_compute")})


def _by_value(values: Mapping[int, Any]) -> str:
    groups: dict[str, list[int]] = {}
    for r, v in values.items():
        groups.setdefault(_show(v), []).append(r)
    return "; ".join(f"{rank_list(rs)}: {v}" for v, rs in list(groups.items())[:4])


def _unsynced(recorded: Mapping[int, Mapping[str, Mapping[str, Any]]]) -> list[Finding]:
    """sync_on_compute=False: one warning per metric and line whose ranks got different values."""
    found: dict[tuple, Finding] = {}
    for cluster in unsynced_computes({r: list(ms.values()) for r, ms in recorded.items()}):
        _, m, k = cluster[0]
        key = (m["qualname"], m["computes"][k].get("callsite"))
        values = {m_["computes"][k_]["sync"]["rank"]: m_["computes"][k_]["value"] for _, m_, k_ in cluster}
        if key in found or _all_close(values.values()):
            continue
        found[key] = Finding(
            kind=Kind.NUMERIC, severity=Severity.WARNING, odd_ranks=tuple(sorted(values)),
            callsite=m["computes"][k].get("callsite"),
            summary=(f"{_where(m, k)}: compute() gave different values on different ranks ({_by_value(values)}) "
                     f"because the metric has sync_on_compute=False: each rank computed over its own updates only. "
                     f"If a value over all ranks was meant, keep sync_on_compute=True (the default)."),
            data={"metric": m["class"], "callsite": m["computes"][k].get("callsite"), "compute": k,
                  "cross_rank": True, "values": {str(r): v for r, v in values.items()}, "sync_on_compute": False})
    return list(found.values())


def _unpaired(recorded: Mapping[int, Mapping[str, Mapping[str, Any]]], finished: frozenset[int] | None
              ) -> list[Finding]:
    """Synced computes some of whose finished ranks left no record: one warning per metric and line."""
    found: dict[tuple, Finding] = {}
    for r, key, k in unpaired_computes({r: list(ms.values()) for r, ms in recorded.items()}):
        m = recorded[r][key]
        c = m["computes"][k]
        where = (m["qualname"], c.get("callsite"))
        if where in found:
            continue
        missing = sorted(set(c["sync"]["ranks"]) - {c["sync"]["rank"]})
        if finished is not None and not set(missing) <= finished:
            continue
        found[where] = Finding(
            kind=Kind.NUMERIC, severity=Severity.WARNING, callsite=c.get("callsite"),
            summary=(f"{_where(m, k)}: could not be checked against a single process: its compute() synced with "
                     f"{rank_list(missing)}, whose record of that compute() is missing."),
            data={"metric": m["class"], "callsite": c.get("callsite"), "compute": k, "skipped": "unpaired",
                  "rank": c["sync"]["rank"]})
    return list(found.values())


def _fix(b: Mapping[str, Any]) -> str:
    right = b.get("right")
    if right is None:
        return (f"no standard reduction of the ranks' {b['state']!r} gives the single-process value: keep states "
                f"that add up over ranks (a total and a count rather than a mean) and reduce them with \"sum\"")
    what = {"sum": "a count" if b.get("integer") else "a total", "max": "a maximum", "min": "a minimum",
            "mean": "an average over ranks"}[right]
    return (f"`{b['state']}` is {what}: reduce it with \"{right}\" "
            f"(add_state(\"{b['state'].rsplit('.', 1)[-1]}\", ..., dist_reduce_fx=\"{right}\"))")


def _wrong(m: Mapping[str, Any], k: int, ref: Mapping[str, Any], ranks: int, n_wrong: int, checked: int,
           total: int) -> Finding:
    bad = ref.get("bad_states") or []
    states = "; ".join(f"state {b['state']!r} uses dist_reduce_fx={b['reduce']!r}: synced it is {_show(b['synced'])}, "
                       f"over all updates in one process {_show(b['single_process'])}" for b in bad)
    why = f" The wrong reduction: {states}. Fix: {_fix(bad[0])}." if bad else ""
    calls = f" ({n_wrong} of the {checked} compute() calls checked, of {total}, are wrong)" if checked > 1 else ""
    site = m["computes"][k].get("callsite")
    return Finding(
        kind=Kind.NUMERIC, severity=Severity.ERROR, odd_ranks=(), callsite=site,
        summary=(f"{_where(m, k)}: the synced compute() gave {_show(m['computes'][k]['value'])}, a single process over "
                 f"the same {ref['samples']:,} samples from the {ranks} ranks gives {_show(ref['reference'])}"
                 f"{calls}.{why}"),
        data={"metric": m["class"], "callsite": site, "compute": k, "actual": m["computes"][k]["value"],
              "reference": ref["reference"], "samples": ref["samples"], "bad_states": bad,
              "state": bad[0]["state"] if bad else None, "dist_reduce_fx": bad[0]["reduce"] if bad else None,
              "fix": _fix(bad[0]) if bad else None, "computes_wrong": n_wrong, "computes_checked": checked,
              "computes": total})


def _agrees(m: Mapping[str, Any], k: int, ref: Mapping[str, Any], ranks: int, checked: int, total: int) -> Finding:
    counts = ref.get("class_counts")
    by_class = f"; class counts of those samples: {counts}" if counts else ""
    calls = f" ({checked} of {total} compute() calls checked)" if checked > 1 or total > 1 else ""
    return Finding(
        kind=Kind.NUMERIC, severity=Severity.INFO, callsite=m["computes"][k].get("callsite"),
        summary=(f"{_where(m, k)} matches a single-process computation over the {ref['samples']:,} samples the "
                 f"{ranks} ranks saw{by_class}{calls}"),
        data={"metric": m["class"], "callsite": m["computes"][k].get("callsite"), "agrees": True,
              "samples": ref["samples"], "ranks": ranks, "class_counts": counts, "computes_checked": checked,
              "computes": total, "value": ref["reference"]})


def _unchecked(m: Mapping[str, Any], why: str, k: int | None = None) -> Finding:
    where = _where(m, k) if k is not None else m["class"]
    return Finding(kind=Kind.NUMERIC, severity=Severity.WARNING,
                   callsite=m["computes"][k].get("callsite") if k is not None else None,
                   summary=f"{where}: could not be checked against a single process: {why}.",
                   data={"metric": m["class"], "skipped": why})


def _unexplained(m: Mapping[str, Any], k: int, off: Mapping[str, Any]) -> Finding:
    why = (f"on rank {off['rank']}, replaying its {off['updates']} update() calls since the last reset() does not "
           f"give the state {off['state']!r} it had at compute(): something other than update() set it (a wrapper "
           f"such as Running restores states), so there is no single-process reference to compare with")
    return _unchecked(m, why, k)


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
    if len(flat) == 1:
        return str(flat[0])
    text = str(v)
    return text if len(text) <= 120 else text[:117] + "..."
