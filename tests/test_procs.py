"""Process hygiene on real child processes: teardown kills, but leaves exit statuses to their parent."""

import signal
import subprocess
import sys

import psutil

from conftest import wait_for
from distcheck.launch.procs import is_alive, stat_of, terminate, terminate_tree

SLEEPER = "import signal, sys, time; signal.signal(signal.SIGTERM, {handler}); print('ready', flush=True); time.sleep(120)"


def _child(handler: str = "signal.SIG_DFL") -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", SLEEPER.format(handler=handler)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    return proc


def test_a_terminated_child_still_reads_as_killed_by_its_parent():
    # torch's agent polls its ranks with Popen.poll(); a child reaped by the teardown reads
    # there as exit code 0 (ECHILD), i.e. a killed rank counted as a success.
    proc = _child()
    try:
        assert terminate([psutil.Process(proc.pid)], grace_s=10) == [proc.pid]
        assert proc.wait(timeout=10) == -signal.SIGTERM
    finally:
        proc.kill()


def test_a_child_that_ignores_sigterm_is_killed_after_the_grace():
    proc = _child(handler="signal.SIG_IGN")
    try:
        terminate_tree([proc.pid], grace_s=0.5)
        assert proc.wait(timeout=10) == -signal.SIGKILL
    finally:
        proc.kill()


def test_one_read_of_proc_stat_gives_what_psutil_reads_in_four():
    """``stat_of``: alive, CPU seconds and resident bytes of a real child, as psutil reads them; a zombie is
    not alive, and a process that is gone reads as gone."""
    proc = subprocess.Popen([sys.executable, "-c", "x = bytearray(64 * 2**20)\nimport sys\nfor _ in range(3 * 10**6): pass\n"
                             "print('ready', flush=True)\nsys.stdin.read()"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        facts, p = stat_of(proc.pid), psutil.Process(proc.pid)
        times, rss = p.cpu_times(), p.memory_info().rss
        assert facts.alive and facts.rss_bytes > 64 * 2**20
        assert abs(facts.rss_bytes - rss) <= 2 * 2**20
        assert 0.05 < facts.cpu_seconds and abs(facts.cpu_seconds - (times.user + times.system)) < 0.05
        proc.stdin.close()
        assert wait_for(lambda: psutil.Process(proc.pid).status() == psutil.STATUS_ZOMBIE, 10)   # not reaped yet
        assert not stat_of(proc.pid).alive and not is_alive(proc.pid)
    finally:
        proc.kill()
        proc.wait()
    assert stat_of(proc.pid) == (False, 0.0, 0)


TREE = ("import subprocess, sys, time; c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); "
        "print(c.pid, flush=True); time.sleep(120)")

# ``and_mine`` ends everything below the calling process: run in a process of its own, not in pytest's.
AND_MINE = """
import subprocess, sys
from distcheck.launch import procs
sleep = [sys.executable, "-c", "import time; time.sleep(120)"]
other, kept = (subprocess.Popen(sleep, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for _ in range(2))
procs.keep(kept.pid)
try:
    procs.terminate_tree([], grace_s=5, and_mine=True)
    print(other.wait(timeout=10), kept.poll(), flush=True)
finally:
    for p in (other, kept):
        p.kill()
"""


def _tree() -> tuple[subprocess.Popen, int]:
    """A child that started a grandchild: (the child, the grandchild's pid)."""
    proc = subprocess.Popen([sys.executable, "-c", TREE], stdout=subprocess.PIPE, text=True)
    return proc, int(proc.stdout.readline())


def test_a_teardown_ends_the_ranks_trees_and_with_and_mine_everything_below_distcheck_but_what_it_keeps():
    rank, grandchild = _tree()
    other = _child()                          # not a rank: left alone without ``and_mine``
    try:
        terminate_tree([rank.pid], grace_s=5)
        assert rank.wait(timeout=10) == -signal.SIGTERM
        assert wait_for(lambda: not is_alive(grandchild), 10)
        assert other.poll() is None
    finally:
        for p in (rank, other):
            p.kill()
            p.wait(timeout=10)
        if is_alive(grandchild):
            psutil.Process(grandchild).kill()
    swept = subprocess.run([sys.executable, "-c", AND_MINE], capture_output=True, text=True, timeout=60)
    assert swept.stdout.split() == [str(-signal.SIGTERM), "None"], swept.stderr   # the kept helper outlived it
