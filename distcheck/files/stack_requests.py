"""The stack request a watchdog leaves for a rank and the rank's ``stack_probe`` answers: one line,
``N KIND``, rewritten atomically; a higher ``N`` is a new request. KIND says which file the answer is
appended to: ``stacks`` (where every thread was, before a teardown) or ``busy`` (where a busy rank
was while others waited). No signal is involved: a thread of distcheck's own in the rank reads it."""

from __future__ import annotations

import enum
import os
from pathlib import Path

from distcheck.files.launch_dir import LaunchFiles


class StackKind(str, enum.Enum):
    STACKS = "stacks"
    BUSY = "busy"


def answer_path(files: LaunchFiles, rank: int, kind: StackKind) -> Path:
    return files.stacks(rank) if kind == StackKind.STACKS else files.busy_stack(rank)


def write_request(files: LaunchFiles, rank: int, number: int, kind: StackKind) -> None:
    path = files.stack_request(rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(f"{number} {kind.value}\n", encoding="ascii")
    os.replace(tmp, path)


def read_request(path: Path) -> tuple[int, StackKind] | None:
    try:
        number, kind = path.read_text(encoding="ascii").split()
        return int(number), StackKind(kind)
    except (OSError, ValueError):
        return None
