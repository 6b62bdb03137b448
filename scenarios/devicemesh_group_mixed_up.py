"""A DeviceMesh group mixed up: on a (2, world / 2) mesh, one rank all-reduces its loss over "tp" where every
other rank uses "dp". The groups then wait on each other in a cycle through every rank."""

from distcheck import scenario


@scenario(expect=("order", "hang"), backends=("gloo",), min_world_size=4)
def devicemesh_group_mixed_up(ctx):
    """The last rank all-reduces its loss over the mesh's "tp" dimension; the others over "dp" (needs an even
    number of ranks)."""
    from _catalogue import mesh_steps

    mesh_steps(ctx, lambda rank: "tp" if rank == ctx.world_size - 1 else "dp")   # the bug
