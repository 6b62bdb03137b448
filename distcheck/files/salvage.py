"""Reading untrusted, possibly cut-short pickle and JSON files (Flight Recorder dumps) for what they
hold, and nothing more.

A pickle is read by an unpickler that resolves no global at all, so only the pickle VM's own dicts,
lists, tuples, strings, bytes, numbers, bools and None can come out of one, and no code runs. A file
cut short (a rank killed while writing its dump) is replayed as far as it goes: what was fully built
is kept, a dict still being filled is dropped. Pure: bytes or text in, values out.
"""

from __future__ import annotations

import io
import json
import pickle
import re
from typing import Any


class RefusedPickle(pickle.UnpicklingError):
    """The pickle asked for a global (a class or function): never loaded."""


class _RestrictedUnpickler(pickle.Unpickler):
    """Resolves no global at all: only the pickle VM's own dict/list/tuple/str/
    bytes/int/float/bool/None values can be built."""

    def find_class(self, module: str, name: str) -> Any:
        raise RefusedPickle(f"{module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        raise RefusedPickle("a persistent id")


class _SalvagingUnpickler(pickle._Unpickler):
    """The pure-Python unpickler (its stacks are inspectable after an error),
    with the same restriction."""

    def find_class(self, module: str, name: str) -> Any:
        raise RefusedPickle(f"{module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        raise RefusedPickle("a persistent id")


def load_pickle(data: bytes) -> tuple[Any, bool]:
    """(object, truncated). Raises RefusedPickle, or ValueError when nothing is readable."""
    try:
        return _RestrictedUnpickler(io.BytesIO(data)).load(), False
    except RefusedPickle:
        raise
    except Exception:
        pass
    # Damaged or cut short: replay with the inspectable unpickler and keep what was built.
    up = _SalvagingUnpickler(io.BytesIO(data))
    try:
        return up.load(), False
    except RefusedPickle:
        raise
    except Exception:
        pass
    frames = [*getattr(up, "metastack", []), getattr(up, "stack", [])]
    partial: set[int] = set()
    for frame in frames:
        for item in frame:
            if isinstance(item, dict) and not item:
                partial.add(id(item))   # dicts still being filled: their items were never set
    for i in range(len(frames) - 1, 0, -1):
        owner = frames[i - 1][-1] if frames[i - 1] else None
        items = frames[i]
        if isinstance(owner, dict):
            for k, v in zip(items[0::2], items[1::2]):
                try:
                    owner[k] = v
                except TypeError:
                    pass
        elif isinstance(owner, list):
            owner.extend(items)
    top = frames[0][0] if frames and frames[0] else None
    if not isinstance(top, dict):
        raise ValueError("no readable content")
    entries = top.get("entries")
    if isinstance(entries, list):
        top["entries"] = [e for e in entries if not (isinstance(e, dict) and id(e) in partial)]
    return top, True


def load_json(text: str) -> tuple[Any, bool]:
    try:
        return json.loads(text), False
    except ValueError:
        pass
    # Cut short: keep the top-level values and the entries that parse whole.
    m = re.search(r'"entries"\s*:\s*\[', text)
    if not m:
        raise ValueError("no readable content")
    decoder = json.JSONDecoder()
    entries = []
    pos = m.end()
    while True:
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= len(text) or text[pos] == "]":
            break
        try:
            obj, pos = decoder.raw_decode(text, pos)
        except ValueError:
            break
        entries.append(obj)
    top: dict[str, Any] = {"entries": entries}
    for key in ("version", "comm_lib_version"):
        km = re.search(rf'"{key}"\s*:\s*("(?:[^"\\]|\\.)*")', text[: m.start()])
        if km:
            top[key] = json.loads(km.group(1))
    return top, True
