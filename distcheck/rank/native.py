"""Collectives issued from C++: DDP's reducer and init, FSDP2, functional
collectives, DTensor, direct ``ProcessGroup`` calls.

The Python tracer never sees these calls. A process group still counts every
collective it runs, whoever issued it (``_get_sequence_number_for_group``,
0.15 µs), and PyTorch's Flight Recorder keeps the last few hundred with op,
sizes, dtypes, and whether each one finished. A sidecar thread polls both.
When the group has a sequence number that the tracer did not write, the call
came from C++. The sidecar writes it into the rank's trace as an ordinary
enter record with the group's own number. Its exit record follows when the
Flight Recorder retires it. The watchdog then sees that call wait or finish,
and the analysis matches it across ranks like any other collective.

The record names what issued the call ("DDP gradient all_reduce, bucket of 5
elements"), and the main thread's innermost user frame at that moment gives
the user's line (``loss.backward()``). Both come from the sampled stack, so
the analysis never compares them across ranks.

Cost: nothing on the hot path. Each poll reads one integer per group. A
Flight Recorder dump (about 2 ms for 256 entries) is taken only while the
groups run calls the tracer did not write, and at most every
``detail_interval_s``.
"""

from __future__ import annotations

import os
import pickle
import time
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Protocol

from distcheck import torch_features
from distcheck.files import trace as records
from distcheck.files.flight_recorder import DTYPES, op_name
from distcheck.files.stacks import LIBRARY, torch_dir
from distcheck.models import UNKNOWN_OP
from distcheck.rank.groups import members_of, process_groups
from distcheck.rank.completion import Completion
from distcheck.rank.issuers import inside_issuer, issuer_label, stack_digest, stack_of, unknown_call_label, user_line
from distcheck.rank.guard import Hook
from distcheck.rank.ticker import TICKER, Ticker

# Ring size distcheck asks of the Flight Recorder when the user set none: a dump
# costs ~2 ms at 256 entries and ~80 ms at 2000 (torch 2.13, measured).
DEFAULT_BUFFER = 256

@dataclass(frozen=True)
class NativeCall:
    """One C++-issued collective as the Flight Recorder describes it (None: no entry for it)."""

    op: str
    shapes: tuple[tuple[int, ...], ...] = ()
    dtypes: tuple[str, ...] = ()
    t_created: float | None = None
    retired: bool = False


def flight_recorder_calls() -> dict[tuple[str, int], NativeCall] | None:
    """{(group name, collective seq): call} from the Flight Recorder; None where it cannot describe this
    rank's collectives (no recorder, or gloo on a torch whose recorder is NCCL's alone)."""
    dump_fr_trace = torch_features.fr_dump_function()
    if dump_fr_trace is None or torch_features.recorder_problem(_backend()) is not None:
        return None
    try:
        dump = pickle.loads(dump_fr_trace(True, False, False))
    except Exception:    # no process group yet, or a torch whose recorder is off
        return None
    out = {}
    for e in dump.get("entries", ()):
        if e.get("is_p2p"):
            continue
        pg = e.get("process_group") or ("",)
        op, backend = op_name(e.get("profiling_name", UNKNOWN_OP))
        created = e.get("time_created_ns")
        out[(str(pg[0]), _counter_value(e, backend))] = NativeCall(
            op=op, shapes=tuple(tuple(s) for s in e.get("input_sizes") or ()),
            dtypes=tuple(DTYPES.get(str(d), str(d).lower()) for d in e.get("input_dtypes") or ()),
            t_created=created / 1e9 if created else None,
            retired=bool(e.get("retired")) or e.get("state") == "completed")
    return out


def _backend() -> str | None:
    """The default group's backend (None before init_process_group)."""
    try:
        import torch.distributed as dist
        return str(dist.get_backend()) if dist.is_initialized() else None
    except Exception:   # a backend torch cannot name: let the recorder answer for it
        return None


def recorder_problem() -> str | None:
    """Why the Flight Recorder cannot show C++-issued calls here (None: it can)."""
    problem = torch_features.recorder_problem(_backend())
    if problem:
        return problem
    size = os.environ.get("TORCH_FR_BUFFER_SIZE") or os.environ.get("TORCH_NCCL_TRACE_BUFFER_SIZE") or "0"
    if not size.strip().isdigit() or int(size) <= 0:
        return "the Flight Recorder is off (--no-flight-recorder, or TORCH_FR_BUFFER_SIZE=0)"
    return None


