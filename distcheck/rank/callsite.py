"""Who issued a collective: the user's line, the library frame, and the label.

* callsite — the innermost frame of the user's own code (not the standard
  library, not torch, not distcheck, not an installed library);
* library callsite — the innermost installed-library frame (torchmetrics,
  lightning, ...) below it, kept because it says *how* the call was made;
* label — the entry point into the ``nn.Module`` that issued the call: the
  outermost frame whose ``self`` is the module seen innermost (the *target*),
  found in the walk below (``BinaryAUROC.compute``, not
  ``BinaryAUROC._sync_dist``).

The walk, from the collective's caller outwards, costs the same at any stack
depth: it stops at the first user frame, and the label is found inside that
walk. Past the first user frame it goes on only while it is still in the
target module: through frames whose ``self`` is the target and through torch's,
the standard library's and distcheck's frames between them (``nn.Module``'s
``_call_impl`` / ``_wrapped_call_impl``, so ``Model.forward -> self.helper()
-> all_reduce`` is labelled ``Model.forward``). It stops at the first user or
library frame whose ``self`` is not the target. If no module was seen by the
first user frame and that frame has no module ``self``, the walk ends there
and there is no label. So a collective in a plain function called from a
module method (``Model.validate`` -> ``evaluate()`` -> ``all_reduce``) has no
label, and a module method reached through a plain user function
(``Model.forward`` -> ``run(self)`` -> ``self.step()``) is labelled by the
inner method (``Model.step``): the outer frames are never looked at.

This runs on every traced call, so the walk is cheap: everything that depends
only on a code object (its file's kind, whether it has a ``self``, whether that
``self`` has been an ``nn.Module``, the line of each instruction that called
out, the label, or for a closure around a bound method the local that holds
it) is computed once per code object. ``frame.f_locals`` — which copies every
local on Python < 3.13 — is read only on frames of module methods, and of
those inside the user's frame only on the innermost (the target) and, from
the outermost in, until one is on the target (the label's frame); past the
user's frame, where it decides whether the walk goes on, on user and library
frames of module methods.
"""

from __future__ import annotations

from types import CodeType, FrameType
from typing import Any

from distcheck.files.stacks import LIBRARY, SKIP, USER, classify_file, torch_dir
from distcheck.models import JOIN_LABEL
from distcheck.rank import integrations

MAX_DEPTH = 96

# What a code object's ``self`` is: none, not yet seen, an nn.Module.
_NO_SELF, _SELF_UNKNOWN, _SELF_MODULE = 0, 1, 2


# torch's Join context: ranks out of data run "shadow" collectives matching the others' on purpose.
_JOIN = -1
_JOIN_FILE = "distributed/algorithms/join.py"

# Module methods that stand for "the module was called".
_CALL_ENTRY = {"_wrapped_call_impl": "forward", "_call_impl": "forward"}

# (id of the callsite's code, line, id of the library frame's code, line, label, self.log site).
SiteKey = tuple


