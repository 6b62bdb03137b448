"""Where a multi-node run meets: ``NodeConfig`` from torchrun's flags or Slurm's variables (``launch.slurm``),
the rendezvous endpoint checked before any launch, and the address a node's stores and gloo listen on."""

from __future__ import annotations

import errno
import ipaddress
import os
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import psutil

from distcheck.errors import LaunchError, UsageError
from distcheck.launch.slurm import SlurmJob, endpoint_port, first_host_address, slurm_job, tasks_per_node

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
    port_from_job: str | None = None       # the Slurm job whose id the endpoint's port was derived from

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
    port_from_job = None
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
                master_port = master_port or _int_or_none(env.get("MASTER_PORT"))
                port_from_job = None if master_port else job.job_id
                master_port = master_port or endpoint_port(job.job_id)
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
                      local_addr=local_addr, port_from_job=port_from_job)


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
    if not config.multi or config.node_rank != 0:
        return
    _check_ports_free(config)
    if host == "localhost" or _is_ip_literal(host):
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


def _check_ports_free(config: NodeConfig) -> None:
    """Node 0 hosts the rendezvous store on the endpoint's port and distcheck's store on the next (or --store-port):
    one already taken is named before anything starts, with the way to choose another."""
    for port in (config.port, config.store_address[1]):
        family = socket.AF_INET6 if ":" in config.host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # TIME_WAIT leftovers are no owner
            try:
                probe.bind((config.host.strip("[]"), port))
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    which = "the rendezvous port" if port == config.port else "distcheck's store port"
                    raise LaunchError(f"{which} {config.host}:{port} is already in use by another process",
                                      _port_hint(config, port)) from None
                return   # not this node's address, or a name: check_endpoint_address and the launch say so


def _port_hint(config: NodeConfig, port: int) -> str:
    store = " (distcheck's store takes the next port)" if port != config.port else ""
    if config.port_from_job is not None:
        return (f"the rendezvous port {config.port} is derived from Slurm job {config.port_from_job}'s id{store}; "
                f"another program or job holds {port}: give every node another with --rdzv-endpoint "
                f"{config.host}:PORT (or export MASTER_PORT in the batch script)")
    return (f"stop the program that holds it, or give every node another --rdzv-endpoint {config.host}:PORT"
            + (" or --store-port" if store else ""))


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
