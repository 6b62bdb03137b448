"""Launching one job on torch's own launch machinery (the engine behind torchrun).

``elastic_launch`` runs on the main thread (it installs signal handlers); the
watchdog runs beside it as a thread. torchrun's own verdict is always "failed"
when anything failed, so per-rank facts come from the launch files and from
the per-rank failures it reports, never from its exit code.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from distcheck import interrupt
from distcheck.launch import slurm
from distcheck.launch import forkserver
from distcheck.launch import memory
from distcheck.launch import procs
from distcheck.launch import rendezvous
from distcheck.launch.rank_output import RankOutput
from distcheck.launch.survivors import survivors_record_first
from distcheck.launch.node_config import gloo_interface
from distcheck.errors import LaunchError
from distcheck.files.launch_dir import LaunchFiles
from distcheck.files.stacks import FATAL_SIGNALS, fatal_dump, read_dumps, signal_of
from distcheck.launch.progress import RankProgress
from distcheck.launch.watchdog import Decision, Limits, NodeChannel, Watchdog, WatchdogResult
from distcheck.models import EndReason, Phase


@dataclass(frozen=True)
class LaunchSpec:
    launch_dir: Path
    nproc_per_node: int
    backend: str
    worker_args: tuple[str, ...]          # what follows ``python -m distcheck.rank.worker``
    limits: Limits
    run_id: str
    device: str = "auto"
    rdzv_endpoint: str | None = None      # None: a free loopback port
    nnodes: int = 1
    node_rank: int = 0                    # 0 hosts the rendezvous store
    local_addr: str = "127.0.0.1"          # where this node's workers' store listens
    rdzv_timeout: float = 300.0
    channel: NodeChannel | None = None    # multi-node: cluster.LaunchChannel
    flight_recorder: bool = True          # PyTorch's Flight Recorder on: C++-issued calls seen, dumped on a stall
    forked: bool = False                  # ranks forked from a server that imported torch (``launch.forkserver``)
    env: tuple[tuple[str, str], ...] = ()  # what this run adds to the ranks' environment (``RunOptions.rank_env``)

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node


@dataclass(frozen=True)
class RankFailure:
    exit_code: int | None            # None: not known (a rank of the user's own launch command)
    signal: str | None
    pid: int | None


@dataclass
class LaunchOutcome:
    end_reason: EndReason
    started_at: float
    ended_at: float
    watchdog: WatchdogResult
    failures: dict[int, RankFailure] = field(default_factory=dict)
    error: str | None = None
    oom_kills: int | None = None          # OOM kills in distcheck's memory cgroup during the launch
    world_size: int | None = None         # ranks found (a command's ranks are counted, not planned)
    command_exit: int | None = None       # ``run -- CMD``: the command's own exit status
    records_lost: tuple[int, ...] = ()    # ranks whose traces went with a node that went silent


_workers_cpp_log_level: str | None = None   # the job's own TORCH_CPP_LOG_LEVEL (None: it set none)
_quieted = False                             # this process's level was set to ERROR (quiet_native_warnings)


def quiet_native_warnings() -> None:
    """Call before torch loads. c10d logs a C++ warning with a backtrace for every store
    connection that drops, which is how every node's ending looks; distcheck reports
    those itself. The ranks keep the user's level (their warnings are the job's)."""
    global _workers_cpp_log_level, _quieted
    if not _quieted:
        _workers_cpp_log_level = os.environ.get("TORCH_CPP_LOG_LEVEL")   # None: the user set none
    _quieted = True
    os.environ["TORCH_CPP_LOG_LEVEL"] = "ERROR"


LAUNCHER_LOG = "launcher.log"   # in logs/: what torch's launcher machinery logged in distcheck's own process


@contextlib.contextmanager
def torch_logs_to(path: Path) -> Iterator[None]:
    """While a launch runs, torch's own log lines in distcheck's process (torchelastic's agent and
    rendezvous, ``torch.multiprocessing``'s "Terminating process ... via signal SIGTERM", its event
    records) go to ``path``, not to the terminal: distcheck reports how the ranks ended itself. The
    loggers' levels stay; their handlers and propagation are restored afterwards."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path, encoding="utf-8", delay=True)
    handler.setFormatter(logging.Formatter("%(levelname).1s %(asctime)s %(process)d %(name)s] %(message)s"))
    loggers = [logging.getLogger("torch"), *(
        logger for name, logger in list(logging.root.manager.loggerDict.items())
        if isinstance(logger, logging.Logger) and name.startswith("torch") and name != "torch"
        and (logger.handlers or not logger.propagate))]
    saved = [(logger, list(logger.handlers), logger.propagate) for logger in loggers]
    for logger in loggers:
        if all(isinstance(h, logging.NullHandler) for h in logger.handlers) and logger.handlers:
            continue   # torchelastic's event records that go nowhere keep going nowhere
        # one that printed on its own (or, with no handler, through logging's last resort) writes to the log
        logger.handlers, logger.propagate = [handler], False
    try:
        yield
    finally:
        for logger, handlers, propagate in saved:
            logger.handlers, logger.propagate = handlers, propagate
        handler.close()


