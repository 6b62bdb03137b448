"""``distcheck run -- CMD [ARGS...]``: the user's own launch command, run unchanged.

The command runs below ``launch.subreaper`` (a child subreaper that ends everything below it
when distcheck goes), with ``rank/inject`` first on PYTHONPATH: every Python process it
starts that calls ``init_process_group`` becomes a traced rank (``rank.injected``) and
writes the same launch files as a rank distcheck started itself. Ranks are found from
those files: the world size from the first rank's status, then the ordinary watchdog.
"""

from __future__ import annotations

import dataclasses
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from distcheck import interrupt
from distcheck.errors import LaunchError, UsageError
from distcheck.files.launch_dir import LaunchFiles
from distcheck.launch import launcher, memory, procs, slurm
from distcheck.launch.launcher import LaunchOutcome, RankFailure, rank_failures
from distcheck.launch.rank_output import folded_output
from distcheck.diagnose.progress import BUSY_CPU
from distcheck.launch.watchdog import Decision, Limits, Watchdog, WatchdogResult
from distcheck.models import EndReason
from distcheck.rank.injected import STALL_TIMEOUT_ENV
from distcheck.text import first_error_line

INJECT_DIR = Path(__file__).resolve().parent.parent / "rank" / "inject"


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

def command_env(files: LaunchFiles, flight_recorder: bool, stall_timeout: float | None = None,
                rank_env: tuple[tuple[str, str], ...] = ()) -> dict[str, str]:
    """What the injection adds to the command's environment (the README lists it); ``rank_env``: what this run
    adds to every rank's (``RunOptions.rank_env``)."""
    env = {**os.environ, **memory.job_standing_env(), **dict(rank_env)}
    # The test a pytest around distcheck runs is not the command's: a pytest the command runs sets its own.
    env.pop("PYTEST_CURRENT_TEST", None)
    env.update({
        "PYTHONPATH": os.pathsep.join([str(INJECT_DIR), *filter(None, [os.environ.get("PYTHONPATH")])]),
        "DISTCHECK_LAUNCH_DIR": str(files.root.resolve()), "DISTCHECK_LAUNCHER_PID": str(os.getpid()),
        "PYTHONUNBUFFERED": "1",
    })
    # distcheck quiets its own c10d logging, not the job's: the job's level as the user set it, or none
    if launcher._workers_cpp_log_level:
        env["TORCH_CPP_LOG_LEVEL"] = launcher._workers_cpp_log_level
    else:
        env.pop("TORCH_CPP_LOG_LEVEL", None)
    if flight_recorder:
        env["TORCH_FR_BUFFER_SIZE"] = os.environ.get("TORCH_FR_BUFFER_SIZE", str(launcher.FLIGHT_RECORDER_ENTRIES))
        env["DISTCHECK_FLIGHT_RECORDER"] = "1"
    if stall_timeout is not None:   # a rank waits no longer than this for distcheck's own start-up keys
        env[STALL_TIMEOUT_ENV] = f"{stall_timeout:g}"
    return env


def start_guard(spec: CommandSpec, files: LaunchFiles, flight_recorder: bool,
                stall_timeout: float | None = None, rank_env: tuple[tuple[str, str], ...] = ()) -> subprocess.Popen:
    """The command below ``launch.subreaper``, in a session of its own (the terminal's Ctrl-C is
    distcheck's to handle), its output in ``logs/command.log``."""
    log_path = files.command_log
    log_path.parent.mkdir(parents=True, exist_ok=True)
    watched, ours = os.pipe()   # never written: its end of file tells the guard distcheck is done (or gone)
    try:
        with open(log_path, "ab") as log:
            guard = subprocess.Popen(
                [sys.executable, "-m", "distcheck.launch.subreaper", "--watch-fd", str(watched), *spec.argv],
                pass_fds=(watched,), stdout=log, stderr=log, start_new_session=True,
                env=command_env(files, flight_recorder, stall_timeout, rank_env))
    except BaseException:
        os.close(ours)
        raise
    finally:
        os.close(watched)
    guard.distcheck_pipe = os.fdopen(ours, "wb", buffering=0)  # type: ignore[attr-defined]
    return guard


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


