"""The rank process: ``python -m distcheck.rank.worker ...``.

Launched by distcheck's launcher, by ``torchrun`` or by ``srun`` alike (it only
reads torchrun's environment). It installs the tracer and the stack probe,
runs one scenario or the user's script, reports through files, then stays idle
until the launcher releases it, exactly like a healthy rank whose peers hang.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import datetime
import faulthandler
import functools
import json
import os
import runpy
import signal
import socket
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Callable

from distcheck import torch_features
from distcheck.rank import integrations, metrics, native, samples
from distcheck.rank.callsite import USER, classify_file
from distcheck.rank.exit_site import exit_site
from distcheck.files.launch_dir import LaunchFiles, RankStatus
from distcheck.files.stacks import torch_dir
from distcheck.rank.oom_standing import take_job_standing
from distcheck.models import Phase
from distcheck.rank import guard
from distcheck.rank.guard import Hook, failed
from distcheck.rank.samples import SampleRecorder
from distcheck.rank.stack_probe import PROBE
from distcheck.rank.tracer import install

PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """Ask Linux to SIGKILL this rank when the launcher dies, even by SIGKILL."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        return
    expected = os.environ.get("DISTCHECK_LAUNCHER_PID")
    if expected and os.getppid() != int(expected):
        os._exit(70)  # the launcher died before we could register


def redirect_output(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def install_stack_dumps(files: LaunchFiles, rank: int, main_thread: int | None) -> None:
    """Stacks on the watchdog's request from a thread of distcheck's own (``rank.stack_probe``: no
    signal, so no handler of the user's is ever fired or replaced); fatal-error tracebacks on the rank's
    stderr, as ``faulthandler`` writes them (the rank's log keeps distcheck's copy), unless the user
    enabled faulthandler already (then theirs stays as it is)."""
    if not faulthandler.is_enabled() and sys.stderr is not None:
        faulthandler.enable(file=sys.stderr, all_threads=True)
    PROBE.aim(files, rank, main_thread)


def install_stack_dumps_guarded(files: LaunchFiles, rank: int, main_thread: int | None = None) -> None:
    """``install_stack_dumps``, its failure counted (rule 0): the rank runs on without stack dumps."""
    try:
        install_stack_dumps(files, rank, main_thread)
    except Exception as exc:
        failed(Hook.STACK_DUMPS, exc)


def _set_up(install: Callable[[], Any]) -> None:
    """One of a rank's recorders installed; its failure counted (rule 0), the others still installed."""
    try:
        install()
    except Exception as exc:
        failed(Hook.RANK_SETUP, exc)


def user_frame_of(tb: Any) -> str | None:
    """file:line:function of the innermost user frame of a traceback."""
    torch = torch_dir()
    where = None
    for frame in traceback.extract_tb(tb):
        if classify_file(frame.filename, torch) == USER:
            where = f"{frame.filename}:{frame.lineno}:{frame.name}"
    return where


class Status:
    """This rank's status file, rewritten atomically on every phase change."""

    def __init__(self, files: LaunchFiles, rank: int, main_thread: int | None = None) -> None:
        self.files, self.rank = files, rank
        self._lock = threading.Lock()
        files.status(rank).parent.mkdir(parents=True, exist_ok=True)
        self.data = RankStatus(
            rank=rank, pid=os.getpid(), host=socket.gethostname(), node=int(os.environ.get("GROUP_RANK", "0")),
            main_thread=main_thread or threading.main_thread().ident, t_start=time.time(),
        )

    def update(self, **fields: Any) -> None:
        with self._lock:   # the main thread and the C++-collective sidecar both report here
            self.data = dataclasses.replace(self.data, **fields, t_update=time.time())
            self.files.write_status(self.rank, self.data)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m distcheck.rank.worker")
    p.add_argument("--launch-dir", required=True)
    p.add_argument("--backend", default="gloo")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--pg-timeout", type=float, default=1800.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--option", action="append", default=[], help="KEY=VALUE for ctx.options")
    p.add_argument("--scenario-file", action="append", default=[], help="repeat for a batch")
    p.add_argument("--scenario-name", action="append", default=[], help="repeat for a batch")
    p.add_argument("--script")
    p.add_argument("--module")
    p.add_argument("script_args", nargs=argparse.REMAINDER)
    return p.parse_args(argv)


