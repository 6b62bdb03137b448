"""Runs that span several nodes: one distcheck per node, torchrun's flags and meaning.

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
import ipaddress
import json
import os
import socket
import threading
import time
from dataclasses import dataclass, fields, replace
from typing import Any, Callable, Iterable, Mapping

import psutil

from distcheck.errors import LaunchError, UsageError
from distcheck.launch.rendezvous import bound_listener, listen_fd_backend
from distcheck.launch.slurm import SlurmJob, endpoint_port, first_host_address, slurm_job, tasks_per_node
from distcheck.files.launch_dir import LaunchFiles
from distcheck.files.trace_window import window
from distcheck.torch_features import quiet_native_stderr
from distcheck.launch.progress import RankProgress
from distcheck.models import bounded, rank_runs, ranks_from_json

DEFAULT_RDZV_PORT = 29500


@dataclass(frozen=True)
class NodeConfig:
    nnodes: int = 1
    node_rank: int = 0
    rdzv_endpoint: str | None = None       # host:port of the c10d rendezvous
    rdzv_id: str | None = None
    rdzv_backend: str = "c10d"
    rdzv_timeout: float = 300.0
    store_port: int | None = None
    local_addr: str | None = None          # this node's address (torchrun's --local-addr)

    @property
    def multi(self) -> bool:
        return self.nnodes > 1

    @property
    def host(self) -> str:
        return (self.rdzv_endpoint or "127.0.0.1").rsplit(":", 1)[0]

    @property
    def port(self) -> int:
        parts = (self.rdzv_endpoint or "").rsplit(":", 1)
        return int(parts[1]) if len(parts) == 2 and parts[1] else DEFAULT_RDZV_PORT

    @property
    def store_address(self) -> tuple[str, int]:
        return self.host, self.store_port or self.port + 1


def node_config(
    nnodes: int | None, node_rank: int | None, rdzv_endpoint: str | None, rdzv_id: str | None,
    rdzv_backend: str, rdzv_timeout: float, master_addr: str | None, master_port: int | None,
    store_port: int | None, local_addr: str | None = None, env: Mapping[str, str] | None = None,
) -> NodeConfig:
    """Command-line flags first, then Slurm's environment (``launch.slurm``): one distcheck per node under
    ``srun``, whatever of --nnodes/--node-rank was left out taken from the job step."""
    env = os.environ if env is None else env
    job = slurm_job(env)
    if job is not None and (nnodes is None or node_rank is None):
        if not job.in_step and job.nnodes > 1 and nnodes is None:
            raise _batch_step_refusal(job)
        if job.in_step:
            _refuse_several_per_node(env)
            nnodes = job.nnodes if nnodes is None else nnodes
            node_rank = job.node_id if node_rank is None else node_rank
            rdzv_id = rdzv_id or f"slurm-{job.job_id}.{job.step_id}"
            if nnodes > 1 and rdzv_endpoint is None and master_addr is None:
                master_addr = env.get("MASTER_ADDR") or _first_host(job)
                master_port = master_port or _int_or_none(env.get("MASTER_PORT")) or endpoint_port(job.job_id)
    nnodes = nnodes or 1
    node_rank = node_rank or 0
    if nnodes < 1:
        raise UsageError(f"--nnodes must be at least 1 (got {nnodes})")
    if not 0 <= node_rank < nnodes:
        raise UsageError(f"--node-rank must be between 0 and {nnodes - 1} (got {node_rank})")
    if rdzv_backend != "c10d":
        # static (and etcd) would share one store between distcheck's successive launches,
        # and the workers' keys of one launch would collide with the next one's.
        raise UsageError(f"unsupported --rdzv-backend {rdzv_backend!r}: distcheck runs on torch's c10d rendezvous only",
                         "leave --rdzv-backend out (c10d)")
    if rdzv_endpoint is None and master_addr:
        rdzv_endpoint = f"{master_addr}:{master_port or DEFAULT_RDZV_PORT}"
    if nnodes > 1:
        if not rdzv_endpoint:
            raise UsageError("a multi-node run needs --rdzv-endpoint HOST:PORT (or --master-addr)",
                             "give every node the same endpoint: the host of node 0")
        if not rdzv_id:
            raise UsageError("a multi-node run needs --rdzv-id", "give every node the same id, e.g. the job id")
    return NodeConfig(nnodes=nnodes, node_rank=node_rank, rdzv_endpoint=rdzv_endpoint, rdzv_id=rdzv_id,
                      rdzv_backend=rdzv_backend, rdzv_timeout=rdzv_timeout, store_port=store_port,
                      local_addr=local_addr)


def _batch_step_refusal(job: SlurmJob) -> UsageError:
    """The batch step of a multi-node job is one process on its first node: it would see only that node's ranks."""
    return UsageError(
        f"this is the batch step of Slurm job {job.job_id} on {job.nnodes} nodes ({job.nodelist}): "
        "one distcheck here sees only the first node's ranks",
        f"run one distcheck per node from the batch script: srun -N {job.nnodes} --ntasks-per-node=1 "
        "distcheck run train.py --nproc-per-node N (or --nnodes 1 to watch this node only)")