@contextlib.contextmanager
def _restore_signal_handlers() -> Iterator[None]:
    """Ctrl-C and SIGTERM stay distcheck's while torch's agent runs (``distcheck.interrupt``): the agent's
    own handler (it installs it for SIGINT, SIGTERM, SIGHUP, SIGQUIT when it starts the ranks) would
    forward the signal to the ranks at once, before their stacks are taken, and the ranks would print
    KeyboardInterrupt tracebacks. Ours records the request; the watchdog ends the launch with the
    evidence first. SIGHUP and SIGQUIT keep torch's handler. Every handler is restored afterwards."""
    from torch.distributed.elastic.multiprocessing import api

    names = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")
    saved = {name: signal.getsignal(getattr(signal, name)) for name in names if hasattr(signal, name)}
    torch_handler = api._terminate_process_handler

    def terminate_handler(signum: int, frame: Any) -> None:
        if signal.Signals(signum).name in interrupt.SIGNALS:
            interrupt.handler(signum, frame)
        else:
            torch_handler(signum, frame)

    api._terminate_process_handler = terminate_handler   # looked up by PContext.start when it installs it
    try:
        with interrupt.watched():
            for name in interrupt.SIGNALS:
                signal.signal(getattr(signal, name), interrupt.handler)
            yield
    finally:
        api._terminate_process_handler = torch_handler
        for name, handler in saved.items():
            if handler is not None:
                signal.signal(getattr(signal, name), handler)


def rank_failures(files: LaunchFiles, killed_by_us: tuple[int, ...] = (), fatal_only: bool = False
                  ) -> dict[int, RankFailure]:
    """Ranks that recorded their own failure, and ranks that vanished mid-work (a signal, os._exit), for
    ranks whose exit codes no launcher of ours saw: a fatal signal is read from faulthandler's dump in the
    rank's log.

    ``fatal_only``: of the vanished ones, only those a fatal signal ended (SIGABRT, SIGSEGV...); a rank
    with a SIGTERM dump was terminated after another one died (a consequence, not the cause)."""
    failures = {}
    for r, s in files.read_statuses().items():
        if s.phase == Phase.ERROR:
            failures[r] = RankFailure(exit_code=s.exit_code if s.exit_code is not None else 1, signal=None, pid=s.pid)
        elif s.phase in (Phase.STARTING, Phase.RUNNING) and r not in killed_by_us and not procs.is_alive(s.pid):
            sig = signal_of(fatal_dump(files.log(r)), read_dumps(files.terminated_stack(r)))
            if not fatal_only or sig in FATAL_SIGNALS.values():
                failures[r] = RankFailure(exit_code=None, signal=sig, pid=s.pid)
    return failures


def _failures(exc: BaseException) -> dict[int, RankFailure]:
    return {int(rank): _failure(failure.exitcode, failure.pid)
            for rank, failure in getattr(exc, "failures", {}).items()}


def _failure(code: int | None, pid: int | None) -> RankFailure:
    """An exit code as the agent gives it (negative: the signal that ended the process)."""
    sig = None
    if code is not None and code < 0:
        try:
            sig = signal.Signals(-code).name
        except ValueError:
            sig = f"signal {-code}"
    return RankFailure(exit_code=code, signal=sig, pid=pid)


@functools.cache
def _default_endpoint() -> str:
    """One loopback port for every launch of this run: its rendezvous store is kept for the run."""
    return f"127.0.0.1:{rendezvous.kept_store_on_a_free_port('127.0.0.1').port}"


def _rdzv_configs(spec: LaunchSpec) -> dict[str, Any]:
    # Node 0 hosts the store (not "whoever matches the endpoint's host": on one machine all do).
    configs: dict[str, Any] = {"is_host": spec.node_rank == 0}
    if spec.nnodes > 1:
        configs["join_timeout"] = int(spec.rdzv_timeout)
    return configs


def _network_environment(spec: LaunchSpec) -> dict[str, str]:
    """gloo listens on the node's address too (it would take whatever the host name resolves to)."""
    if "GLOO_SOCKET_IFNAME" in os.environ or not sys.platform.startswith("linux"):
        return {}
    interface = "lo" if spec.nnodes == 1 else gloo_interface(spec.local_addr)
    return {"GLOO_SOCKET_IFNAME": interface} if interface else {}


