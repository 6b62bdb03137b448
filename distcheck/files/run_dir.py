"""Run-dir checks before anything is launched.

* A run dir must be writable, with room for traces: checked with a real write
  (read-only file systems, a path below a regular file, a full disk), so the
  user gets one clear error before any rank starts.
* Directories distcheck creates are private to the user (0700): traces, stacks
  and logs hold paths, arguments and whatever the job printed.
* A re-used ``--run-dir`` must not mix runs: the traces are append-only, so a
  stale launch dir would add the previous run's collectives to this one's, and
  a stale ``release`` file would let the new ranks leave early. A launch dir
  left by an earlier run is emptied before its launch; one that a *live*
  distcheck is still using is refused.
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

import psutil

from distcheck.errors import LaunchError
from distcheck.files.launch_dir import LaunchFiles

PRIVATE = 0o700
PROBE_BYTES = 64 * 1024


def _probe(path: Path) -> None:
    probe = path / f".distcheck-write-test-{os.getpid()}"
    try:
        with open(probe, "wb") as f:
            f.write(b"\0" * PROBE_BYTES)
            f.flush()
            os.fsync(f.fileno())
    finally:
        try:
            probe.unlink()
        except OSError:
            pass


def make_run_dir(path: Path) -> Path:
    """Create (0700) or re-use ``path``; raise LaunchError when it cannot hold a run."""
    try:
        if path.exists() and not path.is_dir():
            raise LaunchError(f"the run directory {path} exists and is not a directory",
                              "pick another place with --run-dir")
        path.mkdir(parents=True, exist_ok=True, mode=PRIVATE)
        _probe(path)
    except OSError as exc:
        reason = exc.strerror or str(exc)
        if exc.errno == errno.ENOSPC:
            hint = "free some space there, or pick another place with --run-dir"
        else:
            hint = "pick a writable place with --run-dir"
        raise LaunchError(f"cannot write the run directory {path}: {reason}", hint) from None
    return path.resolve()


def prepare_launch_dir(path: Path) -> None:
    """A fresh, private launch dir at ``path``, whatever an earlier run left there."""
    if path.is_dir() and any(path.iterdir()):
        if not LaunchFiles.is_launch_dir(path):
            raise LaunchError(
                f"{path} already exists and is not a distcheck launch directory: refusing to write into it",
                "pick an empty or new --run-dir",
            )
        users = _processes_mentioning(str(path))
        if users:
            raise LaunchError(
                f"{path} is in use by running processes (pids {', '.join(str(p.pid) for p in users[:5])}): "
                "another distcheck run uses the same --run-dir",
                "wait for it to finish, or pick another --run-dir",
            )
        try:
            shutil.rmtree(path)
        except OSError as exc:
            raise LaunchError(f"cannot clear the stale launch directory {path}: {exc.strerror}",
                              "remove it by hand, or pick another --run-dir") from None
    try:
        path.mkdir(parents=True, exist_ok=True, mode=PRIVATE)
        os.chmod(path, PRIVATE)
    except OSError as exc:
        raise LaunchError(f"cannot create the launch directory {path}: {exc.strerror}",
                          "pick a writable place with --run-dir") from None


def _processes_mentioning(path: str) -> list[psutil.Process]:
    """Live processes (not this one) with ``path``, or a path below it, as a command-line argument."""
    below = path.rstrip(os.sep) + os.sep
    found = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        try:
            args = p.info["cmdline"] or []
        except psutil.Error:
            continue
        if p.pid != os.getpid() and any(a == path or a.startswith(below) for a in args) and p.is_running():
            found.append(p)
    return found
