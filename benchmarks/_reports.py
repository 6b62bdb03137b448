"""Every report file node 0 writes, as the CLI writes them, and how long a browser takes to open the timeline
(a helper of ``cluster_scale``, not part of distcheck)."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

BROWSER_TIMEOUT_S = 120
BROWSERS = ("chromium-headless-shell", "chrome-headless-shell", "chromium", "chromium-browser", "google-chrome")


def write_reports(report: Any, files: Any, out: Path) -> dict[str, int]:
    """Every format node 0 writes, as the CLI writes them; their sizes in bytes."""
    from rich.console import Console

    from distcheck.files.trace_reader import read_trace_dir
    from distcheck.report import chrome_trace, html_timeline, json_report, junit, terminal

    out.mkdir(parents=True, exist_ok=True)
    # as ``distcheck run`` does (``files.saved_runs.load_events``): the traces node 0 judged, unless they changed
    events = {report.scenarios[0].name: {r: t.events for r, t in read_trace_dir(files.traces, reuse=True).items()}}
    texts = {"report.json": json_report.render(report), "junit.xml": junit.render(report),
             "trace.json": chrome_trace.render(report, events), "timeline.html": html_timeline.render(report, events)}
    with open(out / "terminal.txt", "w", encoding="utf-8") as f:
        terminal.render(report, Console(file=f, width=120, color_system=None))
    for name, text in texts.items():
        (out / name).write_text(text, encoding="utf-8")
    return {p.name: p.stat().st_size for p in sorted(out.iterdir())}


def browser() -> str | None:
    return next((path for name in BROWSERS if (path := shutil.which(name))), None)


def browser_open_s(page: Path) -> dict[str, float] | None:
    """Seconds a headless Chromium takes to load and lay out ``page`` and hand back its DOM, and to do the
    same for an empty page (its own start); None where no Chromium is installed."""
    chromium = browser()
    if chromium is None:
        return None
    empty = page.parent / "empty.html"
    empty.write_text("<!doctype html><html><body></body></html>", encoding="utf-8")
    out = {}
    for name, path in (("empty_page", empty), ("timeline", page)):
        began = time.perf_counter()
        try:
            subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--dump-dom", path.as_uri()],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=BROWSER_TIMEOUT_S, check=False)
        except subprocess.TimeoutExpired:   # the row says so (a number past the limit) rather than ending
            out[name] = float(BROWSER_TIMEOUT_S)
            continue
        out[name] = round(time.perf_counter() - began, 2)
    empty.unlink()
    return out