def _launch_error(exc: BaseException, spec: LaunchSpec, endpoint: str) -> str:
    """Name what is missing when the job could not even start."""
    name = type(exc).__name__
    if "Rendezvous" in name or "rendezvous" in str(exc).lower():
        if "Timeout" in name or "timed out" in str(exc).lower() or "timeout" in str(exc).lower():
            return (f"the rendezvous at {endpoint} (id {spec.run_id}) timed out after {spec.rdzv_timeout:g} s "
                    f"waiting for {spec.nnodes} node(s) x {spec.nproc_per_node} ranks: some node never arrived "
                    f"(start distcheck there with the same --rdzv-endpoint and --rdzv-id)")
        return f"rendezvous at {endpoint} failed: {name}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return f"{name}: {str(exc).splitlines()[0] if str(exc) else ''}"


def _launch_config(spec: LaunchSpec, files: LaunchFiles, endpoint: str) -> Any:
    from torch.distributed.elastic.multiprocessing.api import DefaultLogsSpecs
    from torch.distributed.launcher.api import LaunchConfig

    return LaunchConfig(
        min_nodes=spec.nnodes, max_nodes=spec.nnodes, nproc_per_node=spec.nproc_per_node,
        run_id=spec.run_id, rdzv_backend=rendezvous.register(),   # torch's c10d, stores bound (not *:PORT)
        rdzv_endpoint=endpoint, rdzv_configs=_rdzv_configs(spec),
        max_restarts=0, monitor_interval=0.05, local_addr=spec.local_addr,
        logs_specs=DefaultLogsSpecs(log_dir=str(files.agent_logs)),
        **({"start_method": forkserver.START_METHOD} if spec.forked else {}),
    )


def _entrypoint(spec: LaunchSpec) -> tuple[Any, tuple[Any, ...]]:
    """What torch's agent starts in each rank: a fork of the fork server, or a process of its own."""
    if spec.forked:
        return forkserver.entrypoint(spec.worker_args)
    return sys.executable, ("-m", "distcheck.rank.worker", *spec.worker_args)


# The Flight Recorder's ring when the user set none. The rank's sidecar reads it whenever the job runs
# collectives issued from C++: a dump costs ~2 ms at 256 entries, ~80 ms at 2,000 (torch 2.13, gloo).
FLIGHT_RECORDER_ENTRIES = 256


def _worker_env(spec: LaunchSpec) -> dict[str, str]:
    env = {
        "DISTCHECK_LAUNCHER_PID": str(os.getpid()),
        "PYTHONUNBUFFERED": "1",
        "TORCHELASTIC_ERROR_FILE": "",
        **_network_environment(spec),
        **workers_torch_environment(spec.flight_recorder),
        **memory.job_standing_env(),
        **dict(spec.env),
    }
    if spec.flight_recorder:
        env["DISTCHECK_FLIGHT_RECORDER"] = "1"
    return env


def workers_torch_environment(flight_recorder: bool) -> dict[str, str]:
    """What of the ranks' environment torch reads: the threads it computes with, its C++ log level (the
    user's, not this process's), the Flight Recorder's ring. A fork server that loads torch before the
    launch (``forkserver.start_early``) loads it under these."""
    # torch's launcher copies this process's environment, quieted to ERROR: the ranks get the job's own level back
    # (torch's default, WARNING, where the job set none)
    level = _workers_cpp_log_level or ("WARNING" if _quieted else None)
    env = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
           **({"TORCH_CPP_LOG_LEVEL": level} if level else {})}
    if flight_recorder:
        env["TORCH_FR_BUFFER_SIZE"] = os.environ.get("TORCH_FR_BUFFER_SIZE", str(FLIGHT_RECORDER_ENTRIES))
    return env


def _end_reason(result: WatchdogResult, interrupted: bool, failures: dict[int, RankFailure],
                error: str | None, files: LaunchFiles) -> EndReason:
    """The watchdog's decision first (it ended the job), then the ranks' failures; raises when
    the job could not run, or the watchdog itself failed."""
    if interrupted or interrupt.requested():
        return slurm.requested_ending()
    if result.decision.end_reason is not None:
        return result.decision.end_reason
    if result.decision is Decision.FAILED and result.lost_node_0:
        raise LaunchError(f"lost node 0's distcheck mid-run (killed, or its machine lost): "
                          f"{result.error}; this node's ranks were stopped",
                          f"this node's traces are in {files.root} ('distcheck analyze' reads them)")
    if result.decision is Decision.FAILED:
        raise LaunchError(f"the watchdog failed and ended the job: {result.error}",
                          f"the traces so far are in {files.root}; please report this as a distcheck bug")
    if failures:
        return EndReason.CRASH
    if error:
        raise LaunchError(f"could not run the job: {error}", "run 'distcheck env' to check the setup")
    return EndReason.COMPLETED