def _stop(guard: subprocess.Popen, watchdog: Watchdog | None) -> None:
    """Nothing the command started survives: the guard ends its tree on end of file."""
    if watchdog is not None:
        watchdog.stop()
        watchdog.join(timeout=15)
    pipe = getattr(guard, "distcheck_pipe", None)
    if pipe is not None:
        pipe.close()
    try:
        guard.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass
    procs.kill_descendants()
    guard.wait()


def _end_reason(result: WatchdogResult, interrupted: bool, failures: dict[int, RankFailure],
                files: LaunchFiles) -> EndReason:
    if interrupted:
        said = slurm.requested_ending()
        return said if said is not EndReason.INTERRUPTED else slurm.ending_in_output(_command_log(files)) or said
    if result.decision is Decision.FAILED:
        raise LaunchError(f"the watchdog failed and ended the job: {result.error}",
                          "please report this as a distcheck bug")
    # Slurm cancelled the command's step (scancel, srun --time) without a signal to distcheck: its ranks
    # died of Slurm's SIGTERM, an interruption, not a crash; srun's output says which ending it was. That
    # holds too where the watchdog saw the first of them die before srun ended, and took it for a certain
    # hang (the others waiting for a rank that can never come).
    decided = result.decision.end_reason
    if failures and (decided is None or _died_before_distcheck_acted(failures, result.killed_ranks)):
        cancelled = slurm.ending_in_output(_command_log(files))
        if cancelled is not None:
            return cancelled
    if decided is not None:
        return decided
    return EndReason.CRASH if failures else EndReason.COMPLETED


def _died_before_distcheck_acted(failures: dict[int, RankFailure], killed: tuple[int, ...]) -> bool:
    """A rank died of a SIGTERM (or of something unknown) that distcheck did not send: it was not among the
    ranks distcheck ended."""
    return any(r not in killed and (f.signal == "SIGTERM" or (f.signal is None and f.exit_code is None))
               for r, f in failures.items())


def _no_rank_error(spec: CommandSpec, code: int | None, files: LaunchFiles, timed_out: bool) -> Exception:
    """The error of a command none of whose processes became a rank; the run dir keeps a report that says it."""
    log = files.command_log
    last = first_error_line(_read(log))
    error: LaunchError | UsageError
    if timed_out:
        error = LaunchError(f"--timeout ended {spec.source!r} before any process it started called "
                            f"init_process_group", f"its output is in {log}")
    elif code == 0:
        error = UsageError(f"{spec.source!r} ran to the end and no process it started called init_process_group: "
                           "there was nothing to check", f"its output is in {log}")
    else:
        error = LaunchError(f"{spec.source!r} exited with code {code} before any process it started called "
                            f"init_process_group" + (f": {last.strip()[:200]}" if last else ""),
                            f"its output is in {log}")
    _save_no_rank_report(spec, files, error, EndReason.TIMEOUT if timed_out else EndReason.CRASH)
    return error


def _save_no_rank_report(spec: CommandSpec, files: LaunchFiles, error: Exception, end: EndReason) -> None:
    from distcheck.files.saved_runs import write_no_rank_report

    why = f"{error} ({hint})" if (hint := getattr(error, "hint", None)) else str(error)
    try:
        write_no_rank_report(files.root, spec.name, spec.source, why, None if isinstance(error, UsageError) else end,
                             command_output_tail(files) or None)
    except OSError:   # the error itself is what the user must see; the report is a courtesy
        pass


def _command_log(files: LaunchFiles) -> str:
    return _read(files.command_log)


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""


@dataclass(frozen=True)
class Generation:
    """One generation of the command's ranks (one ``init_process_group`` of each) and how it ended."""

    index: int
    launch_dir: Path
    outcome: LaunchOutcome
    test: str | None = None   # the pytest node id its ranks served


