"""Shared test helpers: run distcheck as a real process with a hard timeout, and
prove afterwards that no process it started survived."""

from __future__ import annotations

import datetime
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch.distributed as dist

REPO = Path(__file__).resolve().parent.parent
# tests/scripts/ holds the scripts and whole test suites the tests run under distcheck, not tests of ours.
collect_ignore = ["scripts"]
HARD_TIMEOUT_S = 240


# Modules whose tests share one module-scoped launch (or CPU hogs): under pytest-xdist (pyproject's
# `-n 3 --dist loadgroup`) each stays on one worker, so that launch happens once; every other test is
# handed out on its own. test_records_e2e shares its group with test_ecosystem_e2e's loaded tests: their
# launches run together beside one set of hogs (``runs_beside_hogs``).
SHARED_LAUNCH_MODULES = {"test_faults": "test_faults", "test_postmortem": "test_postmortem",
                         "test_records_e2e": "beside_hogs", "test_renderers": "test_renderers",
                         "test_timeline_browser": "test_timeline_browser", "test_slurm_e2e": "test_slurm_e2e",
                         "test_rule0_world_e2e": "test_rule0_world_e2e", "test_help_text": "test_help_text",
                         "test_postmortem_after_failure": "test_postmortem_after_failure"}
MODULES_BESIDE_HOGS = ("test_records_e2e", "test_ecosystem_e2e")
LOADED_TIMEOUT_S = 400


def pytest_configure(config):
    """Runs a test does not send elsewhere (``--run-dir``) go to a folder of this session's, not the user's
    own runs folder (``distcheck.files.run_home``): every process the tests start inherits it."""
    if "DISTCHECK_RUNS_DIR" not in os.environ:
        import tempfile

        os.environ["DISTCHECK_RUNS_DIR"] = tempfile.mkdtemp(prefix="distcheck-test-runs-")


def pytest_sessionstart(session):
    """Every launch starts processes that import distcheck anew (its CLI, a script's ranks, the replay):
    compile it once here, so that none compiles it from source. Where PYTHONDONTWRITEBYTECODE is set, each
    did, at ~0.3 s of CPU a process, several hundred times a run."""
    if hasattr(session.config, "workerinput"):   # a pytest-xdist worker: the controller did it
        return
    import compileall

    for folder in ("distcheck", "scenarios", "tests"):
        compileall.compile_dir(REPO / folder, quiet=2)


@pytest.hookimpl(tryfirst=True)   # before pytest-xdist's own hook, which reads the marks into the node ids
def pytest_collection_modifyitems(config, items):
    for item in items:
        module = item.module.__name__ if item.module else ""
        if module in SHARED_LAUNCH_MODULES:
            item.add_marker(pytest.mark.xdist_group(SHARED_LAUNCH_MODULES[module]))
    # The static checks first, on one worker: a cold mypy (tens of seconds) overlaps the rest of the lane.
    static = [item for item in items if item.module is not None and item.module.__name__ == "test_static_checks"]
    for item in static:
        item.add_marker(pytest.mark.xdist_group("static_checks"))
    items[:] = static + [item for item in items if item not in static]


@pytest.fixture(scope="session")
def runs_beside_hogs(request, tmp_path_factory) -> dict[str, dict]:
    """The loaded runs of every module in MODULES_BESIDE_HOGS whose tests this session runs, all started at once
    beside two busy loops per core (each competes for the CPU with the hogs and with the others); module -> name
    -> the finished run. One set of hogs for the suite: they use CPU the rest of the suite waits for (and a lane
    that deselected a module's tests does not start its runs: the default run left the ecosystem's to its lane)."""
    import importlib

    from launch_group import run_together
    from load import cpu_hogs

    selected = {item.module.__name__ for item in request.session.items if item.module is not None}
    jobs = {(module, name): args for module in MODULES_BESIDE_HOGS if module in selected
            for name, args in importlib.import_module(module).loaded_jobs().items()}
    with cpu_hogs():
        runs = run_together({f"{m}/{n}": a for (m, n), a in jobs.items()},
                            lambda key: tmp_path_factory.mktemp(key.replace("/", "-").replace(".", "_")),
                            LOADED_TIMEOUT_S)
    out: dict[str, dict] = {m: {} for m in MODULES_BESIDE_HOGS if m in selected}
    for (module, name) in jobs:
        out[module][name] = runs[f"{module}/{name}"]
    return out


