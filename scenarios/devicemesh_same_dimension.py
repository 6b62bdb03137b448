"""The fix for devicemesh_group_mixed_up: every rank all-reduces its loss over the same mesh dimension."""

from distcheck import scenario


@scenario(expect="pass", backends=("gloo",), min_world_size=4)
def devicemesh_same_dimension(ctx):
    """Every rank all-reduces its loss over "dp", then its activations over "tp" (needs an even number of ranks)."""
    from _catalogue import mesh_steps

    mesh_steps(ctx, lambda rank: "dp")
