"""A small test project shaped like Lightning's own suite (tests/tests_pytorch, tests/tests_fabric), written
here from scratch: tests that train with real Lightning on 2 CPU ranks, under autouse fixtures that fail a
test which leaves something behind, as Lightning's conftest does.

Each test fails when it
  1. leaves a new file under this project folder;
  2. leaves a new thread in ``threading.enumerate()`` (Lightning's own launcher's observer excepted);
  3. adds, removes or changes an environment variable (Lightning's own leaks excepted, as its suite does);
  4. leaves a signal's handler changed (``signal.getsignal``, as Lightning's conftest checks) or a signal newly
     ignored by the process (/proc/self/status). Newly *caught* is not checked: Lightning's Trainer puts back
     SIG_DFL at its end where faulthandler (pytest's) had a handler from C, and distcheck's documented SIGTERM
     stack writer (docs/rule0.md) is registered while a pytest process is a rank (this check runs before the
     test's process group is destroyed, and distcheck takes it away then);
  5. warns: ``filterwarnings = error`` in pytest.ini, and ``PYTHONWARNINGS`` below for the ranks Lightning
     starts, less the warnings Lightning's own code gives plainly.

Standalone tests (``@pytest.mark.standalone``) run only with ``LIGHTNING_LIKE_STANDALONE=1``, one per pytest
process, as Lightning runs its own with ``PL_RUN_STANDALONE_TESTS=1``: the pytest process is rank 0 and
Lightning's launcher starts rank 1 as the same command again.

tests/test_public_lightning_e2e.py runs this project plainly and under ``distcheck run -- python -m pytest``
and compares the outcomes test by test.
"""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

import pytest

PROJECT = Path(__file__).resolve().parent
STANDALONE_ENV = "LIGHTNING_LIKE_STANDALONE"

# Warnings Lightning's (and torch's) own code gives in these tests without any tool around them. Each is a
# message prefix, the form PYTHONWARNINGS takes (no comma in it); pytest.ini's filterwarnings has the same list.
LIGHTNING_OWN_WARNINGS = (
    ("ignore", "The 'train_dataloader' does not have many workers"),
    ("ignore", "The 'val_dataloader' does not have many workers"),
    ("ignore", "The number of training batches"),
    ("ignore", "`isinstance(treespec"),   # torch 2.10+ deprecates what Lightning calls
    ("ignore", "It is recommended to use `self.log("),
    ("ignore", "Using `DistributedSampler` with the dataloaders"),
    ("ignore", "torch.distributed.nn.functional.all_gather is deprecated"),
    ("ignore", "The `srun` command is available on your system but is not used"),   # a machine with Slurm (CI's)
)
# The ranks Lightning starts (spawned ones, and rank 1 of a standalone test) inherit the environment: the same
# rule holds there. Set once, at start-up, before any test takes its snapshot of the environment.
os.environ["PYTHONWARNINGS"] = ",".join(["error", *(f"{action}:{text}" for action, text in LIGHTNING_OWN_WARNINGS)])

# Variables Lightning sets for its ranks and leaves set after a run (its own conftest allows the same ones), or
# takes away again in the process it started as rank 1.
LIGHTNING_OWN_LEAKS = {"MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "RANK",
                       "PL_GLOBAL_SEED", "PL_SEED_WORKERS", "OMP_NUM_THREADS"}


@pytest.hookimpl(tryfirst=True)   # before pytest's junitxml plugin opens the file
def pytest_configure(config):
    config.addinivalue_line("markers", "standalone: runs alone in its own pytest process, which is rank 0")
    # Rank 1 of a standalone test is this command again (LOCAL_RANK set from its start): its report is its own.
    local_rank = os.environ.get("LOCAL_RANK")
    if getattr(config.option, "xmlpath", None) and local_rank not in (None, "0"):
        config.option.xmlpath = f"{config.option.xmlpath}.rank{local_rank}"


