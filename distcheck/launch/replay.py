"""The single-process reference for torchmetrics results (after the launch).

Every rank recorded its metrics' ``update()`` inputs and ``compute()`` values
(``rank.metrics``). Here one fresh process — the user's environment and
``sys.path``, no process group — replays all ranks' updates into a fresh copy
of each metric and computes what a single process would have. It runs the
user's code (their Metric classes), so it is a subprocess with a hard timeout:
``python -m distcheck.launch.replay IN OUT``. What it returns goes into the
results of the lowest rank as ``metric_reference``; the pure rule that judges
it is ``diagnose.metrics``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Mapping

from distcheck.files.launch_dir import LaunchFiles

REPLAY_TIMEOUT_S = 120.0
MAX_COMPUTES = 50          # per metric: later compute() calls are not replayed
# The launch's rendezvous: a user's module that initializes a process group on import must not find one.
_LAUNCH_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK")


def with_metric_reference(results: Mapping[int, Mapping[str, Any]], launch_dir: Path,
                          timeout_s: float = REPLAY_TIMEOUT_S) -> dict[int, dict[str, Any]]:
    """``results`` plus the replay's answer under the lowest rank's ``metric_reference``."""
    out = {r: dict(res) for r, res in results.items()}
    recorded = {r: res["metrics"] for r, res in results.items() if res.get("metrics")}
    if not recorded:
        return out
    sys_path = next(res.get("metrics_sys_path") or [] for res in results.values() if res.get("metrics"))
    folder = LaunchFiles(launch_dir).metrics_dir
    src, dst = folder / "replay-in.json", folder / "replay-out.json"
    src.parent.mkdir(parents=True, exist_ok=True)
    src.write_text(json.dumps({"ranks": {str(r): m for r, m in recorded.items()}, "sys_path": sys_path}))
    out[min(recorded)]["metric_reference"] = _run(src, dst, timeout_s)
    return out


def _run(src: Path, dst: Path, timeout_s: float) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_ENV}
    cmd = [sys.executable, "-m", "distcheck.launch.replay", str(src), str(dst)]
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"error": f"the single-process replay took more than {timeout_s:g} s and was stopped"}
    try:
        return json.loads(dst.read_text())
    except (OSError, ValueError):
        tail = (proc.stderr or "").strip().splitlines()[-1:] or [f"exit code {proc.returncode}"]
        return {"error": f"the single-process replay failed: {tail[0][:300]}"}


# -- inside the replay process ----------------------------------------------------------------


def _load_module(name: str, file: str | None) -> Any:
    """The module a recorded class lives in; a script's ``__main__`` is run as ``__mp_main__``,
    like multiprocessing's spawn does, so its ``if __name__ == "__main__"`` block stays put."""
    import importlib
    import importlib.util

    if name != "__main__":
        try:
            return importlib.import_module(name)
        except ImportError:
            if not file:
                raise
    alias = "__mp_main__" if name == "__main__" else name
    spec = importlib.util.spec_from_file_location(alias, file)
    module = importlib.util.module_from_spec(spec)   # type: ignore[arg-type]
    sys.modules[alias] = module
    spec.loader.exec_module(module)   # type: ignore[union-attr]
    return module


def _load(path: str, modules: dict[str, str | None]) -> Any:
    """torch.load with the recorded classes found where the ranks had them (scripts, scenario files)."""
    import pickle
    import types

    import torch

    class Unpickler(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> Any:
            if module in modules:
                obj = _load_module(module, modules[module])
                for part in name.split("."):
                    obj = getattr(obj, part)
                return obj
            return super().find_class(module, name)

    shim = types.SimpleNamespace(Unpickler=Unpickler, load=pickle.load, __name__="pickle")
    return torch.load(path, map_location="cpu", weights_only=False, pickle_module=shim)


def main(argv: list[str]) -> None:
    from distcheck.launch.memory import take_job_standing

    take_job_standing()
    src, dst = Path(argv[0]), Path(argv[1])
    spec = json.loads(src.read_text())
    sys.path[:0] = [p for p in spec["sys_path"] if p and p not in sys.path]
    from distcheck.launch.replay_metric import replay_metric

    ranks = {int(r): {m["id"]: m for m in ms} for r, ms in spec["ranks"].items()}
    out: dict[str, Any] = {"metrics": {}}
    for key in sorted({k for ms in ranks.values() for k in ms}):
        per_rank = {r: ms[key] for r, ms in sorted(ranks.items()) if key in ms}
        try:
            out["metrics"][key] = replay_metric(per_rank, _load, MAX_COMPUTES)
        except Exception as exc:   # one metric's replay failing says nothing about the others
            out["metrics"][key] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
    tmp = dst.with_suffix(".tmp")
    tmp.write_text(json.dumps(out))
    os.replace(tmp, dst)


if __name__ == "__main__":
    main(sys.argv[1:])
