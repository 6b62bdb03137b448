"""The command line: thin typer commands that parse options and call the library."""

from __future__ import annotations

import os
import sys

from distcheck import interrupt

if os.path.basename(sys.argv[0]) == "distcheck":   # the console script: Ctrl-C honoured before the imports below
    interrupt.install()

import shlex
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer
from rich.console import Console

from distcheck import __version__
from distcheck.errors import DistcheckError, ExitCode, UsageError
from distcheck.models import Report

if TYPE_CHECKING:
    from distcheck.targets import Target
    from distcheck.models import Event
    from distcheck.options import RunOptions

# Each command's help ends with its own exit codes (130, Ctrl-C or SIGTERM, is every command's).
EXIT_CODES_HELP = ("Exit codes: 0 every scenario behaved as expected (a script: ran clean); 1 findings: some target did not behave as expected; 2 usage error (bad option, unknown scenario); 3 distcheck could not run the job (rendezvous, run dir, launch); "
                   "4 --timeout ended a launch, and with it the run; 6 nothing ran (every target was skipped; --require-process-group: your command started no process group); 130 interrupted (Ctrl-C, SIGTERM). A command after '--' that starts no process group ends with its own exit code.")
ROOT_EXIT_CODES = ("Exit codes: 0 nothing wrong; 1 findings; 2 usage error; 3 distcheck could not run or read the job; 4 --timeout ended the run; 5 a saved run (or dump) cannot be read; 6 nothing ran; 130 interrupted. "
                   "Which a command can end with, and when: distcheck COMMAND -h.")
LIST_EXIT_CODES = "Exit codes: 0 listed; 2 an unknown scenario, or a file that cannot be read; 130 interrupted."
REPORT_EXIT_CODES = ("Exit codes: the saved run's own (0 as expected, 1 findings, 4 --timeout, 6 nothing ran, 130 interrupted; a command's own where it started no process group); "
                     "2 no such run dir; 5 its report.json is missing, torn or not a distcheck report.")
ANALYZE_EXIT_CODES = "Exit codes: 0 the dumps or traces show no problem; 1 they do; 2 a path is missing or a pickle is refused; 5 a file is not a readable dump; 130 interrupted."
RUNS_EXIT_CODES = "Exit codes: 0 listed (no saved run too); 2 a bad option (--limit below 1); 130 interrupted."
ENV_EXIT_CODES = "Exit codes: 0 shown; 2 a bad option; 130 interrupted."
ATTACH_EXIT_CODES = ("Exit codes: 0 nothing is wrong; 1 findings (a hang); 2 usage (no job, several jobs, a bad option); 3 the ranks could not be read (py-spy missing, permission denied, "
                     "another node's attach never came): not decided, never a pass; 130 interrupted.")

app = typer.Typer(
    name="distcheck", no_args_is_help=True, rich_markup_mode="rich", context_settings={"help_option_names": []},
    help="A deadlock and desync doctor for PyTorch distributed jobs.", epilog=ROOT_EXIT_CODES,
)


def _help(ctx: typer.Context, value: bool) -> None:
    """-h/--help, as click's own (that one's help row shows a '<bool>' placeholder: typer gives it no metavar)."""
    if value and not ctx.resilient_parsing:
        typer.echo(ctx.get_help(), color=ctx.color)
        raise typer.Exit()


HELP = typer.Option(False, "--help", "-h", callback=_help, is_eager=True, expose_value=False, metavar="",
                    help="Show this message and exit.")


def _version(value: bool) -> None:
    if value:
        typer.echo(f"distcheck {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, metavar="",
                                 help="Show the version."),
    _help_: bool = HELP,
) -> None:
    """distcheck: run multi-rank jobs under a collective tracer and a hang watchdog."""


def _console(json_path: str | None) -> Console:
    """The human view: on stderr when JSON goes to stdout; 140 columns when not a terminal (logs, CI)."""
    stream = sys.stderr if json_path == "-" else sys.stdout
    return Console(stderr=json_path == "-", highlight=False, width=None if stream.isatty() else 140)


