"""The files a rank shares with the launcher, inside one launch directory.

The worker never coordinates through the job's process group: a distcheck
barrier would pair with the user's collectives and hide the very hang we look
for. Status and results go through these files instead (written atomically);
traces are append-only (see ``tracefile``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


class LaunchFiles:
    """Paths of one launch (one scenario or script run)."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    @property
    def traces(self) -> Path:
        return self.root / "traces"

    def trace(self, rank: int) -> Path:
        return self.traces / f"rank{rank}.trace"

    def status(self, rank: int) -> Path:
        return self.root / "status" / f"rank{rank}.json"

    def stacks(self, rank: int) -> Path:
        return self.root / "stacks" / f"rank{rank}.txt"

    def flight_recorder(self, rank: int) -> Path:
        return self.root / "flight_recorder" / f"rank{rank}.json"

    @property
    def flight_recorder_request(self) -> Path:
        return self.root / "flight_recorder_request"

    def samples(self, rank: int) -> Path:
        return self.root / "samples" / f"rank{rank}.jsonl"

    def log(self, rank: int) -> Path:
        return self.root / "logs" / f"rank{rank}.log"

    @property
    def release(self) -> Path:
        return self.root / "release"

    def make(self) -> None:
        for sub in ("traces", "status", "stacks", "logs"):
            (self.root / sub).mkdir(parents=True, exist_ok=True, mode=0o700)

    def read_status(self, rank: int) -> dict[str, Any] | None:
        return read_json(self.status(rank))


def write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f)
    os.replace(tmp, path)


def read_json(path: Path) -> dict[str, Any] | None:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None
