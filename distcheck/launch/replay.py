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
job's memory standing: ``python -m distcheck.launch.replay``, one per distcheck run, kept for
the launches after the first (a command's generations each have a replay, and the process's start,
torch and torchmetrics loaded, is ~2.5 s of CPU), and started anew after one that failed. It runs after
the launch is collected and before judging starts (``targets.launching``); its answer goes into the
judging as a fact (``RunFacts.metric_reference``), and is kept as ``metrics/replay-out.json`` for
``distcheck analyze``; the pure rule that judges it is ``diagnose.metrics``.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from distcheck.files.launch_dir import LaunchFiles
from distcheck.launch import memory, procs
from distcheck.files.metric_records import REPLAY_IN, REPLAY_OUT, chain_key, chains, entries_by_rank, joint_computes

REPLAY_TIMEOUT_S = 120.0
# The launch's rendezvous: the replay must never find (or join) the job's process group.
_LAUNCH_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK")


def metric_reference(results: Mapping[int, Mapping[str, Any]], launch_dir: Path,
                     timeout_s: float = REPLAY_TIMEOUT_S) -> dict[str, Any] | None:
    """The replay's answer for the metrics the ranks recorded in ``results`` (None: they recorded none)."""
    recorded = entries_by_rank(results)
    if not recorded:
        return None
    planned = chains(joint_computes({r: list(ms.values()) for r, ms in recorded.items()}))
    sys_path = next(res.get("metrics_sys_path") or [] for res in results.values() if res.get("metrics"))
    folder = LaunchFiles(launch_dir).metrics_dir
    src, dst = folder / REPLAY_IN, folder / REPLAY_OUT
    src.parent.mkdir(parents=True, exist_ok=True)
    src.write_text(json.dumps({"ranks": {str(r): ms for r, ms in recorded.items()}, "sys_path": sys_path,
                               "chains": planned}))
    return _run(src, dst, timeout_s) if planned else {"chains": {}}


def _run(src: Path, dst: Path, timeout_s: float) -> dict[str, Any]:
    try:
        _REPLAYER.replay(src, dst, timeout_s)
    except subprocess.TimeoutExpired:
        return {"error": f"the single-process replay took more than {timeout_s:g} s and was stopped"}
    except ReplayFailed as exc:
        return {"error": f"the single-process replay failed: {str(exc)[:300]}"}
    try:
        return json.loads(dst.read_text())
    except (OSError, ValueError):
        return {"error": "the single-process replay failed: it wrote no answer"}


class ReplayFailed(Exception):
    """The replay process ended or answered with an error; the message is its last words."""


class Replayer:
    """The replay process of this distcheck run: started on first use, asked one launch's replay at a time
    (``IN<TAB>OUT`` on its stdin, a line back when done), and ended after a timeout or a crash so that the
    next launch gets a fresh one."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen | None = None
        self._stderr: Any = None

    def replay(self, src: Path, dst: Path, timeout_s: float) -> None:
        proc = self._proc if self._proc is not None and self._proc.poll() is None else self._start()
        assert proc.stdin is not None   # started with stdin=PIPE
        try:
            proc.stdin.write(f"{src}\t{dst}\n")
            proc.stdin.flush()
            answer = self._answer(proc, timeout_s)
        except BrokenPipeError:
            answer = ""
        except subprocess.TimeoutExpired:
            self.close()   # still inside the user's update() or compute(): the next launch gets a fresh one
            raise
        if answer.startswith("ok"):
            return
        why = answer[len("error "):].strip() if answer.startswith("error ") else self._last_words(proc)
        self.close()
        raise ReplayFailed(why)

    def _start(self) -> subprocess.Popen:
        import tempfile

        self.close()
        env = {k: v for k, v in {**os.environ, **memory.job_standing_env()}.items() if k not in _LAUNCH_ENV}
        env.pop("DISTCHECK_LAUNCH_DIR", None)   # the replay is not a rank of the user's command
        self._stderr = tempfile.TemporaryFile(mode="w+", encoding="utf-8", errors="replace")  # noqa: SIM115 - close() closes it
        self._proc = subprocess.Popen([sys.executable, "-m", "distcheck.launch.replay"], env=env,
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr, text=True)
        procs.keep(self._proc.pid)   # a launch's teardown ends the ranks' processes, not this one
        return self._proc

    @staticmethod
    def _answer(proc: subprocess.Popen, timeout_s: float) -> str:
        import selectors

        assert proc.stdout is not None   # started with stdout=PIPE
        with selectors.DefaultSelector() as sel:
            sel.register(proc.stdout, selectors.EVENT_READ)
            if not sel.select(timeout_s):
                raise subprocess.TimeoutExpired(proc.args, timeout_s)
        return proc.stdout.readline()

    def _last_words(self, proc: subprocess.Popen) -> str:
        self._stderr.seek(0)
        lines = self._stderr.read().strip().splitlines()
        return lines[-1] if lines else f"exit code {proc.returncode}"

    def close(self) -> None:
        if self._proc is not None:
            if self._proc.poll() is None:
                self._proc.kill()
            self._proc.wait()
            for stream in (self._proc.stdin, self._proc.stdout, self._stderr):
                if stream is not None:   # each was opened with the process
                    stream.close()
            self._proc = None


_REPLAYER = Replayer()


# -- inside the replay process ----------------------------------------------------------------


def load(folders: list[Path], rel: str) -> Any:
    """A recorded copy or chunk (pickled by value where the class is the user's: nothing of theirs runs),
    from the first of ``folders`` that has it."""
    path = next((f / rel for f in folders if (f / rel).is_file()), folders[0] / rel)
    with open(path, "rb") as f:
        return pickle.load(f)


def serve() -> None:
    """Answer replay requests (``IN<TAB>OUT`` lines) until stdin closes: distcheck ended."""
    from distcheck.rank.oom_standing import take_job_standing

    take_job_standing()
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)   # what the user's update() and compute() print goes with the errors, not into the answers
    for line in sys.stdin:
        src, dst = line.rstrip("\n").split("\t")
        try:
            replay_file(Path(src), Path(dst))
            answer = "ok"
        except Exception as exc:
            answer = f"error {type(exc).__name__}: {exc}".splitlines()[0]
        sys.stdout.flush()
        answers.write(answer + "\n")
        answers.flush()


def replay_file(src: Path, dst: Path) -> None:
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
            def loaded(rel: str, folders: list[Path] = folders) -> Any:
                return load(folders, rel)
            result = replay_chain(chain, members, loaded)
        except Exception as exc:   # one metric's replay failing says nothing about the others
            result = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
        out["chains"][chain_key(chain)] = result
    tmp = dst.with_suffix(".tmp")
    tmp.write_text(json.dumps(out))
    os.replace(tmp, dst)


if __name__ == "__main__":
    serve()
