"""The Prefect flow `batch_generate(spec)`: a task per shard, retries with backoff, artifacts.

    from flows import batch_generate
    from pipeline import JobSpec
    batch_generate(JobSpec(input="s3://bucket/prompts/", output="s3://bucket/out/"))

With no Prefect server configured the flow runs against Prefect's temporary
local API. Each shard task loads the engine through `pipeline.get_llm`, once
per worker process, and reuses it for every later shard; thread workers in one
process share the engine and take turns on it. Shards are submitted to the
flow's task runner, so a distributed runner (prefect-dask's DaskTaskRunner,
RayTaskRunner) spreads them over machines without changes here (process workers
need a running Prefect server: each would otherwise start its own temporary API).

Artifacts: `tokenmill-progress` (fraction of rows done, updated as shards
finish) and `tokenmill-cost-report` (a table with the run's cost report).
"""
from __future__ import annotations

from typing import Any, Optional

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_progress_artifact, create_table_artifact, update_progress_artifact
from prefect.futures import as_completed
from prefect.tasks import exponential_backoff

from pipeline import JobSpec, ShardResult, finish_job, format_report, get_llm, prepare_job, run_shards
from pipeline.job import engine_lock, job_device
from pipeline.planner import Shard

PROGRESS_KEY = "tokenmill-progress"
REPORT_KEY = "tokenmill-cost-report"


@task(name="generate-shard", task_run_name="shard-{shard.index:05d}", retries=3,
      retry_delay_seconds=exponential_backoff(backoff_factor=5), retry_jitter_factor=0.5)
def generate_shard(spec: JobSpec, shard: Shard, run_id: str) -> dict[str, Any]:
    """Run one shard and commit its part file; returns the ShardResult as a dict.

    A retry recomputes the shard from its input rows; the commit is atomic, so
    a failed attempt leaves nothing behind.
    """
    llm = get_llm(spec)
    with engine_lock(llm):
        results = list(run_shards(spec, [shard], llm, run_id=run_id))
    return results[0].to_json()


@flow(name="batch-generate", log_prints=True)
def batch_generate(spec: JobSpec, shard_retries: int = 3, retry_delay_s: float = 5.0) -> dict[str, Any]:
    """Run the job `spec` with a task per pending shard; returns this run's cost report (a dict).

    Args:
        spec: the job (the same JobSpec as the CLI and `pipeline.run_job`).
        shard_retries: retries per shard task.
        retry_delay_s: first retry delay; later ones double (exponential backoff, with jitter).

    Raises:
        pipeline.JobSpecChanged: the output holds a job with another spec (set spec.overwrite).
        Any shard's error once its retries are spent; done shards stay done for a re-run.
    """
    logger = get_run_logger()
    plan = prepare_job(spec)
    todo_rows = plan.rows_total - plan.rows_skipped
    logger.info("job %s: %d shards, %d rows; %d shards (%d rows) already done", plan.job_id, len(plan.shards),
                plan.rows_total, len(plan.shards) - len(plan.pending), plan.rows_skipped)
    progress_id = create_progress_artifact(
        progress=0.0 if todo_rows else 100.0, key=PROGRESS_KEY,
        description=f"rows done of {todo_rows} for {spec.output}")

    shard_task = generate_shard.with_options(
        retries=shard_retries,
        retry_delay_seconds=exponential_backoff(backoff_factor=retry_delay_s) if retry_delay_s > 0 else 0,
    )
    futures = [shard_task.submit(spec, shard, plan.run_id) for shard in plan.pending]
    results: list[ShardResult] = []
    done_rows = 0
    failure: Optional[BaseException] = None
    for fut in as_completed(futures):
        try:
            result = ShardResult.from_json(fut.result())
        except BaseException as exc:  # noqa: BLE001 - let the other shards finish, then fail
            failure = failure or exc
            continue
        results.append(result)
        done_rows += result.rows
        update_progress_artifact(progress_id, 100.0 * done_rows / max(todo_rows, 1))
    if failure is not None:
        raise failure

    report = finish_job(plan, results, model=spec.model, quantization=spec.quantization,
                        device=job_device(plan, results))
    row = report.as_row()
    create_table_artifact(
        table=[{"metric": k, "value": v if isinstance(v, (int, float, str)) or v is None else str(v)}
               for k, v in row.items()],
        key=REPORT_KEY,
        description=f"tokenmill cost report for {spec.output} (run {plan.run_id})",
    )
    print(format_report(row))
    return row
