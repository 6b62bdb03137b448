"""``distcheck run -- CMD [ARGS...]``: the user's own launch command, run unchanged.

The command runs below ``launch.guard`` (a child subreaper that ends everything below it
when distcheck goes), with ``rank/inject`` first on PYTHONPATH: every Python process it
starts that calls ``init_process_group`` becomes a traced rank (``rank.injected``) and
writes the same launch files as a rank distcheck started itself. Ranks are found from
those files: the world size from the first rank's status, then the ordinary watchdog.
"""

from __future__ import annotations

import ast
import dataclasses
import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from distcheck.errors import LaunchError, UsageError
from distcheck.files.launch_dir import LaunchFiles
from distcheck.files.stacks import parse_dumps, signal_of
from distcheck.launch import launcher, memory, procs
from distcheck.launch.launcher import LaunchOutcome, RankFailure
from distcheck.launch.watchdog import Decision, Limits, Watchdog, WatchdogResult
from distcheck.models import EndReason, Phase

INJECT_DIR = Path(__file__).resolve().parent.parent / "rank" / "inject"
COMMAND_LOG = "command.log"   # in logs/: what the command printed before its ranks had their own logs


@dataclass(frozen=True)
class CommandSpec:
    """The user's own launch command (``distcheck run -- CMD``)."""

    name: str
    argv: tuple[str, ...]
    expect: tuple[str, ...] = ("pass",)
    description: str = ""

    @property
    def source(self) -> str:
        return shlex.join(self.argv)

    @property
    def file(self) -> str:   # where a scenario names its file, a command names itself
        return self.source


def command_spec(argv: tuple[str, ...]) -> CommandSpec:
    """Named after its first ``.py`` argument (``torchrun ... train.py`` → train), else the program."""
    script = next((a for a in argv if a.endswith(".py")), None)
    name = Path(script).stem if script else Path(argv[0]).name
    return CommandSpec(name=name or "command", argv=argv, description=f"command: {shlex.join(argv)}")


# -- `distcheck run script.py` on a script that starts its own ranks --

SPAWNERS = {"spawn", "start_processes"}
SPAWN_MODULES = ("torch.multiprocessing", "multiprocessing")


def spawns_own_ranks(path: Path) -> int | None:
    """The line where ``path`` starts ranks of its own (``mp.spawn``, ``start_processes``), if any.

    Read with ``ast``: the script is not run. Only calls through a name bound to
    ``torch.multiprocessing`` (or imported from it) count.
    """
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    except (OSError, SyntaxError, ValueError):
        return None
    modules, functions = _spawn_names(tree)
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        if isinstance(f, ast.Attribute) and f.attr in SPAWNERS and _dotted(f.value) in modules:
            return node.lineno
        if isinstance(f, ast.Name) and f.id in functions:
            return node.lineno
    return None


def _spawn_names(tree: ast.AST) -> tuple[set[str], set[str]]:
    """Names bound to torch.multiprocessing, and to its spawn functions."""
    modules, functions = {"torch.multiprocessing"}, set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules |= {a.asname or a.name for a in node.names if a.name == "torch.multiprocessing"}
        elif isinstance(node, ast.ImportFrom) and node.module == "torch.multiprocessing":
            functions |= {a.asname or a.name for a in node.names if a.name in SPAWNERS}
        elif isinstance(node, ast.ImportFrom) and node.module == "torch":
            modules |= {a.asname or a.name for a in node.names if a.name == "multiprocessing"}
    return modules, functions


def _dotted(node: ast.expr) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return ""


def refuse_self_spawning(path: Path, script_args: tuple[str, ...]) -> None:
    """Before launch: distcheck would run such a script on every rank, and each would spawn its own."""
    line = spawns_own_ranks(path)
    if line is not None:
        form = shlex.join(["distcheck", "run", "--", "python", str(path), *script_args])
        raise UsageError(f"{path}:{line} starts its own ranks (torch.multiprocessing); run it as a command: {form}")


# -- the launch --


