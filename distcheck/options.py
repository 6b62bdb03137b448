"""What one ``distcheck run`` is asked to do: the flags as given (``RunFlags``), checked and
resolved against this machine into ``RunOptions``, which the session and launcher read.

Checking happens in two steps so that a bad flag is refused before targets are resolved
and before torch is imported (``check_flags``), and what needs torch (GPU count,
backend availability) comes after (``run_options``).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from distcheck.errors import UsageError
from distcheck import interrupt
from distcheck.files.run_dir import make_run_dir
from distcheck.files.saved_runs import write_interrupted_before_start
from distcheck.launch.node_config import NodeConfig, node_config

BACKEND_CHOICES = ("auto", "gloo", "nccl", "emulated_nccl")   # emulated_nccl: NCCL's host view on CPU
DEVICE_CHOICES = ("auto", "cpu", "cuda")
DEFAULT_NPROC = 4   # gloo ranks when there is no GPU per rank


@dataclass(frozen=True)
class RunOptions:
    nproc_per_node: int
    backend: str                    # resolved: gloo or nccl
    device: str = "auto"
    stall_timeout: float = 10.0
    busy_timeout: float = 600.0      # how long a rank busy in user code may keep the others waiting
    timeout: float | None = None
    max_duration: float | None = None
    seed: int = 0
    run_dir: Path | None = None
    command: str = ""
    nodes: NodeConfig = NodeConfig()
    batching: bool = True            # all but expected hangs/crashes share a launch (see batch.plan)
    metric_memory_mb: float | None = None   # per-rank cap on recorded torchmetrics inputs (None: the default)
    scenario_options: tuple[tuple[str, str], ...] = ()   # passed to every scenario as ctx.options
    flight_recorder: bool | None = None   # None: on (C++-issued collectives; GPU-side state on NCCL)
    require_process_group: bool = False   # ``run -- CMD`` that starts no process group is an error (else its own exit)
    # What this run adds to every rank's environment (the launch's, never the calling process's own: under the
    # pytest plugin that is the user's pytest): set by ``session.run_targets``.
    rank_env: tuple[tuple[str, str], ...] = ()

    @property
    def world_size(self) -> int:
        return self.nodes.nnodes * self.nproc_per_node


@dataclass(frozen=True)
class RunFlags:
    """``distcheck run``'s options as given (None: not given); see ``cli.run`` for their help."""

    nproc_per_node: int | None = None
    backend: str = "auto"
    device: str = "auto"
    stall_timeout: float = 10.0
    busy_timeout: float = 600.0
    timeout: float | None = None
    max_duration: float | None = None
    seed: int = 0
    run_dir: Path | None = None
    nnodes: int | None = None
    node_rank: int | None = None
    rdzv_endpoint: str | None = None
    rdzv_id: str | None = None
    rdzv_backend: str = "c10d"
    rdzv_timeout: float = 300.0
    master_addr: str | None = None
    master_port: int | None = None
    local_addr: str | None = None
    store_port: int | None = None
    min_busbw: str | None = None      # GB/s, or OP=GB/s,... (bandwidth.parse_floors)
    option: tuple[str, ...] = ()     # KEY=VALUE
    flight_recorder: bool | None = None
    isolate: bool = False
    metric_memory_mb: float | None = None
    require_process_group: bool = False
    command: str = ""

    @classmethod
    def of(cls, values: Mapping[str, Any]) -> RunFlags:
        """The flags among ``values`` (a command's parameters, which hold more)."""
        names = {f.name for f in dataclasses.fields(cls)}
        given: dict[str, Any] = {k: (tuple(v) if k == "option" else v) for k, v in values.items() if k in names}
        return cls(**given)


def positive(name: str, value: float | None) -> None:
    if value is not None and value <= 0:
        raise UsageError(f"{name} must be greater than 0 (got {value:g})")