def survivors(marker: str, launcher_pid: int | None = None) -> list[psutil.Process]:
    """Live processes whose command line mentions ``marker`` (a run dir path), or that distcheck process
    ``launcher_pid`` started: its fork server and the scenario ranks forked from it, whose command lines
    are the server's (they carry its pid in the environment they were started with)."""
    found = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        try:
            cmd = " ".join(p.info["cmdline"] or [])
            ours = marker in cmd or (launcher_pid is not None and "multiprocessing" in cmd
                                     and p.environ().get("DISTCHECK_LAUNCHER_PID") == str(launcher_pid))
            alive = p.status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            continue
        if ours and alive and p.pid != os.getpid():
            found.append(p)
    return found


def findings_less_torch_notes(s: dict) -> list[dict]:
    """A scenario's findings less the info note that every run with C++-issued collectives gets on a
    torch whose gloo has no Flight Recorder (torch < 2.8, tests/test_torch_versions.py): true there,
    and nothing about the job's own code."""
    from distcheck.torch_features import features

    note = features().missing_note("flight_recorder_gloo")
    return [f for f in s["findings"] if not (f["kind"] == "coverage" and note in f["summary"])]


def wait_for(predicate, timeout: float, poll: float = 0.1) -> bool:
    """Poll an observable condition until it holds or the deadline passes (never a bare sleep)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(poll)
    return False


def free_port() -> int:
    """A loopback port free right now, and the one after it too (two distcheck "nodes" must be told the same
    one, and node 0's store listens on the next). Drawn below the kernel's ephemeral range: a port from
    ``bind(0)`` comes from the range every outgoing connection takes its local port from, and another
    test's store client took one such port before distcheck could bind it ("the rendezvous port ... is
    already in use")."""
    first_ephemeral = _first_ephemeral_port()
    draw = random.SystemRandom()   # not the test's seeded ``random``: parallel workers would draw alike
    for _ in range(200):
        port = draw.randrange(PORTS_FROM, first_ephemeral - 1)
        if bindable(port) and bindable(port + 1):
            return port
    with socket.socket() as s:   # a crowded machine: what the kernel hands out
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


PORTS_FROM = 20000


def _first_ephemeral_port() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range", encoding="ascii") as f:
            return max(PORTS_FROM + 1000, int(f.read().split()[0]))
    except (OSError, ValueError, IndexError):
        return 32768   # Linux's default; elsewhere only a lower bound to draw below


def bindable(port: int) -> bool:
    """Whether a TCP port on 127.0.0.1 is free to bind now."""
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def process_tree(pid: int) -> list[psutil.Process]:
    try:
        root = psutil.Process(pid)
        return [root] + root.children(recursive=True)
    except psutil.Error:
        return []


def listening_sockets(tree: list[psutil.Process]) -> list[tuple[int, str, int]]:
    """(pid, address, port) of every listening TCP socket of these processes."""
    out = []
    for p in tree:
        try:
            conns = p.net_connections(kind="inet")
        except psutil.Error:
            continue
        out += [(p.pid, c.laddr.ip, c.laddr.port) for c in conns if c.status == psutil.CONN_LISTEN]
    return out


def is_loopback_ip(ip: str) -> bool:
    return ip in ("127.0.0.1", "::1", "::ffff:127.0.0.1") or ip.startswith("127.")


def process_groups_initialized(status_files: list[Path]) -> bool:
    """Every rank behind these status files has initialized its process group."""
    from distcheck.files.launch_dir import RankStatus

    try:
        return all(RankStatus.from_dict(json.loads(p.read_text())).pg_initialized for p in status_files)
    except (OSError, ValueError, TypeError):   # not written yet, torn, or not a status object
        return False


def kill_tree(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except OSError:
        pass


def kill_everything_below(proc: subprocess.Popen) -> None:
    """The command's session and every process below it: a launcher's ranks may sit in sessions of their
    own (torch's elastic agent), and one left alive keeps the output pipe open for ever."""
    for p in process_tree(proc.pid):
        try:
            p.kill()
        except psutil.Error:
            pass
    kill_tree(proc)


class DistcheckRun:
    def __init__(self, proc: subprocess.CompletedProcess, run_dir: Path, json_path: Path | None) -> None:
        self.proc = proc
        self.returncode = proc.returncode
        self.stdout = proc.stdout
        self.stderr = proc.stderr
        self.run_dir = run_dir
        self.json_path = json_path

    @property
    def report(self) -> dict:
        assert self.json_path is not None and self.json_path.exists(), self.stderr[-3000:]
        return json.loads(self.json_path.read_text())

    def scenario(self, name: str) -> dict:
        for s in self.report["scenarios"]:
            if s["name"] == name:
                return s
        raise KeyError(name)


@pytest.fixture
def distcheck(tmp_path):
    """Run ``python -m distcheck ARGS`` in a new session; kill its whole tree on timeout.

    Adds --run-dir and --json under tmp_path unless given, and asserts that no
    process mentioning the run dir is left when the command returns.
    """

    def run(*args: str, timeout: float = HARD_TIMEOUT_S, json: bool = True, env: dict | None = None,
            cwd: Path | None = None) -> DistcheckRun:
        args = list(args)
        run_dir = tmp_path / "run"
        json_path = tmp_path / "report.json" if json else None
        if args and args[0] == "run":
            cut = args.index("--") if "--" in args else len(args)   # after '--' is the script's
            ours, script = args[:cut], args[cut:]
            if "--run-dir" not in ours:
                ours += ["--run-dir", str(run_dir)]
            if json and "--json" not in ours:
                ours += ["--json", str(json_path)]
            args = ours + script
        done = run_distcheck(args, cwd or tmp_path, run_dir, timeout, env)
        return DistcheckRun(done, run_dir, json_path)

    return run


def run_distcheck(args: list[str], cwd: Path, marker: Path, timeout: float = HARD_TIMEOUT_S,
                  env: dict | None = None) -> subprocess.CompletedProcess:
    """``python -m distcheck ARGS`` in its own session, killed whole on timeout; no survivor
    whose command line mentions ``marker`` (the run dir) may be left."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "distcheck", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, start_new_session=True, cwd=cwd, env={**os.environ, **(env or {})},
    )
    return finish_process(proc, str(marker), timeout)


def finish_process(proc: subprocess.Popen, marker: str, timeout: float) -> subprocess.CompletedProcess:
    """Wait with a hard timeout; kill the whole process tree; prove nothing mentioning ``marker`` survived."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc)
        out, err = proc.communicate()
        pytest.fail(f"{' '.join(map(str, proc.args))} did not finish in {timeout} s\n{err[-3000:]}")
    finally:
        kill_tree(proc)
    gone = wait_for(lambda: not survivors(marker, proc.pid), timeout=10)   # the fork server ends at distcheck's EOF
    left = [] if gone else survivors(marker, proc.pid)
    for p in left:
        p.kill()
    assert not left, f"processes survived the run: {[p.info['cmdline'] for p in left]}"
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.fixture(params=["c", "python"])
def hot_path(request, monkeypatch) -> str:
    """A test of the tracer twice: through its hot path in C, and through the Python wrapper that records the same
    calls where the C one is not built (``DISTCHECK_HOT_PATH=python``)."""
    if request.param == "python":
        monkeypatch.setenv("DISTCHECK_HOT_PATH", "python")
    else:
        monkeypatch.delenv("DISTCHECK_HOT_PATH", raising=False)
        pytest.importorskip("distcheck.rank._hot_path_c", reason="the C hot path is not built here")
    return request.param


@pytest.fixture(scope="module")
def process_group(tmp_path_factory):
    """A one-rank gloo process group (FileStore) for in-process tests of the tracer and call sites."""
    store = tmp_path_factory.mktemp("pg") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60))
    yield
    dist.destroy_process_group()


def injected(under: Path) -> list[psutil.Process]:
    """Live processes whose DISTCHECK_LAUNCH_DIR lies under ``under``: what a ``run -- CMD`` command started."""
    found = []
    for p in psutil.process_iter(["pid"]):
        try:
            launch_dir = p.environ().get("DISTCHECK_LAUNCH_DIR", "")
            alive = p.status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            continue
        if alive and launch_dir.startswith(str(under)) and p.pid != os.getpid():
            found.append(p)
    return found


@pytest.fixture
def no_survivors(tmp_path):
    """After the test: nothing the command started is left (killed here, and the test fails)."""
    yield
    command_processes_gone(tmp_path)


def command_processes_gone(under: Path) -> None:
    """Nothing a command started under ``under`` is left (what is, is killed, and the assertion fails)."""
    left = injected(under) if not wait_for(lambda: not injected(under), timeout=10) else []
    for p in left:
        p.kill()
    assert not left, f"the command's processes survived: {[p.pid for p in left]}"
