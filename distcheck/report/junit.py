"""JUnit XML in pytest's shape: one testcase per scenario.

``testsuites > testsuite(name, tests, failures, errors, skipped, time,
timestamp, hostname) > properties + testcase(classname, name, file, time)``.
Under ``run -- pytest`` each test whose ranks ran is one testcase, named as pytest
names it, and the suite's ``<system-out>`` carries the command's last lines.
A scenario that did not behave as expected is a ``<failure>`` whose message is
its verdict in words (a script's as a script's: ``report.words``) and the first
finding's summary, and whose text lists every finding with its per-rank detail;
an interrupted one is an ``<error>``; a skipped one is ``<skipped>``, and a run
where every target was skipped has one ``<error>`` more ("nothing ran").
``<system-out>`` carries the log tail.
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET

from distcheck.models import PASS, EndReason, Finding, RankDetail, RankOutcome, Report, ScenarioResult
from distcheck.report.frames import without_own_frames
from distcheck.report.words import alike_ranks, verdict
from distcheck.text import short_path
from distcheck.torch_features import LABELS

# characters XML 1.0 cannot carry, even escaped (pytest's bin_xml_escape does the same)
_ILLEGAL = re.compile("[^\u0009\u000a\u000d\u0020-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")


def _x(text: object) -> str:
    return _ILLEGAL.sub(lambda m: f"#x{ord(m.group()):02X}", str(text))


def _finding_text(f: Finding) -> str:
    head = f"{f.kind.upper()} [{f.severity}]"
    where = " ".join(p for p in (
        f"{f.op} #{f.seq}" if f.op and f.seq is not None else (f.op or ""),
        f"(group {f.group})" if f.group is not None else "",
        f"[{f.label}]" if f.label else "",
        f"at {short_path(f.callsite)}" if f.callsite else "",
    ) if p)
    lines = [f"{head} {f.summary}"]
    if where:
        lines.append(f"    collective: {where}")
    if f.fields:
        lines.append(f"    differs in: {', '.join(f.fields)}")
    for label, detail in alike_ranks((d.rank, _detail(d)) for d in f.ranks):
        lines.append(f"    {_who(label)} {detail}")
    if f.detected_after_s is not None:
        lines.append(f"    detected {f.detected_after_s:.1f} s after the last progress")
    return "\n".join(lines)


def _detail(d: RankDetail) -> str:
    parts = [f"({d.role})"]
    if d.op:
        parts.append(f"{d.op} #{d.seq}" if d.seq is not None else d.op)
    if d.label:
        parts.append(f"[{d.label}]")
    if d.callsite:
        parts.append(f"at {short_path(d.callsite)}")
    elif d.where:
        parts.append(f"at {short_path(d.where)}")
    if d.state:
        parts.append(f"state={d.state}")
    if d.note:
        parts.append(f"- {d.note}")
    return " ".join(parts)


def _ranks_text(result: ScenarioResult) -> str:
    lines = ["ranks:"]
    for label, line in alike_ranks((r.rank, _rank_line(r)) for r in result.ranks):
        lines.append(f"    {_who(label)}: {line}")
    return "\n".join(lines)


def _who(label: str) -> str:
    """``alike_ranks``' label in words: "rank 3", "ranks 0-4090, 4092-4095 (4,095)"."""
    return f"{'rank' if label.isdigit() else 'ranks'} {label}"


def _rank_line(r: RankOutcome) -> str:
    where = r.exception or (f"killed by {r.signal}" if r.signal else "")
    at = r.where or (r.last_event.callsite if r.last_event else None)
    if at:
        where = f"{where} at {short_path(at)}" if where else short_path(at)
    return f"{r.state}, {r.collectives} collectives" + (f", {where}" if where else "")


def test_names(nodeid: str) -> tuple[str, str, str]:
    """(classname, name, file) of a pytest node id, as pytest's own junitxml writes them
    ("tests/test_x.py::TestA::test_b[1]" → "tests.test_x.TestA", "test_b[1]", "tests/test_x.py")."""
    path, *parts = nodeid.split("::")
    module = path[:-3] if path.endswith(".py") else path
    names = [module.replace("/", ".").replace("\\", "."), *parts[:-1]]
    return ".".join(names), parts[-1] if parts else nodeid, path


