"""What issued a collective the Python tracer never saw (DDP's reducer, FSDP2, DTensor, a functional collective),
read from the rank's main-thread stack, and the stack readings the C++-collective sidecar (``rank.native``) takes:
cheap (no source lines read), innermost frame first, as ``(file, line, function)``."""

from __future__ import annotations

import sys
from typing import Any

from distcheck.files.stacks import LIBRARY, TORCH, USER, classify_file, torch_dir
from distcheck.models import UNKNOWN_OP
from distcheck.text import call_site

# torch.distributed's Python API (distributed_c10d.py and the like): a frame there means Python made the call.
_PYTHON_API = "/torch/distributed/"

# (path fragment, what issued the call), innermost torch frame first.
_ISSUERS = (
    ("/torch/distributed/fsdp/", "FSDP"),
    ("/torch/distributed/_composable/", "FSDP"),
    ("/torch/distributed/tensor/", "DTensor"),
    ("/torch/distributed/_functional_collectives", "functional collective"),
    ("/torch/nn/parallel/distributed.py", "DDP"),
    ("/torch/autograd/", "autograd"),
)


def issuer_label(op: str, shapes: tuple[tuple[int, ...], ...], frames: list[tuple[str, int, str]]) -> str:
    """A person's name for the call: "DDP gradient all_reduce, bucket of 5 elements".

    ``frames`` is the main thread's stack, innermost first: (file, line, function).
    """
    issuer = next((name for file, _, _ in frames for frag, name in _ISSUERS if frag in file), None)
    ddp = any("/torch/nn/parallel/distributed.py" in file for file, _, _ in frames)
    if issuer == "autograd" or (issuer == "DDP" and not ddp):
        issuer = "DDP gradient" if op == "all_reduce" else "autograd"
    elif issuer == "DDP" and any(fn == "__init__" for file, _, fn in frames if "parallel/distributed.py" in file):
        issuer = "DDP init"
    if issuer is None:
        caller = python_caller(frames)
        issuer = "C++-issued" if caller is None else caller
    text = f"{issuer} {op}" if issuer else op
    if issuer == "DDP gradient" and shapes:
        numel = sum(_numel(s) for s in shapes)
        text += f", bucket of {numel} element{'s' if numel != 1 else ''}"
    return text


def python_caller(frames: list[tuple[str, int, str]]) -> str | None:
    """Who called torch.distributed's Python API, when the stack is inside it: a library by its package name
    ("lightning"), the user's own code as "". Such a call was issued from Python, past the tracer's wrappers (a
    reference to the function taken before distcheck armed, a module's own global): not from C++. None when the
    stack's innermost torch frames are not that API."""
    torch = torch_dir()
    inside_api = False
    for file, _, _ in frames:
        kind = classify_file(file, torch)
        if kind == TORCH:
            inside_api = inside_api or _PYTHON_API in file
        elif kind in (USER, LIBRARY):
            return (_package(file) if kind == LIBRARY else "") if inside_api else None
    return None


def _package(file: str) -> str:
    """The installed package a library file belongs to: the folder under site-packages."""
    parts = file.replace("\\", "/").split("/")
    for marker in ("site-packages", "dist-packages"):
        if marker in parts and parts.index(marker) + 1 < len(parts):
            return parts[parts.index(marker) + 1].removesuffix(".py")
    return parts[-2] if len(parts) > 1 else file


def inside_issuer(frames: list[tuple[str, int, str]]) -> bool:
    """The stack is inside something that issues collectives from C++ (DDP, autograd, FSDP, DTensor, funcol),
    and its innermost frame is torch's own: a call into C++ that may be waiting. A thread that runs an
    import or the user's code (a hook) is busy there, not waiting in a collective."""
    return (bool(frames) and classify_file(frames[0][0], torch_dir()) == TORCH
            and any(frag in file for file, _, _ in frames for frag, _ in _ISSUERS))


def unknown_call_label(frames: list[tuple[str, int, str]], recorder: bool) -> str:
    """A C++-issued call without a recorder entry: what issued it (read from the stack), and that nothing says which
    call it was."""
    issuer = issuer_label(UNKNOWN_OP, (), frames).removesuffix(f" {UNKNOWN_OP}")
    issuer = {"autograd": "DDP's reducer in backward()", "C++-issued": "C++ code"}.get(issuer, issuer)
    why = "the Flight Recorder has no entry for it" if recorder else "without a Flight Recorder nothing says which"
    return f"{issuer} (a collective issued from C++; {why})"


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def user_line(frames: list[tuple[str, int, str]], torch: str, kind: int = USER) -> str | None:
    """The innermost frame of the user's own code (``kind``: of a library), as 'file:line:function'."""
    for file, line, fn in frames:
        if classify_file(file, torch) == kind:
            return call_site(file, line, fn)
    return None


def stack_of(thread_id: int | None) -> list[tuple[str, int, str]]:
    """A thread's stack, innermost first (cheap: no source lines read)."""
    frame = sys._current_frames().get(thread_id) if thread_id is not None else None
    out: list[tuple[str, int, str]] = []
    while frame is not None and len(out) < 200:
        out.append((frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name))
        frame = frame.f_back
    return out


def stack_digest(thread_id: int | None) -> int:
    """A 64-bit digest of a thread's stack (code objects and lines): it changes when the thread moves on."""
    frame = sys._current_frames().get(thread_id) if thread_id is not None else None
    parts: list[tuple[int, int]] = []
    while frame is not None and len(parts) < 200:
        parts.append((id(frame.f_code), frame.f_lineno))
        frame = frame.f_back
    return hash(tuple(parts)) & (1 << 64) - 1


def traceback_frames(tb: Any) -> list[tuple[str, int, str]]:
    """A traceback's frames, innermost first, as ``stack_of`` gives them: where a call that raised was issued."""
    out = []
    while tb is not None:
        out.append((tb.tb_frame.f_code.co_filename, tb.tb_lineno, tb.tb_frame.f_code.co_name))
        tb = tb.tb_next
    return out[::-1]