@app.command(epilog=EXIT_CODES_HELP)
def run(
    targets: list[str] = typer.Argument(None, metavar="TARGETS", show_default=False, hidden=True, help="Said in the command's help (a typed placeholder otherwise)."),
    nproc_per_node: int = typer.Option(None, "--nproc-per-node", metavar="N", rich_help_panel="Launch", help="Ranks to start (default: GPUs for nccl, else 4)."),
    backend: str = typer.Option("auto", "--backend", metavar="auto|gloo|nccl|emulated_nccl", rich_help_panel="Launch", help="The process-group backend (auto: nccl with a GPU per rank, else gloo; emulated_nccl: NCCL's host view on CPU, calls that return before their work is done)."),
    device: str = typer.Option("auto", "--device", metavar="auto|cpu|cuda", rich_help_panel="Launch", help="Where scenario tensors live (gloo works with both)."),
    stall_timeout: float = typer.Option(10.0, "--stall-timeout", metavar="SECONDS", rich_help_panel="Limits", help="Seconds without progress while a rank waits (and none is busy computing) before it is a hang."),
    busy_timeout: float = typer.Option(600.0, "--busy-timeout", metavar="SECONDS", rich_help_panel="Limits", help="Seconds the others may wait for a rank busy in its own code (late, not hung) before it is a hang."),
    timeout: float | None = typer.Option(None, "--timeout", metavar="SECONDS", rich_help_panel="Limits", help="Seconds any one launch may run: at that distcheck ends it and stops the run (exit 4; default: no limit)."),
    json_path: str | None = typer.Option(None, "--json", metavar="PATH|-", rich_help_panel="Reports", help="Write the JSON report here ('-' = stdout; the human view then goes to stderr)."),
    junit_xml: Path | None = typer.Option(None, "--junit-xml", metavar="PATH", rich_help_panel="Reports", help="Write a JUnit XML report here (one testcase per scenario)."),
    chrome_trace: Path | None = typer.Option(None, "--chrome-trace", metavar="PATH", rich_help_panel="Reports", help="Write a Chrome trace-event JSON timeline here (Perfetto, chrome://tracing)."),
    run_dir: Path | None = typer.Option(None, "--run-dir", metavar="DIR", rich_help_panel="Reports", help="Where traces, logs and reports go (default ~/.local/state/distcheck/runs/<id>, or $DISTCHECK_RUNS_DIR/<id>: never your working tree)."),
    seed: int = typer.Option(0, "--seed", metavar="N", rich_help_panel="What to run", help="Seed for the scenarios' data."),
    verbose: bool = typer.Option(False, "--verbose", "-v", metavar="", rich_help_panel="Reports", help="Show every target's findings (expected ones marked so), rank table and tables, and the torch line."),
    quiet: bool = typer.Option(False, "--quiet", "-q", metavar="", rich_help_panel="Reports", help="Print one line: the verdict."),
    quiet_ranks: bool = typer.Option(False, "--quiet-ranks", metavar="", rich_help_panel="Reports", help="Keep the ranks' own output (a script's, or your command's) in the run dir's logs only (default: also on the terminal as it comes, each rank's line prefixed '\\[rankN]:', as torchrun shows it)."),
    module: str | None = typer.Option(None, "--module", "-m", metavar="MODULE", rich_help_panel="What to run", help="Run this module on every rank, like 'python -m' (its arguments after '--')."),
    max_duration: float | None = typer.Option(None, "--max-duration", metavar="SECONDS", rich_help_panel="Limits", help="Pre-flight: end a healthy script after S seconds and report that window."),
    nnodes: int | None = typer.Option(None, "--nnodes", metavar="N", rich_help_panel="Multi-node", help="Nodes in the job (torchrun's meaning; one distcheck per node; SLURM's environment is used under srun)."),
    node_rank: int | None = typer.Option(None, "--node-rank", metavar="N", rich_help_panel="Multi-node", help="This node's rank; node 0 hosts distcheck's store and writes the full report."),
    rdzv_endpoint: str | None = typer.Option(None, "--rdzv-endpoint", metavar="HOST:PORT", rich_help_panel="Multi-node", help="HOST:PORT of the c10d rendezvous (node 0's host)."),
    rdzv_id: str | None = typer.Option(None, "--rdzv-id", metavar="ID", rich_help_panel="Multi-node", help="Job id shared by every node."),
    rdzv_backend: str = typer.Option("c10d", "--rdzv-backend", metavar="c10d", rich_help_panel="Multi-node", help="c10d, torch's rendezvous (the only one supported)."),
    rdzv_timeout: float = typer.Option(300.0, "--rdzv-timeout", metavar="SECONDS", rich_help_panel="Multi-node", help="Seconds to wait for every node to join."),
    master_addr: str | None = typer.Option(None, "--master-addr", metavar="HOST", rich_help_panel="Multi-node", help="Rendezvous host when --rdzv-endpoint is not given."),
    master_port: int | None = typer.Option(None, "--master-port", metavar="PORT", rich_help_panel="Multi-node", help="Rendezvous port with --master-addr (default 29500)."),
    local_addr: str | None = typer.Option(None, "--local-addr", metavar="HOST", rich_help_panel="Multi-node", help="This node's address, where its stores listen (default: the one it reaches the endpoint from)."),
    store_port: int | None = typer.Option(None, "--store-port", metavar="PORT", rich_help_panel="Multi-node", help="Port of distcheck's own store on node 0 (default: rendezvous port + 1)."),
    min_busbw: str | None = typer.Option(None, "--min-busbw", metavar="GBPS|OP=GBPS,...", rich_help_panel="Limits", help="comm_health: fail the node when a collective's bus bandwidth (GB/s) at the largest size is below this floor: one number for every op, or per op (all_reduce=10,all_gather=8)."),
    option: list[str] = typer.Option([], "--option", metavar="KEY=VALUE", rich_help_panel="What to run", help="KEY=VALUE passed to every scenario as ctx.options (repeatable)."),
    flight_recorder: bool | None = typer.Option(None, "--flight-recorder/--no-flight-recorder", metavar="", rich_help_panel="Launch", help="PyTorch's Flight Recorder: shows collectives issued from C++ (DDP, FSDP2, functional collectives) and is dumped on a stall (default: on)."),
    isolate: bool = typer.Option(False, "--isolate", metavar="", rich_help_panel="Launch", help="A fresh launch for every scenario (default: all but expected hangs and crashes share one)."),
    require_process_group: bool = typer.Option(False, "--require-process-group", metavar="", rich_help_panel="What to run", help="Your command must start a process group: one that never calls init_process_group is an error (exit 6). Without it, such a command ends with its own exit code and one line saying nothing was checked."),
    metric_memory_mb: float | None = typer.Option(None, "--metric-memory-mb", metavar="MB", rich_help_panel="Limits", help="Per-rank cap on the torchmetrics update() inputs and states recorded for the single-process reference (default 256); past it the check is skipped with a warning."),
    _help_: bool = HELP,
) -> None:
    """Run scenarios, or your own torchrun-style script, on N ranks under the tracer and watchdog.

    TARGETS: built-in scenario names, scenario files or folders (none: all built-ins), or ONE
    ordinary script that calls init_process_group itself: distcheck run train.py -- --lr 0.1.
    Nothing before '--': your own launch command, every rank it starts traced:
    distcheck run -- torchrun --nproc-per-node 4 train.py
    """
    from distcheck.options import RunFlags, check_flags, run_options
    from distcheck.session import start_fork_server
    from distcheck.targets.discovery import run_targets_of
    from distcheck.torch_features import check_supported

    if verbose and quiet:
        raise UsageError("--verbose and --quiet cannot be used together", "use one: -v shows everything, -q one line")
    check_supported()   # before torch is imported: an old one may fail to import, or fail later
    flags = RunFlags.of({**locals(), "command": shlex.join(["distcheck", *sys.argv[1:]])})
    nodes = check_flags(flags)
    names, script_args = _split_script_args(list(targets or []))
    specs = run_targets_of(names, module, script_args, flags, nodes)
    start_fork_server(specs, flight_recorder is not False)   # before run_options loads torch
    options = run_options(flags, nodes)
    console = _console(json_path)
    report = _run_live(specs, options, console, verbose, quiet, ranks_shown=not (quiet or quiet_ranks))
    # The files first, the verdict last: the files asked for are "wrote PATH" lines above it, the run dir's
    # timeline.html is said on its run dir line.
    written = _write_json(report, json_path) + _write_formats(
        report, console, junit_xml=junit_xml, chrome_trace=chrome_trace, timeline=not report.nothing_ran,
        announce=False)
    timeline = [p for p in written if p.parent == Path(report.run.run_dir) and p.name == "timeline.html"]
    _announce(console, [p for p in written if p not in timeline], quiet)
    _print_run_end(report, options, console, verbose, quiet, timeline=bool(timeline))
    raise typer.Exit(int(_exit_code(report)))


