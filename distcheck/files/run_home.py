"""Where distcheck keeps runs when it is not told where (``--run-dir``): never in the working tree of the job it
watches (rule 0: a test suite that checks its tree for files a test left, Lightning's among them, must see what it
sees without distcheck).

The place, first that applies:

1. ``$DISTCHECK_RUNS_DIR``;
2. ``$XDG_STATE_HOME/distcheck/runs`` (``~/.local/state/distcheck/runs`` where ``XDG_STATE_HOME`` is unset), the
   XDG place for state a program keeps between runs, as pip, pytest and shells keep theirs;
3. ``<temp dir>/distcheck-<uid>/runs`` where no home is writable (a container with a read-only or missing home).

Every command that takes a run id (``report``, ``analyze``, ``runs``) looks there, and, for runs an older
distcheck wrote, in ``.distcheck/runs`` of the current directory.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

RUNS_DIR_ENV = "DISTCHECK_RUNS_DIR"
LEGACY_RUNS_ROOT = Path(".distcheck") / "runs"   # the default before runs left the working tree


def runs_root() -> Path:
    """The folder that holds run dirs by default (made by whoever writes a run into it)."""
    explicit = os.environ.get(RUNS_DIR_ENV, "").strip()
    if explicit:
        return Path(explicit).expanduser()
    state = os.environ.get("XDG_STATE_HOME", "").strip()
    base = Path(state) if state and Path(state).is_absolute() else Path.home() / ".local" / "state"
    root = base / "distcheck" / "runs"
    if _writable_or_creatable(root):
        return root
    return Path(tempfile.gettempdir()) / f"distcheck-{os.getuid()}" / "runs"


def roots_to_search() -> list[Path]:
    """Where a run id may be found: the default place, then an older distcheck's."""
    return [runs_root(), LEGACY_RUNS_ROOT]


def shown(path: Path | str) -> str:
    """A run dir as a person reads it: under the home as ``~/…``."""
    text = str(path)
    try:
        home = str(Path.home())
    except RuntimeError:   # no home at all
        return text
    return "~" + text[len(home):] if home != "/" and (text == home or text.startswith(home + os.sep)) else text


def _writable_or_creatable(path: Path) -> bool:
    """The nearest existing folder on the way to ``path`` accepts new entries."""
    for folder in (path, *path.parents):
        if folder.exists():
            return folder.is_dir() and os.access(folder, os.W_OK | os.X_OK)
    return False
