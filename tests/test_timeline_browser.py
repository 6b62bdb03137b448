"""The HTML timeline as a browser draws it: a real headless Chromium lays the page out.

The page is self-contained SVG, so what matters is that a browser gives every rank's lane and
the hang's marks a place on the screen. A probe script appended to a copy of the page measures
the laid-out elements and writes its result into the DOM, which Chromium's ``--dump-dom`` hands
back after rendering. Skipped where no Chromium is installed (Debian: chromium-headless-shell).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess

import pytest

from distcheck.report import html_timeline

from test_renderers import fixed  # noqa: F401  (the module-scoped report with a hang, a mismatch, a crash)

BROWSERS = ("chromium-headless-shell", "chromium", "chromium-browser", "google-chrome")

PROBE = """
<script>
const box = el => { const r = el.getBoundingClientRect(); return [r.width, r.height]; };
const svg = document.querySelector("svg");
const inFirst = sel => Array.from(svg.querySelectorAll(sel));
const out = {
  lanes: inFirst(".lane-label").filter(e => box(e)[0] > 0).map(e => e.textContent),
  stuck: inFirst("[class*='m-stuck']").map(box),
  absent: inFirst("circle.absent").map(box),
  stall: inFirst("rect.stall").map(box),
  svgs: document.querySelectorAll("svg").length,
};
const pre = document.createElement("pre");
pre.id = "probe";
pre.textContent = JSON.stringify(out);
document.body.appendChild(pre);
</script>
"""


def browser() -> str | None:
    return next((path for name in BROWSERS if (path := shutil.which(name))), None)


@pytest.fixture(scope="module")
def chromium():
    path = browser()
    if path is None:
        pytest.skip("no Chromium installed (apt-get install chromium-headless-shell)")
    return path


def laid_out(chromium: str, page: str, tmp_path) -> dict:
    html = tmp_path / "timeline.html"
    html.write_text(page.replace("</body>", PROBE + "</body>"), encoding="utf-8")
    proc = subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--dump-dom",
                           "--virtual-time-budget=2000", html.as_uri()],
                          capture_output=True, text=True, timeout=60)
    match = re.search(r'<pre id="probe">(.*?)</pre>', proc.stdout, re.S)
    assert match, f"the probe did not run in {chromium}: rc {proc.returncode}, {proc.stderr[-500:]}"
    return json.loads(match.group(1).replace("&quot;", '"').replace("&amp;", "&"))


def test_a_browser_draws_every_rank_and_the_hang(fixed, chromium, tmp_path):  # noqa: F811
    report, events = fixed
    seen = laid_out(chromium, html_timeline.render(report, events), tmp_path)
    assert seen["svgs"] == 4                                   # every scenario that ran has its drawing
    shown = {int(n) for label in seen["lanes"] for n in re.findall(r"\d+", label)}
    assert shown == {0, 1, 2, 3}, seen["lanes"]                # the hang's four ranks each have a visible lane
    assert seen["stuck"] and all(w > 0 and h > 0 for w, h in seen["stuck"])   # the stuck barrier, drawn
    assert len(seen["absent"]) == 3 and all(w > 0 for w, _ in seen["absent"])  # ranks 1-3 circled
    assert seen["stall"] and seen["stall"][0][0] > 0           # the no-progress window, shaded
