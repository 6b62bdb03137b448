"""distcheck's injection for ``distcheck run -- CMD``: this folder goes first on PYTHONPATH,
so every Python process the command starts (by exec, spawn, forkserver, or a fork of one
of them) runs this at startup. With DISTCHECK_LAUNCH_DIR set it arms
``distcheck.rank.injected`` (cheap: torch is not imported here); without it, it does
nothing. Either way it then runs the ``sitecustomize`` it shadows, as Python would have.

This folder is not a package on purpose: it must put nothing on the path but this file.
"""

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))


def _arm_distcheck() -> None:
    if not os.environ.get("DISTCHECK_LAUNCH_DIR"):
        return
    # The checkout holding distcheck, appended (never first: it must not shadow the user's
    # modules) for a Python that does not have distcheck installed.
    root = os.path.dirname(os.path.dirname(os.path.dirname(_HERE)))
    added = root not in sys.path
    if added:
        sys.path.append(root)
    try:
        from distcheck.rank import injected

        injected.activate()
    except Exception as exc:   # never break the user's process: it just runs untraced
        sys.stderr.write(f"distcheck: not tracing process {os.getpid()}: {type(exc).__name__}: {exc}\n")
    finally:
        if added:
            sys.path.remove(root)


def _chain() -> None:
    """Run the environment's own sitecustomize, which this file hides by coming first."""
    import importlib.machinery
    import importlib.util

    rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)


try:
    _chain()
except Exception:   # as site.py does for a failing sitecustomize: say so, carry on
    import traceback

    traceback.print_exc()
_arm_distcheck()
