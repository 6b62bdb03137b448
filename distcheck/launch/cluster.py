"""Runs that span several nodes: one distcheck per node, torchrun's flags and meaning (``node_config``), and
distcheck's own coordination between the nodes (this module: the store, heartbeats, the watch channel,
the bundles and the verdict; what a node says of its ranks: ``progress_wire``).

The job itself rendezvouses through torch's own c10d rendezvous (``LaunchConfig``
with ``min_nodes = max_nodes = nnodes``). distcheck's *own* coordination —
every rank's progress for the watchdogs, the stall decision, the traces for the
final report — goes through a c10d ``TCPStore`` hosted by node 0's distcheck
(next to the rendezvous endpoint, port + 1 unless ``--store-port`` says
otherwise), under ``PrefixStore("distcheck/<rdzv id>/<launch>")``. Node 0
writes the full report; the other nodes print a pointer to it.
"""

from __future__ import annotations

import base64
import datetime
import functools
import json
import socket
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace
from typing import Any

from distcheck.errors import LaunchError
from distcheck.launch.rendezvous import bound_listener, listen_fd_backend
from distcheck.launch.node_config import NodeConfig
from distcheck.launch.progress_wire import judged_part, packed, refresh_s, unpacked
from distcheck.files.launch_dir import LaunchFiles
from distcheck.files.trace_window import window
from distcheck.torch_features import quiet_native_stderr
from distcheck.launch.progress import RankProgress
from distcheck.models import FINDING_RANK_LISTS, ScenarioResult, bounded, shorter_form

def _connect(host: str, port: int, timeout_s: float, slice_s: float = 1.0, max_slice_s: float = 4.0) -> Any:
    """A client of node 0's store, tried in short slices so that Ctrl-C is not held off
    for the whole timeout (Python runs signal handlers only between C calls). A slice that timed out is followed
    by one twice as long, up to ``max_slice_s``: when thousands of nodes connect at once, node 0's store accepts
    them in turn, and a fixed 1 s slice gave up on a connection the store was about to take, then queued again."""
    from torch.distributed import TCPStore

    deadline = time.monotonic() + timeout_s
    while True:
        attempt = max(0.1, min(slice_s, deadline - time.monotonic()))
        try:
            with quiet_native_stderr():   # c10d prints a C++ backtrace when a connection times out
                store = TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=attempt))
        except RuntimeError:
            if time.monotonic() >= deadline:
                raise
            slice_s = min(max_slice_s, slice_s * 2)
            continue
        store.set_timeout(datetime.timedelta(seconds=timeout_s))
        return store


class ClusterStore:
    """distcheck's coordination store for a multi-node run (node 0 hosts it)."""

    def __init__(self, config: NodeConfig, note: Callable[[str], None] = lambda text: None) -> None:
        from torch.distributed import TCPStore

        host, port = config.store_address
        self.config = config
        timeout = datetime.timedelta(seconds=config.rdzv_timeout)
        leader = config.node_rank == 0
        try:
            if leader:
                # Listen on the endpoint's address only, not on every interface (TCPStore's default).
                fd = bound_listener(host, port).detach()   # the store owns the socket from here on
                try:
                    self.store = TCPStore(host, port, is_master=True, wait_for_workers=False, timeout=timeout,
                                          master_listen_fd=fd, use_libuv=listen_fd_backend())
                except BaseException:
                    socket.close(fd)
                    raise
            else:
                note(f"node {config.node_rank}: waiting for node 0's distcheck at {host}:{port} "
                     f"(up to {config.rdzv_timeout:g} s)")
                self.store = _connect(host, port, config.rdzv_timeout)
                _start_heartbeat(_connect(host, port, config.rdzv_timeout), config.node_rank)
        except (RuntimeError, OSError) as exc:
            role = "host" if leader else "reach node 0's"
            raise LaunchError(
                f"node {config.node_rank} could not {role} distcheck store at {host}:{port} within "
                f"{config.rdzv_timeout:g} s: {str(exc).splitlines()[0]}",
                "start distcheck on node 0 with the same --rdzv-endpoint, and check that the port is free "
                "and reachable (or pick another with --store-port)",
            ) from None

    def launch(self, name: str, world_size: int) -> LaunchChannel:
        from torch.distributed import PrefixStore

        prefix = f"distcheck/{self.config.rdzv_id}/{name}"
        return LaunchChannel(PrefixStore(prefix, self.store), self.config, world_size, self.liveness)

    @functools.cached_property
    def liveness(self) -> NodeLiveness:
        return NodeLiveness(self.store, self.config.nnodes)


