"""Reading a rank from outside, read-only: every thread's Python stack through py-spy (a maintained,
pip-installable reader that needs no code in the target and reads its memory without stopping it in
``--nonblocking`` mode), native frames where the Python stack says too little, and /proc's state and
``wchan``. No signal is sent and nothing is written into the process."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from dataclasses import dataclass

from distcheck.errors import LaunchError

INSTALL_HINT = "install the reader: pip install 'distcheck[attach]' (py-spy>=0.4)"
DENIED_HINT = ("run attach as the job's user or as root; in a container add CAP_SYS_PTRACE "
               "(docker run --cap-add SYS_PTRACE, a pod's securityContext.capabilities.add: [SYS_PTRACE]); "
               "with kernel.yama.ptrace_scope=1 only root or a parent may read: sudo sysctl kernel.yama.ptrace_scope=0")
_DENIED_WORDS = ("Permission denied", "Operation not permitted", "EPERM", "ptrace")


@dataclass(frozen=True)
class Frame:
    file: str
    line: int
    function: str            # py-spy's qualified name (``Metric._sync_dist``)
    self_repr: str | None = None   # the frame's ``self``, as py-spy shows it (``<BinaryAUROC at 0x...>``)
    native: bool = False

    def __str__(self) -> str:
        return f"{self.file}:{self.line}:{self.function}"


@dataclass(frozen=True)
class Thread:
    name: str
    os_id: int
    frames: tuple[Frame, ...]      # innermost first
    active: bool = False           # running or runnable when read, as py-spy tells (a sleeping or blocked thread: not)


@dataclass(frozen=True)
class StackRead:
    """One read of one process: its threads, or why there are none, and how long the read took."""

    pid: int
    threads: tuple[Thread, ...] = ()
    error: str | None = None
    denied: bool = False
    took_s: float = 0.0

    def main(self) -> Thread | None:
        return next((t for t in self.threads if t.os_id == self.pid), self.threads[0] if self.threads else None)


def reader() -> str:
    """The py-spy executable; a clear error with the install hint when it is missing."""
    path = shutil.which("py-spy")
    if path is None:
        raise LaunchError("distcheck attach reads stacks with py-spy, which is not installed", INSTALL_HINT)
    return path


def read_stacks(pid: int, *, native: bool = False, with_locals: bool = False, timeout_s: float = 5.0) -> StackRead:
    """All threads of ``pid``. Without ``native`` the process is never paused (``--nonblocking``); with it,
    py-spy stops it while it unwinds (measured in benchmarks/attach.py), bounded by ``timeout_s``."""
    cmd = [reader(), "dump", "--pid", str(pid), "--json"]
    cmd += ["--native"] if native else ["--nonblocking"]
    cmd += ["--locals"] if with_locals else []
    start = time.monotonic()
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        return StackRead(pid, error=f"py-spy did not answer in {timeout_s:g} s", took_s=time.monotonic() - start)
    took = time.monotonic() - start
    if done.returncode != 0:
        err = (done.stderr.strip().splitlines() or ["py-spy failed"])[0]
        return StackRead(pid, error=err, denied=any(w in done.stderr for w in _DENIED_WORDS), took_s=took)
    try:
        return StackRead(pid, threads=tuple(_thread(t) for t in json.loads(done.stdout)), took_s=took)
    except (ValueError, TypeError, KeyError) as exc:
        return StackRead(pid, error=f"py-spy's output could not be read: {exc}", took_s=took)


def _thread(t: dict) -> Thread:
    return Thread(str(t.get("thread_name") or ""), int(t.get("os_thread_id") or 0),
                  tuple(_frame(f) for f in t.get("frames") or ()), bool(t.get("active")))


def _frame(f: dict) -> Frame:
    me = next((v.get("repr") for v in f.get("locals") or () if v.get("name") == "self"), None)
    filename = str(f.get("filename") or "")
    native = not filename.endswith(".py") and not filename.startswith("<")
    return Frame(filename, int(f.get("line") or 0), str(f.get("name") or "?"), me, native)


@dataclass(frozen=True)
class ProcState:
    """What /proc says of a process without touching it: its state letter and the kernel function it
    sleeps in; ``alive`` False once it is gone (or a zombie)."""

    alive: bool
    state: str = ""
    wchan: str = ""


def proc_state(pid: int) -> ProcState:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rpartition(b")")[2].split()[0].decode()
    except (OSError, IndexError):
        return ProcState(False)
    try:
        with open(f"/proc/{pid}/wchan") as f:
            wchan = f.read().strip()
    except OSError:
        wchan = ""
    return ProcState(state not in ("Z", "X"), state, "" if wchan == "0" else wchan)