def check_flags(flags: RunFlags) -> NodeConfig:
    """Refuse bad flags before anything slow happens; returns this node's place in the job."""
    if flags.backend not in BACKEND_CHOICES:
        raise UsageError(f"unknown backend {flags.backend!r}", "use auto, gloo, nccl or emulated_nccl")
    if flags.device not in DEVICE_CHOICES:
        raise UsageError(f"unknown device {flags.device!r}", "use auto, cpu or cuda")
    positive("--stall-timeout", flags.stall_timeout)
    positive("--metric-memory-mb", flags.metric_memory_mb)
    positive("--busy-timeout", flags.busy_timeout)
    positive("--timeout", flags.timeout)
    if flags.nproc_per_node is not None and flags.nproc_per_node < 1:
        raise UsageError(f"--nproc-per-node must be at least 1 (got {flags.nproc_per_node})",
                         "give the number of ranks to start on this node, e.g. --nproc-per-node 2, or leave it "
                         "out (one rank per GPU with nccl, else 4)")
    positive("--max-duration", flags.max_duration)
    positive("--rdzv-timeout", flags.rdzv_timeout)
    nodes = node_config(flags.nnodes, flags.node_rank, flags.rdzv_endpoint, flags.rdzv_id, flags.rdzv_backend,
                        flags.rdzv_timeout, flags.master_addr, flags.master_port, flags.store_port, flags.local_addr)
    if flags.run_dir is not None:
        claim_run_dir(flags.run_dir)   # a bad --run-dir is refused now, before torch is imported
    return nodes


def run_options(flags: RunFlags, nodes: NodeConfig) -> RunOptions:
    """Resolve the flags on this machine (rank count, backend); imports torch."""
    nproc = flags.nproc_per_node or default_nproc(flags.backend)
    backend = resolve_backend(flags.backend, nproc)
    if flags.device == "cuda":
        check_cuda()
    return RunOptions(
        nproc_per_node=nproc, backend=backend, device=flags.device, stall_timeout=flags.stall_timeout,
        busy_timeout=max(flags.busy_timeout, flags.stall_timeout),
        timeout=flags.timeout, max_duration=flags.max_duration, seed=flags.seed, nodes=nodes,
        scenario_options=scenario_options(flags.option, flags.min_busbw), flight_recorder=flags.flight_recorder,
        batching=not flags.isolate, run_dir=flags.run_dir, command=flags.command,
        metric_memory_mb=flags.metric_memory_mb, require_process_group=flags.require_process_group,
    )


def scenario_options(pairs: tuple[str, ...] | list[str], min_busbw: str | None) -> tuple[tuple[str, str], ...]:
    options = []
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise UsageError(f"--option needs KEY=VALUE (got {pair!r})")
        options.append((key, value))
    if min_busbw is not None:
        from distcheck.knowledge.nccl_tests import parse_floors

        try:
            parse_floors(min_busbw)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        options.append(("min_busbw", str(min_busbw)))
    return tuple(options)


def default_nproc(backend: str) -> int:
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if backend in ("auto", "nccl") and gpus >= 2:
        return gpus
    return DEFAULT_NPROC


def check_cuda() -> None:
    import torch

    if not torch.cuda.is_available():
        raise UsageError("--device cuda needs a CUDA GPU, and this machine has none", "use --device cpu")


def resolve_backend(backend: str, nproc_per_node: int) -> str:
    """auto: NCCL when there is a GPU per rank, else gloo on CPU."""
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if backend == "auto":
        return "nccl" if gpus >= nproc_per_node and torch.distributed.is_nccl_available() else "gloo"
    if backend == "nccl":
        if not torch.distributed.is_nccl_available() or gpus == 0:
            raise UsageError("--backend nccl needs CUDA GPUs, and this machine has none",
                             "use --backend gloo (or auto) on a CPU-only machine")
        if gpus < nproc_per_node:
            raise UsageError(f"--backend nccl needs one GPU per rank: {nproc_per_node} ranks, {gpus} GPUs",
                             f"use --nproc-per-node {gpus}, or --backend gloo")
    return backend


def claim_run_dir(path: Path) -> Path:
    """The run dir, made (``files.run_dir.make_run_dir``); an interrupt from the moment it exists until the run
    begins leaves a report in it (before it exists: nothing to write into)."""
    interrupt.on_interrupt_before_start(functools.partial(write_interrupted_before_start, path.absolute()))
    return make_run_dir(path)


def pg_timeout(options: RunOptions) -> float:
    """Above the stall timeout, so distcheck diagnoses before the backend aborts."""
    return max(options.stall_timeout * 4 + 60, options.busy_timeout + 60, (options.timeout or 0) + 60, 300)


def check_command_flags(flags: RunFlags, nodes: NodeConfig) -> None:
    """A command starts its own ranks: flags about starting them would silently do nothing."""
    if flags.nproc_per_node is not None:
        raise UsageError("--nproc-per-node does not apply to a command: it starts its own ranks",
                         "give the rank count to your launcher (torchrun --nproc-per-node N, mp.spawn nprocs=N)")
    # Multi-node: one ``distcheck run --nnodes N --node-rank K ... -- CMD`` per node, as for a script;
    # the command's own launcher does its own rendezvous.
