"""Who issued a collective: the user's line, the library frame, and the label.

* callsite — the innermost frame of the user's own code (not the standard
  library, not torch, not distcheck, not an installed library);
* library callsite — the innermost installed-library frame (torchmetrics,
  lightning, ...) below it, kept because it says *how* the call was made;
* label — the entry point into the ``nn.Module`` that issued the call: the
  outermost frame on the stack whose ``self`` is the module seen innermost
  (``BinaryAUROC.compute``, not ``BinaryAUROC._sync_dist``).

This runs on every traced call, so the walk is cheap: everything that depends
only on a code object (its file's kind, whether it has a ``self``, whether that
``self`` has been an ``nn.Module``) is computed once per code object, and
``frame.f_locals`` — which copies every local on Python < 3.13 — is read only
on frames of module methods, where the identity of ``self`` matters.
"""

from __future__ import annotations

from types import CodeType, FrameType

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
        # id(code) -> [code, file kind, self mode]; the code object is kept so its id stays valid.
        self._codes: dict[int, list] = {}
        self._labels: dict[tuple[type, int], str] = {}
        self._torch_dir = torch_dir()
        self._module_type: type | None = None

    def _code_info(self, code: CodeType) -> list:
        kind = classify_file(code.co_filename, self._torch_dir)
        if code.co_filename.replace("\\", "/").endswith(_JOIN_FILE):
            kind = _JOIN
        has_self = (code.co_argcount > 0 and code.co_varnames[:1] == ("self",)) or "self" in code.co_freevars
        info = [code, kind, _SELF_UNKNOWN if has_self and kind != SKIP else _NO_SELF]
        self._codes[id(code)] = info
        return info

    def _module(self) -> type:
        if self._module_type is None:
            import torch.nn
            self._module_type = torch.nn.Module
        return self._module_type

    def key(self, frame: FrameType | None) -> SiteKey:
        """A hashable key for the call site of the stack starting at ``frame``."""
        codes = self._codes
        user = user_line = lib = lib_line = None
        target = label_frame = None
        joined = False
        depth = MAX_DEPTH
        # Inner part: up to the user's frame, looking for the call site and the library frame.
        while frame is not None and depth:
            code = frame.f_code
            info = codes.get(id(code))
            if info is None or info[0] is not code:
                info = self._code_info(code)
            kind = info[1]
            if kind == USER:
                user, user_line = code, frame.f_lineno
            elif kind == LIBRARY and lib is None:
                lib, lib_line = code, frame.f_lineno
            elif kind == _JOIN:
                joined = True
            if info[2]:
                target, label_frame = self._self_step(info, frame, target, label_frame)
            frame = frame.f_back
            depth -= 1
            if user is not None:
                break
        # Outer part: only frames whose code has a module ``self`` matter (for the label).
        while frame is not None and depth:
            code = frame.f_code
            info = codes.get(id(code))
            if info is None or info[0] is not code:
                info = self._code_info(code)
            if info[2]:
                target, label_frame = self._self_step(info, frame, target, label_frame)
            frame = frame.f_back
            depth -= 1
        label = log_site = None
        if target is not None:
            label = self._label(target, label_frame)
            logged = integrations.LOG_SITES and integrations.logged_name(target)
            if logged:   # Lightning's deferred self.log reduction: blame the self.log line
                log_site = integrations.LOG_SITES.get(logged)
                label = f"{label} (self.log {logged!r})"
        if joined:   # a shadow call: it stands in for whatever the ranks still working call here
            label = f"{JOIN_LABEL} ({label})" if label else JOIN_LABEL
        # ids, not code objects: a code object's hash is computed from its contents on every lookup.
        return (None if user is None else id(user), user_line, None if lib is None else id(lib), lib_line, label,
                log_site)

    def _self_step(self, info: list, frame: FrameType, target: object, label_frame: FrameType | None) -> tuple:
        """Update (target module, outermost frame on it) with a frame whose code has ``self``."""
        obj = frame.f_locals.get("self")
        if info[2] == _SELF_UNKNOWN:
            # A method's self is of its class: decide once whether that is a module.
            info[2] = _SELF_MODULE if isinstance(obj, self._module()) else _NO_SELF
            if info[2] == _NO_SELF:
                return target, label_frame
        if target is None:
            if obj is not None:
                return obj, frame
        elif obj is target:
            return target, frame
        return target, label_frame

    def _label(self, target: object, frame: FrameType) -> str:
        cache_key = (type(target), id(frame.f_code))
        label = self._labels.get(cache_key)
        if label is None:
            label, stable = _label_for(target, frame)
            if stable:   # depends only on the class and the code object (codes are kept alive)
                self._labels[cache_key] = label
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


def _label_for(target: object, frame: FrameType) -> tuple[str, bool]:
    """The label, and whether it depends only on (class, code object)."""
    cls = type(target)
    name = frame.f_code.co_name
    if name in _CALL_ENTRY:
        return f"{cls.__name__}.{_CALL_ENTRY[name]}", True
    if hasattr(cls, name):
        return f"{cls.__name__}.{name}", True
    # A closure around a bound method (torchmetrics wraps compute/update this
    # way): name it after the method it wraps, which this frame's locals say.
    for value in frame.f_locals.values():
        if getattr(value, "__self__", None) is target and hasattr(value, "__name__"):
            return f"{cls.__name__}.{value.__name__}", False
    return f"{cls.__name__}.{name}", False