def command_env(files: LaunchFiles, flight_recorder: bool) -> dict[str, str]:
    """What the injection adds to the command's environment (the README lists it)."""
    env = dict(os.environ)
    env.update({
        "PYTHONPATH": os.pathsep.join([str(INJECT_DIR), *filter(None, [os.environ.get("PYTHONPATH")])]),
        "DISTCHECK_LAUNCH_DIR": str(files.root.resolve()),
        "DISTCHECK_LAUNCHER_PID": str(os.getpid()),
        "PYTHONUNBUFFERED": "1",
    })
    if launcher._workers_cpp_log_level:   # distcheck quiets its own c10d logging, not the job's
        env["TORCH_CPP_LOG_LEVEL"] = launcher._workers_cpp_log_level
    if flight_recorder:
        env["TORCH_FR_BUFFER_SIZE"] = os.environ.get("TORCH_FR_BUFFER_SIZE", str(launcher.FLIGHT_RECORDER_ENTRIES))
        env["DISTCHECK_FLIGHT_RECORDER"] = "1"
    return env


def start_guard(spec: CommandSpec, files: LaunchFiles, flight_recorder: bool) -> subprocess.Popen:
    """The command below ``launch.guard``, in a session of its own (the terminal's Ctrl-C is
    distcheck's to handle), its output in ``logs/command.log``."""
    log_path = files.root / "logs" / COMMAND_LOG
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "distcheck.launch.guard", *spec.argv], stdin=subprocess.PIPE,
            stdout=log, stderr=log, env=command_env(files, flight_recorder), start_new_session=True,
        )


def discovered_world(files: LaunchFiles) -> tuple[int | None, str | None]:
    """(world size, backend) as the ranks report them; None before the first rank."""
    found = [s for s in files.read_statuses().values() if s.world_size]
    return (found[0].world_size, found[0].backend) if found else (None, None)


def _remaining(limits: Limits, elapsed: float) -> Limits:
    """--timeout and --max-duration count from the command's start, not from its first rank's."""
    def left(limit: float | None) -> float | None:
        return None if limit is None else max(limit - elapsed, 0.01)

    return dataclasses.replace(limits, timeout=left(limits.timeout), max_duration=left(limits.max_duration))


def _wait_for_first_rank(files: LaunchFiles, guard: subprocess.Popen, limits: Limits, started: float) -> int | None:
    """The world size once a rank reported it; None when the command ended (or ran out of
    --timeout) before any process called init_process_group."""
    while guard.poll() is None:
        world, _ = discovered_world(files)
        if world:
            return world
        if limits.timeout is not None and time.monotonic() - started >= limits.timeout:
            return None
        time.sleep(0.05)
    return discovered_world(files)[0]


def _wait_for_end(guard: subprocess.Popen, watchdog: Watchdog) -> None:
    """Until the command ends, or the watchdog ended it (a stall, a limit)."""
    while guard.poll() is None and watchdog.is_alive():
        time.sleep(0.05)


def _end_on_every_node(channel: Any, watchdog: Watchdog) -> None:
    """Node 0's command ended by itself (its launcher gave up after a rank failed, or the job is done):
    the other nodes' ranks may be waiting for ones that are gone, so node 0 tells every node to end too
    (a non-leader's watchdog ends on any decision node 0 posts)."""
    if channel is not None and channel.is_leader and watchdog.result.decision is Decision.CONTINUE:
        channel.post_decision(Decision.RELEASE.value, None, time.time())


def _stop(guard: subprocess.Popen, watchdog: Watchdog | None) -> None:
    """Nothing the command started survives: the guard ends its tree on end of file."""
    if watchdog is not None:
        watchdog.stop()
        watchdog.join(timeout=15)
    if guard.stdin is not None:
        guard.stdin.close()
    try:
        guard.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass
    procs.kill_descendants()
    guard.wait()


def rank_failures(files: LaunchFiles, killed_by_us: tuple[int, ...] = ()) -> dict[int, RankFailure]:
    """Ranks that recorded their own failure, and ranks that vanished mid-work (a signal, os._exit):
    no launcher of ours saw their exit codes, so a fatal signal is read from faulthandler's dump."""
    failures = {}
    for r, s in files.read_statuses().items():
        if s.phase == Phase.ERROR:
            failures[r] = RankFailure(exit_code=s.exit_code if s.exit_code is not None else 1, signal=None, pid=s.pid)
        elif s.phase in (Phase.STARTING, Phase.RUNNING) and r not in killed_by_us and not procs.is_alive(s.pid):
            failures[r] = RankFailure(exit_code=None, signal=fatal_signal(files.stacks(r)), pid=s.pid)
    return failures


