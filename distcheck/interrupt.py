"""Ctrl-C and SIGTERM, from distcheck's first line to its last write (stdlib only: it is installed
before anything heavy is imported).

Three stages, one handler:

* start-up (imports, flag checks; nothing started, nothing written): the process ends at once, exit
  130, one line. Python's own KeyboardInterrupt cannot be relied on here: raised inside torch's
  import it is sometimes swallowed, and the run went on as if nobody had asked.
* a run (``begin_run``: the run dir exists, a report will be written): the request is recorded;
  while a launch is watched (``watched``) its watchdog ends it the way it ends a stall, each live
  rank's stack and Flight Recorder taken first, so the report says where every rank was; outside a
  launch, KeyboardInterrupt stops the session at the next unit.
* a second signal: whatever distcheck started is killed and the process ends at once. Not a SIGTERM
  that follows the first within ``SAME_REQUEST_S``: at its time limit Slurm sends SIGTERM, SIGCONT and
  SIGTERM again ~3 ms later, one request to stop, which must still end with a report.

Under Slurm, ``end_reason`` tells which of Slurm's endings it was (``launch.slurm.ending``). Before a job's
time limit distcheck asks itself to stop (``request_stop``, from ``launch.slurm.stop_before_end``'s timer): a
first request like a signal's, after which Slurm's own SIGTERMs are the same request.

Exit 130 on every path. The handler replaces an inherited SIG_IGN (a job started with ``&`` from a
script ignores SIGINT), so Ctrl-C and ``kill -INT`` are honoured however distcheck was started.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

EXIT_CODE = 130   # errors.ExitCode.INTERRUPTED (not imported: this module loads before anything else)
SIGNALS = ("SIGINT", "SIGTERM")
SAME_REQUEST_S = 1.0   # a SIGTERM this soon after the first is the same request (Slurm's time limit sends two)


@dataclass
class _State:
    installed: bool = False      # this process is the distcheck command (``install`` ran)
    running: bool = False        # a run dir exists: a report will be written
    watched: int = 0             # launches whose watchdog ends them on a request
    requested_at: float | None = None
    signal_name: str | None = None
    stop_everything: Callable[[], object] = lambda: None   # kills what distcheck started (``begin_run``)
    # What an interrupt before the run began leaves in the run dir already made (its report); none: no run dir yet.
    before_start: Callable[[str], None] | None = None
    ending: Any = None           # the EndReason, once asked (``end_reason``)
    own: bool = False            # the request is distcheck's own (``request_stop``), not a signal


_state = _State()


def install() -> None:
    """From distcheck's first line (``distcheck.__main__``, the top of ``distcheck.cli`` when it is the command)."""
    _state.installed = True
    for name in SIGNALS:
        signal.signal(getattr(signal, name), handler)


def handler(signum: int, frame: Any) -> None:
    name = signal.Signals(signum).name
    if _state.requested_at is not None and (_same_request(name) or (_state.own and name == "SIGTERM")):
        return
    if _state.requested_at is not None and _state.installed:
        _stop_at_once(name)
    _state.requested_at, _state.signal_name = time.time(), name
    if _state.installed and not _state.running:
        _say(f"distcheck: interrupted ({name}) before any rank started: nothing ran\n")
        if _state.before_start is not None:
            with contextlib.suppress(Exception):   # the exit is what was asked; the report is a courtesy
                _state.before_start(name)
        os._exit(EXIT_CODE)
    if _state.watched == 0:
        raise KeyboardInterrupt


def begin_run(stop_everything: Callable[[], object] = lambda: None) -> None:
    """The run dir exists: from here an interrupted run still writes its report. In a library caller
    (the pytest plugin), each run starts with no request: its own Ctrl-C reaches it as KeyboardInterrupt.
    ``stop_everything`` kills whatever distcheck started, should a second signal come."""
    if not _state.installed:
        _state.requested_at = _state.signal_name = _state.ending = None
        _state.own = False
    _state.running = True
    _state.stop_everything = stop_everything


def on_interrupt_before_start(write: Callable[[str], None]) -> None:
    """A run dir now exists before the run begins (a --run-dir checked with the flags): an interrupt from here
    to ``begin_run`` calls ``write(signal name)`` so the run dir holds a report saying so."""
    _state.before_start = write


def request_stop(name: str) -> None:
    """distcheck's own request to stop the run, from any thread (Slurm's time limit is near): recorded as a
    first signal would be, without raising; the watchdog and the run loop poll it. A SIGTERM after it is the
    same request (Slurm's own at the limit), a Ctrl-C a second one."""
    if _state.running and _state.requested_at is None:
        _state.requested_at, _state.signal_name, _state.own = time.time(), name, True


def requested() -> bool:
    return _state.requested_at is not None


def requested_at() -> float | None:
    return _state.requested_at


def signal_name() -> str | None:
    return _state.signal_name


def ending_once(decide: Callable[[], Any]) -> Any:
    """The request's ``EndReason``, decided once (``launch.slurm.requested_ending``), after the launch stopped."""
    if _state.ending is None:
        _state.ending = decide()
    return _state.ending


def _same_request(name: str) -> bool:
    return (name == "SIGTERM" == _state.signal_name and _state.requested_at is not None
            and time.time() - _state.requested_at < SAME_REQUEST_S)


@contextlib.contextmanager
def watched() -> Iterator[None]:
    """A launch whose watchdog ends it on a request (``Watchdog`` polls ``requested``): the handler
    then only records it, so torch's agent is not unwound mid-teardown."""
    _state.watched += 1
    try:
        yield
    finally:
        _state.watched -= 1


def reset() -> None:
    """A fresh state (the pytest plugin runs several sessions in one process; tests)."""
    global _state
    _state = _State()


def _stop_at_once(name: str) -> None:
    """A second Ctrl-C: no teardown of courtesy, no report; nothing distcheck started is left."""
    _say(f"distcheck: interrupted again ({name}): stopped at once\n")
    with contextlib.suppress(Exception):
        _state.stop_everything()
    os._exit(EXIT_CODE)


def _say(text: str) -> None:
    with contextlib.suppress(OSError):
        os.write(2, text.encode())
