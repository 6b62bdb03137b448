"""distcheck's injection for ``distcheck run -- CMD``: this folder goes first on PYTHONPATH,
so every Python process the command starts (by exec, spawn, forkserver, or a fork of one
of them) runs this at startup. With DISTCHECK_LAUNCH_DIR set it waits, through a finder of
its own on ``sys.meta_path``, for the process to import ``torch.distributed.distributed_c10d``
or ``torch.multiprocessing.spawn``, and only then imports and arms
``distcheck.rank.injected``; without it, it does nothing. Either way it first runs the
``sitecustomize`` it shadows, as Python would have.

Why wait: nothing of the ``distcheck`` package may be imported at start-up. pytest loads
distcheck's pytest11 plugin itself and rewrites its asserts; a package already imported
makes it warn (``PytestAssertRewriteWarning``), and ``-W error`` turns that warning into a
collection error. By the time a test imports torch.distributed, pytest's plugins are loaded.

This folder is not a package on purpose: it must put nothing on the path but this file.
"""

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))


# The modules whose import arms distcheck (``injected.activate`` then hooks the one not yet imported).
_TRIGGERS = ("torch.distributed.distributed_c10d", "torch.multiprocessing.spawn")


def _arm_distcheck() -> None:
    """Import distcheck and arm its hooks (first trigger only)."""
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


class _ArmOnImport:
    """A meta-path finder that arms distcheck right after the first trigger module executed.
    It imports nothing itself; it only wraps the loader the other finders return."""

    def __init__(self) -> None:
        self.armed = False

    def find_spec(self, fullname, path, target=None):  # noqa: ANN001, ANN201 (the finder protocol)
        if self.armed or fullname not in _TRIGGERS:
            return None
        try:
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(fullname, path, target)
                if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    self._wrap(spec.loader)
                    return spec
        except Exception:   # the import system asks the other finders itself, as without us
            pass
        return None

    def _wrap(self, loader) -> None:  # noqa: ANN001
        original = loader.exec_module

        def exec_module(module) -> None:  # noqa: ANN001
            original(module)
            if not self.armed:
                self.armed = True
                _remove(self)
                _arm_distcheck()

        loader.exec_module = exec_module


def _remove(finder: _ArmOnImport) -> None:
    try:
        sys.meta_path.remove(finder)
    except ValueError:   # someone else rearranged sys.meta_path: our finder is inert once armed
        pass


def _arm_later() -> None:
    if not os.environ.get("DISTCHECK_LAUNCH_DIR"):
        return
    if any(name in sys.modules for name in _TRIGGERS):   # already imported (not at a real start-up)
        _arm_distcheck()
        return
    sys.meta_path.insert(0, _ArmOnImport())


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
_arm_later()
