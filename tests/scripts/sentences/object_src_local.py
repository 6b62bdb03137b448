"""A broadcast_object_list given a group-local source: every pair of ranks shares a config from its
first member with ``src=0``, but ``src`` is a global rank. Ranks 0 and 1 (group [0, 1]) broadcast
fine; ranks 2 and 3 (group [2, 3]) both raise the same ValueError (global rank 0 is not in their
group), and ranks 0 and 1 then fail in the next world all_reduce ("Connection closed by peer")."""
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
pairs = [dist.new_group([r, r + 1]) for r in range(0, world, 2)]
mine = pairs[rank // 2]
config = [{"lr": 0.1, "pair": rank // 2} if rank % 2 == 0 else None]
dist.broadcast_object_list(config, src=0, group=mine)   # the bug: src is global; group_src=0 was meant
total = torch.tensor([float(config[0]["pair"])])
dist.all_reduce(total)
print("total", total.item())
dist.destroy_process_group()