HEARTBEAT_S = 1.0
NODE0_SAYS = "node0_says"   # {"released": true, "decision": {...}}: what node 0 said to the other nodes
BUNDLED = "bundled"   # "3,5,...": the nodes whose bundle is in, one key for node 0 to read, not one per node
SILENT_AFTER_S = 10.0   # a node whose distcheck has not beaten for this long is gone
SAY_NODES = 128         # up to this many nodes, another node reads node 0's word once per poll; past it, less often


def say_every_s(nnodes: int) -> float:
    """How often another node reads what node 0 said: once per poll (its two asks share one read), then less
    often past ``SAY_NODES`` nodes (0.2 s at 512 nodes, 0.8 s at 2,048: about 2,500 requests a second to node 0's
    store either way); a node tears down at most that much later."""
    return min(1.0, 0.05 * max(1.0, nnodes / SAY_NODES))


def _start_heartbeat(store: Any, node_rank: int) -> None:
    """Every node but 0 says it is alive, on its own connection, for as long as its distcheck runs."""
    def beat() -> None:
        try:
            while True:
                store.add(f"heartbeat/{node_rank}", 1)
                time.sleep(HEARTBEAT_S)
        except RuntimeError:
            return   # node 0's store is gone: the waits of the main thread say so

    threading.Thread(target=beat, name="distcheck-heartbeat", daemon=True).start()


class NodeLiveness:
    """Node 0's view of the other nodes' heartbeats: who has gone silent."""

    def __init__(self, store: Any, nnodes: int, silent_after_s: float = SILENT_AFTER_S) -> None:
        self.store = store
        self.silent_after_s = silent_after_s
        self._seen: dict[int, tuple[int, float]] = {n: (-1, time.monotonic()) for n in range(1, nnodes)}
        self.lost: list[int] = []    # went silent before sending a launch's traces
        self._read_at, self._read = float("-inf"), set[int]()   # when the counts were last read, and whose

    def silent(self, nodes: Iterable[int]) -> list[int]:
        """Those of ``nodes`` whose heartbeat has not moved for ``silent_after_s``.

        One round trip for every node's count (``multi_get``), not one per node: at 512 nodes, a poll of
        511 ``add`` calls took longer than the poll interval itself."""
        nodes = list(nodes)
        now = time.monotonic()
        # A heartbeat moves once per HEARTBEAT_S: read more often, the counts would be the same ones.
        if now - self._read_at >= min(HEARTBEAT_S, self.silent_after_s) / 2 or not self._read.issuperset(nodes):
            for node, count in zip(nodes, self._counts(nodes)):
                if count != self._seen[node][0]:
                    self._seen[node] = (count, now)
            self._read_at, self._read = now, set(nodes)
        return [n for n in nodes if now - self._seen[n][1] > self.silent_after_s]

    def _counts(self, nodes: list[int]) -> list[int]:
        keys = [f"heartbeat/{n}" for n in nodes]
        fresh = [k for n, k in zip(nodes, keys) if self._seen[n][0] < 0]
        for key in fresh:   # a node never read yet: ``add`` creates its key, so that multi_get finds every key
            self.store.add(key, 0)
        return [int(v) for v in self.store.multi_get(keys)] if keys else []

    def arrived(self, node: int) -> bool:
        """Whether ``node``'s distcheck has beaten at least once (as of the last ``silent``): one that never did
        has not joined yet (a node started late); torch's rendezvous timeout, not silence, tells if it never will."""
        return self._seen[node][0] > 0


def wait_for_keys(store: Any, keys: list[str], timeout_s: float, poll_s: float = 0.1,
                  max_poll_s: float = 1.0) -> bool:
    """Wait until every key is set, polling: Python runs signal handlers only between C
    calls, so one long ``store.wait`` would hold off Ctrl-C for minutes (and short ones
    make c10d log a warning per timeout). The polls space out from ``poll_s`` to ``max_poll_s``: at 512
    nodes, every node asking node 0's store 10 times a second for the result took CPU from the judging."""
    from torch.distributed import DistNetworkError

    deadline = time.monotonic() + timeout_s
    try:
        while not store.check(keys):
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            time.sleep(min(poll_s, left))
            poll_s = min(max_poll_s, poll_s * 1.5)
    except DistNetworkError as exc:
        raise LaunchError(f"lost the connection to node 0's distcheck store: {str(exc).splitlines()[0]}",
                          "node 0's distcheck has probably ended; its report, if any, is in its run dir") from None
    return True