def _run_live(specs: list[Target], options: RunOptions, console: Console, verbose: bool,
              quiet: bool = False, ranks_shown: bool = False) -> Report:
    """``session.run_targets`` under the live view; SIGTERM ends it like Ctrl-C (``distcheck.interrupt``:
    a report is still written)."""
    from distcheck.report.live import LiveView
    from distcheck.session import RunHooks, run_targets

    nodes = options.nodes
    ranks = f"{nodes.nnodes} nodes x {options.nproc_per_node}" if nodes.multi else f"{options.nproc_per_node}"
    on = f"{ranks} {options.backend} ranks" + (f" (node {nodes.node_rank})" if nodes.multi else "")
    what = specs[0].headline(on) if len(specs) == 1 else f"{len(specs)} scenario(s) on {on}"
    if not quiet:   # -q: the verdict line alone
        console.print(f"distcheck {__version__}: {what}", style="dim", markup=False, highlight=False)
    view = LiveView(console, stall_timeout=options.stall_timeout, busy_timeout=options.busy_timeout, verbose=verbose,
                    quiet=quiet)
    hooks = RunHooks(scenario_started=view.scenario_started, scenario_finished=view.scenario_finished,
                     on_poll=view.on_poll, note=view.note, rank_output=view.rank_line if ranks_shown else None)
    with view:
        return run_targets(specs, options, hooks)


