"""Rule 0 in a rank's process: distcheck installs no signal handler but faulthandler's (each chained to
what was there), fires none of the user's, leaves
the warnings filters and faulthandler as the user has them, and adds no module but its own: compared
for a rank run plainly and under ``distcheck run`` (a script's ranks, and a command's)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import HARD_TIMEOUT_S, finish_process, free_port

pytestmark = pytest.mark.e2e

SCRIPTS = Path(__file__).parent / "scripts" / "rule0"
FOOTPRINT = SCRIPTS / "footprint.py"
OWN_HANDLERS = SCRIPTS / "own_handlers.py"
# distcheck may add its own modules, the standard library's, and torch's own submodules (the job imports
# torch already); never a third-party package the job did not import. A command's ranks also have the
# injected start-up module (``sitecustomize``, which runs the user's own in turn).
ALLOWED_TOP = set(sys.stdlib_module_names) | {"torch", "sitecustomize"}
FAULTHANDLER_FATAL = {int(s) for s in (signal.SIGSEGV, signal.SIGFPE, signal.SIGABRT, signal.SIGBUS, signal.SIGILL,
                                        signal.SIGTERM)}


def _plain(out: Path, port: int) -> None:
    env = {**os.environ, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port)}
    done = subprocess.run([sys.executable, str(FOOTPRINT), str(out)], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]


def _seen(prefix: Path, rank: int = 0) -> dict:
    return json.loads(Path(f"{prefix}.rank{rank}.json").read_text())


def _not_distcheck(modules: list[str]) -> set[str]:
    return {m for m in modules if not m.startswith(("distcheck", "__editable__"))}


@pytest.mark.parametrize("mode", ["script", "command"])
def test_a_rank_under_distcheck_sees_its_process_as_without_it(distcheck, tmp_path, mode):
    plain, traced = tmp_path / "plain", tmp_path / "traced"
    _plain(plain, free_port())
    if mode == "script":
        r = distcheck("run", str(FOOTPRINT), "--nproc-per-node", "2", "--", str(traced))
    else:
        r = distcheck("run", "--stall-timeout", "5", "--", sys.executable, "-m", "torch.distributed.run",
                      "--nproc-per-node", "2", "--master-port", str(free_port()), str(FOOTPRINT), str(traced))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    before = _seen(plain)
    for rank in (0, 1):
        after = _seen(traced, rank)
        assert after["handlers"] == before["handlers"]
        # faulthandler's handlers are the only ones, each dumps and hands the signal on as before: the
        # fatal-error ones (only where the user had not enabled faulthandler) and SIGTERM's (chained to the
        # disposition the rank had); none for SIGUSR1, SIGUSR2 or any other signal
        extra = set(after["caught"]) - set(before["caught"])
        assert extra <= FAULTHANDLER_FATAL and set(before["caught"]) <= set(after["caught"]), sorted(extra)
        assert after["warning_filters"] == before["warning_filters"]
        assert after["faulthandler"] == before["faulthandler"] or (not before["faulthandler"] and after["faulthandler"])
        added = _not_distcheck(after["modules"]) - _not_distcheck(before["modules"])
        foreign = sorted(m for m in added if m.split(".")[0].lstrip("_") not in ALLOWED_TOP
                         and m.split(".")[0] not in ALLOWED_TOP and not m.startswith("_sysconfigdata"))
        assert not foreign, f"distcheck imported into the rank: {foreign}"


def test_the_users_own_sigusr_handlers_are_never_fired_and_the_hang_is_still_named(tmp_path):
    marker = tmp_path / "job"
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "distcheck", "run", str(OWN_HANDLERS), "--nproc-per-node", "2", "--stall-timeout", "3",
         "--busy-timeout", "4", "--run-dir", str(run_dir), "--json", str(tmp_path / "report.json"), "--", str(marker),
         "3"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True, cwd=tmp_path)
    done = finish_process(proc, str(run_dir), HARD_TIMEOUT_S)
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-2000:]
    assert not Path(f"{marker}.fired").exists(), Path(f"{marker}.fired").read_text()
    [s] = json.loads((tmp_path / "report.json").read_text())["scenarios"]
    [hang] = [f for f in s["findings"] if f["kind"] == "hang"]
    assert hang["waiting_ranks"] == [1] and hang["absent_ranks"] == [0]
    lines = OWN_HANDLERS.read_text().splitlines()
    asleep = next(i for i, line in enumerate(lines, 1) if "# ASLEEP" in line)
    barrier = next(i for i, line in enumerate(lines, 1) if "# BARRIER" in line)
    assert hang["callsite"].endswith(f"own_handlers.py:{barrier}:main")
    ranks = {x["rank"]: x for x in s["ranks"]}
    assert ranks[0]["where"].endswith(f"own_handlers.py:{asleep}:main")
    stacks = Path(s["launch_dir"]) / "stacks"
    assert f"line {asleep} in main" in (stacks / "rank0.txt").read_text()   # taken by distcheck's own thread
    assert f"line {barrier} in main" in (stacks / "rank1.txt").read_text()
