"""A scenario this run's rank count cannot hold: skipped, so nothing runs."""
import distcheck


@distcheck.scenario(min_world_size=8)
def needs_eight(ctx):
    ctx.all_reduce_ones()
