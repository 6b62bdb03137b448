"""What this machine offers a distributed job: the first thing to paste into a bug report.

``collect()`` gathers torch / CUDA / NCCL / gloo availability, GPUs, library
versions and the environment variables that steer launches, with secrets
redacted; ``redact()`` is pure and tested on its own.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import platform
import re
import socket
import sys
import sysconfig
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, TypedDict

from distcheck import torch_features
from distcheck.models import VERSION

REDACTED = "***"

# variables worth showing, by exact name or prefix
ENV_NAMES = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
             "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "CUDA_VISIBLE_DEVICES",
             "OMP_NUM_THREADS", "CUDA_LAUNCH_BLOCKING")
ENV_PREFIXES = ("MASTER_", "TORCH_", "PYTORCH_", "NCCL_", "GLOO_", "SLURM_", "TORCHELASTIC_", "DISTCHECK_",
                "CUDA_", "UCC_", "OMPI_", "PMI_")
# a name containing any of these words holds a secret
SECRET_WORDS = ("TOKEN", "KEY", "SECRET", "PASSWORD", "PASSWD", "CREDENTIAL", "AUTH", "COOKIE")
# scheme://user:password@host -> scheme://***@host
_URL_CREDENTIALS = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.\-]*://)(?P<userinfo>[^/@\s]+)@")

OPTIONAL_LIBRARIES = ("torchmetrics", "lightning", "pytorch_lightning", "numpy", "typer", "rich", "psutil")

# distcheck's two C extensions, built at install where a C compiler is (setup.py), each with a Python fallback:
# the tracer's hot path (distcheck.rank.hot_path) and distcheck's thread in a rank (distcheck.rank.ticker).
# Named by string: envinfo reports on them, as on torch, without depending on the rank layer.
HOT_PATH_MODULE = "distcheck.rank._hot_path_c"
NATIVE_THREAD_MODULE = "distcheck.rank._native_thread"
FORCE_PYTHON = "DISTCHECK_HOT_PATH"   # =python: both fallbacks run, as rank.hot_path and rank.ticker read it


def is_secret_name(name: str) -> bool:
    upper = name.upper()
    return any(word in upper for word in SECRET_WORDS)


def redact(name: str, value: str) -> str:
    """The value as it can be shown: secrets by name entirely, credentials inside URLs."""
    if is_secret_name(name):
        return REDACTED if value else value
    return _URL_CREDENTIALS.sub(lambda m: f"{m.group('scheme')}{REDACTED}@", value)


def relevant_env(environ: Mapping[str, str]) -> dict[str, str]:
    return {name: redact(name, value) for name, value in sorted(environ.items())
            if name in ENV_NAMES or name.startswith(ENV_PREFIXES)}


@dataclass(frozen=True)
class GPU:
    index: int
    name: str
    memory_gib: float | None = None
    capability: str | None = None


@dataclass(frozen=True)
class EnvInfo:
    distcheck: str
    python: str
    platform: str
    hostname: str
    cpus: int | None
    torch: str | None
    torch_error: str | None = None
    cuda_available: bool = False
    cuda_version: str | None = None
    nccl_version: str | None = None
    backends: dict[str, bool] = field(default_factory=dict)      # gloo, nccl, mpi, ucc, xccl
    gpus: tuple[GPU, ...] = ()
    libraries: dict[str, str | None] = field(default_factory=dict)
    torch_features: dict[str, bool] = field(default_factory=dict)   # distcheck.torch_features, by name
    torch_problem: str | None = None                                  # below distcheck's floor
    context: dict[str, str] = field(default_factory=dict)        # slurm / torchelastic job facts
    hot_path: str = ""           # "C", or "Python (why)": the tracer's hot path that a rank runs
    native_thread: str = ""      # "native", or "_thread fallback (why)": distcheck's thread in a rank
    env: dict[str, str] = field(default_factory=dict)            # redacted

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["gpus"] = [asdict(g) for g in self.gpus]
        return d


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _context(environ: Mapping[str, str]) -> dict[str, str]:
    ctx = {}
    if environ.get("SLURM_JOB_ID"):
        ctx["slurm"] = (f"job {environ['SLURM_JOB_ID']}"
                        + (f", {environ['SLURM_NNODES']} node(s)" if environ.get("SLURM_NNODES") else "")
                        + (f", {environ['SLURM_NTASKS']} task(s)" if environ.get("SLURM_NTASKS") else ""))
    if environ.get("TORCHELASTIC_RUN_ID"):
        ctx["torchelastic"] = f"run {environ['TORCHELASTIC_RUN_ID']}"
    if environ.get("RANK") and environ.get("WORLD_SIZE"):
        ctx["rank"] = f"{environ['RANK']} of {environ['WORLD_SIZE']}"
    return ctx


def _why_not_loaded(module: str) -> str | None:
    """None where the C module loads here; else why not, in a few words."""
    try:
        importlib.import_module(module)
    except ModuleNotFoundError:
        if sysconfig.get_config_var("Py_GIL_DISABLED") and module == HOT_PATH_MODULE:
            return "a free-threaded Python: the C hot path needs the GIL"
        return "no C compiler at install"
    except ImportError as exc:   # built, but refused here (a free-threaded Python, a build for another one)
        return f"the C module did not load: {exc}"
    return None


class CPaths(TypedDict):
    hot_path: str
    native_thread: str


def c_paths(environ: Mapping[str, str]) -> CPaths:
    """Which of each C extension and its Python fallback a rank runs, and why the fallback where it is."""
    forced = environ.get(FORCE_PYTHON, "").lower() == "python"
    hot, thread = ((f"{FORCE_PYTHON}=python",) * 2 if forced
                   else (_why_not_loaded(HOT_PATH_MODULE), _why_not_loaded(NATIVE_THREAD_MODULE)))
    return {"hot_path": "C" if hot is None else f"Python ({hot})",
            "native_thread": "native" if thread is None else f"_thread fallback ({thread})"}


def _torch_facts() -> dict[str, Any]:
    try:
        import torch
        import torch.distributed as dist
    except Exception as exc:  # a broken torch install is exactly what env should report
        return {"torch": None, "torch_error": f"{type(exc).__name__}: {exc}"}
    facts: dict[str, Any] = {"torch": torch.__version__}
    backends = {}
    for name in ("gloo", "nccl", "mpi", "ucc", "xccl"):
        check = getattr(dist, f"is_{name}_available", None)
        try:
            backends[name] = bool(check()) if check else False
        except Exception:
            backends[name] = False
    facts["backends"] = backends
    try:
        facts["cuda_available"] = bool(torch.cuda.is_available())
    except Exception:
        facts["cuda_available"] = False
    facts["cuda_version"] = torch.version.cuda
    if backends.get("nccl"):
        try:
            v = torch.cuda.nccl.version()
            facts["nccl_version"] = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
        except Exception:
            pass
    gpus = []
    if facts["cuda_available"]:
        for i in range(torch.cuda.device_count()):
            try:
                p = torch.cuda.get_device_properties(i)
                gpus.append(GPU(index=i, name=p.name, memory_gib=round(p.total_memory / 2**30, 1),
                                capability=f"{p.major}.{p.minor}"))
            except Exception as exc:
                gpus.append(GPU(index=i, name=f"unreadable ({type(exc).__name__})"))
    facts["gpus"] = tuple(gpus)
    facts["torch_problem"] = torch_features.floor_problem(torch.__version__)
    try:
        facts["torch_features"] = torch_features.features().flags()
    except Exception as exc:   # a half-broken torch: say so, and show the rest
        facts["torch_problem"] = f"its features could not be probed: {type(exc).__name__}: {exc}"
    return facts


def collect(environ: Mapping[str, str] | None = None) -> EnvInfo:
    environ = os.environ if environ is None else environ
    return EnvInfo(
        distcheck=VERSION, python=platform.python_version() + f" ({sys.executable})",
        platform=platform.platform(), hostname=socket.gethostname(), cpus=os.cpu_count(),
        libraries={name: _version(name) for name in OPTIONAL_LIBRARIES},
        context=_context(environ), env=relevant_env(environ), **c_paths(environ), **_torch_facts(),
    )
