"""A user's job for rule 0 (tests/test_rule0.py), run plainly and under ``distcheck run -- torchrun``.

It runs collectives, a send/recv and a batch_isend_irecv, a DataLoader pass, a torchmetrics metric
whose states are non-contiguous (torchmetrics' own ``test_non_contiguous_tensors``), and two calls that
raise the user's own exception through distcheck's hooks (a sampler's, a metric update's). Each rank
writes what it saw to RULE0_OUT/rank<N>.json: the same with and without distcheck, whatever
distcheck's hooks do.

With RULE0_BREAK=1, when distcheck traces this process, ``rule0_faults`` first breaks distcheck's
own hooks (not the program): the job must not notice.
"""

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler, Sampler
from torchmetrics import Metric

BREAK = os.environ.get("RULE0_BREAK") == "1" and "distcheck.rank.injected" in sys.modules
if BREAK:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))   # tests/, for rule0_faults
    import rule0_faults

    rule0_faults.break_before_init()


class DummyCatMetric(Metric):
    """torchmetrics' unittests/bases/test_ddp.py::_test_non_contiguous_tensors."""

    full_state_update = True

    def __init__(self) -> None:
        super().__init__()
        self.add_state("x", default=[], dist_reduce_fx=None)

    def update(self, x: torch.Tensor) -> None:
        if x is None:
            raise ValueError("the user's update needs a tensor")
        self.x.append(x)

    def compute(self) -> torch.Tensor:
        return torch.cat(self.x, dim=0).sum()


class FailingSampler(Sampler):
    """The user's sampler, whose own error must reach the user's loop unchanged."""

    def __iter__(self):
        yield dist.get_rank()   # each rank its own sample
        raise LookupError("the user's sampler ran dry")

    def __len__(self) -> int:
        return 2


def caught(fn) -> str | None:
    try:
        fn()
    except Exception as exc:   # the user's own exception, as the user sees it
        return f"{type(exc).__name__}: {exc}"
    return None


def main() -> None:
    dist.init_process_group("gloo")
    if BREAK:
        rule0_faults.break_after_init()
    rank = dist.get_rank()
    seen: dict = {}
    t = torch.arange(4.0) + rank
    dist.all_reduce(t)
    seen["all_reduce"] = t.tolist()
    gathered = [torch.zeros(2) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, torch.full((2,), float(rank)))
    seen["all_gather"] = [g.tolist() for g in gathered]
    peer = 1 - rank
    received = torch.zeros(2)
    if rank == 0:
        dist.send(torch.tensor([5.0, 6.0]), dst=peer)
    else:
        dist.recv(received, src=peer)
    seen["recv"] = received.tolist()
    batch_in = torch.zeros(3)
    requests = dist.batch_isend_irecv([dist.P2POp(dist.isend, torch.full((3,), 10.0 + rank), peer),
                                       dist.P2POp(dist.irecv, batch_in, peer)])
    for request in requests:
        request.wait()
    seen["batch_isend_irecv"] = batch_in.tolist()
    data = list(range(10))
    loader = DataLoader(data, batch_size=3, sampler=DistributedSampler(data, shuffle=False))
    seen["batches"] = [b.tolist() for b in loader]
    seen["sampler_error"] = caught(lambda: list(DataLoader(list(range(4)), sampler=FailingSampler())))

    torch.manual_seed(rank)
    metric = DummyCatMetric()
    columns = torch.randn(10, 5)
    metric.update(columns[:, 0])   # a column: strided, non-contiguous
    metric.update(columns.t()[1])
    seen["state_strides"] = [list(x.stride()) for x in metric.x]
    seen["metric"] = round(metric.compute().item(), 5)
    seen["metric_update_error"] = caught(lambda: DummyCatMetric().update(None))
    dist.barrier()
    out = Path(os.environ["RULE0_OUT"])
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{rank}.json").write_text(json.dumps(seen, sort_keys=True))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