def _counter_value(entry: dict, backend: str | None) -> int:
    """The entry's number on the group's counter. gloo's counter also counts send/recv, which its
    recorder leaves out of ``collective_seq_id``; ``op_id`` counts them (measured, torch 2.13).
    NCCL's counter is its collective count."""
    key = "op_id" if backend == "gloo" else "collective_seq_id"
    return int(entry.get(key, entry.get("collective_seq_id", -1)))


class TracerSide(Protocol):
    """What the sidecar reads of the Python tracer (``rank.tracer.Tracer``, which answers from its parts)."""

    @property
    def lock(self) -> AbstractContextManager:
        """Held while a batched launch starts its next segment."""

    @property
    def writer(self) -> Any:
        """The trace's ``TraceWriter``."""

    @property
    def completion(self) -> Completion | None:
        """When calls completed (NCCL)."""

    @property
    def busy_group(self) -> str | None:
        """The group a Python call is in right now: the numbers it runs are its own (read before them)."""

    def take_written(self, group: str) -> list[int]:
        """The numbers it wrote for ``group`` since the last call, relative to ``seq_base(group)``."""

    def seq_base(self, group: str) -> int:
        """The group's counter when the segment started."""

    def trace_seq(self, group: str, offset: int) -> int:
        """The trace's number for the counter's ``offset``: P2P calls' numbers left out."""

    def handles_on_device(self) -> bool:
        """P2P calls over a device-completed group whose handles have not said they completed."""

    def completed_on_device(self) -> list[int]:
        """The keys of such calls whose handles say they completed since the last call."""


@dataclass
class _Open:
    seq: int                  # the group's own sequence number (absolute)
    shown: int                # the number in the trace (relative to the segment)