def pytest_collection_modifyitems(config, items):
    standalone = os.environ.get(STANDALONE_ENV) == "1"
    skip = pytest.mark.skip(reason=f"a standalone test: runs with {STANDALONE_ENV}=1, alone in its pytest process")
    for item in list(items):
        marked = item.get_closest_marker("standalone") is not None
        if standalone and not marked:
            items.remove(item)
        elif marked and not standalone:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def ends_the_process_group():
    """As Lightning's conftest: a test's process group does not outlive it."""
    yield
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def _files() -> set[Path]:
    return {p for p in PROJECT.rglob("*") if "__pycache__" not in p.parts}


@pytest.fixture(autouse=True)
def leaves_no_file_behind():
    before = _files()
    yield
    left = sorted(str(p.relative_to(PROJECT)) for p in _files() - before)
    assert not left, f"the test left files in the project: {left}"


# Lightning's own thread that watches the ranks its launcher started (a daemon; it ends when they have, polling
# every 5 s). Lightning's conftest joins it for up to 10 s; here it is let be: rank 0 idle in that join after rank 1
# left is what tests/test_public_lightning_e2e.py's own reproduction of a distcheck harm is about, and a race
# (the poll's phase) would make this project pass or fail by chance.
LIGHTNING_OWN_THREADS = ("child-process-observer",)


@pytest.fixture(autouse=True)
def leaves_no_thread_behind():
    before = set(threading.enumerate())
    yield
    left = [t for t in set(threading.enumerate()) - before if t.is_alive() and t.name not in LIGHTNING_OWN_THREADS]
    assert not left, f"the test left threads running: {left}"


@pytest.fixture(autouse=True)
def leaves_the_environment_as_it_was():
    before = {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}   # pytest's own, per phase
    yield
    after = {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}
    current = os.environ.get("PYTEST_CURRENT_TEST")
    os.environ.clear()
    os.environ.update(before)
    if current is not None:
        os.environ["PYTEST_CURRENT_TEST"] = current
    added = sorted(k for k in after.keys() - before.keys() if k not in LIGHTNING_OWN_LEAKS)
    removed = sorted(k for k in before.keys() - after.keys() if k not in LIGHTNING_OWN_LEAKS)
    changed = sorted(k for k in before.keys() & after.keys() if before[k] != after[k] and k not in LIGHTNING_OWN_LEAKS)
    assert not (added or removed or changed), f"environment: added {added}, removed {removed}, changed {changed}"


def _handlers() -> dict[int, object]:
    out = {}
    for signum in signal.valid_signals() - {signal.SIGKILL, signal.SIGSTOP}:
        try:
            out[int(signum)] = signal.getsignal(signum)
        except (OSError, ValueError):
            continue
    return out


def _ignored() -> int:
    """The signals the process ignores as the kernel has them (SigIgn: one ignored from C included)."""
    try:
        lines = Path("/proc/self/status").read_text().splitlines()
    except OSError:
        return 0
    return next((int(line.split()[1], 16) for line in lines if line.startswith("SigIgn:")), 0)


def _signal_names(mask: int) -> list[str]:
    out = []
    for bit in range(64):
        if mask >> bit & 1:
            try:
                out.append(signal.Signals(bit + 1).name)
            except ValueError:
                out.append(str(bit + 1))
    return out


@pytest.fixture(autouse=True)
def leaves_signal_handlers_as_they_were():
    """Python's handler of every signal as it was (what Lightning's conftest restores), and no signal newly ignored
    by the process."""
    handlers, ignored = _handlers(), _ignored()
    yield
    now, ignored_now = _handlers(), _ignored()
    changed = sorted(signal.Signals(s).name for s in handlers if now.get(s) != handlers[s])
    for name in changed:   # put back, so that one test's change does not fail the next
        try:
            signal.signal(signal.Signals[name], handlers[int(signal.Signals[name])])
        except (OSError, TypeError, ValueError):
            pass
    assert not changed, f"signal handlers changed: {changed}"
    assert not ignored_now & ~ignored, f"signals newly ignored by the process: {_signal_names(ignored_now & ~ignored)}"