@dataclass(frozen=True)
class CommandOutcome:
    """The whole command: its generations, and how the command itself ended."""

    generations: tuple[Generation, ...]
    end_reason: EndReason          # COMPLETED: it ended by itself; STALL, TIMEOUT, ...: distcheck ended it
    started_at: float
    ended_at: float
    command_exit: int | None = None
    why_ended: str | None = None   # what distcheck saw when it ended the command itself
    output_tail: str = ""          # the command's last lines of output (pytest's summary line)


def launch_command(spec: CommandSpec, launch_dir: Path, limits: Limits, flight_recorder: bool = True,
                   on_poll: Callable[..., Any] | None = None, rank_env: tuple[tuple[str, str], ...] = (),
                   channel_for: Callable[[int], Any] | None = None) -> tuple[LaunchOutcome, Any]:
    """Multi-node: one generation, every node's watchdog sharing node 0's decisions. Run the command
    to its end under the watchdog; never leaves a process behind.

    ``channel_for(world_size)`` opens this launch's channel to the other nodes once the first rank told
    the world size; the outcome comes back with it."""
    files = LaunchFiles(launch_dir)
    files.make()
    memory.shield_from_oom_killer()
    started, clock = time.time(), time.monotonic()
    guard = start_guard(spec, files, flight_recorder, limits.stall_timeout, rank_env)
    watchdog, interrupted, world, channel = None, False, None, None
    try:
        world = _wait_for_first_rank(files, guard, limits, clock)
        if world:
            channel = channel_for(world) if channel_for is not None else None
            watchdog = Watchdog(files, world, _remaining(limits, time.monotonic() - clock), on_poll=on_poll,
                                channel=channel)
            watchdog.start()
            _wait_for_end(guard, watchdog)
            launcher.end_on_every_node(channel, watchdog)
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
    return LaunchOutcome(_end_reason(result, interrupted, failures, files), started, time.time(), result, failures,
                         world_size=world or 0, command_exit=guard.returncode), channel


# -- one node: generations of ranks --

OUTPUT_TAIL_LINES = 12


