"""A c10d rendezvous whose TCP stores listen on the rendezvous address only.

torch's ``c10d`` rendezvous backend creates its ``TCPStore`` servers (the
rendezvous store, and the store it shares with the workers as
MASTER_ADDR/MASTER_PORT) with the C++ default of listening on *every*
interface (``*:PORT``), whatever host the endpoint names: a single-node
``distcheck run`` would open two ports to the network, and any peer that
reaches them can read and write the job's store. ``TCPStore`` takes no bind
address, but it does take ``master_listen_fd``: a socket we bound ourselves.
This backend binds both stores to the endpoint's address (127.0.0.1 for a
single-node run) that way, and is otherwise torch's own c10d rendezvous
(``C10dRendezvousBackend`` + ``DynamicRendezvousHandler``).

Binding ourselves also turns "port already in use" into an immediate, named
error; torch's backend would instead connect as a *client* to whatever holds
the port and wait for the rendezvous timeout.
"""

from __future__ import annotations

import datetime
import errno
import ipaddress
import socket
from typing import Any

from distcheck.errors import LaunchError

BACKEND = "distcheck-loopback"
DEFAULT_PORT = 29400


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def bound_listener(host: str, port: int) -> socket.socket:
    """A listening socket on exactly ``host:port`` (0 = any free port)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # TIME_WAIT leftovers only, not live listeners
        sock.bind((host, port))
        sock.listen(1024)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise LaunchError(
                f"the rendezvous port {host}:{port} is already in use by another process",
                "stop that process, or pick another port (leave it out to let distcheck choose a free one)",
            ) from None
        raise LaunchError(f"cannot listen on {host}:{port} for the rendezvous store: {exc.strerror}") from None
    return sock


def bound_tcp_store(host: str, port: int, timeout_s: float = 60.0) -> Any:
    """A TCPStore server that listens on ``host`` only."""
    import torch.distributed as dist

    listener = bound_listener(host, port)
    actual = listener.getsockname()[1]
    fd = listener.detach()            # the store owns the socket from here on
    try:
        return dist.TCPStore(host, actual, is_master=True, multi_tenant=True, master_listen_fd=fd,
                             wait_for_workers=False, timeout=datetime.timedelta(seconds=timeout_s))
    except BaseException:
        socket.close(fd)
        raise


def _handler_class() -> type:
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler

    class BoundRendezvousHandler(DynamicRendezvousHandler):
        """torch's handler, except that the store it shares with the workers
        (MASTER_ADDR/MASTER_PORT) also listens on the node's address only."""

        def _create_tcp_store_server(self, master_addr: str, master_port: int) -> Any:
            return bound_tcp_store(master_addr, master_port)

        def get_backend(self) -> str:
            return BACKEND

    return BoundRendezvousHandler


def create_handler(params: Any) -> Any:
    """The registry's creator for ``rdzv_backend=distcheck-loopback``."""
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler as torch_create_handler
    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

    host, port = parse_rendezvous_endpoint(params.endpoint, default_port=DEFAULT_PORT)
    store = bound_tcp_store(host, port, timeout_s=float(params.get_as_int("read_timeout", 60) or 60))
    handler = torch_create_handler(store, C10dRendezvousBackend(store, params.run_id), params)
    # Same object, one overridden method: the shared store's bind address. If a torch release
    # renames that method the override goes unused, and tests/test_faults.py (which checks
    # every listening socket of a run) fails.
    handler.__class__ = _handler_class()
    return handler


def register() -> str:
    """Make ``rdzv_backend="distcheck-loopback"`` known to torch's launcher (idempotent)."""
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    try:
        rendezvous_handler_registry.register(BACKEND, create_handler)
    except ValueError:
        pass   # already registered by this process
    return BACKEND
