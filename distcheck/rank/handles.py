"""The handles of P2P calls (``isend``, ``irecv``, ``batch_isend_irecv``) and other async calls: a ``wait()`` on one
is where the rank blocks in those calls, so it is written as W records around the wait. ``Handles`` is a part the
tracer owns (``Tracer.handles``).

torch's ``Work.wait`` is replaced only while such a handle is held: every blocking collective calls ``wait()`` on
its own handle from Python, and a job that holds none (the common case) pays nothing for the wrapper. It is
replaced again by the next async call, and given back by the first wait on another handle once none is held.
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Callable
from time import time_ns
from typing import Any, NamedTuple

from distcheck.files.trace import SEQ_BITS, wait_slots
from distcheck.rank.guard import Hook, failed


class HeldHandle(NamedTuple):
    work: weakref.ref           # the handle (weakly: a handle the user drops is forgotten)
    keys: tuple[int, ...]       # the call keys it completes


class WaitPatch(NamedTuple):
    """torch's ``Work.wait`` and the wrapper that stands in for it while a handle is held."""

    work_class: Any
    original: Callable
    wrapper: Callable


class Handles:
    """The handles of one tracer's async calls, and torch's ``Work.wait`` replaced while one is held.

    ``writer`` is the trace's (W records go there). Thread-safe where the sidecar calls it (``handles_on_device``,
    ``completed_on_device``)."""

    def __init__(self, writer: Any) -> None:
        self.writer = writer
        # id(work) -> the handle of a P2P call and the call keys it completes (its ``wait()`` is written as W records)
        self._held: dict[int, HeldHandle] = {}
        # P2P calls over a device-completed group (NCCL): their pairs' ids, and their handles, which the sidecar
        # asks whether they completed
        self._device_pairs: set[int] = set()
        self._on_device: dict[int, HeldHandle] = {}
        self._wait: WaitPatch | None = None
        self._armed = False   # the wrapper in place: while a handle is held
        self._lock = threading.Lock()

    def begin_segment(self) -> None:
        """Forget every handle: their keys name the finished segment's calls."""
        self._held.clear()   # cleared, never replaced: the wrapper holds it
        self._on_device.clear()
        self._device_pairs.clear()

    def after_fork(self) -> None:
        self._lock = threading.Lock()   # another thread of the parent may have held it

    def on_device(self, gid: int) -> None:
        """The P2P pair ``gid``'s calls complete on the device (its handles say when)."""
        self._device_pairs.add(gid)

    def hold(self, works: Any, keys: list[int] | tuple[int, ...]) -> None:
        """Remember the handles a P2P call returned, so a ``wait()`` on one is written as a wait in its calls:
        one handle per call (gloo's batch), or handles that each complete the whole batch (a coalesced one).
        Over a device-completed group (NCCL, where ``wait()`` returns at once) the rank waits in them from now
        until the handle says its work completed (``completed_on_device``)."""
        works = [w for w in (works or ()) if w is not None]
        if not works or not keys:
            return
        keys = tuple(keys)
        per_call = len(works) == len(keys)
        if any(k >> SEQ_BITS in self._device_pairs for k in keys):
            self._hold_on_device(works, keys, per_call)
            return
        held = self._held
        with self._lock:   # held before the wrapper is put back: a wait on no handle cannot take it away
            for i, work in enumerate(works):
                wid = id(work)
                def forget(_: Any, wid: int = wid) -> None:
                    held.pop(wid, None)
                ref = weakref.ref(work, forget)
                held[wid] = HeldHandle(ref, keys[i:i + 1] if per_call else keys)
            if self._wait is not None and not self._armed:
                self._wait.work_class.wait = self._wait.wrapper
                self._armed = True

    def _hold_on_device(self, works: list, keys: tuple[int, ...], per_call: bool) -> None:
        data = wait_slots(keys, time_ns(), False)   # W in: open until the work completed
        with self._lock:
            for i, work in enumerate(works):
                self._on_device[id(work)] = HeldHandle(weakref.ref(work), keys[i:i + 1] if per_call else keys)
        self.writer.write(data)

    def handles_on_device(self) -> bool:
        """P2P calls over a device-completed group whose handles have not said they completed."""
        return bool(self._on_device)

    def completed_on_device(self) -> list[int]:
        """The keys of device-completed P2P calls whose handle says their work completed (or that the user dropped:
        nothing can say then), forgotten here; the sidecar writes them out."""
        done: list[int] = []
        with self._lock:
            for wid, held in list(self._on_device.items()):
                work = held.work()
                try:
                    finished = work is None or bool(work.is_completed())
                except Exception as exc:   # a handle that cannot say: taken as done, its failure counted
                    failed(Hook.COMPLETION, exc)
                    finished = True
                if finished:
                    del self._on_device[wid]
                    done.extend(held.keys)
        return done

    # -- torch's Work.wait --------------------------------------------------

    def install_wait(self, work_class: Any, original: Callable) -> None:
        """Prepare the wrapper of ``Work.wait`` (``hold`` puts it in place); once."""
        if self._wait is None:
            self._wait = WaitPatch(work_class, original, self._wrap_wait(original))

    def uninstall_wait(self) -> None:
        """torch's own ``Work.wait`` back in place for good, handles held or not."""
        if self._wait is not None:
            self.give_back_wait(unless_held=False)
            self._wait = None

    def give_back_wait(self, unless_held: bool = True) -> None:
        """torch's own ``Work.wait`` back in place (``unless_held``: only if no handle is held)."""
        with self._lock:
            if self._armed and self._wait is not None and not (unless_held and self._held):
                self._wait.work_class.wait = self._wait.original
                self._armed = False

    def _wrap_wait(self, original: Callable) -> Callable:
        """torch's ``Work.wait``, which writes W records around the wait on a P2P call's handle (any other
        handle's wait is torch's own, untouched)."""
        handles = self._held
        writer = self.writer
        give_back = self.give_back_wait

        def record(keys: tuple[int, ...], out: bool) -> None:
            data = wait_slots(keys, time_ns(), out)
            try:
                writer.append(data)
            except ValueError:    # the mapping is full: grow it
                writer.write(data)

        @functools.wraps(original)
        def wait(work: Any, *args: Any, **kwargs: Any) -> Any:
            held = handles.get(id(work))
            if held is None:
                if not handles:   # none held any more: torch's own wait until the next async call
                    try:
                        give_back()
                    except Exception as exc:
                        failed(Hook.TRACER, exc)
                return original(work, *args, **kwargs)
            keys = None
            try:   # rule 0, as in the traced call
                if held.work() is work:
                    keys = held.keys
                    record(keys, False)
            except Exception as exc:
                failed(Hook.TRACER, exc)
            result = original(work, *args, **kwargs)
            # Only a wait that returned ends the rank's wait in the record. One that raised is, nearly always, a
            # peer that died or was ended while this rank waited (distcheck's teardown after a hang): the rank
            # was stuck in that call, and its record must say so, not that the wait completed.
            if keys is not None:
                try:
                    record(keys, True)
                except Exception as exc:
                    failed(Hook.TRACER, exc)
            return result

        wait.__distcheck_original__ = original  # type: ignore[attr-defined]
        return wait
