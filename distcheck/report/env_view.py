"""Terminal view of ``distcheck env``: facts first, then the environment (already redacted)."""

from __future__ import annotations

from rich.console import Console, Group
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from distcheck.envinfo import EnvInfo
from distcheck.torch_features import LABELS, SINCE


def _since(name: str) -> str:
    return f"  (torch {SINCE[name]} or newer)" if name in SINCE else ""


def _yes(flag: bool) -> Text:
    return Text("yes", style="green") if flag else Text("no", style="dim")


def _c_path(text: str, c_name: str) -> Text:
    """Which of a C extension and its Python fallback runs: the C one plainly, a fallback with its reason dimmed."""
    if text == c_name:
        return Text(text, style="green")
    head, _, why = text.partition(" (")
    return Text(head, style="yellow") + Text(f" ({why}" if why else "", style="dim")


def renderable(info: EnvInfo) -> Group:
    facts = Table.grid(padding=(0, 2))
    facts.add_column(style="bold")
    facts.add_column()
    facts.add_row("distcheck", info.distcheck)
    facts.add_row("python", escape(info.python))
    facts.add_row("platform", escape(info.platform))
    facts.add_row("host", f"{escape(info.hostname)} · {info.cpus or '?'} CPUs")
    if info.hot_path:
        facts.add_row("tracer hot path", _c_path(info.hot_path, "C"))
    if info.native_thread:
        facts.add_row("rank thread", _c_path(info.native_thread, "native"))
    if info.torch is None:
        facts.add_row("torch", Text(f"not importable: {info.torch_error}", style="bold red"))
    else:
        facts.add_row("torch", Text(info.torch) + (Text(f"  {info.torch_problem}", style="bold red")
                                                    if info.torch_problem else Text("")))
        facts.add_row("CUDA", _yes(info.cuda_available) + Text(f"  (built for {info.cuda_version})"
                                                                if info.cuda_version else "  (CPU build)", style="dim"))
        for name, available in info.backends.items():
            extra = f"  {info.nccl_version}" if name == "nccl" and info.nccl_version else ""
            facts.add_row(name, _yes(available) + Text(extra, style="dim"))
        for name, available in info.torch_features.items():
            facts.add_row(LABELS.get(name, name), _yes(available) + Text(_since(name) if not available else "",
                                                                          style="dim"))
        if info.gpus:
            for g in info.gpus:
                mem = f", {g.memory_gib} GiB" if g.memory_gib is not None else ""
                cap = f", sm {g.capability}" if g.capability else ""
                facts.add_row(f"GPU {g.index}", escape(f"{g.name}{mem}{cap}"))
        else:
            facts.add_row("GPUs", Text("none (gloo on CPU)", style="dim"))
    for name, version in info.libraries.items():
        facts.add_row(name, version or Text("not installed", style="dim"))
    for name, text in info.context.items():
        facts.add_row(name, escape(text))
    parts: list = [facts]
    env = Table(show_header=True, header_style="dim", box=None, padding=(0, 2), pad_edge=False)
    env.add_column("variable", style="bold")
    env.add_column("value (secrets redacted)", overflow="fold")
    for name, value in info.env.items():
        env.add_row(escape(name), escape(value))
    parts.append(Text(""))
    parts.append(env if info.env else Text("no MASTER_*/RANK/TORCH_*/NCCL_*/GLOO_*/SLURM_*/TORCHELASTIC_* "
                                           "variables set", style="dim"))
    return Group(*parts)


def render(info: EnvInfo, console: Console) -> None:
    console.print(renderable(info))
