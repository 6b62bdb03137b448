"""The handles of P2P calls (``isend``, ``irecv``, ``batch_isend_irecv``) and other async calls: a ``wait()`` on one
is where the rank blocks in those calls, so it is written as W records around the wait. Mixed into
``rank.tracer.Tracer``.

torch's ``Work.wait`` is replaced only while such a handle is held: every blocking collective calls ``wait()`` on
its own handle from Python, and a job that holds none (the common case) pays nothing for the wrapper. It is
replaced again by the next async call, and given back by the first wait on another handle once none is held.
"""

from __future__ import annotations

import functools
import weakref
from time import time_ns
from typing import Any, Callable, NamedTuple

from distcheck.files.trace import wait_slots
from distcheck.rank.guard import Hook, failed


class HeldHandle(NamedTuple):
    work: weakref.ref           # the handle (weakly: a handle the user drops is forgotten)
    keys: tuple[int, ...]       # the call keys it completes


class Handles:
    """The handle half of ``Tracer`` (its state: ``_handles``, id(work) -> ``HeldHandle``; ``_work_wait``: (torch's
    Work class, its own wait, the wrapper); ``_wait_armed``: the wrapper in place; ``_wait_lock``; ``writer``)."""

    def _hold(self, works: Any, keys: list[int] | tuple[int, ...]) -> None:
        """Remember the handles a P2P call returned, so a ``wait()`` on one is written as a wait in its calls:
        one handle per call (gloo's batch), or handles that each complete the whole batch (a coalesced one)."""
        works = [w for w in (works or ()) if w is not None]
        if not works or not keys:
            return
        keys = tuple(keys)
        per_call = len(works) == len(keys)
        handles = self._handles
        with self._wait_lock:   # held before the wrapper is put back: a wait on no handle cannot take it away
            for i, work in enumerate(works):
                wid = id(work)
                ref = weakref.ref(work, lambda _, wid=wid: handles.pop(wid, None))
                handles[wid] = HeldHandle(ref, keys[i:i + 1] if per_call else keys)
            if self._work_wait is not None and not self._wait_armed:
                work_class, _, wrapper = self._work_wait
                work_class.wait = wrapper
                self._wait_armed = True

    def _install_wait(self, work_class: Any, original: Callable) -> None:
        """Prepare the wrapper of ``Work.wait`` (``_hold`` puts it in place)."""
        self._work_wait = (work_class, original, self._wrap_wait(original))

    def _give_back_wait(self, unless_held: bool = True) -> None:
        """torch's own ``Work.wait`` back in place (``unless_held``: only if no handle is held)."""
        with self._wait_lock:
            if self._wait_armed and not (unless_held and self._handles):
                work_class, original, _ = self._work_wait
                work_class.wait = original
                self._wait_armed = False

    def _wrap_wait(self, original: Callable) -> Callable:
        """torch's ``Work.wait``, which writes W records around the wait on a P2P call's handle (any other
        handle's wait is torch's own, untouched)."""
        handles = self._handles
        writer = self.writer
        give_back = self._give_back_wait

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
            try:   # rule 0, as in wrap()
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
