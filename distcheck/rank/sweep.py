"""nccl-tests' measurement loop in torch: one collective's buffers, timed loop and result check, and the
pairwise send/recv matrix. Runs on every rank of the node check (``scenarios/comm_health.py``) and in
``benchmarks/comm_health_overhead.py``.

As nccl-tests does it: ``warmup`` calls, a barrier, ``iters`` calls timed together on the host (the
device synchronised at the end), then the inputs are set afresh, one more call is made, and its output
is compared with the values computed locally (``-c 1``): ``wrong`` counts the elements that differ,
summed over the ranks. The time is the ranks' average (nccl-tests' ``-a 1``) unless told otherwise.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from distcheck.knowledge import nccl_tests

ELEMENT_SIZE = 4        # float32, nccl-tests' default type (-d float)
TYPE_NAME = "float"
# Which placements torch offers per op: all_reduce, broadcast and reduce only work in place; torch's
# all_to_all_single and send/recv need distinct buffers.
PLACEMENTS = {
    "all_reduce": ("in",), "all_gather": ("out", "in"), "reduce_scatter": ("out", "in"),
    "broadcast": ("in",), "reduce": ("in",), "all_to_all": ("out",), "sendrecv": ("out",),
}
AVERAGE = {0: "rank 0", 1: "average", 2: "min", 3: "max"}   # nccl-tests' -a


@dataclass(frozen=True)
class Timing:
    seconds: float   # per call, over the ranks as ``average`` says
    wrong: int       # elements that differ from the expected values, summed over the ranks


@dataclass
class Call:
    """One op's buffers on this rank and how to run and check it."""

    run: Callable[[], None]
    reset: Callable[[], None]          # set the inputs afresh (the timed loop overwrote in-place buffers)
    output: Any                        # the tensor the check reads
    expected: Callable[[], Any]        # its expected values, computed locally (None: nothing to check here)


def values(rank: int, count: int, dev: Any, start: int = 0) -> Any:
    """Elements ``start`` to ``start + count`` of rank ``rank``'s input: small integers, so every sum is
    exact in float32."""
    import torch

    return (torch.arange(start, start + count, device=dev) % 13 + rank + 1).float()


def build(op: str, in_place: bool, c: nccl_tests.Counts, rank: int, n: int, dev: Any) -> Call:
    """The buffers of ``op`` at counts ``c`` (nccl-tests' GetCollByteCount) and its call."""
    import torch
    import torch.distributed as dist

    p = c.param
    if op == "all_reduce":
        buf = torch.empty(p, device=dev)
        return Call(lambda: dist.all_reduce(buf), lambda: buf.copy_(values(rank, p, dev)), buf,
                    lambda: sum(values(r, p, dev) for r in range(n)))
    if op == "all_gather":
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        out = torch.empty(p * n, device=dev)
        inp = out[rank * p:(rank + 1) * p] if in_place else torch.empty(p, device=dev)
        return Call(lambda: gather(out, inp), lambda: inp.copy_(values(rank, p, dev)), out,
                    lambda: torch.cat([values(r, p, dev) for r in range(n)]))
    if op == "reduce_scatter":
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        inp = torch.empty(p * n, device=dev)
        out = inp[rank * p:(rank + 1) * p] if in_place else torch.empty(p, device=dev)
        return Call(lambda: scatter(out, inp), lambda: inp.copy_(values(rank, p * n, dev)), out,
                    lambda: sum(values(r, p, dev, rank * p) for r in range(n)))
    if op == "broadcast":
        buf = torch.empty(p, device=dev)
        return Call(lambda: dist.broadcast(buf, src=0), lambda: buf.copy_(values(rank, p, dev)), buf,
                    lambda: values(0, p, dev))
    if op == "reduce":
        buf = torch.empty(p, device=dev)   # only the root's output is defined
        return Call(lambda: dist.reduce(buf, dst=0), lambda: buf.copy_(values(rank, p, dev)), buf,
                    lambda: sum(values(r, p, dev) for r in range(n)) if rank == 0 else None)
    if op == "all_to_all":
        inp, out = torch.empty(p * n, device=dev), torch.empty(p * n, device=dev)
        return Call(lambda: dist.all_to_all_single(out, inp), lambda: inp.copy_(values(rank, p * n, dev)), out,
                    lambda: torch.cat([values(r, p, dev, rank * p) for r in range(n)]))
    if op == "sendrecv":   # nccl-tests' ring: each rank sends to the next and receives from the previous
        send, recv = torch.empty(p, device=dev), torch.empty(p, device=dev)
        nxt, prev = (rank + 1) % n, (rank - 1) % n

        def ring() -> None:
            for work in (dist.isend(send, nxt), dist.irecv(recv, prev)):
                work.wait()

        return Call(ring, lambda: send.copy_(values(rank, p, dev)), recv, lambda: values(prev, p, dev))
    raise ValueError(f"unknown op {op!r}")