def _refuse_several_per_node(env: Mapping[str, str]) -> None:
    per_node = tasks_per_node(env)
    if per_node is not None and per_node > 1:
        raise UsageError(f"srun started {per_node} distchecks per node: distcheck starts the ranks of its node itself",
                         "srun --ntasks-per-node=1 distcheck run ... --nproc-per-node N, or distcheck run -- srun ...")


def _first_host(job: SlurmJob) -> str:
    try:
        return first_host_address(job.nodelist)
    except ValueError:
        raise UsageError(f"Slurm job {job.job_id} has no node list (SLURM_JOB_NODELIST)",
                         "give every node --rdzv-endpoint HOST:PORT") from None


def _int_or_none(text: str | None) -> int | None:
    return int(text) if text and text.isdigit() else None


def node_address(config: NodeConfig) -> str:
    """Where this node's stores listen and what it tells the other nodes to connect to:
    ``--local-addr``, else the address this node reaches the rendezvous endpoint from."""
    if config.local_addr:
        return config.local_addr
    if not config.multi:
        return "127.0.0.1"
    family, _, _, _, address = _resolve(config.host)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect(address)       # UDP: picks the route, sends nothing
        return probe.getsockname()[0]


def check_endpoint_address(config: NodeConfig, resolve: Callable[[str], list[str]] | None = None) -> None:
    """Node 0 listens on the endpoint's address only: refuse one the other nodes cannot reach.

    The classic case is a host name that /etc/hosts maps to 127.0.1.1 on its own machine;
    torch's stores, listening on every interface, hide it, ours would not be reachable.
    """
    host = config.host
    if not config.multi or config.node_rank != 0 or host == "localhost" or _is_ip_literal(host):
        return
    resolved = sorted(set((resolve or _addresses)(host)))
    if all(_is_loopback(a) for a in resolved):
        mine = [a.address for addrs in psutil.net_if_addrs().values() for a in addrs
                if a.family in (socket.AF_INET, socket.AF_INET6) and not _is_loopback(a.address)
                and not a.address.startswith("fe80")]
        raise LaunchError(
            f"the rendezvous host {host!r} resolves to {', '.join(resolved)} on node 0, which the other nodes "
            f"cannot reach (distcheck listens on the endpoint's address only)",
            "give --rdzv-endpoint as an address of this node that the others reach"
            + (f" ({', '.join(mine)})" if mine else ""))


def gloo_interface(address: str) -> str | None:
    """The network interface that holds ``address`` (for GLOO_SOCKET_IFNAME), if any."""
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address.split("%")[0] == address for a in addrs):
            return name
    return None


def _is_ip_literal(host: str) -> bool:
    try:
        ipaddress.ip_address(host.strip("[]"))
        return True
    except ValueError:
        return False


def _is_loopback(address: str) -> bool:
    return ipaddress.ip_address(address.split("%")[0]).is_loopback


def _addresses(host: str) -> list[str]:
    return [info[4][0] for info in _resolve(host)]


