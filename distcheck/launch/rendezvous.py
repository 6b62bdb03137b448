"""torch's c10d rendezvous, with its TCP stores listening only where asked.

torch's ``c10d`` rendezvous backend creates its ``TCPStore`` servers (the
rendezvous store on the endpoint, and the store it shares with the workers as
MASTER_ADDR/MASTER_PORT) with the C++ default of listening on *every*
interface (``*:PORT``), whatever host the endpoint names: any peer that
reaches those ports can read and write the job's store. ``TCPStore`` takes no
bind address, but it does take ``master_listen_fd``: a socket we bound
ourselves. This backend binds the rendezvous store to the endpoint's address
and the workers' store to the node's own address (``local_addr``: 127.0.0.1
for a single-node run), and is otherwise torch's own c10d rendezvous
(``C10dRendezvousBackend`` + ``DynamicRendezvousHandler``).

Binding ourselves also turns "port already in use" into an immediate, named
error; torch's backend would instead connect as a *client* to whatever holds
the port and wait for the rendezvous timeout.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import socket
import sys
from collections.abc import Iterator
from typing import Any

from distcheck.errors import LaunchError
from distcheck.torch_features import features

BACKEND = "distcheck-c10d"
DEFAULT_PORT = 29400


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
                             wait_for_workers=False, timeout=datetime.timedelta(seconds=timeout_s),
                             use_libuv=listen_fd_backend())
    except BaseException:
        socket.close(fd)
        raise


def listen_fd_backend() -> bool:
    """``use_libuv`` for a store on a socket we bound: libuv where it takes one (torch 2.8+), else the
    legacy store (libuv, the constructor's default, raises NotImplementedError there)."""
    return features().libuv_listen_fd


# One rendezvous store per endpoint for the whole distcheck run, not one per launch (torch's
# lifetime): the store dies with the launch's handler, and in a multi-node run a node still
# closing the previous round then talks to a closed port, which a c10d client does not take
# as refused but retries for its whole timeout.
_kept_stores: dict[tuple[str, int, bool], Any] = {}


def kept_store(host: str, port: int, *, is_host: bool, timeout_s: float) -> Any:
    """This process's rendezvous store at ``host:port``: the server if it hosts it, else a client."""
    key = (host, port, is_host)
    if key not in _kept_stores:
        _kept_stores[key] = bound_tcp_store(host, port, timeout_s) if is_host else _client_store(host, port, timeout_s)
    return _kept_stores[key]


def kept_store_on_a_free_port(host: str, timeout_s: float = 60.0) -> Any:
    """A kept rendezvous store on a port the kernel picks: no window between choosing and binding."""
    store = bound_tcp_store(host, 0, timeout_s)
    _kept_stores[(host, store.port, True)] = store
    return store


def _client_store(host: str, port: int, timeout_s: float) -> Any:
    import torch.distributed as dist
    from torch.distributed.elastic.rendezvous import RendezvousConnectionError

    try:
        return dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=timeout_s))
    except (RuntimeError, ValueError, TimeoutError) as exc:
        raise RendezvousConnectionError(
            f"cannot reach the rendezvous store at {host}:{port}: {str(exc).splitlines()[0]}") from None


def _handler_class() -> type:
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler

    class BoundRendezvousHandler(DynamicRendezvousHandler):
        """torch's handler, except that the store it shares with the workers
        (MASTER_ADDR/MASTER_PORT) listens on this node's address only."""

        def _create_tcp_store_server(self, master_addr: str, master_port: int) -> Any:
            return bound_tcp_store(master_addr, master_port)

        def get_backend(self) -> str:
            return BACKEND

        def next_rendezvous(self) -> Any:
            if self._settings.max_nodes > 1:
                return super().next_rendezvous()
            with _no_join_skew():
                return super().next_rendezvous()

    return BoundRendezvousHandler


@contextlib.contextmanager
def _no_join_skew() -> Iterator[None]:
    """torch's handler sleeps a random 0-0.3 s before a node's first join, to spread many nodes' first
    requests over time; with a single node there is nothing to spread (0.15 s of every launch). Only that
    random delay goes: the handler's fixed ones (its 1 s polls) are kept."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    delay = dynamic_rendezvous._delay

    def fixed_delays_only(seconds: float | tuple[float, float]) -> None:
        if not isinstance(seconds, tuple):
            delay(seconds)

    dynamic_rendezvous._delay = fixed_delays_only
    try:
        yield
    finally:
        dynamic_rendezvous._delay = delay


def _calling_method_name(depth: int = 2) -> str:
    """torch's ``get_method_name``, without its ``inspect.stack()``: that reads the source of every frame on
    the stack to name the method behind each rendezvous event, ~50 ms a call and 9 calls a launch (0.46 s
    of every launch's start, measured on torch 2.13). The frame alone names it."""
    try:
        return sys._getframe(depth).f_code.co_name
    except ValueError:
        return "no_method_name"


def create_handler(params: Any) -> Any:
    """The registry's creator for ``rdzv_backend=distcheck-c10d``.

    ``is_host`` (default true) says whether this node hosts the rendezvous store;
    ``local_addr`` (torch's node address) is where the workers' store listens.
    """
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler as torch_create_handler
    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

    host, port = parse_rendezvous_endpoint(params.endpoint, default_port=DEFAULT_PORT)
    is_host = params.get_as_bool("is_host", True)
    store = kept_store(host, port, is_host=is_host, timeout_s=float(params.get_as_int("read_timeout", 60) or 60))
    handler = torch_create_handler(store, C10dRendezvousBackend(store, params.run_id), params)
    # Same object, one overridden method: the shared store's bind address. If a torch release
    # renames that method the override goes unused, and tests/test_faults.py (which checks
    # every listening socket of a run) fails.
    handler.__class__ = _handler_class()
    return handler


def register() -> str:
    """Make ``rdzv_backend="distcheck-c10d"`` known to torch's launcher (idempotent)."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous, rendezvous_handler_registry

    if getattr(dynamic_rendezvous, "get_method_name", None) is not None:
        dynamic_rendezvous.get_method_name = _calling_method_name
    try:
        rendezvous_handler_registry.register(BACKEND, create_handler)
    except ValueError:
        pass   # already registered by this process
    return BACKEND
