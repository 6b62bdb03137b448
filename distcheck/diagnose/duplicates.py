"""Duplicated or missed samples: the DataLoader passes every rank recorded,
per dataset, with the likely cause in plain words; and how much of the
dataset a pass cut short covered. Where no sampler tells (an IterableDataset),
the rows the ranks read from their DataLoaders (``find_read_duplicates``) and the rows
they fed a synced torchmetrics metric (``find_fed_duplicates``). Pure.

Repeated or missing samples are an error only where they reach a result compared or
reported across ranks: a pass whose samples no collective consumed, a training pass
(DDP's gradient reduction during it), and padding accelerate's ``gather_for_metrics``
drops again are said as ``info``.

A pass cut short (``complete: false`` on some rank) still counts for overlap
between ranks: two ranks drawing the same sample is a duplicate however far
the pass got. Samples it never drew are not "missed": they are its coverage.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from distcheck.models import Event, Finding, Kind, Severity
from distcheck.diagnose.sample_evidence import different_rows_at_the_same_indices, told_a_wrong_rank
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
        if different_rows_at_the_same_indices(records[dataset]):
            continue   # each rank's own dataset: a coinciding index is not the same sample
        use = _use_of(records[dataset], results, traces)
        f = _sample_finding(dataset, sizes[dataset], by_rank, world_size, partial=dataset in partial,
                            use=use, sampler=_sampler_of(records[dataset]),
                            told_wrong_rank=told_a_wrong_rank(records[dataset], world_size))
        if f is not None:
            findings.append(f)
    fed = find_fed_duplicates(results, world_size)
    return findings + fed + [f for f in find_read_duplicates(results, world_size, traces) if not _told(f, fed)]


def _records(results: Mapping[int, Mapping[str, Any]]) -> dict[str, dict[int, Mapping[str, Any]]]:
    out: dict[str, dict[int, Mapping[str, Any]]] = defaultdict(dict)
    for rank, res in sorted(results.items()):
        for rec in _drawn(res):
            out[rec["dataset"]][rank] = rec
    return out


def _drawn(res: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """A rank's passes whose indices were recorded (an IterableDataset's pass is only a start time)."""
    return [rec for rec in res.get("samples", ()) if not rec.get("iterable")]


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


def _passes(results: Mapping[int, Mapping[str, Any]]
            ) -> tuple[dict, dict[str, int], dict[str, dict[int, Mapping[str, Any]]]]:
    """(dataset -> rank -> ids, dataset -> size, dataset -> rank -> record, for passes cut short)."""
    per_dataset: dict[str, dict[int, list[int]]] = defaultdict(lambda: defaultdict(list))
    sizes: dict[str, int] = {}
    records: dict[str, dict[int, Mapping[str, Any]]] = defaultdict(dict)
    for rank, res in sorted(results.items()):
        for rec in _drawn(res):
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
        findings.append(Finding(kind=Kind.COVERAGE, severity=Severity.INFO, summary=summary,
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
                    partial: bool = False, use: str | None = None, sampler: str | None = None,
                    told_wrong_rank: tuple[str, str] | None = None) -> Finding | None:
    acc = sample_accounting(size, by_rank)
    if partial:   # a cut pass never drew the rest: not "never seen", only its coverage (find_partial_coverage)
        acc["missing"] = []
    duplicated, missing = acc["duplicated"], acc["missing"]
    if not duplicated and not missing:
        return None
    cause, fix = told_wrong_rank if told_wrong_rank and duplicated else \
        _sample_cause(size, by_rank, world_size, acc, sampler)
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
        kind=Kind.DUPLICATES, severity=Severity.INFO if harmless else Severity.ERROR, summary=summary,
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


# -- duplicates seen in the data: what the ranks fed a synced metric ------------------------------------------
#
# Where no sampler tells which samples a rank drew (an IterableDataset), the rows each rank fed a torchmetrics
# metric (``rank.row_digests``: one digest per row of an update's preds, target and other batch tensors) say it.
# Real data repeats rows (all-zero inputs, a label space of three classes), so only rows that occur once in a
# rank's own stream are evidence: seen on another rank too, they are the same sample. An error needs a strong
# signal: most of the distinctive rows of two or more ranks fed elsewhere too. Streams identical on every rank
# but made of repeating rows are a warning (the data may be so); a smaller share of distinctive rows, an info.

MIN_DISTINCT_ROWS = 16      # distinctive rows a rank needs before its share says anything
STRONG_SHARE = 0.5          # of a rank's distinctive rows, fed on another rank too: an error
WEAK_SHARE = 0.1            # ...: an info line


def find_fed_duplicates(results: Mapping[int, Mapping[str, Any]], world_size: int) -> list[Finding]:
    """One finding per synced metric whose ranks were fed the same rows, where no sampler says what they drew."""
    from distcheck.files.metric_records import chains, entries_by_rank, joint_computes

    recorded = entries_by_rank(results)
    if not recorded or any("t_start" not in rec for res in results.values() for rec in res.get("samples", ())):
        return []   # nothing fed, or a scenario recorded its own samples: they tell
    findings = []
    for chain in chains(joint_computes({r: list(ms.values()) for r, ms in recorded.items()})):
        members = [(r, recorded[r][key]) for r, key in chain["members"]]
        f = _fed_finding(members, _fed_verdicts(chain, members, results), world_size)
        if f is not None:
            findings.append(f)
    return findings


def _fed_verdicts(chain: Mapping[str, Any], members: Sequence[tuple[int, Mapping[str, Any]]],
                  results: Mapping[int, Mapping[str, Any]]) -> tuple[list[dict[str, Any]], int]:
    """(the overlap found in each distinct set of epochs the chain's computes covered, how many sets were checked)."""
    verdicts, seen = [], set()
    for joint in chain["joints"]:
        epochs = tuple(m["computes"][k]["epoch"] for (_, m), k in zip(members, joint["computes"]))
        if epochs in seen:
            continue
        seen.add(epochs)
        streams = {grank: m.get("rows", {}).get(str(e)) for grank, (_, m), e in zip(joint["ranks"], members, epochs)}
        if any(s is None for s in streams.values()) or any(
                _sampler_tells(results.get(r, {}), s) for (r, _), s in zip(members, streams.values())):
            continue
        verdict = fed_overlap(streams)
        if verdict is not None:
            verdicts.append({**verdict, "compute": joint["computes"][0]})
    return verdicts, len(seen)


def _sampler_tells(res: Mapping[str, Any], stream: Mapping[str, Any]) -> bool:
    """Whether the pass feeding this stream (the rank's last one started before its first update) was drawn
    through a sampler: then the sampler's indices are the evidence (``find_duplicates``), not the rows."""
    before = [rec for rec in res.get("samples", ()) if rec["t_start"] <= stream["t0"]]
    last = max(before, key=lambda rec: rec["t_start"], default=None)
    return last is not None and not last.get("iterable")


def fed_overlap(streams: Mapping[int, Mapping[str, Any]]) -> dict[str, Any] | None:
    """How much of what each rank fed was fed on another rank too, and how sure that is (``severity``).

    ``streams``: rank -> {"digests", "rows", "level"}; digests kept at a lower level are brought to the
    highest, so every rank's kept rows are the same sample of the data."""
    mask = (1 << max(int(s.get("level", 0)) for s in streams.values())) - 1
    seqs = {r: [d for d in s["digests"] if not d & mask] for r, s in streams.items()}
    counts = {r: Counter(seq) for r, seq in seqs.items()}
    distinct = {r: [d for d, n in c.items() if n == 1] for r, c in counts.items()}
    share = {r: (sum(1 for d in distinct[r] if any(d in counts[o] for o in counts if o != r)) / len(distinct[r])
                 if distinct[r] else 0.0) for r in seqs}
    evidence = {r for r in seqs if len(distinct[r]) >= MIN_DISTINCT_ROWS}
    first = next(iter(seqs.values()))
    identical = len(seqs) > 1 and all(seq == first for seq in seqs.values()) and \
        len({s["rows"] for s in streams.values()}) == 1
    strong = sorted(r for r in evidence if share[r] >= STRONG_SHARE)
    if len(strong) >= 2:
        severity, ranks = Severity.ERROR, strong
    elif identical and len(first) >= MIN_DISTINCT_ROWS and _changes(first) >= MIN_DISTINCT_ROWS:
        severity, ranks = Severity.WARNING, sorted(seqs)
    elif any(share[r] >= WEAK_SHARE for r in evidence):
        severity, ranks = Severity.INFO, sorted(r for r in evidence if share[r] >= WEAK_SHARE)
    else:
        return None
    return {"severity": severity, "ranks": ranks, "identical": identical,
            "share": {r: round(share[r], 3) for r in sorted(seqs)}, "rows": {r: s["rows"] for r, s in streams.items()},
            "distinct_rows": {r: len(distinct[r]) for r in sorted(seqs)}, "sampled": bool(mask)}


def _changes(seq: Sequence[int]) -> int:
    """How often consecutive rows differ: sorted data (a run of each class) changes rarely."""
    return sum(1 for a, b in itertools.pairwise(seq) if a != b)


def _fed_finding(members: Sequence[tuple[int, Mapping[str, Any]]], found: tuple[list[dict[str, Any]], int],
                 world_size: int) -> Finding | None:
    verdicts, checked = found
    if not verdicts:
        return None
    worst = min(verdicts, key=lambda v: (v["severity"].weight, -max(v["share"].values())))
    m = members[0][1]
    site = m["computes"][worst["compute"]].get("callsite")
    where = f"{m['class']} at {_site_line(site)}"
    fed = sum(worst["rows"].values())
    often = f", in {len(verdicts)} of the {checked} evaluations checked" if checked > 1 else ""
    ranks = worst["ranks"]
    n = next(iter(worst["rows"].values()))
    if worst["identical"] and worst["severity"] is Severity.ERROR:
        counted, cause = f"{fed:,} rows were counted for {n:,} samples", "every rank fed the metric the same rows"
        what = (f"each of its {len(worst['rows'])} ranks fed its update() the same {plural(n, 'row')}{often}: the "
                f"data is not split across the ranks, so its synced compute() counted {fed:,} rows for {n:,} samples")
    elif worst["severity"] is Severity.WARNING:
        counted, cause = f"{fed:,} rows were counted", "every rank may have fed the metric the same rows"
        what = (f"every rank fed it the same {plural(n, 'row')} in the same order{often}, but its rows repeat within "
                f"a rank too (few distinct values), so this may be the data itself")
    else:
        pct = ", ".join(f"rank {r}: {worst['share'][r]:.0%}" for r in ranks)
        counted, cause = "some rows were counted more than once", "several ranks fed the metric the same rows"
        what = (f"of the rows that occur once on a rank, {pct} were fed on another rank too{often}: samples reach "
                f"its synced compute() from several ranks")
    fix = ("give every rank its own shard: an IterableDataset must split its stream itself (each rank takes "
           "every world_size-th item from its rank, or datasets' split_dataset_by_node), or use a map-style dataset "
           "with a DistributedSampler")
    tail = (f"Fix: {fix}." if worst["severity"] is Severity.ERROR else
            f"If each rank should see different samples, {fix}." if worst["severity"] is Severity.WARNING else
            "Real data can repeat rows, so this is only a note.")
    return Finding(
        kind=Kind.DUPLICATES, severity=worst["severity"], odd_ranks=tuple(ranks), callsite=site,
        summary=f"{where}: {what}. {tail}",
        data={"metric": m["class"], "callsite": site, "fed": True, "same_on_every_rank": worst["identical"],
              "counted": counted, "cause": cause,
              "share": {str(r): v for r, v in worst["share"].items()},
              "rows": {str(r): v for r, v in worst["rows"].items()},
              "distinct_rows": {str(r): v for r, v in worst["distinct_rows"].items()}, "sampled": worst["sampled"],
              "evaluations": len(verdicts), "evaluations_checked": checked, "world_size": world_size})


def _site_line(site: str | None) -> str:
    """'eval.py:41': the file's name and the compute() line."""
    return ":".join(site.rsplit("/", 1)[-1].split(":")[:2]) if site else "an unknown line"


# -- duplicates seen in the data: what the ranks read ---------------------------------------------------------
#
# A pass over an IterableDataset has no indices, but the rows its batches held were digested as the loader
# yielded them (``rank.samples``): the samples a rank read, whatever its model made of them (ranks whose models
# are not synchronised yet feed their metrics different predictions for the same samples). The same rules as
# the fed rows decide (``fed_overlap``); whether it reached a compared result, as for a sampler's pass.


def find_read_duplicates(results: Mapping[int, Mapping[str, Any]], world_size: int,
                         traces: Mapping[int, Sequence[Event]] | None = None) -> list[Finding]:
    """One finding per IterableDataset pass whose ranks read the same rows."""
    passes: dict[str, dict[int, Mapping[str, Any]]] = defaultdict(dict)
    for rank, res in sorted(results.items()):
        for rec in res.get("samples", ()):
            if rec.get("iterable") and rec.get("rows") and "t_start" in rec:
                passes[rec["dataset"]][rank] = rec
    findings = []
    for dataset, recs in passes.items():
        verdict = fed_overlap({r: rec["rows"] for r, rec in recs.items()}) if len(recs) > 1 else None
        if verdict is not None:
            findings.append(_read_finding(dataset, verdict, _use_of(recs, results, traces), world_size))
    return findings


def _read_finding(dataset: str, v: Mapping[str, Any], use: str | None, world_size: int) -> Finding:
    harmless = _HARMLESS.get(use or "")
    severity = Severity.INFO if harmless else v["severity"]
    ranks, n = v["ranks"], next(iter(v["rows"].values()))
    sampled = " (a hash-chosen sample of them compared)" if v["sampled"] else ""
    if v["identical"] and v["severity"] is Severity.ERROR:
        read = sum(v["rows"].values())
        counted, cause = f"{read:,} rows were read for {n:,} samples", "the stream is not split across the ranks"
        what = (f"each of its {len(v['rows'])} ranks read the same {plural(n, 'row')}, by their content{sampled}: "
                f"the stream is not split across the ranks, so what they compute together counts {read:,} rows for "
                f"{n:,} samples")
    elif v["severity"] is Severity.WARNING:
        counted, cause = "the same rows were read on every rank", "every rank may have read the same stream"
        what = (f"every rank read the same {plural(n, 'row')} in the same order{sampled}, but its rows repeat "
                f"within a rank too (few distinct values), so this may be the data itself")
    else:
        pct = ", ".join(f"rank {r}: {v['share'][r]:.0%}" for r in ranks)
        counted, cause = "some rows were read on several ranks", "several ranks read the same rows"
        what = f"of the rows that occur once on a rank{sampled}, {pct} were read on another rank too"
    fix = ("split the stream by rank in the IterableDataset (each rank takes every world_size-th item from its "
           "rank, or datasets' split_dataset_by_node), or use a map-style dataset with a DistributedSampler")
    tail = (f"No harm: {harmless}." if harmless else f"Fix: {fix}." if severity is Severity.ERROR else
            f"If each rank should read different samples, {fix}." if severity is Severity.WARNING else
            "Real data can repeat rows, so this is only a note.")
    return Finding(
        kind=Kind.DUPLICATES, severity=severity, odd_ranks=tuple(ranks),
        summary=f"Dataset {dataset!r} (an IterableDataset, no sampler): {what}. {tail}",
        data={"dataset": dataset, "read": True, "same_on_every_rank": v["identical"], "counted": counted,
              "cause": cause, "use": use, "share": {str(r): x for r, x in v["share"].items()},
              "rows": {str(r): x for r, x in v["rows"].items()},
              "distinct_rows": {str(r): x for r, x in v["distinct_rows"].items()}, "sampled": v["sampled"],
              "world_size": world_size})


def _told(f: Finding, fed: Sequence[Finding]) -> bool:
    """Whether a finding from the rows a metric was fed already says as much of the same ranks."""
    return any(g.severity.weight <= f.severity.weight and set(f.odd_ranks) <= set(g.odd_ranks)
               for g in fed)