class CallsiteResolver:
    """Resolves call sites with per-code-object caches (the hot path).

    ``key(frame)`` walks the stack once and returns a small hashable key;
    ``describe(key)`` turns a key into ``(callsite, library_callsite, label)``
    strings and is only needed the first time a key is seen.
    """

    def __init__(self) -> None:
        # id(code) -> [code, file kind, self mode, {f_lasti: line}]; the code object is kept so its id stays valid.
        self._codes: dict[int, list] = {}
        self._labels: dict[tuple[type, int], str] = {}
        # (class, id(code)) of a closure around a bound method -> the name of the local that holds it
        self._wrapped: dict[tuple[type, int], str] = {}
        self._torch_dir = torch_dir()
        self._module_type: type | None = None
        # id(code) -> code of the user's functions without a module ``self``: called from one of them, a
        # collective's site is that function's own line, whatever the stack around it (the hot path's shortcut)
        self.plain_user: dict[int, CodeType] = {}

    def _code_info(self, code: CodeType) -> list:
        kind = classify_file(code.co_filename, self._torch_dir)
        if code.co_filename.replace("\\", "/").endswith(_JOIN_FILE):
            kind = _JOIN
        has_self = (code.co_argcount > 0 and code.co_varnames[:1] == ("self",)) or "self" in code.co_freevars
        info = [code, kind, _SELF_UNKNOWN if has_self and kind != SKIP else _NO_SELF, {}]
        self._codes[id(code)] = info
        if kind == USER and info[2] == _NO_SELF:
            self.plain_user[id(code)] = code
        return info

    def _module(self) -> type:
        if self._module_type is None:
            import torch.nn
            self._module_type = torch.nn.Module
        return self._module_type

    def key(self, frame: FrameType | None) -> SiteKey:
        """A hashable key for the call site of the stack starting at ``frame``."""
        codes = self._codes
        if frame is not None:
            # The commonest case, without a walk: the user's own function (no module ``self``)
            # called the collective, so its line is the whole key.
            info = codes.get(id(frame.f_code))
            if info is not None and info[1] == USER and info[2] == _NO_SELF and info[0] is frame.f_code:
                line = info[3].get(frame.f_lasti)
                if line is not None:
                    return (id(info[0]), line, None, None, None, None)
        user = user_line = lib = lib_line = target = None
        joined = False
        # Frames of module methods, innermost first, and the index of the outermost one known to be on the
        # target; the others' ``self`` is read only if the label needs it.
        on_modules: list[FrameType] = []
        known = 0
        depth = MAX_DEPTH
        while frame is not None and depth:
            code = frame.f_code
            info = codes.get(id(code))
            if info is None or info[0] is not code:
                info = self._code_info(code)
            kind = info[1]
            if user is None:
                # Inner part, up to the user's frame: the call site, the library frame, the target.
                if info[2] and (info[2] == _SELF_MODULE or self._learn_self(info, frame)):
                    on_modules.append(frame)
                if kind == USER:
                    user, user_line = code, _line(info, frame)
                    target, known = _target(on_modules)
                    if target is None:
                        break
                elif kind == LIBRARY:
                    if lib is None:
                        lib, lib_line = code, _line(info, frame)
                elif kind == _JOIN:
                    joined = True
            elif kind in (USER, LIBRARY):
                # Past the user's frame, only while on the target: its own methods, ...
                if (not info[2] or (info[2] == _SELF_UNKNOWN and not self._learn_self(info, frame))
                        or frame.f_locals.get("self") is not target):
                    break
                known = len(on_modules)
                on_modules.append(frame)
            elif info[2] and (info[2] == _SELF_MODULE or self._learn_self(info, frame)):
                on_modules.append(frame)   # ... and torch's frames between them (nn.Module._call_impl)
            frame = frame.f_back
            depth -= 1
        if user is None:   # no user frame: the whole stack (up to MAX_DEPTH) was the inner part
            target, known = _target(on_modules)
        label, log_site = self._site_label(target, on_modules, known, joined)
        # ids, not code objects: a code object's hash is computed from its contents on every lookup.
        return (None if user is None else id(user), user_line, None if lib is None else id(lib), lib_line, label,
                log_site)

    def _site_label(self, target: Any, on_modules: list[FrameType], known: int, joined: bool
                    ) -> tuple[str | None, Any]:
        """(the label, Lightning's self.log line where the call is its deferred reduction) of a call site."""
        label = log_site = None
        if target is not None:
            label = self._label(target, _outermost_on(target, on_modules, known))
            logged = integrations.LOG_SITES and integrations.logged_name(target)
            if logged:   # Lightning's deferred self.log reduction: blame the self.log line
                log_site = integrations.LOG_SITES.get(logged)
                label = f"{label} (self.log {logged!r})"
        if joined:   # a shadow call: it stands in for whatever the ranks still working call here
            label = f"{JOIN_LABEL} ({label})" if label else JOIN_LABEL
        return label, log_site

    def _learn_self(self, info: list, frame: FrameType) -> bool:
        """Whether a frame's code, which has a ``self`` of unknown type, is a module method (decided once:
        a method's ``self`` is of its class)."""
        info[2] = _SELF_MODULE if isinstance(frame.f_locals.get("self"), self._module()) else _NO_SELF
        if info[1] == USER and info[2] == _NO_SELF:
            self.plain_user[id(info[0])] = info[0]
        return info[2] == _SELF_MODULE

    def _label(self, target: object, frame: FrameType) -> str:
        cache_key = (type(target), id(frame.f_code))
        label = self._labels.get(cache_key)
        if label is not None:
            return label
        local = self._wrapped.get(cache_key)
        if local is not None:   # a closure seen before: look only at the local that held the method
            method = frame.f_locals.get(local)
            name = getattr(method, "__name__", None)
            if name is not None and getattr(method, "__self__", None) is target:
                return f"{type(target).__name__}.{name}"
        label, stable = _label_for(target, frame)
        if stable is True:   # depends only on the class and the code object (codes are kept alive)
            self._labels[cache_key] = label
        elif stable:
            self._wrapped[cache_key] = stable
        return label

    def describe(self, key: SiteKey) -> tuple[str | None, str | None, str | None]:
        user_id, user_line, lib_id, lib_line, label, log_site = key
        user = self._codes[user_id][0] if user_id is not None else None
        lib = self._codes[lib_id][0] if lib_id is not None else None
        callsite = f"{user.co_filename}:{user_line}:{user.co_name}" if user is not None else None
        callsite = log_site or callsite
        library = f"{lib.co_filename}:{lib_line}:{lib.co_name}" if lib is not None else None
        return callsite, library, label

    def resolve(self, frame: FrameType | None) -> tuple[str | None, str | None, str | None]:
        """(callsite, library_callsite, label) for the stack starting at ``frame``."""
        return self.describe(self.key(frame))


def _line(info: list, frame: FrameType) -> int | None:
    """``frame.f_lineno``, cached per instruction: computing it scans the code's line table from the start."""
    lasti = frame.f_lasti
    line = info[3].get(lasti)
    if line is None:
        line = info[3][lasti] = frame.f_lineno
    return line


def _target(on_modules: list[FrameType]) -> tuple[object, int]:
    """The module seen innermost, and the index of its frame."""
    for i, frame in enumerate(on_modules):
        obj = frame.f_locals.get("self")
        if obj is not None:
            return obj, i
    return None, 0


def _outermost_on(target: object, on_modules: list[FrameType], known: int) -> FrameType:
    """The outermost frame on the target, reading ``self`` only on the frames outside ``on_modules[known]``."""
    for i in range(len(on_modules) - 1, known, -1):
        if on_modules[i].f_locals.get("self") is target:
            return on_modules[i]
    return on_modules[known]


def _label_for(target: object, frame: FrameType) -> tuple[str, bool | str]:
    """The label, and True if it depends only on (class, code object), or for a closure around a bound
    method the name of the local that holds it, else False."""
    cls = type(target)
    name = frame.f_code.co_name
    if name in _CALL_ENTRY:
        return f"{cls.__name__}.{_CALL_ENTRY[name]}", True
    if hasattr(cls, name):
        return f"{cls.__name__}.{name}", True
    # A closure around a bound method (torchmetrics wraps compute/update this
    # way): name it after the method it wraps, which this frame's locals say.
    for local, value in frame.f_locals.items():
        if getattr(value, "__self__", None) is target and hasattr(value, "__name__"):
            return f"{cls.__name__}.{value.__name__}", local
    return f"{cls.__name__}.{name}", False