def fatal_signal(stacks: Path) -> str | None:
    """What faulthandler's dump says ended a rank of the user's command (a peer the user's launcher
    terminated after another one died shows SIGTERM: a consequence, not the cause)."""
    return signal_of(parse_dumps(_read(stacks)))


def _end_reason(result: WatchdogResult, interrupted: bool, failures: dict[int, RankFailure]) -> EndReason:
    if interrupted:
        return EndReason.INTERRUPTED
    if result.decision.end_reason is not None:
        return result.decision.end_reason
    if result.decision is Decision.FAILED:
        raise LaunchError(f"the watchdog failed and ended the job: {result.error}",
                          "please report this as a distcheck bug")
    return EndReason.CRASH if failures else EndReason.COMPLETED


def _no_rank_error(spec: CommandSpec, code: int | None, files: LaunchFiles, timed_out: bool) -> Exception:
    log = files.root / "logs" / COMMAND_LOG
    last = next((line for line in reversed(_read(log).splitlines()) if line.strip()), "")
    if timed_out:
        return LaunchError(f"--timeout ended {spec.source!r} before any process it started called "
                           f"init_process_group", f"its output is in {log}")
    if code == 0:
        return UsageError(f"{spec.source!r} ran to the end and no process it started called init_process_group: "
                          "there was nothing to check", f"its output is in {log}")
    return LaunchError(f"{spec.source!r} exited with code {code} before any process it started called "
                       f"init_process_group" + (f": {last.strip()[:200]}" if last else ""), f"its output is in {log}")


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""


def launch_command(spec: CommandSpec, launch_dir: Path, limits: Limits, flight_recorder: bool = True,
                   on_poll: Callable[..., Any] | None = None,
                   channel_for: Callable[[int], Any] | None = None) -> tuple[LaunchOutcome, Any]:
    """Run the command to its end under the watchdog. Never leaves a process behind.

    Multi-node: ``channel_for(world_size)`` opens this launch's channel to the other nodes once the
    first rank told the world size; the outcome comes back with it (None on one node)."""
    files = LaunchFiles(launch_dir)
    files.make()
    memory.shield_from_oom_killer()
    started, clock = time.time(), time.monotonic()
    guard = start_guard(spec, files, flight_recorder)
    watchdog, interrupted, world, channel = None, False, None, None
    try:
        world = _wait_for_first_rank(files, guard, limits, clock)
        if world:
            channel = channel_for(world) if channel_for is not None else None
            watchdog = Watchdog(files, world, _remaining(limits, time.monotonic() - clock), on_poll=on_poll,
                                channel=channel)
            watchdog.start()
            _wait_for_end(guard, watchdog)
            _end_on_every_node(channel, watchdog)
    except KeyboardInterrupt:
        interrupted = True
    finally:
        _stop(guard, watchdog)
        files.trim_traces()
    if not world and not interrupted:
        raise _no_rank_error(spec, guard.returncode, files, guard.returncode is None or
                             (limits.timeout is not None and time.monotonic() - clock >= limits.timeout))
    result = watchdog.result if watchdog is not None else WatchdogResult()
    failures = rank_failures(files, result.killed_ranks)
    return LaunchOutcome(_end_reason(result, interrupted, failures), started, time.time(), result, failures,
                         world_size=world or 0, command_exit=guard.returncode), channel


def command_options(options: Any, launch_dir: Path, world: int | None = None) -> Any:
    """``RunOptions`` as the command's ranks turned out: their world size (spread over the nodes)
    and backend."""
    found, backend = discovered_world(LaunchFiles(launch_dir))
    world = world or found
    if not world:
        return options
    return dataclasses.replace(options, nproc_per_node=max(1, world // options.nodes.nnodes),
                               backend=backend or options.backend)
