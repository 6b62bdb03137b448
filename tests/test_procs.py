"""Process hygiene on real child processes: teardown kills, but leaves exit statuses to their parent."""

import signal
import subprocess
import sys

import psutil

from distcheck.launch.procs import terminate, terminate_tree

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