def _testcase(suite: ET.Element, result: ScenarioResult, classname: str) -> None:
    name, file = result.name, short_path(result.source)
    if result.test:   # one testcase per pytest test, named as pytest's own JUnit XML names it
        classname, name, file = test_names(result.test)
    case = ET.SubElement(suite, "testcase", {
        "classname": _x(classname), "name": _x(name), "file": _x(file), "time": f"{result.duration_s:.3f}",
    })
    observed = "+".join(result.observed) or PASS
    said = verdict(result)   # a script as a script: "train.py: hang", never "expected pass"
    ended = EndReason.of(result.end_reason)
    if result.skipped:
        ET.SubElement(case, "skipped", {"type": "distcheck.skip", "message": _x(result.skipped)}).text = _x(
            f"{result.name}: {result.skipped}")
        return
    findings = "\n\n".join(_finding_text(f) for f in result.findings)
    if not result.ok:
        first = result.findings[0].summary if result.findings else f"no finding; {ended.words}"
        tag = "error" if ended.interrupted else "failure"
        body = f"{said} (ended: {ended.words})\n\n"
        body += (findings + "\n\n" if findings else "") + _ranks_text(result)
        ET.SubElement(case, tag, {
            "type": f"distcheck.{observed}", "message": _x(f"{said}: {first}"),
        }).text = _x(body)
    out = []
    if result.ok and result.findings:
        out.append(f"{said}:\n\n{findings}")
    if result.log_tail:
        out.append("log tail (distcheck's own frames left out):\n" + without_own_frames(result.log_tail))
    if out:
        ET.SubElement(case, "system-out").text = _x("\n\n".join(out))


def render(report: Report, suite_name: str = "distcheck") -> str:
    run = report.run
    ran = [s for s in report.scenarios if not s.skipped]
    failures = sum(1 for s in ran if not s.ok and not EndReason.of(s.end_reason).interrupted)
    errors = sum(1 for s in ran if not s.ok and EndReason.of(s.end_reason).interrupted)
    # a run cut short between scenarios, or one that ran nothing, must not look green in CI
    cut_short = report.interrupted and not errors
    # a wrapped command that started no process group ends as it ended: its skip says why, no error of ours
    nothing_ran = report.nothing_ran and not report.interrupted and report.unchecked_exit is None
    errors += nothing_ran
    skipped = len(report.scenarios) - len(ran)
    attrs = {
        "name": suite_name, "errors": str(errors + cut_short), "failures": str(failures), "skipped": str(skipped),
        "tests": str(len(report.scenarios) + cut_short + nothing_ran), "time": f"{run.duration_s:.3f}",
        "timestamp": run.started_at,
        "hostname": _x(run.hostname or "unknown"),
    }
    root = ET.Element("testsuites", {"name": "distcheck"})
    suite = ET.SubElement(root, "testsuite", attrs)
    props = ET.SubElement(suite, "properties")
    values = {
        "seed": run.seed, "backend": run.backend, "world_size": run.world_size, "nnodes": run.nnodes,
        "nproc_per_node": run.nproc_per_node, "torch": run.torch_version, "distcheck": run.distcheck_version,
        "python": run.python_version, **{name: v for name, v in sorted(run.versions.items())},
        **{f"torch feature: {LABELS.get(name, name)}": "yes" if ok else "no"
           for name, ok in run.torch_features.items()},
        "command": run.command, "run_dir": run.run_dir, "verdict": report.verdict,
        "end_reason": report.end_reason.words,
    }
    for name, value in values.items():
        if value not in (None, ""):
            ET.SubElement(props, "property", {"name": name, "value": _x(value)})
    classname = f"distcheck.{run.backend}.{run.world_size}ranks"
    for result in report.scenarios:
        _testcase(suite, result, classname)
    if cut_short:
        case = ET.SubElement(suite, "testcase", {"classname": classname, "name": "(run interrupted)", "time": "0.000"})
        ET.SubElement(case, "error", {"type": "distcheck.interrupted",
                                      "message": "the run was interrupted before every scenario ran"})
    if nothing_ran:
        case = ET.SubElement(suite, "testcase", {"classname": classname, "name": "(nothing ran)", "time": "0.000"})
        ET.SubElement(case, "error", {"type": "distcheck.nothing_ran",
                                      "message": "nothing ran: every target was skipped, so nothing was checked"})
    if run.command_output:   # the command's own last lines (pytest's summary), beside distcheck's verdicts
        ET.SubElement(suite, "system-out").text = _x("the command's last output:\n" + run.command_output)
    ET.indent(root)
    return '<?xml version="1.0" encoding="utf-8"?>\n' + ET.tostring(root, encoding="unicode") + "\n"
