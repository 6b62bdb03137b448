"""Library-aware attribution, without importing the libraries.

Lightning reduces ``self.log(..., sync_dist=True)`` values at the end of the
epoch, far from the ``self.log`` line that asked for it: the stack then shows
``trainer.validate(...)`` and ``_ResultMetric.compute``. When (and only when)
the user's script imports Lightning, a post-import hook wraps
``LightningModule.log`` and ``log_dict`` to remember the line each logged name
came from; the tracer then attributes the epoch-end collective to that line.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable, Mapping
from types import ModuleType
from typing import Any

from distcheck.rank.guard import Hook, failed
from distcheck.rank.patches import Patches

# logged name -> "file:line:function" of the user's self.log(...) / self.log_dict(...) call
LOG_SITES: dict[str, str] = {}

# Sites of the wrapped log/log_dict calls in progress, outermost first. log_dict calls
# self.log per key: the user's log_dict line, not Lightning's frame, must be the one kept.
_OUTER: list[str] = []

LIGHTNING_MODULES = ("lightning.pytorch.core.module", "pytorch_lightning.core.module")


class _PostImportHook(importlib.abc.MetaPathFinder):
    """Runs a callback right after a named module finished executing; ``owner``: the hook whose
    failure it counts (rule 0: the user's import goes on as without distcheck)."""

    def __init__(self, hooks: Mapping[str, Callable[[ModuleType], None]], owner: Hook = Hook.RANK_SETUP) -> None:
        self.hooks, self.owner = hooks, owner

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        hook = self.hooks.get(fullname)
        if hook is None:
            return None
        try:
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(fullname, path, target)
                if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    _wrap_exec(spec.loader, hook, self.owner)
                    return spec
        except Exception as exc:   # the import system asks the other finders itself, as without us
            failed(self.owner, exc)
        return None


def _wrap_exec(loader: Any, hook: Callable[[ModuleType], None], owner: Hook) -> None:
    original = loader.exec_module

    def exec_module(module: ModuleType) -> None:
        original(module)
        try:
            hook(module)
        except Exception as exc:   # never break the user's import (rule 0)
            failed(owner, exc)

    loader.exec_module = exec_module


def _caller_site() -> str:
    caller = sys._getframe(2)   # 0: here, 1: the wrapper, 2: whoever called self.log / self.log_dict
    return f"{caller.f_code.co_filename}:{caller.f_lineno}:{caller.f_code.co_name}"


def _outermost(call: Callable[[], Any], site: str) -> Any:
    """Run ``call`` with ``site`` pushed; a nested wrapped call sees the outermost site in _OUTER[0]."""
    _OUTER.append(site)
    try:
        return call()
    finally:
        _OUTER.pop()


def _patch_lightning_log(module: ModuleType) -> None:
    cls = getattr(module, "LightningModule", None)
    if cls is None or getattr(cls.log, "__distcheck__", False):
        return
    original_log, original_log_dict = cls.log, cls.log_dict

    # Rule 0: the user's self.log runs once and as it is; an error in noting its line is only counted.
    @functools.wraps(original_log)
    def log(self: Any, name: str, *args: Any, **kwargs: Any) -> Any:
        try:
            site = _OUTER[0] if _OUTER else _caller_site()
            LOG_SITES[name] = site
        except Exception as exc:
            failed(Hook.LIGHTNING, exc)
            return original_log(self, name, *args, **kwargs)
        return _outermost(lambda: original_log(self, name, *args, **kwargs), site)

    @functools.wraps(original_log_dict)
    def log_dict(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            site = _OUTER[0] if _OUTER else _caller_site()
        except Exception as exc:
            failed(Hook.LIGHTNING, exc)
            return original_log_dict(self, *args, **kwargs)
        return _outermost(lambda: original_log_dict(self, *args, **kwargs), site)

    log.__distcheck__ = log_dict.__distcheck__ = True  # type: ignore[attr-defined]
    _PATCHES.set(cls, "log", log)
    _PATCHES.set(cls, "log_dict", log_dict)


_PATCHES = Patches()   # the rank's record of what distcheck replaced (``rank.patches``), once installed


def install(patches: Patches | None = None) -> None:
    """Attribute Lightning's deferred self.log / self.log_dict reductions to their lines; what it replaces goes
    through ``patches``."""
    global _PATCHES
    _PATCHES = patches or Patches()
    for name in LIGHTNING_MODULES:
        if name in sys.modules:
            _patch_lightning_log(sys.modules[name])
    _PATCHES.finder(_PostImportHook({name: _patch_lightning_log for name in LIGHTNING_MODULES}, Hook.LIGHTNING))
    _PATCHES.on_undo(_forget_patches)


def _forget_patches() -> None:
    global _PATCHES
    _PATCHES = Patches()


def logged_name(target: Any) -> str | None:
    """The self.log name behind a Lightning _ResultMetric (duck-typed: meta.name)."""
    meta = getattr(target, "meta", None)
    name = getattr(meta, "name", None)
    return name if isinstance(name, str) else None