def _print_run_end(report: Report, options: RunOptions, console: Console, verbose: bool = False,
                   quiet: bool = False, timeline: bool = False) -> None:
    from distcheck.files.saved_runs import REPORT_FILE
    from distcheck.report import terminal

    console.print(terminal.summary_line(report, verbose, quiet, timeline), soft_wrap=quiet)
    nodes = options.nodes
    if quiet:
        return
    if nodes.multi and nodes.node_rank != 0 and report.scenarios and report.scenarios[-1].launch_dir:
        console.print(f"      node 0 wrote the full report: {Path(report.scenarios[-1].launch_dir).parent / REPORT_FILE}",
                      markup=False)


def _announce(console: Console, written: list[Path], quiet: bool = False) -> None:
    for path in [] if quiet else written:
        console.print(f"      wrote {path}", style="dim", markup=False, highlight=False, soft_wrap=True)


def _write_json(report: Report, json_path: str | None) -> list[Path]:
    """``--json``: '-' is stdout, anything else a file; returns the file written."""
    from distcheck.report import json_report
    from distcheck.report.outputs import write_outputs

    if json_path == "-":
        sys.stdout.write(json_report.render(report))
        return []
    return write_outputs(report, {}, json_path=Path(json_path)) if json_path else []


def _write_formats(report: Report, console: Console, *, junit_xml: Path | None, chrome_trace: Path | None,
                   timeline: bool, html: Path | None = None,
                   events: dict[str, dict[int, list[Event]]] | None = None, announce: bool = True) -> list[Path]:
    """JUnit, Chrome trace and the HTML timeline (always into the run dir after a run); the files written
    (``announce``: a "wrote PATH" line each)."""
    from distcheck.files.saved_runs import TIMELINE_FILE, load_events
    from distcheck.report.outputs import write_outputs

    run_dir = Path(report.run.run_dir)
    html_path = html or (run_dir / TIMELINE_FILE if timeline else None)
    if not (junit_xml or chrome_trace or html_path):
        return []
    if events is None:
        events = load_events(report, run_dir)
    written = write_outputs(report, events, junit_path=junit_xml, chrome_path=chrome_trace, html_path=html_path)
    _announce(console, written if announce else [])
    return written


