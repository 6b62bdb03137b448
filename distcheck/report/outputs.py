"""Writing a report's requested formats to files (the CLI's ``--json``, ``--junit-xml``,
``--chrome-trace`` and ``--html``, and the run dir's ``timeline.html``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from distcheck.errors import UsageError
from distcheck.models import Event, Report
from distcheck.report import chrome_trace, html_timeline, json_report, junit

Events = Mapping[str, Mapping[int, Sequence[Event]]]   # scenario name -> rank -> events


def _write(path: Path, text: str) -> Path:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    except OSError as exc:
        raise UsageError(f"cannot write {path}: {exc.strerror}", "pick a writable path") from None
    return path


def write_outputs(report: Report, events: Events, *,
                  json_path: Path | None = None, junit_path: Path | None = None,
                  chrome_path: Path | None = None, html_path: Path | None = None) -> list[Path]:
    """Render and write each requested format; returns the files written."""
    written = []
    if json_path is not None:
        written.append(_write(json_path, json_report.render(report)))
    if junit_path is not None:
        written.append(_write(junit_path, junit.render(report)))
    if chrome_path is not None:
        written.append(_write(chrome_path, chrome_trace.render(report, events)))
    if html_path is not None:
        written.append(_write(html_path, html_timeline.render(report, events)))
    return written
