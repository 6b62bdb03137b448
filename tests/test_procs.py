"""Process hygiene on real child processes: teardown kills, but leaves exit statuses to their parent."""

import signal
import subprocess
import sys
import time

import psutil

from conftest import wait_for
from distcheck.diagnose.progress import progress
from distcheck.launch.procs import Activity, ActivityMeter, is_alive, stat_of, terminate, terminate_tree

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


# A rank whose data-loader worker (a child process) writes while its main process waits for it on a pipe; with
# ``main_writes`` the main process writes and the child only waits.
WRITING_TREE = """
import os, sys, time
out = sys.argv[1]
main_writes = sys.argv[2] == "main"
r, w = os.pipe()
pid = os.fork()
if pid == 0:
    if main_writes:
        os.read(r, 1)
        os._exit(0)
    with open(out + ".child", "wb") as f:
        while True:
            f.write(b"x" * 8192); f.flush(); time.sleep(0.005)
print(pid, flush=True)
if main_writes:
    with open(out + ".main", "wb") as f:
        while True:
            f.write(b"x" * 8192); f.flush(); time.sleep(0.005)
os.read(r, 1)   # waits for good: the child never writes to the pipe
"""


def _writing_tree(tmp_path, who: str) -> tuple[subprocess.Popen, int]:
    proc = subprocess.Popen([sys.executable, "-c", WRITING_TREE, str(tmp_path / "data"), who], stdout=subprocess.PIPE,
                            text=True)
    return proc, int(proc.stdout.readline())


def _measured(proc: subprocess.Popen, enough: int) -> Activity:
    """The meter's sample of the tree once it has counted ``enough`` bytes since its first look."""
    meter = ActivityMeter(interval_s=0.0, children_s=0.0)
    assert meter.sample(0, proc.pid, time.monotonic()) is None   # the first look is the baseline
    seen: list[Activity] = []
    def counted() -> bool:
        act = meter.sample(0, proc.pid, time.monotonic())
        seen.extend([act] if act else [])
        return sum(a.io_bytes for a in seen) >= enough
    assert wait_for(counted, timeout=30), seen
    span = sum(a.span for a in seen)
    return Activity(seen[-1].at, span, sum(a.cores * a.span for a in seen) / span,
                    sum(a.io_bytes for a in seen), 0, 0.0, sum(a.child_io_bytes for a in seen),
                    tuple(dict.fromkeys(p for a in seen for p in a.children)))


def test_io_made_by_a_child_is_said_of_that_child_not_of_the_rank_s_main_process(tmp_path):
    proc, child = _writing_tree(tmp_path, "child")
    try:
        act = _measured(proc, 256 * 1024)
        assert act.children == (child,) and act.child_io_bytes == act.io_bytes
        words = progress(act.signs(), keeps_watching=True)
        assert words and words.startswith(f"its child process {child} read or wrote "), words
    finally:
        terminate_tree([proc.pid], grace_s=1)
        proc.wait(timeout=10)


def test_io_made_by_the_main_process_is_said_of_it(tmp_path):
    proc, child = _writing_tree(tmp_path, "main")
    try:
        act = _measured(proc, 256 * 1024)
        assert child not in act.children and act.child_io_bytes == 0
        words = progress(act.signs(), keeps_watching=True)
        assert words and words.startswith("its main process read or wrote "), words
    finally:
        terminate_tree([proc.pid], grace_s=1)
        proc.wait(timeout=10)


def test_a_child_the_main_thread_starts_is_measured_at_once_not_at_the_next_table_scan():
    """A rank late by a subprocess it waits for: the meter reads the new child at its next sample, where it
    waited for its next scan of the process table (up to twice ``children_s``), and a 5 s stall timeout on a
    loaded machine called such a rank stuck."""
    starts_child = ("import subprocess, sys\nsys.stdin.readline()\n"
                    "subprocess.run([sys.executable, '-c', 'while True: pass'])")
    proc = subprocess.Popen([sys.executable, "-c", starts_child], stdin=subprocess.PIPE, text=True)
    meter = ActivityMeter(interval_s=0.0, children_s=3600.0)   # no table scan due during the test
    try:
        assert wait_for(lambda: meter.sample(0, proc.pid, time.monotonic()) is not None, timeout=30)
        proc.stdin.write("go\n")
        proc.stdin.flush()
        def child_seen() -> bool:
            act = meter.sample(0, proc.pid, time.monotonic())
            return act is not None and bool(act.children) and act.child_cores > 0
        assert wait_for(child_seen, timeout=30)
    finally:
        terminate_tree([proc.pid], grace_s=1)
        proc.wait(timeout=10)
