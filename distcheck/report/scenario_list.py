"""Terminal view of ``distcheck list``: scenarios, what they expect, what they need."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from rich.console import Console, Group
from rich.text import Text

from distcheck.models import PASS
from distcheck.scenario import BACKENDS, ScenarioSpec
from distcheck.text import short_path


def _entry(spec: ScenarioSpec, missing: Sequence[str], name_w: int, expect_w: int) -> Group:
    expect = "+".join(spec.expect)
    line = Text.assemble((spec.name.ljust(name_w), "bold"), "  ",
                         (expect.ljust(expect_w), "green" if expect == PASS else "yellow"))
    if spec.requires:
        line.append("  needs ")
        for i, name in enumerate(spec.requires):
            if i:
                line.append(", ")
            line.append(name + (" (missing)" if name in missing else ""), style="bold red" if name in missing else "")
    if set(spec.backends) != set(BACKENDS):
        line.append(f"  {'/'.join(spec.backends)} only", style="cyan")
    if spec.min_world_size != 2:
        line.append(f"  ≥{spec.min_world_size} ranks", style="cyan")
    for n, other in spec.expect_by_world_size:
        line.append(f"  {'+'.join(other)} at {n} ranks", style="cyan")
    if not spec.builtin:
        line.append(f"  {short_path(spec.file)}", style="dim")
    parts = [line]
    if spec.description:
        parts.append(Text("    " + " ".join(spec.description.split()), style="dim"))
    return Group(*parts)


def renderable(specs: Sequence[ScenarioSpec], missing: Mapping[str, Sequence[str]]) -> Group:
    name_w = max((len(s.name) for s in specs), default=0)
    expect_w = max((len("+".join(s.expect)) for s in specs), default=0)
    parts: list = [_entry(s, missing.get(s.name, ()), name_w, expect_w) for s in specs]
    builtin = sum(1 for s in specs if s.builtin)
    parts.append(Text(f"\n{len(specs)} scenario(s): {builtin} built-in, {len(specs) - builtin} given", style="dim"))
    if any(missing.get(s.name) for s in specs):
        parts.append(Text("scenarios with a missing requirement are skipped by 'distcheck run'; "
                          "pip install 'distcheck[metrics]' brings torchmetrics", style="dim"))
    return Group(*parts)


def render(specs: Sequence[ScenarioSpec], missing: Mapping[str, Sequence[str]], console: Console) -> None:
    console.print(renderable(specs, missing))
