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

import atexit
import os
import pickle
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from distcheck import torch_features
from distcheck.files import trace as records
from distcheck.files.flight_recorder import DTYPES, op_name
from distcheck.files.stacks import TORCH, USER, classify_file, torch_dir
from distcheck.models import UNKNOWN_OP
from distcheck.rank.groups import members_of, process_groups
from distcheck.rank.guard import Hook, failed

# Ring size distcheck asks of the Flight Recorder when the user set none: a dump
# costs ~2 ms at 256 entries and ~80 ms at 2000 (torch 2.13, measured).
DEFAULT_BUFFER = 256

# (path fragment, what issued the call), innermost torch frame first.
_ISSUERS = (
    ("/torch/distributed/fsdp/", "FSDP"),
    ("/torch/distributed/_composable/", "FSDP"),
    ("/torch/distributed/tensor/", "DTensor"),
    ("/torch/distributed/_functional_collectives", "functional collective"),
    ("/torch/nn/parallel/distributed.py", "DDP"),
    ("/torch/autograd/", "autograd"),
)


@dataclass(frozen=True)
class NativeCall:
    """One C++-issued collective as the Flight Recorder describes it (None: no entry for it)."""

    op: str
    shapes: tuple[tuple[int, ...], ...] = ()
    dtypes: tuple[str, ...] = ()
    t_created: float | None = None
    retired: bool = False


def issuer_label(op: str, shapes: tuple[tuple[int, ...], ...], frames: list[tuple[str, int, str]]) -> str:
    """A person's name for the call: "DDP gradient all_reduce, bucket of 5 elements".

    ``frames`` is the main thread's stack, innermost first: (file, line, function).
    """
    issuer = next((name for file, _, _ in frames for frag, name in _ISSUERS if frag in file), None)
    ddp = any("/torch/nn/parallel/distributed.py" in file for file, _, _ in frames)
    if issuer == "autograd" or (issuer == "DDP" and not ddp):
        issuer = "DDP gradient" if op == "all_reduce" else "autograd"
    elif issuer == "DDP" and any(fn == "__init__" for file, _, fn in frames if "parallel/distributed.py" in file):
        issuer = "DDP init"
    if issuer is None:
        issuer = "C++-issued"
    text = f"{issuer} {op}"
    if issuer == "DDP gradient" and shapes:
        numel = sum(_numel(s) for s in shapes)
        text += f", bucket of {numel} element{'s' if numel != 1 else ''}"
    return text


def inside_issuer(frames: list[tuple[str, int, str]]) -> bool:
    """The stack is inside something that issues collectives from C++ (DDP, autograd, FSDP, DTensor, funcol),
    and its innermost frame is torch's own: a call into C++ that may be waiting. A thread that runs an
    import or the user's code (a hook) is busy there, not waiting in a collective."""
    return (bool(frames) and classify_file(frames[0][0], torch_dir()) == TORCH
            and any(frag in file for file, _, _ in frames for frag, _ in _ISSUERS))


def unknown_call_label(frames: list[tuple[str, int, str]], recorder: bool) -> str:
    """A C++-issued call without a recorder entry: what issued it, and that nothing says which call it was."""
    if recorder:
        return "C++-issued call (no Flight Recorder entry)"
    issuer = issuer_label(UNKNOWN_OP, (), frames).removesuffix(f" {UNKNOWN_OP}")
    issuer = {"autograd": "DDP's reducer in backward()", "C++-issued": "C++ code"}.get(issuer, issuer)
    return f"{issuer} (a collective issued from C++; without a Flight Recorder nothing says which)"


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def user_line(frames: list[tuple[str, int, str]], torch: str) -> str | None:
    """The innermost frame of the user's own code, as 'file:line:function'."""
    for file, line, fn in frames:
        if classify_file(file, torch) == USER:
            return f"{file}:{line}:{fn}"
    return None


def stack_of(thread_id: int | None) -> list[tuple[str, int, str]]:
    """A thread's stack, innermost first (cheap: no source lines read)."""
    frame = sys._current_frames().get(thread_id) if thread_id is not None else None
    out = []
    while frame is not None and len(out) < 200:
        out.append((frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name))
        frame = frame.f_back
    return out


def stack_digest(thread_id: int | None) -> int:
    """A 64-bit digest of a thread's stack (code objects and lines): it changes when the thread moves on."""
    frame = sys._current_frames().get(thread_id) if thread_id is not None else None
    parts = []
    while frame is not None and len(parts) < 200:
        parts.append((id(frame.f_code), frame.f_lineno))
        frame = frame.f_back
    return hash(tuple(parts)) & (1 << 64) - 1


def traceback_frames(tb: Any) -> list[tuple[str, int, str]]:
    """A traceback's frames, innermost first, as ``stack_of`` gives them: where a call that raised was issued."""
    out = []
    while tb is not None:
        out.append((tb.tb_frame.f_code.co_filename, tb.tb_lineno, tb.tb_frame.f_code.co_name))
        tb = tb.tb_next
    return out[::-1]


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


@dataclass
class _Open:
    seq: int                  # the group's own sequence number (absolute)
    shown: int                # the number in the trace (relative to the segment)


