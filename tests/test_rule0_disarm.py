"""Rule 0: ``disarm`` puts a process back as it was before distcheck armed it (issue 56 item 2).

A real process runs a small gloo job untraced, is armed as ``distcheck run -- CMD`` arms a command's rank, runs
the same job traced (torch.distributed's calls, a DataLoader pass over an IterableDataset, a torchmetrics metric
synced across the group, Lightning imported), and is disarmed: every attribute of torch.distributed, the
DataLoader's iterators, torchmetrics and Lightning, the import finders, the signal handlers, faulthandler, the
threads (Python's and the OS's), the open files, stdout and stderr, the exit hooks are as they were before it was
armed (what an untraced run changes by itself, torch chaining ``sys.excepthook`` at each init, set aside).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import finish_process
from distcheck.files.trace_reader import read_trace_dir

SCRIPT = Path(__file__).parent / "scripts" / "rule0" / "disarmed.py"
TIMEOUT_S = 180

pytestmark = pytest.mark.e2e

pytest.importorskip("torchmetrics")
pytest.importorskip("lightning")


def _run(tmp_path: Path, mode: str) -> dict:
    launch = tmp_path / "launch"
    proc = subprocess.Popen([sys.executable, str(SCRIPT), str(launch), mode], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    done = finish_process(proc, str(launch), TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _traced_ops(trace_dir: Path) -> list[str]:
    return [event.op for event in read_trace_dir(trace_dir)[0].events if hasattr(event, "op")]


# What a traced rank has that an untraced one has not: the proof that the job was traced before it was disarmed.
TRACED_CHANGES = {"attributes", "modules", "meta_path", "faulthandler", "stdout", "stderr", "atexit callbacks",
                  "multiprocessing finalizers", "open files"}


# The one library distcheck imports into a rank and leaves imported: the metric recorder copies a metric by value
# with cloudpickle (its by-value registrations are taken back after each copy); it holds nothing of distcheck's.
LIBRARIES_IT_NEEDS = {"cloudpickle"}


def _left_behind(found: dict) -> dict:
    left = dict(found["left behind"])
    modules = {name: ids for name, ids in left.pop("modules", {}).items()
               if name.split(".")[0] not in LIBRARIES_IT_NEEDS or ids[0] is not None}
    return {**left, **({"modules": modules} if modules else {})}


@pytest.mark.parametrize("mode", ["after_destroy", "mid_job"])
def test_disarm_leaves_the_process_as_it_was_before_distcheck_armed_it(tmp_path, mode):
    found = _run(tmp_path, mode)
    assert found["traced"] == found["untraced"]
    assert TRACED_CHANGES <= set(found["traced changed"])
    assert _left_behind(found) == {}
    ops = _traced_ops(tmp_path / "launch" / "traces")
    assert ops[:2] == ["all_reduce", "barrier"]
    assert ops.count("all_reduce") == 1   # mid_job: the calls made after disarm went untraced


def test_a_process_disarmed_and_armed_again_is_traced_again_and_disarmed_again_cleanly(tmp_path):
    found = _run(tmp_path, "rearm")
    assert _left_behind(found) == {}
    first, second = (_traced_ops(tmp_path / "launch" / "traces"),
                     _traced_ops(tmp_path / "launch" / "generations" / "1" / "traces"))
    assert first == second and first[:2] == ["all_reduce", "barrier"]
