"""A training-style job for the Slurm tests. Its rank and world come from torchrun-style variables when a
launcher set them (distcheck's per-node pattern), else from Slurm's own (srun starting every rank).

MODE: healthy (every rank in the barrier), hang (rank 0 alone in it; the others end), stuck (rank 0 alone in
it; the others wait in their own code, so only Slurm's time limit, scancel or --stall-timeout ends the job).
"""

import os
import sys
import threading

import torch.distributed as dist

mode = sys.argv[1] if len(sys.argv) > 1 else "healthy"
# In hang mode the others must not leave while rank 0 is still connecting: on a loaded node gloo then fails
# rank 0's init_process_group ("Connection closed by peer"), and the job is a crash, not this hang.
os.environ.setdefault("TORCH_DIST_INIT_BARRIER", "1")
if "RANK" in os.environ:
    dist.init_process_group("gloo")
else:
    dist.init_process_group("gloo", rank=int(os.environ["SLURM_PROCID"]), world_size=int(os.environ["SLURM_NTASKS"]))
print(f"rank {dist.get_rank()} of {dist.get_world_size()} on {os.environ.get('SLURMD_NODENAME')}", flush=True)
if mode == "healthy" or dist.get_rank() == 0:
    dist.barrier()  # BARRIER
elif mode == "stuck":
    threading.Event().wait()   # busy elsewhere for good: never enters the barrier
dist.destroy_process_group()
