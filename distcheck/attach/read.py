"""Reading a rank from outside, read-only: every thread's Python stack through py-spy (a maintained,
pip-installable reader that needs no code in the target and reads its memory without stopping it in
``--nonblocking`` mode), native frames where the Python stack says too little, and /proc's state and
``wchan``. No signal is sent and nothing is written into the process."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

from distcheck.errors import LaunchError
from distcheck.text import call_site

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
        return call_site(self.file, self.line, self.function)


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


def _beside_python() -> list[Path]:
    """Where ``pip install 'distcheck[attach]'`` put py-spy for this interpreter: beside it (a venv's bin, called
    by its path without the venv on PATH), its scripts folder, the user's (``pip install --user``)."""
    folders = [Path(sys.executable).parent]   # not resolved: a venv's python is a link to the base interpreter
    for scheme in (None, f"{os.name}_user"):
        try:
            folders.append(Path(sysconfig.get_path("scripts", scheme) if scheme else sysconfig.get_path("scripts")))
        except KeyError:
            continue
    return [f / "py-spy" for f in dict.fromkeys(folders)]


def reader() -> str:
    """The py-spy executable: the one installed with distcheck's interpreter, else the first on PATH; a clear
    error with the install hint when there is none."""
    for path in [*_beside_python(), shutil.which("py-spy")]:
        if path is not None and os.path.isfile(path) and os.access(path, os.X_OK):
            return str(path)
    raise LaunchError(f"distcheck attach reads stacks with py-spy, which is not installed (not beside "
                      f"{sys.executable}, not on PATH)", INSTALL_HINT)


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
    return parse_dump(pid, done.stdout, took)


def parse_dump(pid: int, output: str, took_s: float = 0.0) -> StackRead:
    """What ``py-spy dump --json`` printed (with ``--native``: native frames among the Python ones), as a read."""
    try:
        return StackRead(pid, threads=tuple(_thread(t) for t in json.loads(output)), took_s=took_s)
    except (ValueError, TypeError, KeyError) as exc:
        return StackRead(pid, error=f"py-spy's output could not be read: {exc}", took_s=took_s)


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
    """What /proc says of a process without touching it: its state letter, the kernel function it sleeps in,
    and the backends its threads are named for; ``alive`` False once it is gone (or a zombie)."""

    alive: bool
    state: str = ""
    wchan: str = ""
    backend: str = ""        # "gloo", "nccl", "nccl+gloo"; "" when no backend's thread runs in it


# The threads a backend's process group starts when it is created, by the names torch gives them (gloo: its work
# loop and its TCP transport's; NCCL: ProcessGroupNCCL's watchdog and heartbeat monitor). A rank's libraries do not
# say it (a CUDA build of torch loads libnccl whichever backend the job uses) and its environment names none.
_BACKEND_THREADS = {"pt_gloo_runloop": "gloo", "gloo_tcp_loop": "gloo", "pt_nccl_watchdg": "nccl",
                    "pt_nccl_heartbt": "nccl"}
BACKENDS = ("nccl", "gloo")   # in the order a job using both is named: "nccl+gloo"


def thread_names(pid: int) -> tuple[str, ...]:
    """The names of a process's threads (``/proc/<pid>/task/*/comm``: anyone may read them)."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return ()
    names = []
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/comm", encoding="utf-8", errors="replace") as f:
                names.append(f.read().strip())
        except OSError:
            continue
    return tuple(names)


def backend_of(names: tuple[str, ...] | list[str]) -> str:
    """The backends whose threads run among ``names``, "nccl+gloo" for both; "" for none."""
    found = {_BACKEND_THREADS[n] for n in names if n in _BACKEND_THREADS}
    return "+".join(b for b in BACKENDS if b in found)


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
    return ProcState(state not in ("Z", "X"), state, "" if wchan == "0" else wchan, backend_of(thread_names(pid)))
