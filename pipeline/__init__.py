"""The batch job: Parquet prompts in (any fsspec URL), generations and a cost report out.

    from pipeline import JobSpec, run_job
    report = run_job(JobSpec(input="s3://bucket/prompts/", output="s3://bucket/out/"))

`pipeline` imports `engine`, never `prefect`; the Prefect flow lives in `flows/`.
"""
from pipeline.startup import interrupts_end_the_command

with interrupts_end_the_command():  # a Ctrl-C while torch etc. load: the command's one line, not a traceback
    from pipeline.cost import CostReport, TokenCounts, cost_report, format_report
    from pipeline.bookkeeping import JobInterrupted, abort_job, booked_report, finish_job, read_metrics
    from pipeline.engines import WindowRun, cache_llm, get_llm, run_shards, run_window
    from pipeline.job import prepare_job, run_job
    from pipeline.manifest import ShardResult
    from pipeline.plan import JobPlan, done_shards, plan_windows
    from pipeline.spec import JobSpec, JobSpecChanged, validate_spec
    from pipeline.lease import JobLocked, LeaseLost
    from pipeline.storage import StorageError

__all__ = [
    "CostReport", "JobInterrupted", "JobLocked", "JobPlan", "JobSpec", "JobSpecChanged", "LeaseLost", "ShardResult",
    "StorageError", "TokenCounts", "WindowRun", "abort_job", "booked_report", "cache_llm", "cost_report", "done_shards", "finish_job",
    "format_report", "get_llm", "plan_windows", "prepare_job", "read_metrics", "run_job", "run_shards", "run_window",
    "validate_spec",
]