@dataclass
class NativeWatcher:
    """Finds C++-issued collectives of one rank and writes them into its trace.

    ``tracer`` gives the Python side: ``take_written(key)`` (the numbers it wrote
    for a group since the last call, relative to ``seq_base(key)``), ``trace_seq(key, offset)``
    (the trace's number for one of them: P2P calls' numbers left out), ``busy_group``
    (a Python call in flight: the numbers it runs are its own, e.g. an object
    collective runs two), and ``lock`` (held while a batched launch starts its
    next segment). Every number up to ``seen`` is accounted for: written by the
    tracer, or recorded here.
    """

    tracer: Any
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
    recorder: bool = field(default_factory=lambda: recorder_problem() is None)   # False: counted, not watched
    on_unwatched: Callable[[str], None] = lambda why: None   # told once, when a call could not be watched
    _last_detail: float = 0.0
    _told: bool = False
    _pending_since: dict[tuple[str, int], float] = field(default_factory=dict)
    _torch: str = field(default_factory=torch_dir)

    def flush(self, frames: list[tuple[str, int, str]] | None = None) -> None:
        """Record every call the groups ran so far, and close them all: the caller's work is over
        (the end of a scenario or script, a failure, or a group about to be destroyed), so each
        call it made has returned. ``frames``: the stack the calls were issued from, where the main
        thread has left it (a failure's traceback), innermost first."""
        with self.tracer.lock:
            self.end_segment(frames)

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
        self._forget(gone)
        self._synced(now)

    def reset(self) -> None:
        """A new trace segment: numbers restart, definitions are written again."""
        self.open.clear()
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
            if new or any(self.open.values()):
                # Rate limit (a dump costs ~2 ms): the numbers wait in the group's counter, and the
                # sync word stays behind, so nobody reads the record as complete meanwhile. A group
                # that was destroyed cannot wait: its counter is read for the last time.
                if now - self._last_detail < self.detail_interval_s and not any(k in gone for k, *_ in new):
                    self._forget(gone)
                    return
                self._last_detail = now
                if not self._record(new, gone, now):
                    self._forget(gone)
                    return   # a counted call waits for its recorder entry: the record is not whole yet
            self._forget(gone)
            self._synced(now)

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
            # the call (DDP's backward, FSDP, a functional collective's wait), it may be waiting in it.
            if final or (call.retired if call else self.recorder or not inside_issuer(frames)):
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
            out.define(records.group_record(gid, key, members_of(pg)))
        return gid

    def _fingerprint(self, call: NativeCall | None, frames: list, out: records.RecordBatch) -> int:
        op = call.op if call else UNKNOWN_OP
        shapes = call.shapes if call else ()
        dtypes = call.dtypes if call else ()
        label = issuer_label(op, shapes, frames) if call else unknown_call_label(frames, self.recorder)
        site_key = (user_line(frames, self._torch), label)
        site = self.sites.get(site_key)
        if site is None:
            site = self.sites[site_key] = f"n{len(self.sites)}"
            out.define(records.site_record(site, site_key[0], None, label))
        fp_key = (op, shapes, dtypes, site)
        fp = self.fps.get(fp_key)
        if fp is None:
            fp = self.fps[fp_key] = records.NATIVE_FP_BASE + len(self.fps)
            out.define(records.native_fingerprint_record(fp, op, shapes, dtypes, site))
        return fp


# A poll reads each group's counter through torch's C++ API, which lets go of the GIL. A daemon thread inside
# such a call when the interpreter finalizes is ended on its way back (pthread_exit), through C++ code that
# cannot unwind: the process aborts ("terminate called without an active exception", measured: 10 of 10 exits
# of a 2-rank gloo job with a thread reading the counter in a loop). So every sidecar stops before that, at
# exit, while threads still run: a program that exits cleanly without distcheck exits cleanly with it.
STOP_WAIT_S = 2.0
_running: set["Sidecar"] = set()


class Sidecar:
    """The thread that polls one generation's ``NativeWatcher``, and its stop."""

    def __init__(self, watcher: NativeWatcher, poll_s: float) -> None:
        self.watcher, self.poll_s = watcher, poll_s
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="distcheck-native-collectives", daemon=True)

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.watcher.poll()
            except Exception as exc:   # never take the rank down; the trace shows less, the report says so
                failed(Hook.SIDECAR, exc)
            self._stop.wait(self.poll_s)

    def stop(self, wait_s: float = STOP_WAIT_S) -> None:
        """Stop polling, and wait (bounded) for a poll under way to return."""
        self._stop.set()
        _running.discard(self)
        if self.thread.is_alive() and self.thread is not threading.current_thread():
            self.thread.join(wait_s)


@atexit.register
def _stop_all() -> None:
    for sidecar in list(_running):
        sidecar.stop()


def start(watcher: NativeWatcher, poll_s: float = 0.1) -> Sidecar:
    """Poll in a daemon thread: collectives release the GIL while they wait, so it runs during a hang."""
    sidecar = Sidecar(watcher, poll_s)
    _running.add(sidecar)
    sidecar.thread.start()
    return sidecar
