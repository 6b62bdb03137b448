"""Duplicated or missed samples: the DataLoader passes every rank recorded,
per dataset, with the likely cause in plain words; and how much of the
dataset a pass cut short covered. Pure.

Repeated or missing samples are an error only where they reach a result compared or
reported across ranks: a pass whose samples no collective consumed, a training pass
(DDP's gradient reduction during it), and padding accelerate's ``gather_for_metrics``
drops again are said as ``info``.

A pass cut short (``complete: false`` on some rank) still counts for overlap
between ranks: two ranks drawing the same sample is a duplicate however far
the pass got. Samples it never drew are not "missed": they are its coverage.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from typing import Any, Iterable, Mapping, Sequence

from distcheck.models import Event, Finding
from distcheck.text import id_list, plural


ACCELERATE_REMOVES = "gather_for_metrics"   # accelerate's gather that drops even_batches' padding again


def find_duplicates(results: Mapping[int, Mapping[str, Any]], world_size: int,
                    traces: Mapping[int, Sequence[Event]] | None = None) -> list[Finding]:
    """Samples counted more than once or never, per dataset, with the likely cause in plain words.

    An error only where they reach a result compared or reported across ranks (``_use_of``); a
    training pass's padding, padding a gather_for_metrics drops again, and a pass no collective
    consumed are an ``info`` line.
    """
    per_dataset, sizes, partial = _passes(results)
    records = _records(results)
    findings = []
    for dataset, by_rank in per_dataset.items():
        use = _use_of(records[dataset], results, traces)
        f = _sample_finding(dataset, sizes[dataset], by_rank, world_size, partial=dataset in partial,
                            use=use, sampler=_sampler_of(records[dataset]))
        if f is not None:
            findings.append(f)
    return findings


def _records(results: Mapping[int, Mapping[str, Any]]) -> dict[str, dict[int, dict]]:
    out: dict[str, dict[int, dict]] = defaultdict(dict)
    for rank, res in sorted(results.items()):
        for rec in res.get("samples", ()):
            out[rec["dataset"]][rank] = rec
    return out


def _sampler_of(recs: Mapping[int, Mapping[str, Any]]) -> str | None:
    names = {r.get("sampler") for r in recs.values()} - {None}
    return names.pop() if len(names) == 1 else None


def _use_of(recs: Mapping[int, Mapping[str, Any]], results: Mapping[int, Mapping[str, Any]],
            traces: Mapping[int, Sequence[Event]] | None) -> str | None:
    """What the pass's samples fed, from the collectives each rank issued from the pass's start until
    its next pass: ``training`` (C++-issued calls during it: DDP's gradient reduction, or Lightning's
    training stage), ``removed`` (accelerate's gather_for_metrics), ``unused`` (no collective: nothing
    crossed ranks), ``compared`` (a collective took them); None: not recorded (a scenario's own record)."""
    if traces is None or any("t_start" not in r for r in recs.values()):
        return None
    if any(r.get("stage") == "training" for r in recs.values()):
        return "training"
    window = [e for rank, rec in recs.items() for e in _window(rank, rec, results, traces)]
    if not window:
        return "unused"
    if any(e.native for e in window):
        return "training"
    if any(ACCELERATE_REMOVES in (e.library_callsite or "") + (e.label or "") + (e.callsite or "") for e in window):
        return "removed"
    return "compared"


def _window(rank: int, rec: Mapping[str, Any], results: Mapping[int, Mapping[str, Any]],
            traces: Mapping[int, Sequence[Event]]) -> list[Event]:
    start = rec["t_start"]
    later = [r["t_start"] for r in results.get(rank, {}).get("samples", ()) if r.get("t_start", 0) > start]
    end = min(later, default=math.inf)
    return [e for e in traces.get(rank, ()) if start <= e.t_enter < end]


def _passes(results: Mapping[int, Mapping[str, Any]]) -> tuple[dict, dict[str, int], dict[str, dict[int, dict]]]:
    """(dataset -> rank -> ids, dataset -> size, dataset -> rank -> record, for passes cut short)."""
    per_dataset: dict[str, dict[int, list[int]]] = defaultdict(lambda: defaultdict(list))
    sizes: dict[str, int] = {}
    records: dict[str, dict[int, dict]] = defaultdict(dict)
    for rank, res in sorted(results.items()):
        for rec in res.get("samples", ()):
            per_dataset[rec["dataset"]][rank].extend(rec["ids"])
            sizes[rec["dataset"]] = rec["dataset_size"]
            records[rec["dataset"]][rank] = rec
    # Records without "complete" (a scenario's own ctx.record_samples) are whole passes.
    partial = {d: recs for d, recs in records.items() if any(r.get("complete") is False for r in recs.values())}
    return per_dataset, sizes, partial


def find_partial_coverage(results: Mapping[int, Mapping[str, Any]]) -> list[Finding]:
    """One info line per kind of pass cut short: how much of its dataset it covered, and which limit cut it."""
    per_dataset, sizes, partial = _passes(results)
    lines: dict[str, list[dict[str, Any]]] = {}
    for dataset, recs in partial.items():
        data = _coverage_data(dataset, sizes[dataset], per_dataset[dataset], recs)
        lines.setdefault(_coverage_text(data), []).append(data)
    findings = []
    for text, passes in lines.items():
        summary = text + (f", in each of {len(passes)} passes" if len(passes) > 1 else "")
        summary += f" ({', '.join(p['dataset'] for p in passes[:3])}{', ...' if len(passes) > 3 else ''})."
        findings.append(Finding(kind="coverage", severity="info", summary=summary,
                                data={**passes[0], "passes": [p["dataset"] for p in passes]}))
    return findings


_DEFAULTS = {"max_steps": -1, "num_sanity_val_steps": None}   # limit_*_batches: 1.0 (all)


def _limit(limits: Mapping[str, Any]) -> dict[str, Any] | None:
    """The Lightning setting that cut the pass: the first one not at its default."""
    for name, value in limits.items():
        default = _DEFAULTS.get(name, 1.0)
        if value is not None and value != default and not (isinstance(value, float) and value == 1.0):
            return {"setting": name, "value": value}
    return None


def _coverage_data(dataset: str, size: int, by_rank: Mapping[int, Sequence[int]],
                   recs: Mapping[int, Mapping[str, Any]]) -> dict[str, Any]:
    first = recs[min(recs)]
    batches = sorted({r.get("batches") for r in recs.values()}, key=str)
    drawn = sum(len(ids) for ids in by_rank.values())
    return {"dataset": dataset, "stage": first.get("stage"), "covered": len(set().union(*map(set, by_rank.values()))),
            "dataset_size": size, "drawn": drawn, "ranks": len(recs),
            "batches": batches[0] if len(batches) == 1 else None, "batch_size": first.get("batch_size"),
            "limit": _limit(first.get("limits") or {})}


def _coverage_text(d: Mapping[str, Any]) -> str:
    """'validation covered 480 of 10,000 samples (4 ranks × 10 batches × 12; limit_val_batches=10)'."""
    how = f"{d['ranks']} ranks × {d['batches']} batches × {d['batch_size']}" \
        if d["batches"] is not None and d["batch_size"] else f"{d['drawn']:,} drawn by {d['ranks']} ranks"
    if d["batches"] is not None and d["batch_size"] and d["drawn"] != d["covered"]:
        how += f" = {d['drawn']:,} drawn"
    limit = d["limit"]
    why = f"{limit['setting']}={limit['value']}" if limit else "the loop stopped before the loader's end"
    return (f"{d['stage'] or 'a DataLoader pass'} covered {d['covered']:,} of {d['dataset_size']:,} samples "
            f"({how}; {why})")


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
                  acc: Mapping[str, Any], sampler: str | None = None) -> tuple[str, str]:
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
        return (f"{_padder(sampler)} padded {size} samples to {padded_to} for {world_size} ranks by repeating "
                f"{plural(padded_to - size, 'sample')}",
                "shard evaluation data without padding (an unrepeated sampler), or use drop_last=True where "
                "losing samples is acceptable")
    if missing and not duplicated and total == (size // world_size) * world_size:
        return (f"DistributedSampler(drop_last=True) dropped {plural(len(missing), 'sample')} so that "
                f"{world_size} ranks get equal shards", "evaluate with an unrepeated sampler instead")
    if duplicated and sampler and sampler.startswith("accelerate."):
        return (f"{_padder(sampler)} repeated samples so that every rank gets full batches (even_batches=True)",
                "gather evaluation results with accelerator.gather_for_metrics, which drops the repeats")
    if duplicated:
        return "the ranks' shards overlap", "give every rank a disjoint shard"
    return "the ranks' shards do not cover the dataset", "make the shards cover every sample"


def _padder(sampler: str | None) -> str:
    """The sampler's class name for a sentence, with accelerate's named as accelerate's."""
    if not sampler:
        return "DistributedSampler"
    name = sampler.rsplit(".", 1)[-1]
    return f"accelerate's {name}" if sampler.startswith("accelerate.") else name


# Why repeated or missing samples that reach no compared result are only an info line.
_HARMLESS = {
    "training": "this is a training pass: repeated samples only weigh a few gradients twice",
    "removed": "accelerate's gather_for_metrics drops the repeats again before the result",
    "unused": ("no collective consumed this pass, so nothing of it was compared or reported across ranks "
               "(a loop every rank runs over the data on its own is no unsharded evaluation)"),
}


def _sample_finding(dataset: str, size: int, by_rank: Mapping[int, Sequence[int]], world_size: int,
                    partial: bool = False, use: str | None = None, sampler: str | None = None) -> Finding | None:
    acc = sample_accounting(size, by_rank)
    if partial:   # a cut pass never drew the rest: not "never seen", only its coverage (find_partial_coverage)
        acc["missing"] = []
    duplicated, missing = acc["duplicated"], acc["missing"]
    if not duplicated and not missing:
        return None
    cause, fix = _sample_cause(size, by_rank, world_size, acc, sampler)
    counted = _how_counted(duplicated, missing)
    shown = ", ".join(f"id {i} (ranks {', '.join(map(str, rs))})" for i, rs in list(duplicated.items())[:10])
    same_everywhere = cause.startswith("every rank evaluated")
    # Who saw which duplicate — unless it is "everyone saw everything", which the cause already says.
    detail = f" — {shown}" + (", ..." if len(duplicated) > 10 else "") if duplicated and not same_everywhere else ""
    harmless = _HARMLESS.get(use or "")
    if harmless and same_everywhere:   # no evaluation took place: say only what was drawn
        cause = cause.replace("every rank evaluated", "every rank drew", 1)
    summary = f"Dataset {dataset!r} ({plural(size, 'sample')}): {counted}{detail}; because {cause}. " + \
        (f"No harm: {harmless}." if harmless else f"Fix: {fix}.")
    extra = acc["total"] - len(acc["counts"])   # draws beyond the first of each sample
    return Finding(
        kind="duplicates", severity="info" if harmless else "error", summary=summary,
        odd_ranks=tuple(sorted({r for rs in duplicated.values() for r in rs})),
        data={"dataset": dataset, "dataset_size": size, "duplicated": {str(i): rs for i, rs in duplicated.items()},
              "missing": missing, "extra": extra, "cause": cause, "counted": counted,
              "same_on_every_rank": same_everywhere, "partial_pass": partial, "use": use, "sampler": sampler,
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