@dataclass
class NativeWatcher:
    """Finds C++-issued collectives of one rank and writes them into its trace.

    ``tracer`` gives the Python side (``TracerSide``): the numbers it wrote for a group, the group a
    Python call is in (``busy_group``: the numbers it runs are its own, e.g. an object collective runs
    two), the P2P calls over a device-completed group, and ``lock`` (held while a batched launch starts
    its next segment). Every number up to ``seen`` is accounted for: written by the tracer, or recorded here.
    """

    tracer: TracerSide
    main_thread: int | None
    groups: Callable[[], Iterable[tuple[str, Any]]] = process_groups
    calls: Callable[[], dict[tuple[str, int], NativeCall] | None] = flight_recorder_calls
    detail_interval_s: float = 0.25
    seen: dict[str, int] = field(default_factory=dict)        # group → every absolute seq up to it is accounted for
    python: dict[str, set[int]] = field(default_factory=dict)  # group → absolute seqs above ``seen`` the tracer wrote
    open: dict[str, list[_Open]] = field(default_factory=dict)
    gids: dict[str, int] = field(default_factory=dict)       # group → its id in the trace (the sidecar's own ids)
    pgs: dict[str, Any] = field(default_factory=dict)        # group → the process group read last time
    fps: dict[tuple, int] = field(default_factory=dict)
    sites: dict[tuple, str] = field(default_factory=dict)
    completion: Completion | None = None                      # when calls completed (NCCL): the tracer's own
    counters: dict[str, int] = field(default_factory=dict)    # group → its counter at the last read
    done: dict[str, int] = field(default_factory=dict)        # group → the trace's number written done up to
    done_abs: dict[str, int] = field(default_factory=dict)    # ... and the counter's number it stands for
    recorder: bool = field(default_factory=lambda: recorder_problem() is None)   # False: counted, not watched
    on_unwatched: Callable[[str], None] = lambda why: None   # told once, when a call could not be watched
    _last_detail: float = 0.0
    _told: bool = False
    _pending_since: dict[tuple[str, int], float] = field(default_factory=dict)
    _torch: str = field(default_factory=torch_dir)

    def __post_init__(self) -> None:
        if self.completion is None:
            self.completion = self.tracer.completion or Completion()

    @property
    def _completion(self) -> Completion:
        """``completion``, always set once the watcher is made (``__post_init__``)."""
        assert self.completion is not None
        return self.completion

    def flush(self, frames: list[tuple[str, int, str]] | None = None, settle_s: float = 0.0) -> None:
        """Record every call the groups ran so far, and close them all: the caller's work is over
        (the end of a scenario or script, a failure, or a group about to be destroyed), so each
        call it made has returned. ``frames``: the stack the calls were issued from, where the main
        thread has left it (a failure's traceback), innermost first. ``settle_s``: how long calls still
        waiting on the device (NCCL) may take to complete first (a healthy one does in milliseconds; one that
        never does stays open in the record, where its hang is told)."""
        with self.tracer.lock:
            self.end_segment(frames)
            deadline = time.monotonic() + settle_s
            while self._waiting_on_device() and time.monotonic() < deadline:
                time.sleep(0.01)
                self._write_done(time.time())

    def _waiting_on_device(self) -> bool:
        """A device-completed group has calls not known done."""
        return (any(self._completion.device(key) and seq > self._done_abs(key) for key, seq in self.counters.items())
                or self.tracer.handles_on_device())

    def end_segment(self, frames: list[tuple[str, int, str]] | None = None) -> None:
        """``flush`` with the tracer's lock held (a batched launch's segment ends here)."""
        now = time.time()
        calls = self.calls() if self.recorder else None
        out = records.RecordBatch()
        new, gone = self._new_numbers()
        if new and calls is None:
            self._unwatched(recorder_problem() or "the Flight Recorder could not be read")
        for key, pg, todo, upto in new:
            self._record_new(key, pg, todo, upto, calls or {}, now, out, final=True, frames=frames)
        for key, opened in self.open.items():
            for o in opened:
                out.add(records.exit_slot(records.call_key(self.gids[key], o.shown), int(now * 1e9)))
            opened.clear()
        if out:
            self.tracer.writer.write(out.data())
        self._write_done(now)
        self._forget(gone)
        self._synced(now)

    def reset(self) -> None:
        """A new trace segment: numbers restart, definitions are written again."""
        self.open.clear()
        self.done.clear()
        self.done_abs.clear()
        self.python.clear()
        self.gids.clear()
        self.fps.clear()
        self.sites.clear()

    def poll(self, now: float | None = None) -> None:
        """Record what the groups ran since the last poll, then say so in the trace's sync word.

        ``now`` is read before the counters: every call a group counted by then is in the trace
        once the sync word says ``now`` (the watchdog judges a rank only on a record that new).
        """
        now = time.time() if now is None else now
        with self.tracer.lock:
            new, gone = self._new_numbers()
            try:
                if new or any(self.open.values()):
                    # Rate limit (a dump costs ~2 ms): the numbers wait in the group's counter, and the
                    # sync word stays behind, so nobody reads the record as complete meanwhile. A group
                    # that was destroyed cannot wait: its counter is read for the last time.
                    if now - self._last_detail < self.detail_interval_s and not any(k in gone for k, *_ in new):
                        return
                    self._last_detail = now
                    if not self._record(new, gone, now):
                        return   # a counted call waits for its recorder entry: the record is not whole yet
                self._synced(now)
            finally:
                self._write_done(now)   # after the calls it may cover are in the record
                self._forget(gone)

    def _record(self, new: list, gone: set[str], now: float) -> bool:
        """Write what ``new`` holds; False when a call was left for the next poll (not in the record yet)."""
        calls = self.calls() if self.recorder else None
        if calls is None and new:
            self._unwatched(recorder_problem() or "the Flight Recorder could not be read")
        out = records.RecordBatch()
        whole = True
        for key, pg, todo, upto in new:
            whole &= self._record_new(key, pg, todo, upto, calls or {}, now, out, final=key in gone)
        self._retire(calls, now, out)
        if out:
            self.tracer.writer.write(out.data())
        return whole

    def _write_done(self, now: float) -> None:
        """D records: how far each device-completed group's calls have completed (``rank.completion``), never past a
        number whose enter record is not written yet (``seen``); and the ends of the waits in P2P calls over such a
        group whose handles completed."""
        out = records.RecordBatch()
        completed = self.tracer.completed_on_device()
        if completed:
            out.add(records.wait_slots(completed, int(now * 1e9), True))
        marks = self._completion.done_through(pending=lambda key: self.counters.get(key, 0) > self._done_abs(key))
        for key, upto in marks.items():
            pg = self.pgs.get(key)
            base = self.tracer.seq_base(key)
            upto = min(upto, self.seen.get(key, base))
            local = self.tracer.trace_seq(key, upto - base) if upto > base else 0
            if pg is None or local <= self.done.get(key, 0):
                continue
            self.done[key] = local
            self.done_abs[key] = upto
            out.add(records.done_slot(self._define_group(key, pg, out), local, int(now * 1e9)))
        if out:
            self.tracer.writer.write(out.data())

    def _done_abs(self, key: str) -> int:
        return self.done_abs.get(key, self.tracer.seq_base(key))

    def _synced(self, now: float) -> None:
        """Tell the watchdog that every call counted up to ``now`` is in the trace."""
        sync = getattr(self.tracer.writer, "sync", None)
        if sync is not None:
            sync(int(now * 1e9), self.recorder, stack_digest(self.main_thread))


    def _unwatched(self, why: str) -> None:
        if self.recorder or not self._told:
            self.recorder = False
            self._told = True
            self.on_unwatched(f"collectives issued from C++ (DDP, FSDP2, functional collectives) were counted "
                              f"but not watched: {why}, so a hang inside one is found from the rank's stack "
                              f"and the report cannot say which collective it was")

    def _live_and_gone_groups(self) -> tuple[list[tuple[str, Any]], set[str]]:
        """The groups to read now: the ones that exist, and, one last time, those destroyed since the
        last read (their counter and the Flight Recorder's entries outlive them; measured, torch
        2.13). A script's ``destroy_process_group()`` at its end no longer takes its last calls along."""
        current = list(self.groups())
        live = {key: pg for key, pg in current}
        for key, pg in current:   # before its first call where it can be: a call that completes unseen waits forever
            if key not in self.pgs:
                self._completion.attach(pg, key)
        gone = {key for key, pg in self.pgs.items() if live.get(key) is not pg}
        # A group re-made under the same name is read from the next poll on, counting afresh.
        groups = [(key, self.pgs[key]) for key in gone] + [(key, pg) for key, pg in current if key not in gone]
        self.pgs = live
        return groups, gone

    def _new_numbers(self) -> tuple[list[tuple[str, Any, list[int], int]], set[str]]:
        """(group, pg, numbers no one recorded yet, the group's counter) for each group with some, and the
        names of the groups read for the last time (destroyed)."""
        busy = self.tracer.busy_group          # read before the numbers (see the class docstring)
        new = []
        groups, gone = self._live_and_gone_groups()
        for key, pg in groups:
            try:
                seq = pg._get_sequence_number_for_group()
            except Exception:    # a backend without sequence numbers: nothing to learn here
                continue
            self.counters[key] = seq
            base = self.tracer.seq_base(key)
            python = self.python.setdefault(key, set())
            python.update(s + base for s in self.tracer.take_written(key))
            seen = max(self.seen.get(key, base), base)
            if key == busy:   # numbers past the Python call's own may be its own (an object collective)
                seq = max((s for s in python if s <= seq), default=seen)
            todo = [s for s in range(seen + 1, seq + 1) if s not in python]
            if not todo:
                self._advance(key, seq)
                continue
            new.append((key, pg, todo, seq))
        return new, gone

    def _forget(self, gone: set[str]) -> None:
        """After their last read: a new group under the same name (a re-init) counts from zero again."""
        for key in gone:
            self.seen.pop(key, None)
            self.python.pop(key, None)
            self.counters.pop(key, None)
            self.done.pop(key, None)
            self.done_abs.pop(key, None)
            self._completion.forget(key)

    def _advance(self, key: str, seq: int) -> None:
        self.seen[key] = max(self.seen.get(key, 0), seq)
        self.python[key] = {s for s in self.python.get(key, ()) if s > self.seen[key]}

    def _record_new(self, key: str, pg: Any, todo: list[int], upto: int, calls: dict, now: float,
                    out: records.RecordBatch, final: bool = False,
                    frames: list[tuple[str, int, str]] | None = None) -> bool:
        """Write the calls ``todo`` of group ``key``; False when the newest waits for its recorder entry."""
        base = self.tracer.seq_base(key)
        frames = frames or stack_of(self.main_thread)
        for seq in todo:
            call = calls.get((key, seq))
            if call is None and self.recorder and not final and seq == upto and now - self._pending_since.setdefault(
                    (key, seq), now) < 1.0:
                self._advance(key, seq - 1)
                return False   # the recorder has not shown the newest call yet: next poll
            self._pending_since.pop((key, seq), None)
            gid = self._define_group(key, pg, out)
            fp = self._fingerprint(call, frames, out)
            t_enter = call.t_created if call and call.t_created else now
            local = self.tracer.trace_seq(key, seq - base)   # less what P2P calls took (library_shapes)
            out.add(records.enter_slot(gid, fp, local, int(t_enter * 1e9)))
            # Without a recorder entry the main thread's stack is the evidence: still inside what issued
            # the call (DDP's backward, FSDP, a functional collective's wait), it may be waiting in it. On a
            # device-completed group the exit record says only that it was issued: a D record closes it.
            if final or self._completion.device(key) or (call.retired if call else self.recorder
                                                         or not inside_issuer(frames)):
                out.add(records.exit_slot(records.call_key(gid, local), int(now * 1e9)))
            else:
                self.open.setdefault(key, []).append(_Open(seq, local))
        self._advance(key, upto)
        return True

    def _retire(self, calls: dict | None, now: float, out: records.RecordBatch) -> None:
        # No recorder: every call the main thread issued is over once its stack has left the issuer.
        left = calls is None and any(self.open.values()) and not inside_issuer(stack_of(self.main_thread))
        for key, opened in self.open.items():
            still = []
            for o in opened:
                call = calls.get((key, o.seq)) if calls is not None else None
                if left if calls is None else (call is None or call.retired):   # retired, or so old it left the ring
                    out.add(records.exit_slot(records.call_key(self.gids[key], o.shown), int(now * 1e9)))
                else:
                    still.append(o)
            opened[:] = still

    def _define_group(self, key: str, pg: Any, out: records.RecordBatch) -> int:
        gid = self.gids.get(key)
        if gid is None:
            gid = self.gids[key] = records.NATIVE_GROUP_BASE + len(self.gids)
            out.define(records.group_record(gid, key, members_of(pg), self._completion.device(key)))
        return gid

    def _fingerprint(self, call: NativeCall | None, frames: list, out: records.RecordBatch) -> int:
        op = call.op if call else UNKNOWN_OP
        shapes = call.shapes if call else ()
        dtypes = call.dtypes if call else ()
        label = issuer_label(op, shapes, frames) if call else unknown_call_label(frames, self.recorder)
        library = user_line(frames, self._torch, LIBRARY)
        # no line of the user's: the library's that made the call is still a place (never "an unknown place")
        site_key = (user_line(frames, self._torch) or library, library, label)
        site = self.sites.get(site_key)
        if site is None:
            site = self.sites[site_key] = f"n{len(self.sites)}"
            out.define(records.site_record(site, *site_key))
        fp_key = (op, shapes, dtypes, site)
        fp = self.fps.get(fp_key)
        if fp is None:
            fp = self.fps[fp_key] = records.NATIVE_FP_BASE + len(self.fps)
            out.define(records.native_fingerprint_record(fp, op, shapes, dtypes, site))
        return fp


class Sidecar:
    """One generation's ``NativeWatcher``, polled every ``poll_s`` as a task of the rank's one thread of
    distcheck's (``rank.ticker``: the job cannot see it); ``stop`` removes the task."""

    def __init__(self, watcher: NativeWatcher, poll_s: float, ticker: Ticker = TICKER) -> None:
        self.watcher, self.poll_s, self.ticker = watcher, poll_s, ticker
        self.task = f"sidecar-{id(self)}"

    def stop(self) -> None:
        """No poll after this one (a poll under way finishes: the tracer's lock orders it with what follows)."""
        self.ticker.remove(self.task)


def start(watcher: NativeWatcher, poll_s: float = 0.05, ticker: Ticker = TICKER) -> Sidecar:
    """Poll from the rank's thread of distcheck's: collectives release the GIL while they wait, so it runs
    during a hang."""
    sidecar = Sidecar(watcher, poll_s, ticker)
    ticker.every(sidecar.task, poll_s, watcher.poll, Hook.SIDECAR)
    return sidecar
