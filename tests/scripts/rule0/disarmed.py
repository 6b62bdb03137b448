"""A process that runs one small gloo job untraced, then is armed as a command's rank would be (the hooks
``distcheck run -- CMD`` arms), runs the same job traced, and is disarmed, with the process compared before and
after: every attribute of torch.distributed, the DataLoader's iterators, torchmetrics and Lightning, the import
finders, signal handlers, faulthandler, threads, open files, exit hooks. Prints one JSON object: the differences
found (none expected) and what the traced job recorded (proof that it was traced at all).

``python disarmed.py LAUNCH_DIR MODE``: MODE ``after_destroy`` disarms once the job destroyed its group;
``mid_job`` disarms while the group is up, and the job then goes on untraced; ``rearm`` disarms, arms again and
runs the job a third time, traced again.
"""

from __future__ import annotations

import atexit
import faulthandler
import json
import multiprocessing.util
import os
import signal
import sys
import tempfile
import threading

# atexit cannot list its callbacks (and its count keeps unregistered ones' slots): this process keeps the list.
EXIT_HOOKS: list = []
_register, _unregister = atexit.register, atexit.unregister


def _registering(function, *args, **kwargs):
    EXIT_HOOKS.append(function)
    return _register(function, *args, **kwargs)


def _unregistering(function):
    EXIT_HOOKS[:] = [hook for hook in EXIT_HOOKS if hook != function]
    return _unregister(function)


atexit.register, atexit.unregister = _registering, _unregistering

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.distributed_c10d as c10d  # noqa: E402
import torch.utils.data.dataloader as loader_module  # noqa: E402
import torchmetrics  # noqa: E402
from torch.utils.data import DataLoader, IterableDataset  # noqa: E402


class Numbers(IterableDataset):
    def __iter__(self):
        return iter(torch.arange(8.0).split(2))


CLASSES = (c10d.Work, loader_module._BaseDataLoaderIter, loader_module._SingleProcessDataLoaderIter,
           loader_module._MultiProcessingDataLoaderIter, torchmetrics.Metric, torchmetrics.MetricCollection,
           pl.LightningModule)
MODULES = {"c10d": c10d, "dist": dist, "sys": sys}


def snapshot() -> dict:
    attributes = {f"{name}.{key}": repr(value) if isinstance(value, (bool, int, str)) else id(value)
                  for name, module in MODULES.items() for key, value in vars(module).items() if callable(value)}
    attributes.update({f"{cls.__qualname__}.{key}": id(value) for cls in CLASSES for key, value in vars(cls).items()})
    return {
        "attributes": attributes,
        "meta_path": [repr(finder) for finder in sys.meta_path],
        "signals": {sig.name: repr(signal.getsignal(sig)) for sig in signal.valid_signals()
                    if isinstance(sig, signal.Signals)},
        "faulthandler": faulthandler.is_enabled(),
        "threads": sorted(thread.name for thread in threading.enumerate()),
        "os threads": len(os.listdir("/proc/self/task")),
        "open files": sorted(os.readlink(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd")
                             if os.path.exists(f"/proc/self/fd/{fd}")),
        "stdout": os.readlink("/proc/self/fd/1"),
        "stderr": os.readlink("/proc/self/fd/2"),
        "atexit callbacks": [getattr(hook, "__qualname__", repr(hook)) for hook in EXIT_HOOKS],
        "multiprocessing finalizers": len(multiprocessing.util._finalizer_registry),
        "excepthook": id(sys.excepthook),
        # distcheck's own modules stay imported once disarmed, holding no state of the job (their globals reset)
        "modules": {name: id(module) for name, module in sys.modules.items()
                    if name != "distcheck" and not name.startswith("distcheck.")},
        "exit": id(sys.exit),
    }


DURING: list[dict] = []   # snapshots taken inside a job, while its group is up


def job(store_dir: str) -> float:
    """init, collectives, a DataLoader pass, a metric synced across the group, destroy."""
    dist.init_process_group("gloo", init_method=f"file://{store_dir}/store", rank=0, world_size=1)
    total = run_collectives()
    DURING.append(snapshot())
    dist.destroy_process_group()
    return total


def run_collectives() -> float:
    values = torch.ones(4)
    dist.all_reduce(values)
    dist.barrier()
    metric = torchmetrics.MeanMetric()
    for batch in DataLoader(Numbers(), batch_size=None):
        metric.update(batch)
    return float(metric.compute()) + float(values.sum())


def differences(before: dict, after: dict, ignore: dict | None = None) -> dict:
    """What changed, key by key (one level into dicts); ``ignore``: what changes without distcheck too."""
    ignore = ignore or {}
    found = {}
    for key, old in before.items():
        new = after[key]
        if key in ignore and not isinstance(old, dict):
            continue
        if isinstance(old, dict):
            changed = {name: [old.get(name), new.get(name)] for name in old.keys() | new.keys()
                       if old.get(name) != new.get(name) and name not in ignore.get(key, {})}
            if changed:
                found[key] = changed
        elif old != new:
            found[key] = [old, new]
    return found


def main() -> None:
    launch_dir, mode = sys.argv[1], sys.argv[2]
    # stdout and stderr write where `distcheck run -- CMD` sends a command's output (its log), as a rank's do there
    command_log = os.path.join(launch_dir, "logs", "command.log")
    os.makedirs(os.path.dirname(command_log))
    result = os.fdopen(os.dup(1), "w")
    log = os.open(command_log, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    job(tempfile.mkdtemp())   # torch's own lazily made state exists before the snapshot
    first = snapshot()
    untraced = job(tempfile.mkdtemp())
    before = snapshot()
    torchs_own = differences(first, before)   # what each run changes untraced (torch chains sys.excepthook at init)

    os.environ["DISTCHECK_LAUNCH_DIR"] = launch_dir
    from distcheck.rank import injected
    from distcheck.rank.runtime import PROCESS

    injected.activate()
    armed = snapshot()
    if mode == "mid_job":
        dist.init_process_group("gloo", init_method=f"file://{tempfile.mkdtemp()}/store", rank=0, world_size=1)
        run_collectives()
        DURING.append(snapshot())
        PROCESS.disarm()
        traced = run_collectives()   # the job goes on, untraced
        dist.destroy_process_group()
    else:
        traced = job(tempfile.mkdtemp())
        PROCESS.disarm()
    if mode == "rearm":
        injected.activate()
        job(tempfile.mkdtemp())
        PROCESS.disarm()
    after = snapshot()
    print(json.dumps({"untraced": untraced, "traced": traced, "armed changed": sorted(differences(before, armed)),
                      "traced changed": sorted(differences(before, DURING[2], ignore=torchs_own)),
                      "torch's own": sorted(torchs_own),
                      "left behind": differences(before, after, ignore=torchs_own)}), file=result, flush=True)


if __name__ == "__main__":
    main()
