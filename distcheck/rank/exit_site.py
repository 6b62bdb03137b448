"""Where a rank ended its work early: the user's line that called ``sys.exit`` (its innermost user
frame in the SystemExit's traceback). Recorded in the rank's status (``where`` of a finished rank), so a
hang whose peers wait for that rank names the line it left at. Never raises into the user's program."""

from __future__ import annotations

import traceback
from typing import Any

from distcheck.rank.guard import Hook, failed


def exit_site(exc: BaseException) -> str | None:
    """"file:line:function (sys.exit)" of the innermost user frame; None when there is none or on any error."""
    try:
        from distcheck.files.stacks import torch_dir
        from distcheck.rank.callsite import USER, classify_file

        torch = torch_dir()
        where = None
        for frame in traceback.extract_tb(exc.__traceback__):
            if classify_file(frame.filename, torch) == USER:
                where = f"{frame.filename}:{frame.lineno}:{frame.name}"
        return f"{where} (sys.exit)" if where else None
    except Exception as err:   # rule 0: a failing hook never changes how the rank ends; it is counted
        failed(Hook.RANK_END, err)
        return None


def exit_site_of_caller(frame: Any) -> str | None:
    """The same, for a ``sys.exit`` about to raise: the innermost user frame from ``frame`` (the caller
    of ``sys.exit``) outward. A rank of the user's own command records it through distcheck's
    ``sys.exit`` hook (``rank.injected``)."""
    try:
        from distcheck.files.stacks import torch_dir
        from distcheck.rank.callsite import USER, classify_file

        torch = torch_dir()
        while frame is not None:
            if classify_file(frame.f_code.co_filename, torch) == USER:
                return f"{frame.f_code.co_filename}:{frame.f_lineno}:{frame.f_code.co_name} (sys.exit)"
            frame = frame.f_back
        return None
    except Exception as err:   # rule 0: counted, never raised
        failed(Hook.RANK_END, err)
        return None