def synchronize(dev: Any) -> None:
    import torch

    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def timed_loop(run: Callable[[], None], iters: int, dev: Any) -> float:
    """Seconds per call of ``iters`` back-to-back calls (launched together, the device synced once)."""
    start = time.perf_counter()
    for _ in range(iters):
        run()
    synchronize(dev)
    return (time.perf_counter() - start) / iters


def measure(call: Call, warmup: int, iters: int, dev: Any, average: int = 1, check: bool = True) -> Timing:
    """nccl-tests' BenchTime for one op and placement: warm up, time, then check one fresh call."""
    import torch.distributed as dist

    call.reset()
    for _ in range(warmup):
        call.run()
    synchronize(dev)
    dist.barrier()
    seconds = timed_loop(call.run, iters, dev)
    wrong = _check(call, dev) if check else 0
    return Timing(_over_ranks(seconds, average, dev), int(_summed(wrong, dev)))


def _check(call: Call, dev: Any) -> int:
    call.reset()
    call.run()
    synchronize(dev)
    expected = call.expected()
    return 0 if expected is None else int((call.output != expected).sum())


def _over_ranks(seconds: float, average: int, dev: Any) -> float:
    import torch
    import torch.distributed as dist

    t = torch.tensor([seconds], dtype=torch.float64, device=dev)
    if average == 0:
        dist.broadcast(t, src=0)
        return t.item()
    op = {1: dist.ReduceOp.SUM, 2: dist.ReduceOp.MIN, 3: dist.ReduceOp.MAX}[average]
    dist.all_reduce(t, op=op)
    return t.item() / (dist.get_world_size() if average == 1 else 1)


def _summed(value: float, dev: Any) -> float:
    import torch
    import torch.distributed as dist

    t = torch.tensor([float(value)], dtype=torch.float64, device=dev)
    dist.all_reduce(t)
    return t.item()


def pair_matrix(count: int, warmup: int, iters: int, dev: Any, rounds: int = 3,
                slow_rank: int | None = None, slow_s: float = 0.0) -> dict[tuple[int, int], float]:
    """GB/s of every ordered pair's send/recv of ``count`` floats, one pair at a time (the others wait at a
    barrier), timed on the receiver. Each pair is measured ``rounds`` times, each round in a new order
    (the same on every rank), and keeps its best: a neighbour's burst of load slows one round, a slow link slows
    them all.
    ``slow_rank`` sleeps ``slow_s`` before each of its sends: fault injection, to test the slow-link finding."""
    import torch
    import torch.distributed as dist

    rank, n = dist.get_rank(), dist.get_world_size()
    buf = values(rank, count, dev)
    best = torch.zeros(n, n, dtype=torch.float64, device=dev)   # best[src, dst], filled in by dst
    pairs = [(src, dst) for src in range(n) for dst in range(n) if src != dst]
    for round_ in range(rounds):
        order = list(pairs)
        random.Random(round_).shuffle(order)   # the same order on every rank; a new one each round
        for src, dst in order:
            if rank not in (src, dst):
                dist.barrier()
                dist.barrier()
                continue
            if rank == src:
                def one() -> None:
                    if slow_rank == rank:
                        time.sleep(slow_s)
                    dist.send(buf, dst)  # noqa: B023 - one() runs in this pass only
            else:
                def one() -> None:
                    dist.recv(buf, src)  # noqa: B023
            for _ in range(warmup):
                one()
            synchronize(dev)
            dist.barrier()
            seconds = timed_loop(one, iters, dev)
            dist.barrier()
            if rank == dst:
                best[src, dst] = max(best[src, dst].item(), count * ELEMENT_SIZE / 1e9 / seconds)
    dist.all_reduce(best)   # each entry was filled in by its receiver alone
    return {(src, dst): best[src, dst].item() for src, dst in pairs}
