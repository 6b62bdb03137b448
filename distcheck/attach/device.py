"""A rank whose host is blocked in a device sync, as attach tells it from outside, and the words for it. On NCCL a
collective returns once its work is enqueued; the host blocks later, at ``loss.item()`` or
``torch.cuda.synchronize()``, while the call waits on the device. From outside that is a rank at one user line whose
main thread is in a CUDA wait (native frames) or torch's ``synchronize`` (emulated_nccl's stand-ins on CPU), in every
sample. Which call it waits in only the Flight Recorder says (the first call its dump holds not completed); without
one, attach says so and what to set, and claims no call. Pure."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from distcheck.attach.position import Position, Where
from distcheck.models import Finding, Kind, RankDetail, Severity
from distcheck.text import rank_list, site

# What to set for the Flight Recorder, for a sentence.
FR_TODO = ("set TORCH_FR_BUFFER_SIZE (e.g. 2000) and TORCH_FR_DUMP_TEMP_FILE (a path prefix: each rank writes "
           "<prefix><rank>) in the job's environment; NCCL's watchdog dumps every rank's Flight Recorder there when a "
           "collective times out, and attach then names the call by its number")


def synced(positions: Sequence[Position], alive: bool) -> Position | None:
    """The device sync the rank is blocked in: its main thread at the same stack in every readable sample, in a
    device sync in the last (a native read, which pauses the rank, is taken only for the last: the Python stack of
    the others, the same, stands for it). None: not blocked in one."""
    seen = [p for p in positions if p.kind != Where.UNREADABLE]
    last = seen[-1] if seen else None
    if not alive or last is None or len(seen) < 2 or last.kind != Where.DEVICE_SYNC:
        return None
    return last if all(p.digest == last.digest for p in seen) else None


def where(at: Position) -> str:
    """"blocked in a device sync at train.py:42 (cudaStreamSynchronize in Tensor.item())"."""
    return f"blocked in a device sync at {site(at.callsite)} ({at.sync})"


def reworded(f: Finding, synced_at: Mapping[int, Position]) -> Finding:
    """The rules' words for a rank outside every call ("running outside any collective at X") and for the host of a
    call not completed ("the host is blocked at X"), said of the ranks blocked in a device sync as what they are."""
    if not synced_at:
        return f

    def say(text: str | None) -> str | None:
        if not text:
            return text
        for at in synced_at.values():
            line = site(at.callsite)
            text = text.replace(f"running outside any collective at {line}", f"blocked in a device sync at {line}")
            if f"the host is blocked at {line}" in text:
                text = text.replace(f"the host is blocked at {line}", f"the host is blocked in a device sync at {line}")
                text = text.replace("its work never completed;", "its work never completed on the device;")
        return text

    details = tuple(dataclasses.replace(d, note=say(d.note)) for d in f.ranks)
    return dataclasses.replace(f, summary=say(f.summary) or f.summary, ranks=details)


def unknown_call(synced_at: Mapping[int, Position], elsewhere: Mapping[int, str], dumps_read: bool) -> Finding:
    """Ranks blocked in a device sync, and no Flight Recorder says which call they wait in: not decided (attach
    exits 3, never a pass), said with where each rank is and what to set."""
    ranks = sorted(synced_at)
    blocked = "; ".join(f"the host{'' if len(rs) == 1 else 's'} of {rank_list(rs)} "
                        f"{'is' if len(rs) == 1 else 'are'} {w}"
                        for w, rs in _by_words({r: where(synced_at[r]) for r in ranks}).items())
    others = "; ".join(f"{rank_list(rs)} {'is' if len(rs) == 1 else 'are'} {w}"
                       for w, rs in _by_words(elsewhere).items())
    them = "it waits" if len(ranks) == 1 else "they wait"
    why = ("the Flight Recorder dumps read hold no call in flight for it (written before it was enqueued)"
           if dumps_read else "no Flight Recorder dump was reachable")
    summary = (f"Not decided: {blocked}, waiting for work enqueued on the device (on NCCL, a collective) to "
               f"complete{'; ' + others if others else ''}. Which call {them} in is not known: {why}; {FR_TODO}.")
    details = tuple(RankDetail(rank=r, role="waiting", where=synced_at[r].callsite,
                               note=f"blocked in a device sync ({synced_at[r].sync})") for r in ranks)
    return Finding(kind=Kind.COVERAGE, severity=Severity.WARNING, summary=summary,
                   callsite=synced_at[ranks[0]].callsite, waiting_ranks=tuple(ranks), ranks=details,
                   data={"flight_recorder": "not joined" if dumps_read else "none",
                         "device_sync": {str(r): {"callsite": synced_at[r].callsite, "sync": synced_at[r].sync}
                                         for r in ranks}})


def _by_words(words: Mapping[int, str]) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for r in sorted(words):
        out.setdefault(words[r], []).append(r)
    return out
