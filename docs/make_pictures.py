"""Remake the pictures in docs/ from a real run: the terminal report and the HTML timeline of a hang.

    python docs/make_pictures.py [--scenario auroc_rank0_only_compute] [--nproc-per-node 4]

It runs ``distcheck run SCENARIO`` (a real launch on gloo), then

* renders the saved report with distcheck's own terminal renderer into a recording rich console
  and writes ``docs/terminal-report.svg``, then a PNG of it (``docs/terminal-report.png``);
* opens the run's ``timeline.html`` in headless Chromium and writes ``docs/timeline.png``.

Needs Chromium (Debian: ``apt-get install chromium-headless-shell``) for the PNGs; without it the
SVG is still written.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

DOCS = Path(__file__).resolve().parent
BROWSERS = ("chromium-headless-shell", "chromium", "chromium-browser", "google-chrome")


def run_scenario(scenario: str, nproc: int, run_dir: Path) -> None:
    cmd = [sys.executable, "-m", "distcheck", "run", scenario, "--nproc-per-node", str(nproc),
           "--backend", "gloo", "--run-dir", str(run_dir)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if not (run_dir / "report.json").exists():
        sys.exit(f"make_pictures: {' '.join(cmd)} wrote no report (exit {proc.returncode}):\n{proc.stderr[-2000:]}")


def terminal_svg(run_dir: Path, width: int) -> str:
    from rich.console import Console

    from distcheck.files.saved_runs import load_report
    from distcheck.report import terminal

    console = Console(record=True, width=width, force_terminal=True, color_system="truecolor", file=open("/dev/null", "w"))
    terminal.render(load_report(run_dir), console)
    return console.export_svg(title="distcheck run")


def screenshot(browser: str, page: Path, png: Path, size: tuple[int, int]) -> None:
    subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                    f"--window-size={size[0]},{size[1]}", f"--screenshot={png}", page.as_uri()],
                   check=True, capture_output=True, timeout=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenario", default="auroc_rank0_only_compute")
    parser.add_argument("--nproc-per-node", type=int, default=4)
    parser.add_argument("--width", type=int, default=110, help="terminal columns")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="distcheck-pictures-") as tmp:
        run_dir = Path(tmp) / "run"
        run_scenario(args.scenario, args.nproc_per_node, run_dir)
        svg = DOCS / "terminal-report.svg"
        svg.write_text(terminal_svg(run_dir, args.width), encoding="utf-8")
        print(f"wrote {svg}")
        browser = next((p for name in BROWSERS if (p := shutil.which(name))), None)
        if browser is None:
            print("make_pictures: no Chromium found; PNGs not made (apt-get install chromium-headless-shell)")
            return
        timelines = sorted(run_dir.rglob("timeline.html"))
        if not timelines:
            sys.exit(f"make_pictures: the run wrote no timeline.html under {run_dir}")
        screenshot(browser, timelines[0], DOCS / "timeline.png", (1280, 600))
        screenshot(browser, svg, DOCS / "terminal-report.png", (1100, 420))
        print(f"wrote {DOCS / 'timeline.png'}\nwrote {DOCS / 'terminal-report.png'}")


if __name__ == "__main__":
    main()
