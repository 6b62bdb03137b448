"""One rank skips gloo's monitored_barrier and goes on to the next all_reduce, while its peers wait in the
barrier (on gloo: P2P with rank 0). The rank that skipped it is the odd one out, at its all_reduce line.

At 2 ranks there is no odd one out: rank 0 waits in the barrier, rank 1 in its all_reduce, each in its
own call, and the verdict is the certain hang that names both calls (expected there)."""

from distcheck import scenario


@scenario(expect="mismatch", expect_by_world_size={2: "hang"}, backends=("gloo",))
def monitored_barrier_skipped_by_one_rank(ctx):
    """The last rank never calls dist.monitored_barrier(); the others do, then all ranks all_reduce."""
    from _catalogue import monitored_barrier_then_collectives

    monitored_barrier_then_collectives(ctx, skips=ctx.rank == ctx.world_size - 1)   # the bug
