"""Everything distcheck installs in a rank, kept so that all of it can be put back (pytest's ``monkeypatch`` keeps the
same record): attributes it replaced, import finders it added, and what else it must undo (a recorder's global, a
file it keeps open). ``RankProcess.disarm`` undoes it all, newest first (``tests/test_rule0_disarm.py`` checks)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any


class Patches:
    def __init__(self) -> None:
        self._undo: list[Callable[[], None]] = []

    def set(self, owner: Any, name: str, value: Any) -> None:
        """``owner.name = value``, the old value (or its absence) kept to be put back."""
        missing = object()
        old = owner.__dict__.get(name, missing) if isinstance(owner, type) else getattr(owner, name, missing)

        def undo() -> None:
            if old is missing:
                try:
                    delattr(owner, name)
                except AttributeError:
                    pass
            else:
                setattr(owner, name, old)

        setattr(owner, name, value)
        self._undo.append(undo)

    def finder(self, finder: Any) -> None:
        """An import finder first on ``sys.meta_path``, taken out again on undo."""
        sys.meta_path.insert(0, finder)
        self._undo.append(lambda: sys.meta_path.remove(finder) if finder in sys.meta_path else None)

    def on_undo(self, undo: Callable[[], None]) -> None:
        """Something else to put back (a module global, an open file, an ``atexit`` hook)."""
        self._undo.append(undo)

    def undo(self) -> None:
        while self._undo:
            self._undo.pop()()
