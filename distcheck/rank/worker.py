"""The rank process: ``python -m distcheck.rank.worker ...``.

Launched by distcheck's launcher, by ``torchrun`` or by ``srun`` alike (it only
reads torchrun's environment). It installs the tracer and the stack probe,
runs one scenario or the user's script, reports through files, then stays idle
until the launcher releases it, exactly like a healthy rank whose peers hang.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import os
import runpy
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from distcheck.files.launch_dir import LaunchFiles
from distcheck.models import Phase
from distcheck.rank.groups import default_group_facts
from distcheck.rank import metrics, samples
from distcheck.rank.exit_site import exit_site
from distcheck.rank.oom_standing import take_job_standing
from distcheck.rank.runtime import (PROCESS, RankRuntime, Status, arm, finish_rank, flush_native, record_failure,
                                    redirect_output, wait_for_release)

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


def run_scenarios(args: argparse.Namespace, rank: int, world: int, local_rank: int, runtime: RankRuntime
                  ) -> dict[str, Any]:
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

    tracer, status = runtime.tracer, runtime.status
    device = pick_device(args.backend, args.device, local_rank)
    if args.backend == "emulated_nccl":   # NCCL's host view on CPU (distcheck.testing.emulated_nccl)
        from distcheck.testing import emulated_nccl
        emulated_nccl.register()
    dist.init_process_group(args.backend, timeout=datetime.timedelta(seconds=args.pg_timeout))
    status.update(phase=Phase.RUNNING)
    batch = len(args.scenario_name) > 1
    done: dict[str, Any] = {}
    results: dict[str, Any] = {}
    for index, (file, name) in enumerate(zip(args.scenario_file, args.scenario_name)):
        if batch:
            tracer.begin_segment(name)
            status.update(current=name, scenarios=done)
        fn = load_scenario(file, name, index)
        ctx = ScenarioContext(rank=rank, world_size=world, local_rank=local_rank, backend=args.backend,
                              device=device, seed=args.seed, options=parse_options(args.option))
        ctx.generator = ctx.generator_for(rank)
        torch.manual_seed(args.seed * 100_003 + rank)
        _wait_for_peers(dist, world, rank, f"start/{index}", args.pg_timeout)
        started, before = time.time(), tracer.count
        fn(ctx)
        results = scenario_results(ctx)
        done[name] = {"results": results, "collectives": tracer.count - before,
                      "t_start": started, "t_end": time.time()}
        if batch:
            status.update(scenarios=done)
            _wait_for_peers(dist, world, rank, f"end/{index}", args.pg_timeout)
    return results


def scenario_results(ctx: Any) -> dict[str, Any]:
    """What the scenario declared, and what the rank recorded on its own while it ran (DataLoader passes,
    torchmetrics), unless the scenario declared its own: a scenario that checks itself is not checked twice."""
    out = ctx.results()
    passes = samples.drain()
    recorded = metrics.results()   # drained either way: nothing leaks into the next scenario of a batch
    if not ctx.numeric_checks:
        out.update(recorded)
    if passes and not ctx.samples:
        out["samples"] = passes
    return out


def _wait_for_peers(dist: Any, world: int, rank: int, point: str, timeout_s: float) -> None:
    store = dist.distributed_c10d._get_default_store()
    store.set(f"distcheck/batch/{point}/{rank}", "1")
    store.wait([f"distcheck/batch/{point}/{r}" for r in range(world)], datetime.timedelta(seconds=timeout_s))


def run_script(args: argparse.Namespace, status: Status) -> dict[str, Any]:
    status.update(phase=Phase.RUNNING)
    script_args = [a for a in args.script_args if a != "--"] if args.script_args[:1] == ["--"] else args.script_args
    if args.module:
        sys.argv = [args.module, *script_args]
        runpy.run_module(args.module, run_name="__main__", alter_sys=True)
    else:
        sys.argv = [args.script, *script_args]
        sys.path.insert(0, str(Path(args.script).resolve().parent))
        runpy.run_path(args.script, run_name="__main__")
    return {}




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

    server: Any = multiprocessing.forkserver._forkserver   # its private state, which typeshed does not declare
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
    try:
        runtime = arm(files, rank, script=not args.scenario_file)
    except KeyboardInterrupt:   # the launcher forwarded Ctrl-C before the job started (torch still loading)
        os._exit(130)
    status = runtime.status
    PROCESS.on_init.append(lambda: status.update(phase=Phase.RUNNING, pg_initialized=True, **default_group_facts()))
    try:
        if args.scenario_file:
            results = run_scenarios(args, rank, world, local_rank, runtime)
        else:
            results = run_script(args, status)
    except SystemExit as exc:
        if exc.code not in (0, None):
            _fail(exc, runtime, exit_code=exc.code if isinstance(exc.code, int) else 1)
        results = {}
        status.update(where=exit_site(exc))   # where its work ended, for a hang its peers then show
    except KeyboardInterrupt:     # the launcher forwards Ctrl-C: not this rank's failure
        status.update(phase=Phase.INTERRUPTED, collectives=runtime.tracer.count)
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
    record_failure(runtime.status, exc, runtime.tracer.count, exit_code)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)


if __name__ == "__main__":
    main()
