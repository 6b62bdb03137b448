"""The single-process reference for torchmetrics results (after the launch).

Every rank recorded its metrics' ``update()`` inputs, local states and
``compute()`` values (``rank.metrics``); ``files.metric_records`` pairs the
computes the ranks made together into chains. Here one fresh process — the
user's environment and ``sys.path``, no process group — replays each chain: all
ranks' updates go into one copy of the metric, and what a single process would
have computed is set beside what the ranks got.

The copies were pickled by value where their class is the user's own code, so
the replay runs none of the user's scripts or modules' top levels (a script
without a main guard initializes its process group there). It still runs the
user's ``update``/``compute``, so it is a subprocess with a hard timeout and the
job's memory standing: ``python -m distcheck.launch.replay IN OUT``. Its answer
goes into the results of the lowest rank as ``metric_reference``, and is kept
as ``metrics/replay-out.json`` for ``distcheck analyze``; the pure rule that
judges it is ``diagnose.metrics``.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any, Mapping

from distcheck.files.launch_dir import LaunchFiles
from distcheck.files.metric_records import REPLAY_IN, REPLAY_OUT, chain_key, chains, entries_by_rank, joint_computes

REPLAY_TIMEOUT_S = 120.0
# The launch's rendezvous: the replay must never find (or join) the job's process group.
_LAUNCH_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK")


def with_metric_reference(results: Mapping[int, Mapping[str, Any]], launch_dir: Path,
                          timeout_s: float = REPLAY_TIMEOUT_S) -> dict[int, dict[str, Any]]:
    """``results`` plus the replay's answer under the lowest rank's ``metric_reference``."""
    out = {r: dict(res) for r, res in results.items()}
    recorded = entries_by_rank(results)
    if not recorded:
        return out
    planned = chains(joint_computes({r: list(ms.values()) for r, ms in recorded.items()}))
    sys_path = next(res.get("metrics_sys_path") or [] for res in results.values() if res.get("metrics"))
    folder = LaunchFiles(launch_dir).metrics_dir
    src, dst = folder / REPLAY_IN, folder / REPLAY_OUT
    src.parent.mkdir(parents=True, exist_ok=True)
    src.write_text(json.dumps({"ranks": {str(r): ms for r, ms in recorded.items()}, "sys_path": sys_path,
                               "chains": planned}))
    out[min(recorded)]["metric_reference"] = _run(src, dst, timeout_s) if planned else {"chains": {}}
    return out


def _run(src: Path, dst: Path, timeout_s: float) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_ENV}
    env.pop("DISTCHECK_LAUNCH_DIR", None)   # the replay is not a rank of the user's command
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


def load(folders: list[Path], rel: str) -> Any:
    """A recorded copy or chunk (pickled by value where the class is the user's: nothing of theirs runs),
    from the first of ``folders`` that has it."""
    path = next((f / rel for f in folders if (f / rel).is_file()), folders[0] / rel)
    with open(path, "rb") as f:
        return pickle.load(f)


def main(argv: list[str]) -> None:
    from distcheck.launch.memory import take_job_standing

    take_job_standing()
    src, dst = Path(argv[0]), Path(argv[1])
    spec = json.loads(src.read_text())
    sys.path[:0] = [p for p in spec["sys_path"] if p and p not in sys.path]
    from distcheck.launch.replay_metric import replay_chain

    entries = {int(r): ms for r, ms in spec["ranks"].items()}
    out: dict[str, Any] = {"chains": {}}
    for chain in spec["chains"]:
        members = [entries[r][key] for r, key in chain["members"]]
        if len({m["qualname"] for m in members}) > 1:   # crossed metrics: the judge names them, nothing to replay
            continue
        try:
            folders = [src.parent, *(Path(m["written_in"]) for m in members if m.get("written_in"))]
            result = replay_chain(chain, members, lambda rel, folders=folders: load(folders, rel))
        except Exception as exc:   # one metric's replay failing says nothing about the others
            result = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
        out["chains"][chain_key(chain)] = result
    tmp = dst.with_suffix(".tmp")
    tmp.write_text(json.dumps(out))
    os.replace(tmp, dst)


if __name__ == "__main__":
    main(sys.argv[1:])
