"""An early-stopping decision taken on a loss whose async all_reduce only rank 0 waited on: rank 1 reads its
own, unreduced value and goes on to another call than rank 0's."""

import torch
import torch.distributed as dist


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    loss = torch.tensor([float(rank)])
    work = dist.all_reduce(loss, async_op=True)   # ASYNC
    if rank == 0:
        work.wait()
        stop = loss.item() > 0.5    # the reduced loss: 1.0
    else:
        stop = False                # what rank 1's unreduced loss (0.0) says, read before any wait
    if stop:
        dist.barrier()              # STOP
    else:
        dist.all_reduce(torch.ones(3))   # GO ON
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
