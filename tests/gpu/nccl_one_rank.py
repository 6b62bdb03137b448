"""One-rank NCCL under distcheck (script mode), for a single-GPU machine.

--mode clean : all_reduce / broadcast / all_gather on cuda:0, checked; ends normally.
--mode stall : a long GPU kernel is queued before an all_reduce, then barrier() waits on the
               GPU: the rank is "inside a collective" with no progress, so distcheck's watchdog
               fires and dumps PyTorch's Flight Recorder, whose GPU-side state (last enqueued >
               last completed) must appear in the report.
"""

import argparse

import torch
import torch.distributed as dist


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=("clean", "stall"), default="clean")
    args = p.parse_args()
    dist.init_process_group("nccl")
    torch.cuda.set_device(0)
    t = torch.ones(1024, device="cuda")
    for _ in range(10):
        dist.all_reduce(t)
    torch.cuda.synchronize()
    assert torch.all(t == 1), "one-rank all_reduce must be the identity"
    dist.broadcast(t, src=0)
    out = torch.empty(1024, device="cuda")
    dist.all_gather_into_tensor(out, t)
    if args.mode == "stall":
        torch.cuda._sleep(int(1e12))       # keeps the stream busy far longer than the stall timeout
        dist.all_reduce(t)                 # enqueued, never completed while the kernel runs
        dist.barrier()                     # waits for the GPU: the rank sits inside a collective
    torch.cuda.synchronize()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
