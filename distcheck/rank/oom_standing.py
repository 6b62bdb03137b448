"""The OOM killer's standing a process distcheck starts for the job takes first thing (a rank, the guard
of ``run -- CMD``, the metric replay): the ``oom_score_adj`` the launcher chose for the job
(``launch.memory.shield_from_oom_killer`` says why), passed down in the environment. Standard library
only: it runs in the user's processes."""

from __future__ import annotations

import os

OOM_SCORE_ADJ = "/proc/self/oom_score_adj"
JOB_OOM_SCORE_ADJ_ENV = "DISTCHECK_JOB_OOM_SCORE_ADJ"


def write_oom_score_adj(value: int) -> bool:
    try:
        fd = os.open(OOM_SCORE_ADJ, os.O_WRONLY)
    except OSError:
        return False
    try:
        os.write(fd, str(value).encode())
        return True
    except OSError:    # EACCES: lowering it needs CAP_SYS_RESOURCE
        return False
    finally:
        os.close(fd)


def take_job_standing() -> None:
    """Take the ``oom_score_adj`` meant for the job (raising it, or putting back the job's own above
    distcheck's, needs no privilege)."""
    value = os.environ.pop(JOB_OOM_SCORE_ADJ_ENV, None)
    if value is not None and value.lstrip("-").isdigit():
        write_oom_score_adj(int(value))
