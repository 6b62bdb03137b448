"""The per-rank samples file (``samples/rank<N>.jsonl``): one JSON line per DataLoader pass,
written by the rank's ``SampleRecorder`` (``rank.samples``), read after the run (``evidence.collect``)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def append_pass(path: Path, record: dict[str, Any]) -> None:
    """One pass, in one ``os.write`` to an ``O_APPEND`` file (whole lines survive a killed rank)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        os.write(fd, (json.dumps(record) + "\n").encode())
    finally:
        os.close(fd)


def read_samples(path: Path) -> list[dict[str, Any]]:
    """Every whole pass in the file (a torn or corrupt line is skipped)."""
    records: list[dict[str, Any]] = []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError:
        return records
    for line in lines:
        try:
            records.append(json.loads(line))
        except ValueError:
            continue
    return records