def _resolve(host: str) -> list[tuple]:
    try:
        return socket.getaddrinfo(host.strip("[]"), 9, type=socket.SOCK_DGRAM)
    except socket.gaierror as exc:
        raise LaunchError(f"cannot resolve the rendezvous host {host!r}: {exc.strerror}",
                          "check --rdzv-endpoint (or --master-addr / MASTER_ADDR)") from None


def _connect(host: str, port: int, timeout_s: float, slice_s: float = 1.0) -> Any:
    """A client of node 0's store, tried in short slices so that Ctrl-C is not held off
    for the whole timeout (Python runs signal handlers only between C calls)."""
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
        self._read_at, self._read = float("-inf"), set()   # when the counts were last read, and whose

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
REFRESH_S = 1.0
REFRESH_NODES = 64   # up to this many nodes, every REFRESH_S; past it, as much less often as there are more


def refresh_s(nnodes: int) -> float:
    """How often a node sends what is only measured: every REFRESH_S up to REFRESH_NODES nodes, then less often
    (8 s at 512 nodes), so that node 0 reads about as many refreshes per poll as at 64 nodes, not 51 of them."""
    return REFRESH_S * max(1.0, nnodes / REFRESH_NODES)


def _judged(progress: RankProgress) -> RankProgress:
    """``progress`` less what changes at every poll without changing a verdict: memory, CPU, and the words
    and age of a late rank's progress (whether it shows progress at all stays)."""
    return replace(progress, rss_bytes=None, peak_rss_bytes=None, cpu=None, evidence_age=0.0,
                   evidence=None if progress.evidence is None else "")


def _packed(progress: RankProgress) -> dict[str, Any]:
    """A rank's progress as JSON, each call's members as runs ([[0, 4095]]): a waiting rank's members are the
    whole group, and at 4,096 ranks their plain lists made a node's progress 190 KB (97 MB per change at 512
    nodes, 2 s to parse on node 0); as runs it is a few hundred bytes.

    Field by field, not ``dataclasses.asdict``: that deep-copies each member of each call, 29 ms per waiting
    rank at 4,096 ranks, and at 512 nodes sharing two cores it made a node's poll take tens of seconds."""
    data = {f.name: getattr(progress, f.name) for f in fields(progress)}
    data["entered"] = dict(progress.entered)
    data["waits"] = [[group, seq, _runs(members), signature] for group, seq, members, signature in progress.waits]
    data["left"] = _left_runs(progress.left)
    return data


def _left_runs(left: tuple) -> list[list[Any]]:
    """The calls a rank left, ``(group, seq, signature)`` each, as ``[group, first seq, last seq, signature]``
    runs of one signature: a rank keeps its last 32, most of them one step's same call, and at 512 nodes
    they were most of what a node publishes (15 KB for 8 waiting ranks, 3.7 MB for node 0 to read when half
    the job entered the hang at once)."""
    out: list[list[Any]] = []
    for group, seq, signature in left:
        last = out[-1] if out else None
        if last is not None and last[0] == group and last[2] + 1 == seq and last[3] == signature:
            last[2] = seq
        else:
            out.append([group, seq, seq, signature])
    return out


def _left_of(runs: list[list[Any]]) -> tuple:
    return tuple((group, seq, signature) for group, first, last, signature in runs for seq in range(first, last + 1))


@functools.lru_cache(maxsize=64)
def _runs(members: tuple[int, ...]) -> list[list[int]] | Any:
    """One call's members as runs, computed once per call (every rank of a node waiting in it shares them)."""
    return rank_runs(members)


def _unpacked(data: dict[str, Any]) -> RankProgress:
    waits = tuple((group, seq, _members(tuple(map(tuple, runs))), signature)
                  for group, seq, runs, signature in data.get("waits", ()))
    left = _left_of(data.get("left", ()))
    return RankProgress(**{**data, "waits": waits, "left": left})


@functools.lru_cache(maxsize=1024)
def _members(runs: tuple[tuple[int, int], ...]) -> tuple[int, ...]:
    """A call's members from their runs, one tuple shared by every rank in the call: at 4,096 ranks waiting
    in one barrier, a tuple each was 16 M entries (about 0.6 GB and seconds of node 0's poll)."""
    return ranks_from_json(runs)


