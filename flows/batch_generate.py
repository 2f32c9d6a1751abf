"""The Prefect flow `batch_generate(spec)`: a task per shard, retries with backoff, artifacts.

    from flows import batch_generate
    from pipeline import JobSpec
    batch_generate(JobSpec(input="s3://bucket/prompts/", output="s3://bucket/out/"),
                   storage_secret="tokenmill-s3")   # optional: a Prefect Secret block with storage options

With no Prefect server configured the flow runs against Prefect's temporary
local API. Each shard task loads the engine through `pipeline.get_llm`, once
per worker process, and reuses it for every later shard; thread workers in one
process share the engine and take turns on it. Shards are submitted to the
flow's task runner, so a distributed runner (prefect-dask's DaskTaskRunner,
RayTaskRunner) spreads them over machines without changes here (process workers
need a running Prefect server: each would otherwise start its own temporary API).

Secrets: flow parameters are stored in Prefect's database, so the flow refuses
a spec whose `storage_options` hold credentials (`key`, `secret`, `token`, ...;
JobSpec masks them in any JSON dump, so even the refused run's stored
parameters hold none). Credentials come by reference instead: the worker's
environment (`AWS_*`), or `storage_secret`, the name of a Prefect `Secret`
block whose value is a dict of storage options, loaded by the flow and by each
shard task itself (a value never travels as a parameter).

Artifacts: `tokenmill-progress` (fraction of rows done, updated as shards
finish) and `tokenmill-cost-report` (a table with the run's cost report).

This module does not use `from __future__ import annotations`: a served
deployment runs the flow in a new process that loads this file by path and
validates the parameters from JSON, and there string annotations ("JobSpec")
could not be resolved.
"""
import json
from typing import Any, Optional

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_progress_artifact, create_table_artifact, update_progress_artifact
from prefect.futures import as_completed
from prefect.tasks import exponential_backoff

from pipeline import JobSpec, ShardResult, finish_job, format_report, get_llm, prepare_job, run_shards
from pipeline.job import abort_job, engine_lock, job_device
from pipeline.planner import Shard
from pipeline.storage import secret_keys

PROGRESS_KEY = "tokenmill-progress"
REPORT_KEY = "tokenmill-cost-report"


def refuse_inline_secrets(spec: JobSpec) -> None:
    """Refuse credentials inside `spec.storage_options` (they would be stored as flow parameters).

    Raises:
        ValueError: naming the options and how to pass credentials instead.
    """
    keys = secret_keys(spec.storage_options)
    if keys:
        raise ValueError(
            f"spec.storage_options holds credentials ({', '.join(keys)}); flow parameters are stored in Prefect's "
            f"database, so the flow does not take them. Save them in a Prefect Secret block "
            f"(Secret(value={{...storage options...}}).save('NAME')) and pass storage_secret='NAME', or set AWS_* "
            f"in the worker's environment.")


def resolve_storage_secret(spec: JobSpec, storage_secret: Optional[str]) -> JobSpec:
    """The spec with the storage options of the Prefect Secret block `storage_secret` merged in (a
    dict, or a JSON object string); the spec itself when no block is named.

    Raises:
        ValueError: no such block, or its value is not a mapping of storage options.
    """
    if not storage_secret:
        return spec
    from prefect.blocks.system import Secret

    try:
        value = Secret.load(storage_secret).get()
    except ValueError as exc:
        raise ValueError(f"storage_secret {storage_secret!r}: cannot load the Secret block ({exc})") from None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            value = None
    if not isinstance(value, dict):
        raise ValueError(f"storage_secret {storage_secret!r}: the Secret's value must be a mapping of storage "
                         f"options, e.g. {{\"key\": ..., \"secret\": ...}}")
    return spec.model_copy(update={"storage_options": {**spec.storage_options, **value}})


@task(name="generate-shard", task_run_name="shard-{shard.index:05d}", retries=3,
      retry_delay_seconds=exponential_backoff(backoff_factor=5), retry_jitter_factor=0.5)
def generate_shard(spec: JobSpec, shard: Shard, run_id: str, storage_secret: Optional[str] = None,
                   columns: Optional[dict] = None, structured: Optional[bool] = None) -> dict[str, Any]:
    """Run one shard and commit its part file; returns the ShardResult as a dict.

    A retry recomputes the shard from its input rows; the commit is atomic, so
    a failed attempt leaves nothing behind.

    Args:
        storage_secret: a Prefect Secret block with storage options, loaded here (by the worker).
        columns: the output types of the id / pass-through columns (`JobPlan.columns`).
        structured: the job writes the structured-output columns (`JobPlan.structured`).
    """
    spec = resolve_storage_secret(spec, storage_secret)
    llm = get_llm(spec)
    with engine_lock(llm):
        results = list(run_shards(spec, [shard], llm, run_id=run_id, columns=columns, structured=structured))
    return results[0].to_json()


@flow(name="batch-generate", log_prints=True)
def batch_generate(spec: JobSpec, shard_retries: int = 3, retry_delay_s: float = 5.0,
                   storage_secret: Optional[str] = None) -> dict[str, Any]:
    """Run the job `spec` with a task per pending shard; returns this run's cost report (a dict).

    However the run ends, its cost is booked (status "ok", "failed" or "interrupted")
    and its lease on the output given back.

    Args:
        spec: the job (the same JobSpec as the CLI and `pipeline.run_job`), without credentials.
        shard_retries: retries per shard task.
        retry_delay_s: first retry delay; later ones double (exponential backoff, with jitter).
        storage_secret: name of a Prefect Secret block holding storage options (credentials).

    Raises:
        ValueError: credentials inside spec.storage_options, or a bad spec (see `pipeline.prepare_job`).
        pipeline.JobSpecChanged: the output holds a job with another spec (set spec.overwrite).
        pipeline.JobLocked: another run holds the output's lease.
        Any shard's error once its retries are spent; done shards stay done for a re-run.
    """
    logger = get_run_logger()
    refuse_inline_secrets(spec)
    job_spec = resolve_storage_secret(spec, storage_secret)
    plan = prepare_job(job_spec)
    results: list[ShardResult] = []
    try:
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
        futures = [shard_task.submit(spec, shard, plan.run_id, storage_secret, plan.columns, plan.structured)
                   for shard in plan.pending]
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
    except BaseException as exc:
        abort_job(plan, results, exc, model=spec.model, quantization=spec.quantization,
                  device=job_device(plan, results, look_up=False))
        raise
    plan.close()
    row = report.as_row()
    create_table_artifact(
        table=[{"metric": k, "value": v if isinstance(v, (int, float, str)) or v is None else str(v)}
               for k, v in row.items()],
        key=REPORT_KEY,
        description=f"tokenmill cost report for {spec.output} (run {plan.run_id})",
    )
    print(format_report(row))
    return row