def _split_script_args(targets: list[str]) -> tuple[list[str], tuple[str, ...]]:
    """click merges what follows '--' into TARGETS; give it back to the script."""
    argv = sys.argv[1:]
    if "--" not in argv:
        return targets, ()
    after = argv[argv.index("--") + 1:]
    if after and targets[-len(after):] == after:
        return targets[:-len(after)], tuple(after)
    return targets, tuple(after)


def _exit_code(report: Report) -> int:
    from distcheck.diagnose.verdict import exit_code

    return exit_code(report)


@app.command("list", epilog=LIST_EXIT_CODES)
def list_scenarios(
    targets: list[str] = typer.Argument(None, metavar="TARGETS", show_default=False, hidden=True, help="In the help."),
    json_out: bool = typer.Option(False, "--json", metavar="", help="Print the list as JSON."),
    _help_: bool = HELP,
) -> None:
    """List scenarios (built-in and given) with their expectations, requirements and missing dependencies.

    TARGETS: scenario names, files or folders (none: the built-ins).
    """
    import json

    from distcheck.targets.discovery import resolve_targets
    from distcheck.report import scenario_list
    from distcheck.scenario import missing_requirements

    specs = resolve_targets(list(targets or []))
    missing = {spec.name: missing_requirements(spec) for spec in specs}
    if json_out:
        rows = [{**spec.to_dict(), "missing": missing[spec.name]} for spec in specs]
        sys.stdout.write(json.dumps(rows, indent=2) + "\n")
        return
    scenario_list.render(specs, missing, _console(None))


@app.command("report", epilog=REPORT_EXIT_CODES)
def report_cmd(
    run_dir: str = typer.Argument(..., metavar="RUN_DIR", hidden=True, help="In the help."),
    json_path: str | None = typer.Option(None, "--json", metavar="PATH|-", help="Write the JSON report here ('-' = stdout; the human view then goes to stderr)."),
    junit_xml: Path | None = typer.Option(None, "--junit-xml", metavar="PATH", help="Write a JUnit XML report here."),
    chrome_trace: Path | None = typer.Option(None, "--chrome-trace", metavar="PATH", help="Write a Chrome trace-event JSON timeline here."),
    html: Path | None = typer.Option(None, "--html", metavar="PATH", help="Write the HTML timeline here (default: none; every run dir has timeline.html)."),
    verbose: bool = typer.Option(False, "--verbose", "-v", metavar="", help="Show every target's findings (expected ones marked so), rank table and tables, and the torch line."),
    quiet: bool = typer.Option(False, "--quiet", "-q", metavar="", help="Print one line: the verdict."),
    _help_: bool = HELP,
) -> None:
    """Re-render a saved run (terminal view and any format) from its report.json and traces, without re-running.

    RUN_DIR: a run directory (or its report.json, or a run id from 'distcheck runs').
    """
    from distcheck.files.saved_runs import load_run
    from distcheck.report import terminal

    saved = load_run(run_dir)
    console = _console(json_path)
    if verbose or not (json_path or junit_xml or chrome_trace or html or quiet):
        terminal.render(saved.report, console, verbose)
    else:   # only files (or -q) were asked for: the verdict and where they went, not the whole view again
        console.print(terminal.summary_line(saved.report, quiet=quiet), soft_wrap=quiet)
    _announce(console, _write_json(saved.report, json_path))
    _write_formats(saved.report, console, junit_xml=junit_xml, chrome_trace=chrome_trace, timeline=False,
                   html=html, events=saved.events)
    raise typer.Exit(int(_exit_code(saved.report)))


