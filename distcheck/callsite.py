"""Who issued a collective: the user's line, the library frame, and the label.

* callsite — the innermost frame of the user's own code (not the standard
  library, not torch, not distcheck, not an installed library);
* library callsite — the innermost installed-library frame (torchmetrics,
  lightning, ...) below it, kept because it says *how* the call was made;
* label — the entry point into the ``nn.Module`` that issued the call: the
  outermost frame on the stack whose ``self`` is the module seen innermost
  (``BinaryAUROC.compute``, not ``BinaryAUROC._sync_dist``).
"""

from __future__ import annotations

import os
import sys
import sysconfig
from types import CodeType, FrameType

USER, LIBRARY, TORCH, SKIP = 0, 1, 2, 3

_DISTCHECK_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
_BUILTIN_SCENARIOS_DIR = os.path.join(_DISTCHECK_DIR, "builtin_scenarios") + os.sep


def _dirs(*names: str) -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    found = {os.path.abspath(paths[n]) + os.sep for n in names if n in paths}
    return tuple(sorted(found))


_STDLIB_DIRS = _dirs("stdlib", "platstdlib")
_SITE_DIRS = _dirs("purelib", "platlib")


def _torch_dir() -> str:
    torch = sys.modules.get("torch")
    if torch is not None and getattr(torch, "__file__", None):
        return os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
    return os.sep + "torch" + os.sep


def classify_file(filename: str, torch_dir: str) -> int:
    if filename.startswith("<"):
        return SKIP
    path = os.path.abspath(filename)
    if path.startswith(_BUILTIN_SCENARIOS_DIR):
        return USER
    if path.startswith(_DISTCHECK_DIR):
        return SKIP
    if path.startswith(torch_dir):
        return TORCH
    if any(path.startswith(d) for d in _SITE_DIRS) or "site-packages" in path or "dist-packages" in path:
        return LIBRARY
    if any(path.startswith(d) for d in _STDLIB_DIRS):
        return SKIP
    return USER


# Module methods that stand for "the module was called".
_CALL_ENTRY = {"_wrapped_call_impl": "forward", "_call_impl": "forward"}


class CallsiteResolver:
    """Resolves call sites with per-code-object caches (the hot path)."""

    def __init__(self) -> None:
        self._kind: dict[str, int] = {}
        self._has_self: dict[CodeType, bool] = {}
        self._torch_dir = _torch_dir()
        self._module_type: type | None = None

    def _file_kind(self, filename: str) -> int:
        kind = self._kind.get(filename)
        if kind is None:
            kind = self._kind[filename] = classify_file(filename, self._torch_dir)
        return kind

    def _code_has_self(self, code: CodeType) -> bool:
        has = self._has_self.get(code)
        if has is None:
            has = self._has_self[code] = (
                (code.co_argcount > 0 and code.co_varnames[:1] == ("self",))
                or "self" in code.co_freevars
            )
        return has

    def _is_module(self, obj: object) -> bool:
        if self._module_type is None:
            import torch.nn
            self._module_type = torch.nn.Module
        return isinstance(obj, self._module_type)

    def resolve(self, frame: FrameType | None) -> tuple[str | None, str | None, str | None]:
        """(callsite, library_callsite, label) for the stack starting at ``frame``."""
        callsite = library = None
        target = None
        label_frame = None
        depth = 0
        while frame is not None and depth < 96:
            code = frame.f_code
            kind = self._file_kind(code.co_filename)
            if callsite is None:
                if kind == USER:
                    callsite = f"{code.co_filename}:{frame.f_lineno}:{code.co_name}"
                elif kind == LIBRARY and library is None:
                    library = f"{code.co_filename}:{frame.f_lineno}:{code.co_name}"
            if kind != SKIP and self._code_has_self(code):
                obj = frame.f_locals.get("self")
                if target is None:
                    if obj is not None and self._is_module(obj):
                        target, label_frame = obj, frame
                elif obj is target:
                    label_frame = frame
            frame = frame.f_back
            depth += 1
        label = _label_for(target, label_frame) if target is not None else None
        return callsite, library, label


def _label_for(target: object, frame: FrameType) -> str:
    cls = type(target)
    name = frame.f_code.co_name
    if name in _CALL_ENTRY:
        name = _CALL_ENTRY[name]
    elif not hasattr(cls, name):
        # A closure around a bound method (torchmetrics wraps compute/update this
        # way): name it after the method it wraps.
        for value in frame.f_locals.values():
            if getattr(value, "__self__", None) is target and hasattr(value, "__name__"):
                name = value.__name__
                break
    return f"{cls.__name__}.{name}"