# How stale node 0's copy of a rank's measurements (memory, CPU, a late rank's progress in words) may be.
class LaunchChannel:
    """One launch's keys: progress of each node's ranks, the decision, the bundles, the result."""

    def __init__(self, store: Any, config: NodeConfig, world_size: int, liveness: NodeLiveness) -> None:
        self.store = store
        self.config = config
        self.world_size = world_size
        self.liveness = liveness
        self._gathered: list[int] = []   # the nodes whose bundles node 0 got: they wait for its result
        self._published: dict[int, RankProgress] | None = None   # the progress this node published last
        # ... less what is only measured (``progress_wire.judged_part``)
        self._judged: dict[int, RankProgress] | None = None
        self._published_at = float("-inf")
        self._versions: dict[int, int] = {}           # node 0: node -> the version of its progress last read
        self._progress: dict[int, dict[int, RankProgress]] = {}   # node 0: node -> its ranks' progress
        self._word: dict[str, Any] = {}   # node 0: what it said to the other nodes (``node0_says``)
        self._heard = False               # another node: node 0 has said something
        self._said: dict[str, Any] = {}   # another node: what node 0 said, as last read, and when
        self._said_at = float("-inf")

    @property
    def is_leader(self) -> bool:
        return self.config.node_rank == 0

    @property
    def lost_nodes(self) -> list[int]:
        """Nodes that went silent before sending this launch's traces (known on node 0 after ``gather``)."""
        return self.liveness.lost

    def publish(self, progress: Mapping[int, RankProgress]) -> None:
        """This node's ranks' progress, when it changed: its ``version`` key tells node 0 to read it again.

        What node 0 judges by goes at once; a change only in what is measured (memory, CPU, the words and
        age of a late rank's progress) goes at most every ``refresh_s``: a running rank's memory and CPU
        differ at every poll, and node 0 would read every node at every poll."""
        if progress == self._published:   # compared as objects: a node whose ranks wait costs no JSON per poll
            return
        judged = {r: judged_part(p) for r, p in progress.items()}
        if judged == self._judged and time.monotonic() - self._published_at < refresh_s(self.config.nnodes):
            return
        text = json.dumps({str(r): packed(p) for r, p in progress.items()})
        self.store.set(f"progress/{self.config.node_rank}", text)
        self.store.add(f"version/{self.config.node_rank}", 1)
        self._published, self._judged, self._published_at = dict(progress), judged, time.monotonic()

    def everyone(self, local: Mapping[int, RankProgress]) -> dict[int, RankProgress]:
        """Every rank's progress; on node 0, the ranks of a node gone silent count as dead
        (else a run whose live ranks are all idle would wait for them forever).

        Only node 0 judges the job, so only node 0 reads the other nodes: another node's watchdog sees
        its own ranks and follows node 0's decision (a release included). Node 0 reads every node's
        version in one round trip and the progress of those whose version moved in another one, so a
        poll costs what changed, not one round trip per node."""
        if not self.is_leader:
            return dict(local)
        others = [n for n in range(self.config.nnodes) if n != self.config.node_rank]
        silent = set(self.liveness.silent(others))
        self._read_changed(others)
        merged: dict[int, RankProgress] = {}
        for node in others:
            for r, p in self._progress.get(node, {}).items():
                merged[r] = replace(p, alive=False) if node in silent else p
        merged.update(local)
        if any(self.liveness.arrived(n) for n in silent):
            # A node can go silent before its watchdog published its ranks (killed right after they
            # started, its machine lost during the start). torch's rendezvous, not --node-rank, places
            # ranks on nodes, so the ranks nobody reports are the silent nodes' ones: dead too.
            merged.update({r: RankProgress(alive=False) for r in range(self.world_size) if r not in merged})
        return merged

    def _read_changed(self, nodes: list[int]) -> None:
        """Refresh ``_progress`` for the nodes whose published progress changed since the last read.

        Every node's version key is made once (``add`` of 0: a node adds 1 each time it publishes, before or
        after), so that one ``multi_get`` reads them all: asking each node not yet heard from whether it had
        published took a round trip per node and poll, 2,047 per poll at 2,048 nodes while they started."""
        for node in nodes:
            if node not in self._versions:
                self._versions[node] = 0   # 0: not published yet
                self.store.add(f"version/{node}", 0)
        seen = sorted(self._versions)
        if not seen:
            return
        versions = [int(v) for v in self.store.multi_get([f"version/{n}" for n in seen])]
        changed = [n for n, v in zip(seen, versions) if v != self._versions[n]]
        if not changed:
            return
        texts = self.store.multi_get([f"progress/{n}" for n in changed])
        for node, text in zip(changed, texts):
            self._progress[node] = {int(r): unpacked(p) for r, p in json.loads(text).items()}
        self._versions.update({n: v for n, v in zip(seen, versions) if n in changed})

    def post_release(self) -> None:
        """Node 0: every rank of the job finished; the other nodes let theirs exit."""
        self._say(released=True)

    def post_decision(self, decision: str, stall_onset: float | None, detected_at: float | None) -> None:
        self._say(decision={"decision": decision, "stall_onset": stall_onset, "detected_at": detected_at})

    def _say(self, **word: Any) -> None:
        self._word = {**self._word, **word}
        self.store.set(NODE0_SAYS, json.dumps(self._word))

    def node0_says(self) -> dict[str, Any]:
        """Another node: what node 0 said so far (``released``, ``decision``), in one round trip once it said
        anything (two keys read by every node at every poll were 10,000 requests a second to node 0's store at
        512 nodes), read at most every ``say_every_s``: a poll asks twice (released? decided?), and 2,048 nodes
        asking at every poll were 40,000 requests a second."""
        now = time.monotonic()
        if now - self._said_at < say_every_s(self.config.nnodes):
            return self._said
        self._said_at = now
        if not self._heard and not self.store.check([NODE0_SAYS]):
            return self._said
        self._heard = True
        self._said = json.loads(self.store.get(NODE0_SAYS))
        return self._said

    # -- after the launch ---------------------------------------------------

    def upload(self, files: LaunchFiles, summary: dict[str, Any]) -> None:
        """This node's ranks' files and its launch summary, for node 0's report. A long trace crosses as its
        window (``files.trace_window``: its last calls, digests of the rest); the whole one stays here."""
        node = self.config.node_rank

        def crossing(rel: str, data: bytes) -> bytes:
            return window(data, node, str(files.root / rel)) if rel.startswith("traces/") else data

        bundle = {"summary": summary, "files": {   # base64: traces are binary
            rel: base64.b64encode(crossing(rel, data)).decode("ascii") for rel, data in files.shipped_contents()}}
        _put(self.store, f"bundle/{self.config.node_rank}", json.dumps(bundle))
        self.store.append(BUNDLED, f"{self.config.node_rank},")   # node 0 reads one key to see who uploaded

    def gather(self, files: LaunchFiles, timeout_s: float) -> list[dict[str, Any]]:
        """Node 0: every other node's bundle, written into this launch's directory as it comes (the nodes
        tear down and upload at their own pace: at 512 nodes the last bundle came seconds after the first,
        and reading them all only then left node 0 idle, then busy).

        A node whose distcheck went silent (killed, its machine gone) is not waited for:
        it is added to ``liveness.lost`` and its ranks are left without traces. Nor is one that
        never arrived (Ctrl-C while the rendezvous waited for it), which is not lost.
        """
        deadline = time.monotonic() + timeout_s
        self.store.append(BUNDLED, "")   # creates the list of nodes whose bundle is in, if none has come yet
        pending = set(range(1, self.config.nnodes))
        summaries: dict[int, dict[str, Any]] = {}
        pause = 0.05
        while pending:
            arrived = sorted({int(n) for n in self.store.get(BUNDLED).decode().split(",") if n} & pending)
            summaries.update(self._take_bundles(arrived, files))
            pending.difference_update(arrived)
            waiting = sorted(pending)
            if not waiting or self.liveness.silent(waiting) == waiting:   # ``silent`` keeps the order it is given
                break
            if time.monotonic() >= deadline:
                raise LaunchError(f"node(s) {', '.join(map(str, waiting))} sent no traces within "
                                  f"{timeout_s:g} s", "check that distcheck is still running there")
            if not arrived:
                time.sleep(pause)
            pause = 0.05 if arrived else min(1.0, pause * 1.5)
        # A pending node that never beat never joined (the launch ended while it was awaited): no records are lost.
        self.liveness.lost = sorted(set(self.liveness.lost) | {n for n in pending if self.liveness.arrived(n)})
        self._gathered = sorted(summaries)
        return [summaries[n] for n in self._gathered]

    def _take_bundles(self, nodes: list[int], files: LaunchFiles) -> dict[int, dict[str, Any]]:
        """The bundles of ``nodes`` (each uploaded): their files written here (none already here is overwritten),
        their summaries. Their heads in one round trip, their parts in one per ``PARTS_PER_READ``: at 2,048 nodes
        two round trips per node, each behind every node's heartbeat and wait at node 0's store, took 15 minutes."""
        if not nodes:
            return {}
        heads = self.store.multi_get([f"bundle/{n}" for n in nodes])
        keys = [(n, _part_key(f"bundle/{n}", i))
                for n, head in zip(nodes, heads) for i in range(json.loads(head)["parts"])]
        parts: dict[int, list[bytes]] = {n: [] for n in nodes}
        for start in range(0, len(keys), PARTS_PER_READ):
            batch = keys[start:start + PARTS_PER_READ]
            for (node, _), data in zip(batch, self.store.multi_get([key for _, key in batch])):
                parts[node].append(data)
        made: set[Any] = set()
        summaries = {}
        for node in nodes:
            bundle = json.loads(b"".join(parts.pop(node)).decode("utf-8"))
            for rel, data in bundle["files"].items():
                path = files.root / rel
                if not path.exists():
                    if path.parent not in made:
                        path.parent.mkdir(parents=True, exist_ok=True)
                        made.add(path.parent)
                    path.write_bytes(base64.b64decode(data))
            summaries[node] = bundle["summary"]
        return summaries

    def post_result(self, result: ScenarioResult, timeout_s: float = 60.0) -> None:
        """Publish the verdict, then stay until every live node has read it: the store ends with node 0."""
        _put(self.store, "result", json.dumps(bounded(_for_other_nodes(result))))   # groups as runs
        wait_for_keys(self.store, [f"read/{n}" for n in self._gathered], timeout_s)
        # (a node that went away says so itself)

    def result(self, timeout_s: float) -> dict[str, Any]:
        if not wait_for_keys(self.store, ["result"], timeout_s):
            raise LaunchError(f"node 0 published no result within {timeout_s:g} s",
                              "its report may still be in its run dir")
        result = json.loads(_take(self.store, "result"))
        self.store.set(f"read/{self.config.node_rank}", "1")
        return result


