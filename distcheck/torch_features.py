"""What the installed torch offers distcheck: the one place that asks.

distcheck supports torch 2.6 and newer (``MIN_TORCH``). Older releases are
refused at start (``check_supported``), by the installed package's metadata,
without importing torch. Between the floor and the newest release the pieces
distcheck builds on come and go, so every caller asks ``features()`` (probed
once per process) instead of guessing from a version or wrapping its own
try/except:

* the libuv ``TCPStore`` and whether it takes a socket we bound
  (``master_listen_fd``): before torch 2.8 only the legacy store does, and the
  libuv one, the constructor's default, raises ``NotImplementedError``;
* the Flight Recorder, its dump API, and whether gloo's collectives go into it
  (torch 2.8: ``_dump_fr_trace``; 2.6/2.7 have only NCCL's ``_dump_nccl_trace``);
* the process group's collective counter (``_get_sequence_number_for_group``);
* FSDP2's ``fully_shard`` and functional collectives.

Each fact is probed by using the thing (a store on a socket of our own), or by
the name torch exposes for it where using it would disturb the caller (a real
collective would add an entry to the rank's own Flight Recorder);
``tests/test_torch_versions.py`` checks those names against behaviour on the
installed torch. ``SINCE`` says which release first has each feature, for the
notes a report shows when one is missing (measured on 2.6.0, 2.7.1, 2.8.0,
2.9.1 and 2.13.0 from PyPI).
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import importlib.metadata
import importlib.util
import os
import re
import socket
import sys
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass
from typing import Any

from distcheck.errors import UsageError

MIN_TORCH = (2, 6)

# The first torch release with each feature (measured, see the module docstring).
SINCE = {
    "libuv_listen_fd": "2.8",
    "flight_recorder": "2.6",
    "flight_recorder_gloo": "2.8",
    "sequence_counter": "2.6",
    "fully_shard": "2.6",
    "fully_shard_cpu": "2.7",
    "functional_collectives": "2.6",
}

# A person's name for each feature, as `distcheck env` and every report list them.
LABELS = {
    "libuv_store": "libuv TCPStore",
    "libuv_listen_fd": "libuv TCPStore on a bound socket",
    "flight_recorder": "Flight Recorder",
    "flight_recorder_gloo": "Flight Recorder on gloo",
    "sequence_counter": "group sequence counter",
    "fully_shard": "FSDP2 fully_shard",
    "fully_shard_cpu": "FSDP2 on CPU tensors",
    "functional_collectives": "functional collectives",
}


@dataclass(frozen=True)
class TorchFeatures:
    """What this torch offers distcheck. ``fr_dump`` names the recorder's dump function."""

    version: str
    libuv_store: bool = False
    libuv_listen_fd: bool = False
    flight_recorder: bool = False
    flight_recorder_gloo: bool = False
    fr_dump: str | None = None
    sequence_counter: bool = False
    fully_shard: bool = False
    fully_shard_cpu: bool = False
    functional_collectives: bool = False

    def flags(self) -> dict[str, bool]:
        """{feature: available}, in ``LABELS`` order."""
        return {name: bool(getattr(self, name)) for name in LABELS}

    def lines(self) -> list[str]:
        """"Flight Recorder on gloo: yes", one per feature; a missing one says which torch has it."""
        return [f"{LABELS[name]}: {'yes' if ok else 'no' + _since(name)}" for name, ok in self.flags().items()]

    def missing_note(self, name: str) -> str:
        """Why a feature is absent, for a coverage note: "torch 2.6.0 has no Flight Recorder on gloo
        (torch 2.8 or newer has one)"."""
        return f"torch {self.version} has no {LABELS[name]}{_since(name)}"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TorchFeatures:
        known = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        return cls(**{"version": "unknown", **known})


def _since(name: str) -> str:
    return f" (torch {SINCE[name]} or newer has it)" if name in SINCE else ""


# ---------------------------------------------------------------- the floor (no torch import)

def release(version: str) -> tuple[int, ...]:
    """(major, minor, patch) of a torch version string: "2.6.0+cu124" → (2, 6, 0), "2.9.0a0" → (2, 9, 0)."""
    numbers = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", version.strip())
    if numbers is None:
        raise ValueError(f"not a torch version: {version!r}")
    return tuple(int(n or 0) for n in numbers.groups())


def floor_problem(version: str) -> str | None:
    """The one-line refusal for a torch below the floor (None: supported)."""
    if release(version)[:2] >= MIN_TORCH:
        return None
    floor = ".".join(map(str, MIN_TORCH))
    return (f"torch {version} is installed, but distcheck needs torch {floor} or newer: "
            f"pip install 'torch>={floor}'")


def installed_version() -> str | None:
    """The installed torch's version, from its package metadata (importing an old torch may fail)."""
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return None


def check_supported() -> None:
    """Refuse a torch below ``MIN_TORCH`` (UsageError, exit code 2); a missing torch is left to the import."""
    version = installed_version()
    problem = floor_problem(version) if version else None
    if problem:
        raise UsageError(problem)


# ---------------------------------------------------------------- the probes

@functools.cache
def features() -> TorchFeatures:
    """This process's torch, probed once (about 15 ms beyond importing torch: the store probe starts a
    server). Rank-side code asks the cheap probes below instead: it never needs the store."""
    import torch

    libuv, listen_fd = _probe_libuv_store()
    fsdp2 = _has_module("torch.distributed.fsdp", "_fully_shard")
    return TorchFeatures(
        version=torch.__version__,
        libuv_store=libuv, libuv_listen_fd=listen_fd,
        flight_recorder=fr_dump_name() is not None,
        flight_recorder_gloo=recorder_on_gloo(),
        fr_dump=fr_dump_name(),
        sequence_counter=_has_sequence_counter(),
        fully_shard=fsdp2,
        fully_shard_cpu=fsdp2 and _cpu_stream_events(),
        functional_collectives=_has_module("torch.distributed", "_functional_collectives"),
    )


