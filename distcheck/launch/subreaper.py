"""The parent of the user's launch command under ``distcheck run -- CMD``:
``python -m distcheck.launch.subreaper --watch-fd FD CMD [ARGS...]``.

It makes itself a child subreaper (``prctl(PR_SET_CHILD_SUBREAPER)``): every process the
command starts, at any depth, stays below it even when its own parent exits first (a
torchrun agent, an ``mp.spawn`` parent), so walking the guard's descendants finds them
all. Descriptor FD is a pipe from distcheck that is never written: end of file means
distcheck is done with the job or gone — the kernel closes the pipe even when distcheck
is SIGKILLed, which no signal handler would see. Then, as on SIGTERM and when the
command exits, the guard ends every process below it before it exits itself. The
command's own stdin is distcheck's, as the user gave it (rule 0: a command that reads its
input reads what it would read without distcheck), and the pipe is never passed on to it.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading

PR_SET_CHILD_SUBREAPER = 36
_lock = threading.Lock()


def become_subreaper() -> bool:
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):   # not Linux: the process group and tree walk remain
        return False


def end_everything_below(grace_s: float = 2.0) -> None:
    """SIGTERM (ranks dump their stacks on it), a grace period, SIGKILL; then reap the orphans."""
    from distcheck.launch import procs

    with _lock:   # distcheck's EOF, a SIGTERM and the command's end may all ask at once
        procs.kill_descendants(grace_s)
        _reap()


def _reap() -> None:
    """Orphans that ended below a subreaper are its zombies until it waits for them."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _watch_distcheck(fd: int) -> None:
    try:
        while os.read(fd, 4096):
            pass
    except OSError:
        pass
    end_everything_below()
    os._exit(128 + signal.SIGKILL)


def _on_sigterm(signum: int, frame: object) -> None:
    end_everything_below()
    os._exit(128 + signum)


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[0] != "--watch-fd" or not argv[1].isdigit():
        sys.stderr.write("usage: python -m distcheck.launch.subreaper --watch-fd FD CMD [ARGS...]\n")
        return 2
    watched, argv = int(argv[1]), argv[2:]
    from distcheck.rank.oom_standing import take_job_standing

    take_job_standing()   # the command and all it starts get the OOM standing meant for the job
    become_subreaper()
    signal.signal(signal.SIGTERM, _on_sigterm)
    signal.signal(signal.SIGINT, _on_sigterm)
    try:
        child = subprocess.Popen(argv)
    except OSError as exc:
        sys.stderr.write(f"distcheck: cannot run {argv[0]!r}: {exc.strerror}\n")
        return 127
    threading.Thread(target=_watch_distcheck, args=(watched,), name="distcheck-guard", daemon=True).start()
    code = child.wait()
    end_everything_below()   # whatever the command left behind is no longer the job's
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    sys.stdout.flush()
    os._exit(main(sys.argv[1:]))