@app.command("analyze", epilog=ANALYZE_EXIT_CODES)
def analyze_cmd(
    paths: list[Path] = typer.Argument(..., metavar="PATHS", hidden=True, help="In the help."),
    world_size: int | None = typer.Option(None, "--world-size", metavar="N", help="Ranks in the job (dumps do not record it; default: from the file names)."),
    json_path: str | None = typer.Option(None, "--json", metavar="PATH|-", help="Write the JSON report here ('-' = stdout; the human view then goes to stderr)."),
    junit_xml: Path | None = typer.Option(None, "--junit-xml", metavar="PATH", help="Write a JUnit XML report here."),
    chrome_trace: Path | None = typer.Option(None, "--chrome-trace", metavar="PATH", help="Write a Chrome trace-event JSON timeline here."),
    verbose: bool = typer.Option(False, "--verbose", "-v", metavar="", help="Show the per-rank table even when nothing is wrong."),
    _help_: bool = HELP,
) -> None:
    """Post-mortem: read PyTorch Flight Recorder dumps (NCCL or gloo) or distcheck traces and report hangs,
    missing ranks and mismatches with the same analysis as a live run. Pickles are loaded without running code.

    PATHS: Flight Recorder dumps (pickle or JSON, one per rank, named PREFIX<rank>), their directory, or
    distcheck run, launch or trace dirs.
    """
    from distcheck.evidence.postmortem import analyze_paths
    from distcheck.report import terminal

    result = analyze_paths(list(paths), world_size, command=shlex.join(["distcheck", *sys.argv[1:]]))
    console = _console(json_path)
    for scenario in result.report.scenarios:
        console.print(terminal.scenario_block(scenario, verbose))
        for line in (scenario.description or "").splitlines():
            console.print(f"    note: {line}", style="dim", markup=False, highlight=False)
    console.print(terminal.summary_line(result.report))
    _announce(console, _write_json(result.report, json_path))
    _write_formats(result.report, console, junit_xml=junit_xml, chrome_trace=chrome_trace, timeline=False,
                   events=result.events)
    raise typer.Exit(int(_exit_code(result.report)))


@app.command("runs", epilog=RUNS_EXIT_CODES)
def runs_cmd(
    root: Path | None = typer.Option(None, "--dir", metavar="DIR", help="Where runs are saved (default ~/.local/state/distcheck/runs, or $DISTCHECK_RUNS_DIR)."),
    limit: int = typer.Option(20, "--limit", "-n", metavar="N", help="Show at most this many runs (newest first)."),
    json_out: bool = typer.Option(False, "--json", metavar="", help="Print the list as JSON."),
    _help_: bool = HELP,
) -> None:
    """List recent saved runs: id, time, verdict, scenarios, backend x ranks."""
    import json

    from distcheck.files.run_home import runs_root, shown
    from distcheck.files.saved_runs import list_runs
    from distcheck.report import runs_table

    if limit < 1:
        raise UsageError(f"--limit must be at least 1 (got {limit})")
    root = root if root is not None else runs_root()
    runs = list_runs(root, limit)
    if json_out:
        sys.stdout.write(json.dumps([r.to_dict() for r in runs], indent=2) + "\n")
        return
    runs_table.render(runs, _console(None), shown(root))


