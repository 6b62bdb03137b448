"""The fix for pipeline_stage_splits_differently: every pipeline stage derives n_microbatches from the same
memory budget, so ScheduleGPipe's sends and receives pair up and the job completes."""

from distcheck import scenario


@scenario(expect="pass")
def pipeline_stages_agree(ctx):
    """One PipelineStage per rank under ScheduleGPipe, every stage with 2 microbatches of 4 rows; 3 steps."""
    from _catalogue import PIPELINE_BUDGET_ROWS, pipeline_steps

    pipeline_steps(ctx, PIPELINE_BUDGET_ROWS)
