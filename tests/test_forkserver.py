"""The fork server taken from distcheck's own torch import (``forkserver.start_early``) gives the ranks the
process a new server gives them: same threads, C++ log level, unbuffered output, signal handlers,
environment, torch modules and open files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

PROBE = Path(__file__).parent / "scripts" / "fork_server" / "probe.py"


def _facts(distcheck, tmp_path: Path, how: str, **env: str) -> list[dict]:
    out = tmp_path / how
    r = distcheck("run", str(PROBE), "--nproc-per-node", "2", "--run-dir", str(tmp_path / f"run-{how}"),
                  env={"FORK_SERVER_PROBE_OUT": str(out), **env}, timeout=180)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    facts = [json.loads(Path(f"{out}.{rank}.json").read_text()) for rank in range(2)]
    for f in facts:   # the files each run opened, less the name of its run dir
        f["fds"] = [fd.replace(f"run-{how}", "RUN") for fd in f["fds"]]
    return facts


def test_ranks_of_a_server_forked_from_distcheck_find_what_a_new_server_gives(distcheck, tmp_path):
    forked = _facts(distcheck, tmp_path, "forked", TORCH_CPP_LOG_LEVEL="INFO", OMP_NUM_THREADS="1")
    new = _facts(distcheck, tmp_path, "new", TORCH_CPP_LOG_LEVEL="INFO", OMP_NUM_THREADS="1",
                 DISTCHECK_FORK_SERVER="new")
    assert forked[0]["parent_threads"] == 1 == new[0]["parent_threads"]   # the ranks' parent: a server
    assert forked[0]["server_was_distcheck"] and not new[0]["server_was_distcheck"]
    for f, n in zip(forked, new):
        n["env"].remove("DISTCHECK_FORK_SERVER")
        assert {k: v for k, v in f.items() if k != "server_was_distcheck"} == \
            {k: v for k, v in n.items() if k != "server_was_distcheck"}
    assert forked[0]["num_threads"] == 1 and forked[0]["cpp_log_level"] == 0   # the user's, not distcheck's
    assert forked[0]["stdout"] == ["FileIO", True]