@app.command("env", epilog=ENV_EXIT_CODES)
def env_cmd(
    json_out: bool = typer.Option(False, "--json", metavar="", help="Print the facts as JSON."),
    _help_: bool = HELP,
) -> None:
    """Show torch/CUDA/NCCL/gloo availability, GPUs, versions and launch variables (secrets redacted)."""
    import json

    from distcheck import envinfo
    from distcheck.report import env_view

    info = envinfo.collect()
    if json_out:
        sys.stdout.write(json.dumps(info.to_dict(), indent=2) + "\n")
        return
    env_view.render(info, _console(None))


@app.command("attach", epilog=ATTACH_EXIT_CODES)
def attach_cmd(
    pids: list[int] = typer.Argument(None, metavar="PID", show_default=False, hidden=True, help="In the help."),
    job: str | None = typer.Option(None, "--job", metavar="ID", help="Only ranks of this SLURM_JOB_ID."),
    json_path: str | None = typer.Option(None, "--json", metavar="PATH|-", help="Write the JSON report here ('-' = stdout; the human view then goes to stderr)."),
    junit_xml: Path | None = typer.Option(None, "--junit-xml", metavar="PATH", help="Write a JUnit XML report here."),
    run_dir: Path | None = typer.Option(None, "--run-dir", metavar="DIR", help="Save the report here (default ~/.local/state/distcheck/runs/attach-<id>, or $DISTCHECK_RUNS_DIR/attach-<id>)."),
    samples: int = typer.Option(3, "--samples", metavar="N", help="Stack samples per rank (at least 2)."),
    interval: float = typer.Option(0.5, "--interval", metavar="SECONDS", help="Seconds between samples."),
    verbose: bool = typer.Option(False, "--verbose", "-v", metavar="", help="Show the per-rank table even when nothing is wrong."),
    nnodes: int | None = typer.Option(None, "--nnodes", metavar="N", rich_help_panel="Multi-node", help="Nodes the job runs on: one attach per node, node 0 judges (Slurm's environment is used under srun)."),
    node_rank: int | None = typer.Option(None, "--node-rank", metavar="N", rich_help_panel="Multi-node", help="This node's rank among the attaches; node 0 hosts their store and writes the report."),
    rdzv_endpoint: str | None = typer.Option(None, "--rdzv-endpoint", metavar="HOST:PORT", rich_help_panel="Multi-node", help="Where the attaches meet: node 0's host and a free port (the store listens on PORT+1). Not the job's own."),
    rdzv_id: str | None = typer.Option(None, "--rdzv-id", metavar="ID", rich_help_panel="Multi-node", help="An id every node's attach shares (default: attach)."),
    rdzv_timeout: float = typer.Option(60.0, "--rdzv-timeout", metavar="SECONDS", rich_help_panel="Multi-node", help="How long node 0 waits for the other nodes' reads; a node not heard from by then is named."),
    store_port: int | None = typer.Option(None, "--store-port", metavar="PORT", rich_help_panel="Multi-node", help="Port of the attaches' store on node 0 (default: the endpoint's port + 1)."),
    _help_: bool = HELP,
) -> None:
    """Diagnose a running job distcheck did not launch (hung right now?), read-only from outside: every
    rank's stacks (py-spy) and /proc counters, judged by the same rules as 'distcheck run'.

    PID: a rank's pid (its job's other ranks on this node are found too, its launcher gone or not) or its
    launcher's (torchrun, srun, mp.spawn's parent); none: the one torch.distributed job on this node.
    """
    from distcheck.attach.nodes import attach_nodes
    from distcheck.attach.render import render
    from distcheck.attach.session import AttachOptions, attach

    if samples < 2 or interval <= 0:
        raise UsageError(f"--samples must be at least 2 and --interval above 0 (got {samples}, {interval:g})")
    nodes = attach_nodes(nnodes, node_rank, rdzv_endpoint, rdzv_id, rdzv_timeout, store_port, os.environ)
    done = attach(AttachOptions(pids=tuple(pids or ()), slurm_job=job, samples=samples, interval_s=interval,
                                run_dir=run_dir, command=shlex.join(["distcheck", *sys.argv[1:]]), nodes=nodes))
    if done.report is None:   # another node: node 0 judged the whole job
        said = done.node0 or {}
        typer.echo(f"distcheck attach (node {nodes.node_rank}): node 0 judged the job: {said.get('summary')}\n"
                   f"  its report: {said.get('run_dir')} (on node 0)")
        raise typer.Exit(done.exit_code)
    console = _console(json_path)
    render(done.report, console, verbose, done.undecided)   # "NOT DECIDED" first where ranks were not read
    _announce(console, _write_json(done.report, json_path))
    assert done.judged is not None   # a report of node 0's own comes with its judgement
    _write_formats(done.report, console, junit_xml=junit_xml, chrome_trace=None, timeline=False,
                   events={done.report.scenarios[0].name: done.judged.events})
    if done.incomplete:
        typer.echo(f"distcheck attach: {done.incomplete}", err=True)
    raise typer.Exit(done.exit_code)