class Generations:
    """Watches a command whose ranks may come and go: every generation that appears in the launch dir
    gets a watchdog of its own (``Watchdog(generation=True)``). Between generations (every rank gone,
    the command still running) nothing is stalled: it waits for the next one or for the command's end.
    Only after distcheck ended a generation itself may the command be stuck waiting for ranks that
    are gone (a pool's task): then a command without progress for --stall-timeout is ended too."""

    def __init__(self, files: LaunchFiles, guard: subprocess.Popen, limits: Limits,
                 on_poll: Callable[..., Any] | None, clock: float) -> None:
        self.files, self.guard, self.limits, self.on_poll, self.clock = files, guard, limits, on_poll, clock
        self.watchdogs: dict[int, Watchdog] = {}
        self.quiet = CommandQuiet(limits.stall_timeout)
        self.end_reason: EndReason = EndReason.COMPLETED
        self.why_ended: str | None = None

    def run(self) -> None:
        """Until the command ends by itself, or distcheck ends it."""
        while self.guard.poll() is None:
            self.discover()
            now = time.monotonic()
            if interrupt.requested():   # each generation's watchdog takes its ranks' stacks, then ends them
                self._wait_for_watchdogs(timeout_s=3.0)
                self.end_reason = slurm.requested_ending()
                return
            reason = self._limit_reached(now - self.clock)
            if reason is None and self.active() == [] and self.ended_one():
                if self.quiet.observe(now, _tree_cpu_seconds(self.guard.pid)):
                    reason, self.why_ended = EndReason.STALL, (
                        f"after distcheck ended a hung generation of ranks, the command made no progress for "
                        f"{self.limits.stall_timeout:g} s and started no new ranks (it may wait for the ranks "
                        "that were ended)")
            elif self.active():
                self.quiet.reset()
            if reason is not None:
                self._wait_for_watchdogs()
                self.end_reason = reason
                return
            time.sleep(0.05)
        self.discover()

    def _limit_reached(self, elapsed: float) -> EndReason | None:
        """--timeout and --max-duration: a generation's watchdog ends its ranks; the command ends with them."""
        if self.limits.timeout is not None and elapsed >= self.limits.timeout:
            self.why_ended = f"the command ran past its --timeout of {self.limits.timeout:g} s"
            return EndReason.TIMEOUT
        if self.limits.max_duration is not None and elapsed >= self.limits.max_duration:
            self.why_ended = f"the pre-flight window of {self.limits.max_duration:g} s ended"
            return EndReason.MAX_DURATION
        return None

    def discover(self, watch: bool = True) -> None:
        """``watch=False``: after the end, generations that appeared too late to be watched (ranks that had
        just initialized when Ctrl-C came) still get their outcome judged from what they wrote."""
        for index in self.files.generations():
            if index in self.watchdogs:
                continue
            files = self.files.generation(index)
            world, _ = discovered_world(files)
            if not world:
                continue
            watchdog = Watchdog(files, world, _remaining(self.limits, time.monotonic() - self.clock),
                                on_poll=self.on_poll, generation=True)
            if watch:
                watchdog.start()
            self.watchdogs[index] = watchdog

    def active(self) -> list[int]:
        return [i for i, w in self.watchdogs.items() if w.is_alive()]

    def ended_one(self) -> bool:
        """distcheck ended some generation itself (a stall, a limit)."""
        return any(w.result.decision is not Decision.CONTINUE for w in self.watchdogs.values() if not w.is_alive())

    def _wait_for_watchdogs(self, timeout_s: float = 30.0) -> None:
        """A limit: each generation's watchdog saw it too and is taking its ranks' stacks."""
        deadline = time.monotonic() + timeout_s
        for watchdog in self.watchdogs.values():
            watchdog.join(timeout=max(0.0, deadline - time.monotonic()))

    def stop(self) -> None:
        for watchdog in self.watchdogs.values():
            watchdog.stop()
        for watchdog in self.watchdogs.values():
            watchdog.join(timeout=15)


@dataclass
class CommandQuiet:
    """Whether the command made progress lately: CPU used by its process tree (a new process counts)."""

    stall_timeout: float
    since: float | None = None
    last: dict[int, float] = dataclasses.field(default_factory=dict)

    def reset(self) -> None:
        self.since = None

    def observe(self, now: float, used: dict[int, float]) -> bool:
        """True once the tree used under ``BUSY_CPU`` cores for ``stall_timeout`` seconds."""
        grew = sum(max(0.0, cpu - self.last.get(pid, 0.0)) for pid, cpu in used.items())
        elapsed = now - self.since if self.since is not None else 0.0
        if self.since is None or grew >= BUSY_CPU * max(elapsed, 0.1):
            self.since, self.last = now, dict(used)
            return False
        return elapsed >= self.stall_timeout


def _tree_cpu_seconds(pid: int) -> dict[int, float]:
    """CPU seconds used so far by ``pid`` and each process below it."""
    import psutil

    out: dict[int, float] = {}
    try:
        root = psutil.Process(pid)
        members = [root, *root.children(recursive=True)]
    except psutil.Error:
        return out
    for proc in members:
        try:
            t = proc.cpu_times()
            out[proc.pid] = t.user + t.system
        except psutil.Error:
            continue
    return out


