"""The files the user named: their code is the user's wherever it lives.

A script run from ``site-packages`` (accelerate's own test scripts), any ``.py`` file given on the
command line, and the test files or folders given to pytest are the user's code, even where
``files.stacks.classify_file`` would call a frame in them a library's. ``distcheck run`` names them
once: in its own process (``declare``, for its diagnosis of stack dumps) and in every rank it starts,
however the command starts them (``DISTCHECK_USER_FILES`` in the ranks' environment: absolute paths joined by
``os.pathsep``), so all agree.
"""

from __future__ import annotations

import os
import sysconfig
from collections.abc import Iterable, Sequence

USER_FILES_ENV = "DISTCHECK_USER_FILES"

_cache: tuple[str, frozenset[str], tuple[str, ...]] = ("", frozenset(), ())


def _roots() -> tuple[str, ...]:
    """Folders that hold other people's code as a whole: naming one of them (or a folder above) is not
    naming the user's code."""
    paths = sysconfig.get_paths()
    return tuple(os.path.abspath(paths[n]) for n in ("stdlib", "platstdlib", "purelib", "platlib") if n in paths)


def named_paths(argv: Sequence[str], cwd: str | None = None) -> list[str]:
    """The ``.py`` files and folders named on a command line (``path::test`` as pytest writes it, and
    ``--opt=path``), as absolute paths; a folder only if it holds no installed packages."""
    cwd = cwd or os.getcwd()
    found: list[str] = []
    roots = _roots()
    for arg in argv:
        value = arg.split("=", 1)[1] if arg.startswith("-") and "=" in arg else arg
        value = value.split("::", 1)[0]
        if not value or value.startswith("-"):
            continue
        path = os.path.abspath(os.path.join(cwd, value))
        if os.path.isfile(path) and path.endswith(".py"):
            found.append(path)
        elif os.path.isdir(path) and not any(r == path or r.startswith(path + os.sep) for r in roots):
            found.append(path.rstrip(os.sep) + os.sep)
    return list(dict.fromkeys(found))


_declared: str | None = None   # named in this process (distcheck's own), which keeps its environment as it is


def environment(paths: Iterable[str]) -> dict[str, str]:
    """What the processes distcheck starts are given to know the same files as the user's."""
    joined = os.pathsep.join(dict.fromkeys(p for p in paths if p))
    return {USER_FILES_ENV: joined} if joined else {}


def declare(paths: Iterable[str]) -> None:
    """Name these files and folders as the user's in this process (never through its environment: under the
    pytest plugin this process is the user's own pytest)."""
    global _declared
    _declared = os.pathsep.join(dict.fromkeys(p for p in paths if p))


def is_named(path: str) -> bool:
    """Whether an absolute path is a file the user named, or inside a folder they named."""
    global _cache
    raw = _declared if _declared is not None else os.environ.get(USER_FILES_ENV, "")
    if not raw:
        return False
    if raw != _cache[0]:
        parts = [p for p in raw.split(os.pathsep) if p]
        _cache = (raw, frozenset(p for p in parts if not p.endswith(os.sep)),
                  tuple(p for p in parts if p.endswith(os.sep)))
    return path in _cache[1] or any(path.startswith(d) for d in _cache[2])
