"""Where a rank ended its work early: the user's line that called ``sys.exit`` (its innermost user
frame in the SystemExit's traceback). Recorded in the rank's status (``where`` of a finished rank), so a
hang whose peers wait for that rank names the line it left at. Never raises into the user's program."""

from __future__ import annotations

import traceback
from collections.abc import Iterable
from typing import Any

from distcheck.rank.guard import Hook, failed


def exit_site(exc: BaseException) -> str | None:
    """"file:line:function (sys.exit)" of the innermost user frame; None when there is none or on any error."""
    try:
        return _user_site(reversed(list(traceback.walk_tb(exc.__traceback__))))
    except Exception as err:   # rule 0: a failing hook never changes how the rank ends; it is counted
        failed(Hook.RANK_END, err)
        return None


def exit_site_of_caller(frame: Any) -> str | None:
    """The same, for a ``sys.exit`` about to raise: the innermost user frame from ``frame`` (the caller
    of ``sys.exit``) outward. A rank of the user's own command records it through distcheck's
    ``sys.exit`` hook (``rank.injected``)."""
    try:
        return _user_site(traceback.walk_stack(frame))
    except Exception as err:   # rule 0: counted, never raised
        failed(Hook.RANK_END, err)
        return None


def _user_site(frames: Iterable[tuple[Any, int]]) -> str | None:
    """The first user frame of ``frames`` ((frame, line), innermost first), as "file:line:function (sys.exit)"."""
    from distcheck.files.stacks import torch_dir
    from distcheck.rank.callsite import USER, classify_file

    torch = torch_dir()
    for frame, line in frames:
        code = frame.f_code
        if classify_file(code.co_filename, torch) == USER:
            return f"{code.co_filename}:{line}:{code.co_name} (sys.exit)"
    return None
