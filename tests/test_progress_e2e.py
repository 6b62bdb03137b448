"""Certain hangs named at once, and late told from stuck by evidence (issue 21), on real gloo ranks.

* Certain: only rank 0 calls ``BinaryAUROC.compute()`` while ranks 1-3 finished; two ranks each
  ``send`` to the other first (a cycle). Named within seconds although ``--stall-timeout`` is 30.
* Late, not hung (``--stall-timeout 3``, each slow part lasting well past it, at about zero CPU of
  the rank's own): rank 0 writing a file in small chunks, waiting on a child process that computes,
  downloading from a slow local HTTP server. Each completes clean with exit 0.
* Stuck: rank 0 blocked on an ``Event`` never set is a hang within the stall timeout + 1 s that
  names the ``wait`` line.
"""

from __future__ import annotations

import http.server
import threading
import time
from pathlib import Path

import pytest

from launch_group import run_together

pytestmark = pytest.mark.e2e

PROGRESS = Path(__file__).parent / "scripts" / "progress"
SLOW_S = "8"     # each slow part: well past the stall timeout below
STALL = "3"


def _only(report: dict) -> dict:
    [s] = report["scenarios"]
    return s


def _line(callsite: str, marker: str) -> bool:
    path, line = callsite.split(":")[:2]
    return marker in Path(path).read_text().splitlines()[int(line) - 1]


def test_a_hang_whose_peers_finished_is_named_at_once_whatever_the_stall_timeout(distcheck):
    r = distcheck("run", "auroc_rank0_only_compute", "--nproc-per-node", "4", "--stall-timeout", "30")
    assert r.returncode == 0, r.stderr[-2000:]   # the scenario expects its hang
    s = _only(r.report)
    [hang] = [f for f in s["findings"] if f["kind"] == "hang"]
    assert hang["waiting_ranks"] == [0] and hang["absent_ranks"] == [1, 2, 3]
    assert hang["detected_after_s"] < 1.5 and "certain: ranks 1, 2, 3 finished" in hang["summary"]
    assert s["duration_s"] < 25


def test_send_send_is_one_cycle_finding_naming_both_ranks(distcheck, tmp_path):
    script = tmp_path / "send_send.py"
    script.write_text("import torch, torch.distributed as dist\n"
                      "dist.init_process_group('gloo')\n"
                      "peer = 1 - dist.get_rank()\n"
                      "t = torch.ones(4)\n"
                      "dist.send(t, peer)  # SEND\n"
                      "dist.recv(t, peer)\n")
    r = distcheck("run", str(script), "--nproc-per-node", "2", "--stall-timeout", "30")
    assert r.returncode == 1
    [hang] = [f for f in _only(r.report)["findings"] if f["kind"] in ("hang", "mismatch")]
    assert hang["kind"] == "hang" and hang["waiting_ranks"] == [0, 1] and hang["absent_ranks"] == []
    assert hang["detected_after_s"] < 2.0   # confirmed over 0.8 s: both ranks are still inside calls
    assert [c["ranks"] for c in hang["data"]["cycle"]] == [[0], [1]]
    assert all(_line(c["callsite"], "# SEND") for c in hang["data"]["cycle"])
    assert "batch_isend_irecv" in hang["summary"]


@pytest.fixture(scope="module")
def slow_server():
    """A local HTTP server that trickles 1 KB every 0.1 s for SLOW_S seconds."""
    class Trickle(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()
            end = time.monotonic() + float(SLOW_S)
            while time.monotonic() < end:
                self.wfile.write(b"x" * 1024)
                self.wfile.flush()
                time.sleep(0.1)   # the server's pace, not a wait for the test

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Trickle)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/"
    server.shutdown()
    server.server_close()


LATE = ("slow_writer.py", "waits_on_child.py", "slow_download.py")
LATE_TIMEOUT = 240


@pytest.fixture(scope="module")
def late_runs(slow_server, tmp_path_factory) -> dict:
    """The three late-not-hung scripts, one launch each, started together: most of each is its slow part,
    at about zero CPU, so they wait side by side rather than one after the other. script -> the run."""
    jobs = {script: [str(PROGRESS / script), "--nproc-per-node", "2", "--stall-timeout", STALL, "--",
                     slow_server if script == "slow_download.py" else SLOW_S] for script in LATE}
    return run_together(jobs, lambda script: tmp_path_factory.mktemp(script.replace(".", "_")), LATE_TIMEOUT)


@pytest.mark.xdist_group("test_progress_e2e_late")   # one worker runs the three, so the group is launched once
@pytest.mark.timeout(LATE_TIMEOUT + 60)
@pytest.mark.parametrize("script", LATE)
def test_a_late_rank_making_progress_without_cpu_is_not_called_hung(late_runs, script):
    r = late_runs[script]
    s = _only(r.report)
    assert r.returncode == 0 and s["end_reason"] == "completed", [f["summary"] for f in s["findings"]]
    assert not [f for f in s["findings"] if f["severity"] == "error"]
    [late] = [f for f in s["findings"] if f["kind"] == "straggler"]
    assert late["odd_ranks"] == [0] and late["data"]["progress"], late["summary"]
    # said of the process that made it: the writer's own, the waiting rank's child (not the rank, idle in wait())
    maker = {"slow_writer.py": "its main process ", "waits_on_child.py": "its child process "}.get(script)
    assert maker is None or late["data"]["progress"].startswith(maker), late["data"]["progress"]


def test_a_rank_blocked_on_an_event_never_set_is_a_hang_naming_the_wait_line(distcheck):
    r = distcheck("run", str(PROGRESS / "event_never_set.py"), "--nproc-per-node", "3", "--stall-timeout", STALL)
    assert r.returncode == 1
    s = _only(r.report)
    [hang] = [f for f in s["findings"] if f["kind"] == "hang"]
    assert hang["waiting_ranks"] == [1, 2] and hang["absent_ranks"] == [0]
    assert hang["detected_after_s"] <= float(STALL) + 1.0
    rank0 = {x["rank"]: x for x in s["ranks"]}[0]
    assert _line(rank0["where"], "# WAIT")