def pick_device(backend: str, wanted: str, local_rank: int) -> Any:
    import torch

    use_cuda = wanted == "cuda" or (wanted == "auto" and backend == "nccl")
    if use_cuda:
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def parse_options(pairs: list[str]) -> dict[str, Any]:
    options: dict[str, Any] = {}
    for pair in pairs:
        key, _, value = pair.partition("=")
        try:
            options[key] = float(value)
        except ValueError:
            options[key] = value
    return options


def load_scenario(file: str, name: str, index: int) -> Any:
    import importlib.util

    path = Path(file)
    if str(path.parent) not in sys.path:
        sys.path.insert(0, str(path.parent))
    spec = importlib.util.spec_from_file_location(f"distcheck_scenario_{index}_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    sys.modules[spec.name] = module  # type: ignore[union-attr]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return getattr(module, name)


def run_scenarios(args: argparse.Namespace, rank: int, world: int, local_rank: int, tracer: Any) -> dict[str, Any]:
    """One scenario, or several in a row on the same process group (a batched launch).

    In a batch every scenario's calls go to their own self-contained part of the
    trace, and the ranks wait for each other between scenarios. They also wait for
    each other right before each scenario's body: a rank still loading the scenario
    on a loaded node would otherwise miss a crash its peers cause at once (gloo
    aborts a receiver of the wrong size, and the job is torn down before the slow
    rank records its call). Both waits go through the c10d store, never through a
    collective, which would pair with the scenarios' own.
    """
    import torch
    import torch.distributed as dist

    from distcheck.scenario import ScenarioContext

    device = pick_device(args.backend, args.device, local_rank)
    dist.init_process_group(args.backend, timeout=datetime.timedelta(seconds=args.pg_timeout))
    STATUS.update(phase=Phase.RUNNING)
    batch = len(args.scenario_name) > 1
    done: dict[str, Any] = {}
    results: dict[str, Any] = {}
    for index, (file, name) in enumerate(zip(args.scenario_file, args.scenario_name)):
        if batch:
            tracer.begin_segment(name)
            STATUS.update(current=name, scenarios=done)
        fn = load_scenario(file, name, index)
        ctx = ScenarioContext(rank=rank, world_size=world, local_rank=local_rank, backend=args.backend,
                              device=device, seed=args.seed, options=parse_options(args.option))
        ctx.generator = ctx.generator_for(rank)
        torch.manual_seed(args.seed * 100_003 + rank)
        _wait_for_peers(dist, world, rank, f"start/{index}", args.pg_timeout)
        started, before = time.time(), tracer.count
        fn(ctx)
        results = ctx.results()
        done[name] = {"results": results, "collectives": tracer.count - before,
                      "t_start": started, "t_end": time.time()}
        if batch:
            STATUS.update(scenarios=done)
            _wait_for_peers(dist, world, rank, f"end/{index}", args.pg_timeout)
    return results


def _wait_for_peers(dist: Any, world: int, rank: int, point: str, timeout_s: float) -> None:
    store = dist.distributed_c10d._get_default_store()
    store.set(f"distcheck/batch/{point}/{rank}", "1")
    store.wait([f"distcheck/batch/{point}/{r}" for r in range(world)], datetime.timedelta(seconds=timeout_s))


def note_process_group_init() -> None:
    """Record in the status file when the job's process group exists."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    original = c10d.init_process_group

    @functools.wraps(original)
    def init_process_group(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        try:
            STATUS.update(phase=Phase.RUNNING, pg_initialized=True)
        except Exception as exc:   # the user's init_process_group returns all the same (rule 0)
            failed(Hook.RANK_SETUP, exc)
        return result

    c10d.init_process_group = init_process_group
    dist.init_process_group = init_process_group


def run_script(args: argparse.Namespace) -> dict[str, Any]:
    STATUS.update(phase=Phase.RUNNING)
    script_args = [a for a in args.script_args if a != "--"] if args.script_args[:1] == ["--"] else args.script_args
    if args.module:
        sys.argv = [args.module, *script_args]
        runpy.run_module(args.module, run_name="__main__", alter_sys=True)
    else:
        sys.argv = [args.script, *script_args]
        sys.path.insert(0, str(Path(args.script).resolve().parent))
        runpy.run_path(args.script, run_name="__main__")
    return {}


def start_flight_recorder_sidecar(files: LaunchFiles, rank: int) -> None:
    """On the launcher's request, dump PyTorch's Flight Recorder (GPU-side state on NCCL).

    A thread, because the main thread may be blocked inside the collective;
    collectives release the GIL while they wait, so this thread runs.
    """
    def serve() -> None:
        try:
            dump()
        except Exception as exc:   # a thread of distcheck's own: its failure is counted, never printed (rule 0)
            failed(Hook.SIDECAR, exc)

    def dump() -> None:
        while not files.flight_recorder_request.exists():
            time.sleep(0.05)
        dump_json = torch_features.fr_dump_json_function()
        try:
            if dump_json is None:
                raise RuntimeError(torch_features.recorder_problem(None) or "no Flight Recorder")
            data = dump_json()
        except Exception as exc:   # no process group yet, or a recorder that is off
            data = json.dumps({"error": f"{type(exc).__name__}: {exc}"}).encode()
        path = files.flight_recorder(rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(data if isinstance(data, bytes) else str(data).encode())
        os.replace(tmp, path)

    threading.Thread(target=serve, name="distcheck-flight-recorder", daemon=True).start()


def watch_native_collectives(tracer: Any, main_thread: int | None = None) -> native.NativeWatcher:
    """The sidecar that writes C++-issued collectives (DDP, FSDP2, functional) into the trace."""
    watcher = native.NativeWatcher(tracer, main_thread=main_thread or threading.main_thread().ident,
                                   on_unwatched=lambda why: STATUS.update(unwatched=why))
    tracer.segment_listeners.append(watcher)
    flush_before_destroy(watcher)
    native.start(watcher)
    return watcher


def flush_before_destroy(watcher: native.NativeWatcher) -> None:
    """A script that ends with ``destroy_process_group()`` would take its groups' last C++-issued calls
    along before "finished" is written: record them first (and the sidecar reads a group it finds gone
    one last time, for a destroy that bypasses this wrapper)."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    original = c10d.destroy_process_group
    if getattr(original, "__distcheck__", False):
        return

    @functools.wraps(original)
    def destroy_process_group(*args: Any, **kwargs: Any) -> Any:
        try:
            watcher.flush()
        except Exception as exc:   # never keep the user's call from running (rule 0)
            failed(Hook.SIDECAR, exc)
        return original(*args, **kwargs)

    destroy_process_group.__distcheck__ = True  # type: ignore[attr-defined]
    c10d.destroy_process_group = destroy_process_group
    if getattr(dist, "destroy_process_group", None) is original:
        dist.destroy_process_group = destroy_process_group


def wait_for_release(files: LaunchFiles, still_wanted: Callable[[], bool] = lambda: True) -> None:
    """Idle like a healthy rank whose peers are stuck, until the launcher says stop
    (or ``still_wanted`` says nobody is left to say it)."""
    while not files.release.exists() and still_wanted():
        time.sleep(0.05)


@dataclasses.dataclass
class RankRuntime:
    """What a traced rank carries: its status file, its tracer and the C++-collective sidecar."""

    files: LaunchFiles
    status: Status
    tracer: Any
    watcher: native.NativeWatcher


def trace_rank(files: LaunchFiles, rank: int, *, script: bool, main_thread: int | None = None) -> RankRuntime:
    """Everything a rank needs to be watched, however it was started: by distcheck's own
    worker (before the job runs) or by the user's launch command (right after its
    ``init_process_group``, through ``rank.injected``)."""
    global STATUS
    status = STATUS = Status(files, rank, main_thread)
    status.update(phase=Phase.STARTING)
    guard.set_publisher(lambda counts: STATUS.update(hook_failures=counts))   # this generation's status
    install_stack_dumps_guarded(files, rank, main_thread)
    if os.environ.get("DISTCHECK_FLIGHT_RECORDER") == "1":
        start_flight_recorder_sidecar(files, rank)
        status.update(flight_recorder=True)
    tracer = install(files.trace(rank), rank)
    watcher = watch_native_collectives(tracer, main_thread)
    if script:
        _set_up(integrations.install)
    # Scripts write their passes to a file; a scenario's go out with its results (scenario.results()).
    _set_up(SampleRecorder(files.samples(rank) if script else None).install)   # no code change needed
    _set_up(lambda: metrics.install(files.metrics(rank)))   # torchmetrics, once the job imports it
    return RankRuntime(files, status, tracer, watcher)


def flush_native(runtime: RankRuntime, exc: BaseException | None = None) -> None:
    """The rank's C++-issued calls are all in its trace (before it says it finished or failed).
    A failure's traceback says where the call that raised was issued (``loss.backward()``)."""
    try:
        runtime.watcher.flush(native.traceback_frames(exc.__traceback__) if exc is not None else None)
    except Exception as err:   # a failing flush must not hide the rank's own end
        failed(Hook.SIDECAR, err)


def finish_rank(runtime: RankRuntime, results: dict[str, Any]) -> None:
    """The rank's work is done: its last C++-issued calls are in the trace before "finished"."""
    flush_native(runtime)
    try:
        if samples.ACTIVE is not None:
            samples.ACTIVE.flush()   # passes cut short whose iterators are still alive
    except Exception as exc:
        failed(Hook.SAMPLES, exc)
    try:
        results = {**results, **metrics.results()}   # a script's metrics (a scenario's went with its results)
    except Exception as exc:
        failed(Hook.METRICS, exc)
    runtime.status.update(phase=Phase.FINISHED, collectives=runtime.tracer.count, results=results,
                          hook_failures=guard.failures() or None)


def record_failure(status: Status, exc: BaseException, collectives: int, exit_code: int) -> None:
    """The rank's own failure, with the user's line it was raised at."""
    tb = exc.__traceback__
    text = "".join(traceback.format_exception(type(exc), exc, tb))
    message = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    status.update(
        phase=Phase.ERROR, collectives=collectives, exit_code=exit_code,
        exception=f"{type(exc).__name__}: {message}"[:500], traceback=text[-8000:], where=user_frame_of(tb),
        hook_failures=guard.failures() or None,
    )


STATUS: Status


# The environment this module was imported with: in the fork server (``launch.forkserver``), the one
# the server started with, so a forked rank can tell what torch's agent set for it.
_SERVER_ENV = dict(os.environ)


def run_forked(env: dict[str, str], *argv: str) -> None:
    """A rank forked from the fork server: the launcher's environment at this launch (``env``) and what
    torch's agent set for this rank, then ``main``. It returns where ``main`` would exit 0, so that the
    agent gets the rank's return value; the process then ends at once, as ``main``'s own ``os._exit(0)``
    would (no waiting for threads left running)."""
    import multiprocessing.util

    _let_the_server_go()
    agent = {k: v for k, v in os.environ.items() if _SERVER_ENV.get(k) != v}
    os.environ.clear()
    os.environ.update(env)
    os.environ.update(agent)
    multiprocessing.util.Finalize(None, os._exit, args=(0,), exitpriority=100)   # the first thing at exit
    if os.getcwd() not in sys.path:   # as ``python -m distcheck.rank.worker`` would have it: modules beside the run
        sys.path.insert(0, os.getcwd())
    main(list(argv), forked=True)


def _let_the_server_go() -> None:
    """The fork server lives while any process holds the write end of its "alive" pipe, and hands that
    end to every process it forks: a rank holding it would keep the server alive after distcheck died,
    and the server's death is what kills the rank (``die_with_parent``). Only distcheck keeps it."""
    import multiprocessing.forkserver

    server = multiprocessing.forkserver._forkserver
    if getattr(server, "_forkserver_alive_fd", None) is not None:
        os.close(server._forkserver_alive_fd)
        server._forkserver_alive_fd = None


def main(argv: list[str] | None = None, forked: bool = False) -> None:
    take_job_standing()
    args = parse_args(sys.argv[1:] if argv is None else argv)
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    files = LaunchFiles(Path(args.launch_dir))
    die_with_parent()
    redirect_output(files.log(rank))
    runtime = trace_rank(files, rank, script=not args.scenario_file)
    tracer = runtime.tracer
    note_process_group_init()
    try:
        if args.scenario_file:
            results = run_scenarios(args, rank, world, local_rank, tracer)
        else:
            results = run_script(args)
    except SystemExit as exc:
        if exc.code not in (0, None):
            _fail(exc, runtime, exit_code=exc.code if isinstance(exc.code, int) else 1)
        results = {}
        STATUS.update(where=exit_site(exc))   # where its work ended, for a hang its peers then show
    except KeyboardInterrupt:     # the launcher forwards Ctrl-C: not this rank's failure
        STATUS.update(phase=Phase.INTERRUPTED, collectives=tracer.count)
        os._exit(130)
    except BaseException as exc:  # the rank's own failure: report it, then die like the job would
        _fail(exc, runtime, exit_code=1)
    finish_rank(runtime, results)
    wait_for_release(files)
    sys.stdout.flush()
    sys.stderr.flush()
    if not forked:
        os._exit(0)


def _fail(exc: BaseException, runtime: RankRuntime, exit_code: int) -> None:
    sys.stderr.write("".join(traceback.format_exception(type(exc), exc, exc.__traceback__)))
    flush_native(runtime, exc)
    record_failure(STATUS, exc, runtime.tracer.count, exit_code)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)


if __name__ == "__main__":
    main()
