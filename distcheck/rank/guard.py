"""Rule 0 inside the user's process: an error in one of distcheck's own hooks never reaches the user.

Every hook distcheck runs in a rank (the tracer around each collective, the C++-collective sidecar,
the torchmetrics and DataLoader recorders, the Lightning attribution, the stack dumps, the rank's
end hooks) catches its own failure and calls ``failed``: the failure is counted per hook, the first
one's message kept, and the counts go into the rank's status file (``RankStatus.hook_failures``),
from which ``diagnose.coverage`` reports what was not recorded, and why. The user's call goes on
as it would without distcheck: its result returned, its own exception raised unchanged.

Cheap: nothing runs until a hook fails; then a dict update, and a status write at the 1st, 2nd,
4th, 8th... failure of a hook (a hook failing on every call does not write on every call).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from distcheck.models import Hook


_FAILURES: dict[str, dict[str, Any]] = {}   # hook -> {"count": n, "error": "Type: first line"}
_publish: Callable[[dict[str, dict[str, Any]]], None] | None = None


def failed(hook: Hook, exc: BaseException) -> None:
    """Count a failure of ``hook`` (call it from the hook's ``except``); never raises."""
    try:
        entry = _FAILURES.get(hook.value)
        if entry is None:
            message = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            entry = _FAILURES[hook.value] = {"count": 0, "error": f"{type(exc).__name__}: {message}"[:300]}
        entry["count"] += 1
        if entry["count"] & (entry["count"] - 1) == 0:
            _send()
    except Exception:   # counting must not fail the hook's caller either
        pass


class CapReached(Exception):
    """A recorder reached the cap on what it keeps in the user's process: said once, as a coverage note."""


def capped(hook: Hook, why: str) -> None:
    """Say (once per hook) that a recorder stopped keeping something at its memory cap; never raises."""
    if hook.value not in _FAILURES:
        failed(hook, CapReached(why))


def set_publisher(publish: Callable[[dict[str, dict[str, Any]]], None] | None) -> None:
    """Where counts go (the rank's status file); failures counted before it was set are sent now."""
    global _publish
    _publish = publish
    if _FAILURES:
        _send()


def reset() -> None:
    """Forget the counts (a process's next generation reports its own)."""
    _FAILURES.clear()


def failures() -> dict[str, dict[str, Any]]:
    """A copy of the counts so far (hook -> {count, error})."""
    return {k: dict(v) for k, v in _FAILURES.items()}


def _send() -> None:
    publish = _publish
    if publish is None:
        return
    try:
        publish(failures())
    except Exception:   # a status that cannot be written: the counts go out with the next one
        pass