def launch_generations(spec: CommandSpec, launch_dir: Path, limits: Limits, flight_recorder: bool = True,
                       on_poll: Callable[..., Any] | None = None,
                       rank_env: tuple[tuple[str, str], ...] = ()) -> CommandOutcome:
    """Run the command to its end on this node, judging each generation of its ranks on its own.
    Never leaves a process behind."""
    files = LaunchFiles(launch_dir)
    files.make()
    memory.shield_from_oom_killer()
    started, clock = time.time(), time.monotonic()
    guard = start_guard(spec, files, flight_recorder, limits.stall_timeout, rank_env)
    watch = Generations(files, guard, limits, on_poll, clock)
    interrupted = False
    try:
        with interrupt.watched():   # Ctrl-C only recorded: the watchdogs end the ranks, evidence first
            watch.run()
    except KeyboardInterrupt:
        interrupted = True
    finally:
        watch.stop()
        _stop(guard, None)
    interrupted = interrupted or watch.end_reason.interrupted
    watch.discover(watch=False)
    ended = time.time()
    watched = sorted(watch.watchdogs.items())
    generations = tuple(_generation_outcome(files, i, w, interrupted, guard.returncode, started,
                                            span=(started if n == 0 else None,
                                                  ended if n == len(watched) - 1 else None))
                        for n, (i, w) in enumerate(watched))
    if not generations and interrupted:
        raise KeyboardInterrupt   # before any rank: nothing to judge, but the run was still interrupted
    if not generations:
        if watch.end_reason == EndReason.TIMEOUT or guard.returncode is None:
            raise _no_rank_error(spec, guard.returncode, files, watch.end_reason == EndReason.TIMEOUT)
        # It ran to its own end without a process group (a test selection with no distributed test):
        # nothing to judge, and its own exit code is the run's (the target says so in one line).
        return CommandOutcome((), EndReason.NOTHING_RAN, started, ended, command_exit=guard.returncode,
                              why_ended=first_error_line(_command_log(files)) if guard.returncode else None,
                              output_tail=command_output_tail(files))
    end_reason = slurm.requested_ending() if interrupted else watch.end_reason
    if end_reason is EndReason.COMPLETED and guard.returncode not in (0, None):   # Slurm cancelled the command
        end_reason = slurm.ending_in_output(_command_log(files)) or end_reason
    return CommandOutcome(generations, end_reason, started, ended, command_exit=guard.returncode,
                          why_ended=watch.why_ended, output_tail=command_output_tail(files))


def _generation_outcome(files: LaunchFiles, index: int, watchdog: Watchdog, interrupted: bool,
                        command_exit: int | None, started: float,
                        span: tuple[float | None, float | None] = (None, None)) -> Generation:
    """``span``: the command's start (for its first generation) and end (for its last); a generation outside
    any pytest test is timed from there, so a command's duration is the command's, not its ranks' alone."""
    gen = files.generation(index)
    gen.trim_traces()
    statuses = gen.read_statuses()
    result = watchdog.result
    failures = rank_failures(gen, result.killed_ranks)
    times = [s.t_start for s in statuses.values() if s.t_start] or [started]
    ends = [s.t_update for s in statuses.values() if s.t_update] or [time.time()]
    tests = [s.test for _, s in sorted(statuses.items()) if s.test]
    first, last = span if not tests else (None, None)
    outcome = LaunchOutcome(_end_reason(result, interrupted, failures, files), first or min(times),
                            last or result.torn_down_at or max(ends), result, failures,
                            world_size=watchdog.monitor.world_size, command_exit=command_exit)
    return Generation(index, gen.root, outcome, test=tests[0] if tests else None)


def command_output_tail(files: LaunchFiles, lines: int = OUTPUT_TAIL_LINES) -> str:
    """The command's own last lines (pytest's summary line); its launcher's report of its children's end as one line."""
    return "\n".join([line.rstrip() for line in folded_output(_read(files.command_log)) if line.strip()][-lines:])


def command_options(options: Any, launch_dir: Path, world: int | None = None) -> Any:
    """``RunOptions`` as the command's ranks turned out: their world size (spread over the nodes)
    and backend."""
    found, backend = discovered_world(LaunchFiles(launch_dir))
    world = world or found
    if not world:
        return options
    return dataclasses.replace(options, nproc_per_node=max(1, world // options.nodes.nnodes),
                               backend=backend or options.backend)
