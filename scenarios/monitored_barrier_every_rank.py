"""The fix for monitored_barrier_skipped_by_one_rank: every rank calls gloo's monitored_barrier, the last one
late (busy for a second). gloo implements it as P2P with rank 0, so the group's counter moves by different
amounts on different ranks; the collectives after it must still line up, and the job is clean."""

from distcheck import scenario


@scenario(expect="pass", backends=("gloo",))
def monitored_barrier_every_rank(ctx):
    """Every rank calls dist.monitored_barrier() between two steps (the last one a second late), then an
    all_reduce, a broadcast, another all_reduce and a barrier."""
    import time

    from _catalogue import monitored_barrier_then_collectives

    if ctx.rank == ctx.world_size - 1:
        deadline = time.monotonic() + 1.0
        n = 0
        while time.monotonic() < deadline:   # late, and busy: not stuck
            n = (n * 31 + 7) % 1_000_003
    monitored_barrier_then_collectives(ctx, skips=False)