def launch(spec: LaunchSpec, on_poll: Callable[[Mapping[int, RankProgress], float], None] | None = None,
           on_output: Callable[[int | None, str], None] | None = None) -> LaunchOutcome:
    """Run one job to its end under the watchdog. Never leaves a process behind. ``on_output``: each line
    the ranks write, as they write it (``rank_output``)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.launcher.api import elastic_launch

    files = LaunchFiles(spec.launch_dir)
    files.make()
    memory.shield_from_oom_killer()
    endpoint = spec.rdzv_endpoint or _default_endpoint()
    config = _launch_config(spec, files, endpoint)
    watchdog = Watchdog(files, spec.world_size, spec.limits, on_poll=on_poll, channel=spec.channel)
    started = time.time()
    oom_before = memory.oom_kills()
    interrupted = False
    failures: dict[int, RankFailure] = {}
    exit_codes: dict[int, tuple[int, int]] = {}
    error = None
    with (procs.environment_with(_worker_env(spec)), torch_logs_to(files.root / "logs" / LAUNCHER_LOG),
          _restore_signal_handlers(),
          survivors_record_first(files, exit_codes),
          forkserver.without_main() if spec.forked else contextlib.nullcontext()):
        entry, args = _entrypoint(spec)   # inside the workers' environment: a fork server starting inherits it
        watchdog.start()
        output = RankOutput(files.root / "logs", on_output) if on_output is not None else None
        if output is not None:
            output.start()
        try:
            elastic_launch(config, entry)(*args)
        except (SignalException, KeyboardInterrupt):
            interrupted = True
        except LaunchError:       # e.g. the rendezvous port is taken: already a clear message
            raise
        except Exception as exc:  # ChildFailedError, rendezvous errors
            failures = _failures(exc)
            if not failures:
                error = _launch_error(exc, spec, endpoint)
        finally:
            watchdog.stop()
            watchdog.join(timeout=15)
            end_on_every_node(spec.channel, watchdog)
            if output is not None:
                output.stop()
            procs.kill_descendants()
            files.trim_traces()
    if spec.forked:   # torch's agent reports the first forked rank it saw fail; the others' ends are in their files
        failures = {**rank_failures(files, watchdog.result.killed_ranks, fatal_only=True),
                    **{r: _failure(code, pid) for r, (code, pid) in exit_codes.items()}, **failures}
    end_reason = _end_reason(watchdog.result, interrupted, failures, error, files)
    return LaunchOutcome(end_reason, started, time.time(), watchdog.result, failures, error,
                         oom_kills=memory.oom_kills_since(oom_before))


# -- multi-node: each node launches its own ranks; node 0 merges what the others report --


def end_on_every_node(channel: NodeChannel | None, watchdog: Watchdog) -> None:
    """Node 0's launch ended by itself, no decision taken (torch's agent gave up after a rank failed before the
    watchdog judged, or the job is done): the other nodes' ranks may wait for ones that are gone, so node 0 tells
    every node to end too (a non-leader's watchdog ends on any decision node 0 posts; a released one ignores it)."""
    if channel is not None and channel.is_leader and watchdog.result.decision is Decision.CONTINUE:
        channel.post_decision(Decision.RELEASE.value, None, time.time())


def node_summary(outcome: LaunchOutcome) -> dict[str, Any]:
    """What node 0 needs from another node's launch (JSON-ready)."""
    w = outcome.watchdog
    return {
        "end_reason": outcome.end_reason,
        "failures": {str(r): [f.exit_code, f.signal, f.pid] for r, f in outcome.failures.items()},
        "killed_ranks": list(w.killed_ranks),
        "oom_kills": outcome.oom_kills,
    }


def merge_node_summaries(outcome: LaunchOutcome, summaries: list[dict[str, Any]]) -> LaunchOutcome:
    """Node 0's view of the whole job: every node's failures and the ranks it killed; the job
    ended for the most telling of the nodes' reasons (``EndReason.priority``)."""
    w = outcome.watchdog
    reasons = [outcome.end_reason] + [EndReason(s["end_reason"]) for s in summaries]
    failures = dict(outcome.failures)
    for s in summaries:
        failures.update({int(r): RankFailure(*f) for r, f in s["failures"].items()})
        w.killed_ranks = tuple(sorted(set(w.killed_ranks) | set(s["killed_ranks"])))
    counts = [c for c in [outcome.oom_kills] + [s.get("oom_kills") for s in summaries] if c is not None]
    return dataclasses.replace(outcome, failures=failures, end_reason=min(reasons, key=lambda r: r.priority),
                               oom_kills=sum(counts) if counts else None)