class LaunchChannel:
    """One launch's keys: progress of each node's ranks, the decision, the bundles, the result."""

    def __init__(self, store: Any, config: NodeConfig, world_size: int, liveness: NodeLiveness) -> None:
        self.store = store
        self.config = config
        self.world_size = world_size
        self.liveness = liveness
        self._gathered: list[int] = []   # the nodes whose bundles node 0 got: they wait for its result
        self._published: dict[int, RankProgress] | None = None   # the progress this node published last
        self._judged: dict[int, RankProgress] | None = None      # ... less what is only measured (``_judged``)
        self._published_at = float("-inf")
        self._versions: dict[int, int] = {}           # node 0: node -> the version of its progress last read
        self._progress: dict[int, dict[int, RankProgress]] = {}   # node 0: node -> its ranks' progress
        self._word: dict[str, Any] = {}   # node 0: what it said to the other nodes (``node0_says``)
        self._heard = False               # another node: node 0 has said something

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
        judged = {r: _judged(p) for r, p in progress.items()}
        if judged == self._judged and time.monotonic() - self._published_at < refresh_s(self.config.nnodes):
            return
        text = json.dumps({str(r): _packed(p) for r, p in progress.items()})
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
        """Refresh ``_progress`` for the nodes whose published progress changed since the last read."""
        for node in nodes:
            if node not in self._versions and self.store.check([f"progress/{node}"]):
                self.store.add(f"version/{node}", 0)   # published: from now on its version says when it changes
                self._versions[node] = -1
        seen = sorted(self._versions)
        if not seen:
            return
        versions = [int(v) for v in self.store.multi_get([f"version/{n}" for n in seen])]
        changed = [n for n, v in zip(seen, versions) if v != self._versions[n]]
        if not changed:
            return
        texts = self.store.multi_get([f"progress/{n}" for n in changed])
        for node, text in zip(changed, texts):
            self._progress[node] = {int(r): _unpacked(p) for r, p in json.loads(text).items()}
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
        """Another node: what node 0 said so far (``released``, ``decision``), in one round trip per poll
        once it said anything (two keys read by every node at every poll were 10,000 requests a second to
        node 0's store at 512 nodes)."""
        if not self._heard and not self.store.check([NODE0_SAYS]):
            return {}
        self._heard = True
        return json.loads(self.store.get(NODE0_SAYS))

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
            for node in arrived:
                summaries[node] = self._take_bundle(node, files)
                pending.discard(node)
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

    def _take_bundle(self, node: int, files: LaunchFiles) -> dict[str, Any]:
        """One node's bundle: its files written here (none already here is overwritten), its summary."""
        bundle = json.loads(_take(self.store, f"bundle/{node}"))
        for rel, data in bundle["files"].items():
            path = files.root / rel
            if not path.exists():
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(base64.b64decode(data))
        return bundle["summary"]

    def post_result(self, result: dict[str, Any], timeout_s: float = 60.0) -> None:
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


def _for_other_nodes(result: dict[str, Any]) -> dict[str, Any]:
    if len(result.get("ranks", ())) <= RANK_TABLES_UP_TO:
        return result
    findings = [{**f, "ranks": []} for f in result.get("findings", ())]
    return {**result, "ranks": [], "findings": findings}


# c10d's TCPStore refuses a message over 8 MiB ("Invalid payload size"): a 512-node result was 196 MB, and a
# node's bundle of long traces passes that too. A large value goes as parts, then a head naming how many.
PART_BYTES = 4 * 1024 * 1024


def _put(store: Any, key: str, text: str) -> None:
    data = text.encode("utf-8")
    parts = max(1, -(-len(data) // PART_BYTES))
    for i in range(parts):
        store.set(f"{key}/part/{i}", data[i * PART_BYTES:(i + 1) * PART_BYTES])
    store.set(key, json.dumps({"parts": parts}))   # last: whoever waits for ``key`` finds every part


def _take(store: Any, key: str) -> str:
    parts = json.loads(store.get(key))["parts"]
    return b"".join(store.get(f"{key}/part/{i}") for i in range(parts)).decode("utf-8")