@functools.cache
def fr_dump_name() -> str | None:
    """The Flight Recorder's pickle dump function in ``torch._C._distributed_c10d`` (None: no recorder)."""
    try:
        import torch._C._distributed_c10d as c10d
    except ImportError:
        return None
    return next((name for name in ("_dump_fr_trace", "_dump_nccl_trace") if hasattr(c10d, name)), None)


def recorder_on_gloo() -> bool:
    """gloo's collectives go into the Flight Recorder. The backend-neutral recorder (``_dump_fr_trace``)
    came with gloo's entries; before it the recorder was NCCL's alone (``_dump_nccl_trace``).
    tests/test_torch_versions.py runs a gloo group to check this on the installed torch."""
    return fr_dump_name() == "_dump_fr_trace"


def fr_dump_function() -> Any:
    """The recorder's pickle dump, ``f(include_collectives, include_stack_traces, only_active)``; None without one."""
    name = fr_dump_name()
    if name is None:
        return None
    import torch._C._distributed_c10d as c10d

    return getattr(c10d, name)


def recorder_problem(backend: str | None) -> str | None:
    """Why the Flight Recorder cannot describe this backend's collectives (None: it can)."""
    import torch

    if fr_dump_name() is None:
        return f"torch {torch.__version__} has no {LABELS['flight_recorder']}{_since('flight_recorder')}"
    if backend == "gloo" and not recorder_on_gloo():   # None (before init_process_group): not known yet
        return f"torch {torch.__version__} has no {LABELS['flight_recorder_gloo']}{_since('flight_recorder_gloo')}"
    return None


def _has_sequence_counter() -> bool:
    try:
        import torch.distributed as dist
    except ImportError:
        return False
    return hasattr(getattr(dist, "ProcessGroup", None), "_get_sequence_number_for_group")


def _has_module(package: str, name: str) -> bool:
    """``package.name`` is installed, found without importing it (FSDP's import takes seconds)."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return False
    return spec is not None and any(
        os.path.exists(os.path.join(where, name)) or os.path.exists(os.path.join(where, name + ".py"))
        for where in spec.submodule_search_locations or ())


def _cpu_stream_events() -> bool:
    """FSDP2 on CPU tensors records events on ``torch.cpu.Stream`` (absent before torch 2.7)."""
    import torch

    return hasattr(getattr(torch, "cpu", None), "Stream") and hasattr(torch.cpu.Stream, "record_event")


def _probe_libuv_store() -> tuple[bool, bool]:
    """(libuv store exists, it takes a bound socket): a server on 127.0.0.1, port of the kernel's choosing."""
    try:
        import torch.distributed as dist
    except ImportError:
        return False, False
    if not dist.is_available():
        return False, False
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(1)
    port = sock.getsockname()[1]
    fd = sock.detach()            # a store that starts owns the socket and closes it when it goes
    try:
        with quiet_native_stderr():   # torch < 2.8 logs the refusal at ERROR level before raising it
            store = dist.TCPStore("127.0.0.1", port, is_master=True, master_listen_fd=fd, use_libuv=True,
                                  wait_for_workers=False, timeout=datetime.timedelta(seconds=5))
    except NotImplementedError:    # "The libuv TCPStore backend does not support initialization with an listen fd"
        socket.close(fd)
        return True, False
    except (RuntimeError, TypeError, ValueError):
        socket.close(fd)
        return False, False
    libuv = bool(getattr(store, "libuvBackend", False))
    del store
    return libuv, libuv


@contextlib.contextmanager
def quiet_native_stderr() -> Iterator[None]:
    """fd 2 to /dev/null for a C++ call whose own log line our message says better."""
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def feature_problem(name: str, cpu_tensors: bool = True, backend: str = "gloo") -> str | None:
    """Why a scenario's ``requires=("torch:NAME",)`` cannot be met here (None: it can). Two names mean
    what the run needs on its backend and device: ``fully_shard`` (FSDP2 on CPU tensors needs more than
    ``fully_shard`` itself) and ``flight_recorder`` (gloo's collectives in it)."""
    if name not in LABELS:
        return f"unknown torch feature {name!r} (known: {', '.join(LABELS)})"
    if name == "fully_shard" and cpu_tensors:
        name = "fully_shard_cpu"
    if name == "flight_recorder" and backend == "gloo":
        name = "flight_recorder_gloo"
    found = features()
    return None if getattr(found, name) else found.missing_note(name)


def describe(version: str, flags: Mapping[str, bool]) -> str:
    """The report's line on the torch a run used: "torch 2.6.0 · yes: …, group sequence counter ·
    no: Flight Recorder on gloo (torch 2.8+), …" ('' for a saved run from before features were kept)."""
    if not flags:
        return ""
    yes = [LABELS.get(name, name) for name, ok in flags.items() if ok]
    no = [LABELS.get(name, name) + (f" (torch {SINCE[name]}+)" if name in SINCE else "")
          for name, ok in flags.items() if not ok]
    return " · ".join([f"torch {version}"] + ([f"yes: {', '.join(yes)}"] if yes else [])
                      + ([f"no: {', '.join(no)}"] if no else []))


def fr_dump_json_function() -> Any:
    """The recorder's JSON dump (``_dump_fr_trace_json``, or NCCL's ``_dump_nccl_trace_json`` before
    torch 2.8); None without one."""
    name = fr_dump_name()
    if name is None:
        return None
    import torch._C._distributed_c10d as c10d

    return getattr(c10d, name + "_json", None)