def main() -> None:
    """Entry point: one error boundary mapping known failures to a line and an exit code."""
    interrupt.install()   # again: a caller that imported distcheck.cli itself (its argv is not 'distcheck')
    try:
        from distcheck.session import prepare_process

        prepare_process()
        code = app(standalone_mode=False)   # returns the typer.Exit code instead of exiting
        _exit_now(code if isinstance(code, int) else 0)
    except DistcheckError as exc:
        sys.stderr.write(f"distcheck: error: {exc.message}\n")
        if exc.hint:
            sys.stderr.write(f"  hint: {exc.hint}\n")
        sys.exit(int(exc.exit_code))
    except typer.Exit as exc:
        _exit_now(exc.exit_code)
    except KeyboardInterrupt:
        sys.stderr.write("distcheck: interrupted\n")
        sys.exit(int(ExitCode.INTERRUPTED))
    except Exception as exc:
        # click's usage errors (typer vendors click) arrive here with standalone_mode=False
        if hasattr(exc, "format_message") and hasattr(exc, "exit_code"):
            sys.stderr.write(f"distcheck: error: {usage_message(exc)}\n")
            sys.exit(int(ExitCode.USAGE))
        if isinstance(exc, typer.Abort):   # click's own Ctrl-C at a prompt
            sys.exit(int(ExitCode.INTERRUPTED))
        raise


_FORMS = {int: ("a whole number", "4"), float: ("a number", "30")}


def usage_message(exc: Any) -> str:   # click's usage error (typer vendors click, which is not followed)
    """click's usage error as one line: what, where, the valid form ("--nproc-per-node: 'abc' is not a whole
    number (e.g. --nproc-per-node 4)"), instead of its usage block and pydantic's wording."""
    param = getattr(exc, "param", None)
    ctx = getattr(exc, "ctx", None)
    where = f" (see 'distcheck {ctx.info_name} -h')" if ctx is not None and ctx.parent is not None else \
        " (see 'distcheck -h')"
    opts = getattr(param, "opts", None)
    annotation = getattr(getattr(param, "type_descriptor", None), "annotation", None)
    if opts and annotation in _FORMS:
        name = max(opts, key=len)
        value = _given(name)
        form, example = _FORMS[annotation]
        given = f"{value!r} is not {form}" if value is not None else f"needs {form}"
        return f"{name}: {given} (e.g. {name} {example})"
    first = exc.format_message().splitlines()[0] if exc.format_message() else type(exc).__name__
    return first + where


def _given(name: str) -> str | None:
    """The value the command line gave an option ("--n 3" or "--n=3")."""
    argv = sys.argv[1:]
    for i, arg in enumerate(argv):
        if arg == name and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return None


def _exit_now(code: int) -> None:
    """Everything is written and flushed: end without the interpreter's teardown, which after a launch
    waits ~1.5 s on torch's native store threads (an interrupted run must end within 2 s of Ctrl-C)."""
    import logging

    if "torch" not in sys.modules:
        sys.exit(code)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
