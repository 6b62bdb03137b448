"""A self-contained HTML page with one inline-SVG timeline per scenario.

For people who never open Perfetto: one lane per rank, one box per collective,
the stuck / mismatched collective in red, ranks that never came and crashes
flagged, the stall window shaded. No script, no network, no CDN: the page is
one file that a browser (or a bug tracker attachment) shows as is. Hover a box
for its fingerprint (SVG ``<title>``).

Layout only: what is marked, and why, comes from the findings via
``distcheck.report.timeline``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from html import escape
from dataclasses import dataclass

from distcheck.models import EndReason, Event, Kind, Report, ScenarioResult
from distcheck.report.words import verdict
from distcheck.text import short_path
from distcheck.torch_features import describe
from distcheck.report.timeline import Marker, MarkerKind, ScenarioTimeline, Slice, build_all, zoom

WIDTH = 1180
GUTTER = 190          # lane labels
RIGHT = 24
LANE_H = 28          # the bar row of a lane
NOTE_H = 14          # under it: call-outs for marked collectives too narrow to hold their name
LANE_GAP = 6
AXIS_H = 28
PLOT_W = WIDTH - GUTTER - RIGHT

OP_CLASS = {
    "all_reduce": "op-ar", "all_gather": "op-ag", "all_gather_into_tensor": "op-ag", "all_gather_object": "op-ag",
    "barrier": "op-bar", "monitored_barrier": "op-bar", "broadcast": "op-bc", "broadcast_object_list": "op-bc",
    "reduce_scatter": "op-rs", "reduce_scatter_tensor": "op-rs", "reduce": "op-rs",
    "gather": "op-ga", "scatter": "op-ga", "all_to_all": "op-a2a", "all_to_all_single": "op-a2a",
}

CSS = """
body{font:14px/1.45 -apple-system,BlinkMacSystemFont,"Segoe UI",Roboto,Helvetica,Arial,sans-serif;
     margin:24px auto;max-width:1240px;color:#1f2328;background:#fff;padding:0 16px}
h1{font-size:20px;margin:0 0 4px} h2{font-size:16px;margin:28px 0 6px}
.meta{color:#59636e;font-size:12.5px}
.badge{display:inline-block;padding:1px 8px;border-radius:10px;font-weight:600;font-size:12px;color:#fff}
.pass{background:#1a7f37}.fail{background:#cf222e}.skip{background:#8c959f}
.finding{margin:4px 0 4px 0;padding:6px 10px;border-left:4px solid #cf222e;background:#fff5f5;font-size:13px}
.finding.warning{border-color:#bf8700;background:#fffbe6}
.finding .kind{font-weight:700;margin-right:6px}
.scenario{border:1px solid #d1d9e0;border-radius:8px;padding:10px 14px 14px;margin:18px 0}
.desc{color:#59636e;font-size:13px;margin:2px 0 8px}
svg{display:block;margin-top:8px}
svg text{font:11.5px ui-monospace,SFMono-Regular,Menlo,Consolas,monospace;fill:#1f2328}
svg .lane-label{font-weight:600} svg .lane-state{fill:#59636e;font-size:10.5px}
svg .axis{stroke:#d1d9e0} svg .tick{fill:#59636e;font-size:10px}
svg .lane-bg{fill:#f6f8fa}
svg .op{stroke:#fff;stroke-width:.5}
svg .op-ar{fill:#4f8ff7} svg .op-ag{fill:#2da44e} svg .op-bar{fill:#8c959f} svg .op-bc{fill:#8250df}
svg .op-rs{fill:#1b7c83} svg .op-ga{fill:#bc4c00} svg .op-a2a{fill:#9a6700} svg .op-p2p{fill:#d4a72c}
svg .op-other{fill:#6e7781}
svg .op.summary{fill:#d0d7de;stroke:#8c959f;stroke-dasharray:3 2}
h3.window{font-size:13px;margin:14px 0 4px;color:#57606a}
svg .m-stuck,svg .m-crashed{fill:#cf222e;stroke:#82071e;stroke-width:1.5}
svg .m-odd{fill:#bf3989;stroke:#6e1150;stroke-width:2}
svg .m-majority{stroke:#bf3989;stroke-width:2}
svg .open-tail{fill:url(#hatch)}
svg .slice-text{fill:#fff;font-size:10.5px;pointer-events:none;paint-order:stroke;stroke:rgba(0,0,0,.4);stroke-width:2.5px}
svg .err{stroke:#cf222e;stroke-width:2;stroke-dasharray:3 2}
svg .tick-line{stroke:#6e1150;stroke-width:1.5}
svg .callout{fill:#6e1150;font-size:11px;font-weight:600;paint-order:stroke;stroke:#fff;stroke-width:3px}
svg .stall{fill:#cf222e;fill-opacity:.07;stroke:#cf222e;stroke-opacity:.35;stroke-dasharray:4 3}
svg .stall-text{fill:#82071e;font-size:10.5px}
svg .absent{fill:#fff;stroke:#bf8700;stroke-width:2} svg .absent-text{fill:#7d4e00;font-size:11px}
svg .crash{stroke:#cf222e;stroke-width:3} svg .crash-text{fill:#82071e;font-size:11px;font-weight:600}
.legend{font-size:12px;color:#59636e;margin-top:6px}
.legend span{display:inline-block;margin-right:14px}
.legend i{display:inline-block;width:12px;height:12px;border-radius:2px;vertical-align:-2px;margin-right:4px}
.empty{color:#59636e;font-style:italic;font-size:13px}
"""  # noqa: E501 - the page's CSS, one rule a line

LEGEND = (
    '<div class="legend">'
    '<span><i style="background:#4f8ff7"></i>all_reduce</span>'
    '<span><i style="background:#2da44e"></i>all_gather</span>'
    '<span><i style="background:#8c959f"></i>barrier</span>'
    '<span><i style="background:#8250df"></i>broadcast</span>'
    '<span><i style="background:#1b7c83"></i>reduce(_scatter)</span>'
    '<span><i style="background:#d4a72c"></i>send/recv</span>'
    '<span><i style="background:#cf222e"></i>stuck / crashed</span>'
    '<span><i style="background:#bf3989"></i>odd one out (mismatch / order)</span>'
    '<span><i style="background:#fff;border:2px solid #bf8700;border-radius:50%"></i>never entered</span>'
    '<span><i style="background:rgba(207,34,46,.12);border:1px dashed #cf222e"></i>no progress (stall)</span>'
    "</div>"
)


def _nice_step(span: float, target: int = 8) -> float:
    raw = span / target if span > 0 else 1.0
    mag = 10 ** math.floor(math.log10(raw))
    for m in (1, 2, 5, 10):
        if raw <= m * mag:
            return m * mag
    return 10 * mag


def _fmt_t(t: float, step: float) -> str:
    if step >= 1:
        return f"{t:.0f} s"
    if step >= 0.1:
        return f"{t:.1f} s"
    if step >= 0.01:
        return f"{t:.2f} s"
    return f"{t * 1000:.0f} ms"


def _op_class(e: Event) -> str:
    if e.is_p2p or e.op in ("send", "recv", "isend", "irecv", "batch_isend_irecv"):
        return "op-p2p"
    return OP_CLASS.get(e.op, "op-other")


def _tooltip(tl: ScenarioTimeline, s: Slice) -> str:
    e = s.event
    if s.count > 1:
        return escape(f"rank {s.rank}: {s.summary}, {s.end - s.start:.2f} s (the close-ups below draw each call)")
    fp = e.fingerprint()
    lines = [f"rank {s.rank}: {s.name}", f"group {e.group} {list(e.group_ranks)}"]
    if fp["reduce_op"]:
        lines.append(f"reduce_op {fp['reduce_op']}")
    if e.shapes:
        lines.append("shapes " + ", ".join(str(list(x)) for x in e.shapes))
    if e.dtypes:
        lines.append("dtypes " + ", ".join(e.dtypes))
    if e.device:
        lines.append(f"device {e.device}")
    if e.root is not None:
        lines.append(f"root {e.root}")
    if e.callsite:
        lines.append(f"at {short_path(e.callsite)}")
    if e.library_callsite:
        lines.append(f"via {short_path(e.library_callsite)}")
    lines.append(f"{(s.end - s.start) * 1000:.2f} ms" + ("" if s.returned else " and never returned"))
    if s.finding is not None:
        lines.append("")
        lines.append(f"{tl.result.findings[s.finding].kind.upper()}: {tl.result.findings[s.finding].summary}")
    return escape("\n".join(lines))


def _callout(tl: ScenarioTimeline, s: Slice) -> str:
    """'all_reduce #6 · reduce_op MAX': the slice's name and, for a mismatch, this rank's differing values."""
    if s.finding is None:
        return s.name
    f = tl.result.findings[s.finding]
    detail = next((d for d in f.ranks if d.rank == s.rank and d.fingerprint), None)
    fingerprint = detail.fingerprint if detail is not None else None
    values = []
    for name in f.fields:
        if fingerprint and name in fingerprint:
            value = fingerprint[name]
            values.append(f"{name} {value}")
    if f.kind is Kind.ORDER and s.event.label:
        values = [s.event.label]
    return s.name + (" · " + ", ".join(values) if values else "")


@dataclass(frozen=True)
class _Frame:
    """Where one timeline's seconds and ranks land in its SVG."""

    tl: ScenarioTimeline
    lanes: dict[int, int]           # rank -> row
    height: int
    scale: float

    @classmethod
    def of(cls, tl: ScenarioTimeline) -> _Frame:
        return cls(tl=tl, lanes={lane.rank: i for i, lane in enumerate(tl.lanes)},
                   height=AXIS_H + len(tl.lanes) * (LANE_H + NOTE_H + LANE_GAP) + 14,
                   scale=PLOT_W / tl.end if tl.end > 0 else 1.0)

    def x(self, t: float) -> float:
        return GUTTER + max(0.0, min(t, self.tl.end)) * self.scale

    def y(self, rank: int) -> float:
        return AXIS_H + self.lanes[rank] * (LANE_H + NOTE_H + LANE_GAP)


def _axis(f: _Frame) -> list[str]:
    end, x = f.tl.end, f.x
    step = _nice_step(end)
    out = [f'<line class="axis" x1="{GUTTER}" y1="{AXIS_H - 6}" x2="{GUTTER + PLOT_W}" y2="{AXIS_H - 6}"/>']
    for i in range(int(end / step) + 2):
        t = i * step
        if t > end:
            break
        out.append(f'<line class="axis" x1="{x(t):.1f}" y1="{AXIS_H - 10}" x2="{x(t):.1f}" y2="{f.height - 4}" '
                   f'stroke-opacity=".45"/>')
        out.append(f'<text class="tick" x="{x(t) + 3:.1f}" y="{AXIS_H - 12}">{_fmt_t(t, step)}</text>')
    return out


def _lane_rows(f: _Frame) -> list[str]:
    out = []
    for lane in f.tl.lanes:
        ly = f.y(lane.rank)
        out.append(f'<rect class="lane-bg" x="{GUTTER}" y="{ly:.1f}" width="{PLOT_W}" height="{LANE_H}" rx="3"/>')
        label = lane.label if len(lane.label) <= 26 else lane.label[:25] + "…"
        full = f"<title>{escape(lane.label)}</title>" if label != lane.label else ""
        out.append(f'<text class="lane-label" x="8" y="{ly + 13:.1f}">{escape(label)}{full}</text>')
        note = f"{lane.state}" + (f" · {short_path(lane.note)}" if lane.note and lane.state == "crashed" else "")
        if len(note) > 30:
            note = note[:29] + "…"
        out.append(f'<text class="lane-state" x="8" y="{ly + 26:.1f}">{escape(note)}'
                   f'<title>{escape(lane.state + (": " + lane.note if lane.note else ""))}</title></text>')
    return out


def _stall_window(f: _Frame) -> list[str]:
    if f.tl.stall is None:
        return []
    x0, x1 = f.x(f.tl.stall[0]), f.x(f.tl.stall[1])
    return [f'<rect class="stall" x="{x0:.1f}" y="{AXIS_H - 4}" width="{max(x1 - x0, 1):.1f}" '
            f'height="{f.height - AXIS_H}"><title>no rank made progress from here until the watchdog '
            f'declared the stall</title></rect>']


def _slice(f: _Frame, s: Slice) -> tuple[list[str], str | None]:
    """The slice's group, and its call-out when it is marked but too narrow to hold its name."""
    x0, x1 = f.x(s.start), f.x(s.end)
    w = max(x1 - x0, 2.0)
    ly = f.y(s.rank) + 3
    h = LANE_H - 6
    mark = f" m-{s.mark}" if s.mark else (" err" if s.event.error else "")
    if s.count > 1:
        mark = " summary"
    out = [f'<g><title>{_tooltip(f.tl, s)}</title>']
    if not s.returned and w > 14:
        head = min(12.0, w / 3)
        out.append(f'<rect class="op {_op_class(s.event)}{mark}" x="{x0:.1f}" y="{ly:.1f}" width="{head:.1f}" '
                   f'height="{h}" rx="2"/>')
        out.append(f'<rect class="open-tail{mark}" x="{x0 + head:.1f}" y="{ly:.1f}" width="{w - head:.1f}" '
                   f'height="{h}" rx="2"/>')
    else:
        out.append(f'<rect class="op {_op_class(s.event)}{mark}" x="{x0:.1f}" y="{ly:.1f}" width="{w:.1f}" '
                   f'height="{h}" rx="2"/>')
    text = _callout(f.tl, s) if s.mark else s.name
    if not s.returned:
        text += " — never returned"
    callout = None
    if w > 7 * len(text) + 16:
        out.append(f'<text class="slice-text" x="{x0 + 16:.1f}" y="{ly + h / 2 + 4:.1f}">{escape(text)}</text>')
    elif s.mark:
        # marked but narrow: name it under the box, above everything else (drawn last)
        anchor = "end" if x0 + 7 * len(text) > GUTTER + PLOT_W else "start"
        cx = x1 if anchor == "end" else x0
        callout = (f'<line class="tick-line" x1="{(x0 + x1) / 2:.1f}" y1="{ly + h:.1f}" '
                   f'x2="{(x0 + x1) / 2:.1f}" y2="{ly + h + 5:.1f}"/>'
                   f'<text class="callout" x="{cx:.1f}" y="{ly + h + 15:.1f}" text-anchor="{anchor}">'
                   f'{escape(text)}</text>')
    out.append("</g>")
    return out, callout


def _marker(f: _Frame, m: Marker) -> str | None:
    if m.kind is MarkerKind.STALL:
        tx = f.x(m.t)
        anchor = "end" if tx > GUTTER + PLOT_W / 2 else "start"
        dx = -4 if anchor == "end" else 4
        return (f'<text class="stall-text" x="{tx + dx:.1f}" y="{f.height - 6}" text-anchor="{anchor}">'
                f'{escape(m.text)}</text>')
    if m.rank is None or m.rank not in f.lanes:
        return None
    mx, my = f.x(m.t), f.y(m.rank) + LANE_H / 2
    anchor = "end" if mx > GUTTER + PLOT_W * 0.6 else "start"
    dx = -12 if anchor == "end" else 12
    if m.kind is MarkerKind.ABSENT:
        return (f'<g><title>{escape(m.text)}</title><circle class="absent" cx="{mx:.1f}" cy="{my:.1f}" r="7"/>'
                f'<text class="absent-text" x="{mx + dx:.1f}" y="{my + 4:.1f}" text-anchor="{anchor}">'
                f'{escape(m.text)}</text></g>')
    if m.kind is MarkerKind.CRASH:
        return (f'<g><title>{escape(m.text)}</title>'
                f'<line class="crash" x1="{mx - 7:.1f}" y1="{my - 7:.1f}" x2="{mx + 7:.1f}" y2="{my + 7:.1f}"/>'
                f'<line class="crash" x1="{mx - 7:.1f}" y1="{my + 7:.1f}" x2="{mx + 7:.1f}" y2="{my - 7:.1f}"/>'
                f'<text class="crash-text" x="{mx + dx:.1f}" y="{my + 4:.1f}" text-anchor="{anchor}">'
                f'{escape(m.text)}</text></g>')
    return None


def _svg(tl: ScenarioTimeline) -> str:
    f = _Frame.of(tl)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{f.height}" '
           f'viewBox="0 0 {WIDTH} {f.height}" role="img" aria-label="timeline of {escape(tl.result.name)}">',
           '<defs><pattern id="hatch" width="6" height="6" patternUnits="userSpaceOnUse" '
           'patternTransform="rotate(45)"><rect width="6" height="6" fill="#cf222e" fill-opacity=".55"/>'
           '<line x1="0" y1="0" x2="0" y2="6" stroke="#82071e" stroke-width="2.5"/></pattern></defs>']
    out += _axis(f) + _lane_rows(f) + _stall_window(f)   # the stall window lies under the slices
    callouts: list[str] = []
    for s in tl.slices:
        if s.rank in f.lanes:
            parts, callout = _slice(f, s)
            out += parts
            callouts += [callout] if callout else []
    out += callouts
    out += [svg for m in tl.markers if (svg := _marker(f, m)) is not None]
    out.append("</svg>")
    return "\n".join(out)


def _badge(result: ScenarioResult) -> str:
    if result.skipped:
        return '<span class="badge skip">SKIP</span>'
    return '<span class="badge pass">OK</span>' if result.ok else '<span class="badge fail">FAIL</span>'


def _scenario(tl: ScenarioTimeline | None, result: ScenarioResult) -> str:
    parts = [f'<section class="scenario" id="{escape(result.name)}">',
             f"<h2>{_badge(result)} {escape(result.name)}</h2>"]
    if result.skipped:
        parts.append(f'<div class="desc">skipped: {escape(result.skipped)}</div></section>')
        return "\n".join(parts)
    parts.append(f'<div class="meta"><b>{escape(verdict(result))}</b> · '   # a script as a script (report.words)
                 f"ended: {escape(EndReason.of(result.end_reason).words)} · {result.duration_s:.1f} s · "
                 f"{len(result.ranks)} ranks · source {escape(short_path(result.source))}</div>")
    if result.description:
        parts.append(f'<div class="desc">{escape(result.description)}</div>')
    for f in result.findings:
        parts.append(f'<div class="finding {escape(f.severity)}"><span class="kind">{escape(f.kind.upper())}</span>'
                     f"{escape(f.summary)}</div>")
    if tl is None or (not tl.slices and not tl.markers):
        parts.append('<div class="empty">no collective was recorded for this scenario</div>')
    else:
        parts += _bounded(tl)
    parts.append("</section>")
    return "\n".join(parts)


def _bounded(tl: ScenarioTimeline) -> list[str]:
    """The whole run (long stretches summarised, alike ranks sharing a lane), then a close-up of the
    window around each finding, where every call is drawn."""
    notes = []
    if tl.summarised:
        notes.append(f"{tl.summarised:,} calls are drawn as summaries (grey); the close-ups below draw each call "
                     "around the findings and at the end")
    if len(tl.lanes) < tl.ranks:
        notes.append(f"{tl.ranks:,} ranks in {len(tl.lanes)} lanes: ranks that behave alike (same state, calls and "
                     "last call) share one")
    parts = [f'<div class="meta">{escape("; ".join(notes))}</div>'] if notes else []
    parts.append(_svg(tl))
    for t0, t1, title in tl.windows:
        parts.append(f'<h3 class="window">close-up: {escape(title)} ({t1 - t0:.3f} s)</h3>')
        parts.append(_svg(zoom(tl, t0, t1)))
    return parts


_VERDICT_BADGE = {"pass": '<span class="badge pass">PASS</span>', "fail": '<span class="badge fail">FAIL</span>'}


def render(report: Report, events: Mapping[str, Mapping[int, Sequence[Event]]]) -> str:
    timelines = {tl.result.name: tl for tl in build_all(report, events)}
    run = report.run
    verdict = report.verdict
    title = f"distcheck {verdict.upper()} · {run.backend} × {run.world_size} ranks · {run.started_at}"
    body = [
        f"<h1>{_VERDICT_BADGE[verdict]} distcheck timeline</h1>",
        f'<div class="meta">{escape(run.backend)} × {run.world_size} ranks ({run.nnodes} node(s)) · '
        f"torch {escape(run.torch_version)} · distcheck {escape(run.distcheck_version)} · seed {run.seed} · "
        f"started {escape(run.started_at)} on {escape(run.hostname or '?')} · {run.duration_s:.1f} s"
        + (" · interrupted" if report.interrupted else "") + "</div>",
        f'<div class="meta">command: <code>{escape(run.command)}</code></div>',
        (f'<div class="meta">{escape(describe(run.torch_version, run.torch_features))}</div>'
         if run.torch_features else ""),
        LEGEND,
    ]
    for result in report.scenarios:
        body.append(_scenario(timelines.get(result.name), result))
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>{escape(title)}</title><style>{CSS}</style></head><body>\n"
            + "\n".join(body) + "\n</body></html>\n")