# Past this many ranks the other nodes get a verdict without its per-rank tables: they print a summary and a
# pointer to node 0's report, and at 4,096 ranks the tables made the result 4.7 MB, read by each of 511 nodes
# (2.4 GB out of node 0's store at the end of the run).
RANK_TABLES_UP_TO = 64


def _for_other_nodes(result: ScenarioResult) -> dict[str, Any]:
    """The verdict as the other nodes get it; past ``RANK_TABLES_UP_TO`` ranks its tables are left out before
    it is made plain (at 4,096 ranks making them took 3 s of node 0's report, to be thrown away), and a finding's
    long rank lists go as runs. At 16,384 ranks a long-trace note's table of every group (583 KB) and a finding's
    16,383 waiting ranks made the result 689 KB, held by node 0's store for each of 2,047 readers: 1.3 GB."""
    if len(result.ranks) <= RANK_TABLES_UP_TO:
        return result.to_dict()
    result = replace(result, ranks=(), findings=tuple(
        replace(f, ranks=(), data={k: v for k, v in f.data.items() if not _table(v)}) for f in result.findings))
    d = result.to_dict()
    for finding in d["findings"]:
        for key in FINDING_RANK_LISTS:
            finding[key] = shorter_form(finding[key])
    return d


def _table(value: Any) -> bool:
    return isinstance(value, (dict, list, tuple)) and len(value) > RANK_TABLES_UP_TO


# c10d's TCPStore refuses a message over 8 MiB ("Invalid payload size"): a 512-node result was 196 MB, and a
# node's bundle of long traces passes that too. A large value goes as parts, then a head naming how many.
PART_BYTES = 4 * 1024 * 1024
# Parts node 0 reads in one round trip (at most 64 MiB; a node's bundle is a part of about 130 KB at 8 ranks).
PARTS_PER_READ = 16


def _put(store: Any, key: str, text: str) -> None:
    data = text.encode("utf-8")
    parts = max(1, -(-len(data) // PART_BYTES))
    for i in range(parts):
        store.set(_part_key(key, i), data[i * PART_BYTES:(i + 1) * PART_BYTES])
    store.set(key, json.dumps({"parts": parts}))   # last: whoever waits for ``key`` finds every part


def _take(store: Any, key: str) -> str:
    parts = json.loads(store.get(key))["parts"]
    return b"".join(store.get(_part_key(key, i)) for i in range(parts)).decode("utf-8")


def _part_key(key: str, i: int) -> str:
    """The store key of a large value's part ``i`` (``_put`` writes them, ``_take`` and node 0's gather read them)."""
    return f"{key}/part/{i}"
