"""Processes attach may not read: whose they are, whether they look like a torch.distributed job, and what to do.

A non-root user may not read another user's ``/proc/<pid>/environ`` (nor its memory, which py-spy reads), so
such a job's ranks cannot be told apart by their environment. What anyone may read is enough to name it: the
owner (``/proc/<pid>/status``), the command line and the threads' names (torchrun's ``pt_elastic``, gloo's
``pt_gloo_runloop``, NCCL's ``pt_nccl_watchdg``)."""

from __future__ import annotations

import os
import pwd
from collections.abc import Sequence
from dataclasses import dataclass

import psutil

from distcheck.attach.read import DENIED_HINT, thread_names
from distcheck.errors import DistcheckError, LaunchError, UsageError
from distcheck.text import plural

_LAUNCHERS = ("torchrun", "torch.distributed.run", "torch.distributed.launch")
_DIST_THREADS = ("pt_elastic", "pt_gloo_runloop", "gloo_tcp_loop", "pt_nccl_watchdg", "pt_nccl_heartbt")
_SHOWN = 60   # characters of a command line shown


@dataclass(frozen=True)
class Foreign:
    """A process whose environment this user may not read."""

    pid: int
    uid: int
    user: str                     # its owner's name ("uid N" where it has none)
    command: str                  # its command line, shortened
    threads: tuple[str, ...] = ()

    @property
    def others(self) -> bool:
        """Another user's, not ours (ours, and still unreadable: a container's or a set-uid program's rules)."""
        return self.uid != os.getuid()


def user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"


def foreign(pid: int) -> Foreign | None:
    """What anyone may read of a process (None: gone)."""
    try:
        proc = psutil.Process(pid)
        uid, command = proc.uids().real, " ".join(proc.cmdline())
    except psutil.Error:
        return None
    shown = command if len(command) <= _SHOWN else command[: _SHOWN - 3] + "..."
    return Foreign(pid, uid, user_name(uid), shown, thread_names(pid))


def looks_distributed(f: Foreign) -> bool:
    """A launcher by its command line, or a process with a backend's or torchrun's threads."""
    return any(w in f.command for w in _LAUNCHERS) or any(t.startswith(_DIST_THREADS) for t in f.threads)


def _what_to_do(f: Foreign) -> str:
    as_owner = "" if f.uid == 0 else f"as {f.user} (sudo -u {f.user} distcheck attach {f.pid}) or "
    ptrace = "" if f.uid == 0 else (f"; as {f.user}, reading the ranks' stacks also needs kernel.yama.ptrace_scope 0 "
                                    "(sudo sysctl kernel.yama.ptrace_scope=0)")
    return f"run attach {as_owner}as root (sudo distcheck attach {f.pid}){ptrace}; in a container, with CAP_SYS_PTRACE"


def no_job_error(denied: Sequence[Foreign], asked: Sequence[int]) -> DistcheckError:
    """Why no job was found, as one line and a hint: the given process (or a job on the node) is another user's,
    or could not be read; else there is none."""
    named = [f for f in denied if f.pid in asked] or list(denied)
    me = user_name(os.getuid())
    cannot = f"attach runs as {me} and may not read another user's processes (their environment, their stacks)"
    if named and named[0].others and asked:
        f, more = named[0], len(denied) - 1
        also = f" (and {more} more process{'es' if more > 1 else ''} of theirs)" if more > 0 else ""
        return LaunchError(f"process {f.pid} ({f.command}){also} belongs to user {f.user}; {cannot}", _what_to_do(f))
    if named and named[0].others:
        listed = "; ".join(f"{f.pid} ({f.user}: {f.command})" for f in named[:4])
        many = (plural(len(named), "process", "processes") + " of other users "
                + ("looks" if len(named) == 1 else "look"))
        return LaunchError(f"no torch.distributed job of {me}'s found on this node; {many} like one: {listed}"
                           f"{'; ...' if len(named) > 4 else ''}; {cannot}",
                           _what_to_do(named[0]))
    if named:
        return LaunchError(f"the environment of process {named[0].pid} ({named[0].command}) could not be read "
                           f"(permission denied, though it runs as {me})", DENIED_HINT)
    if asked:
        return UsageError(f"no rank of a torch.distributed job in process {', '.join(map(str, asked))} or below it "
                          "(no RANK and WORLD_SIZE in their environment)",
                          "give the pid of a rank or of its launcher (torchrun, srun)")
    return UsageError("no torch.distributed job found on this node (no process with RANK and WORLD_SIZE)",
                      "give the ranks' or their launcher's pid, or run attach as the job's user or root")
