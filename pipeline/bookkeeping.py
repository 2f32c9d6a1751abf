"""A run's bookkeeping: its cost report, booked as one Parquet row under `OUTPUT/_job/runs/` however the
run ends (`finish_job`, `abort_job`), and read back for `tokenmill report` (`read_metrics`).
"""
from __future__ import annotations

import contextlib
import json
import warnings
from datetime import datetime, timezone
from typing import Any, Optional

import polars as pl

from pipeline import io, manifest
from pipeline.cost import CostReport, TokenCounts, cost_report
from pipeline.manifest import ShardResult
from pipeline.openai_batch import request_counts
from pipeline.plan import JobPlan, done_shards
from pipeline.storage import StorageError, quick_options, storage_call


RUNS_DIR = "runs"  # OUTPUT/_job/runs/run-<started>-<run_id>.parquet: one cost row per run


LEGACY_METRICS = "metrics.parquet"  # one file with every run's row (jobs written before the runs/ folder)


class JobInterrupted(KeyboardInterrupt):
    """The run was interrupted (Ctrl-C, SIGTERM); its cost is booked and the shards done are kept.

    Attributes:
        shards_done: shards committed, this run and earlier ones.
        shards_total: shards in the job; None when the run was interrupted while it was being
            prepared (planned), before it knew them.
        signum: the signal that interrupted it (SIGINT for a plain KeyboardInterrupt).
        report: the run's partial cost report as booked under `_job/runs/` (status "interrupted":
            the wall time so far, the rows and tokens of the shards it committed, the output
            tokens it discarded), or None when it could not be booked.
        when: where the run stopped, for messages: "after 1 of 4 shards", or "while preparing
            the job, before any shard ran".
    """

    def __init__(self, shards_done: int, shards_total: Optional[int], signum: int,
                 report: Optional[CostReport] = None) -> None:
        self.when = (f"after {shards_done} of {shards_total} shards" if shards_total is not None
                     else "while preparing the job, before any shard ran")
        super().__init__(f"interrupted {self.when}")
        self.shards_done, self.shards_total, self.signum = shards_done, shards_total, signum
        self.report = report


def finish_job(plan: JobPlan, results: list[ShardResult], *, model: str, quantization: Optional[str],
               device: str, status: str = "ok", error: Optional[str] = None,
               discarded_completion_tokens: int = 0,
               storage_options: Optional[dict[str, Any]] = None,
               engine_steps: Optional[dict] = None, device_count: Optional[int] = None) -> CostReport:
    """Build this run's cost report and book it: one Parquet row under `_job/runs/` (one put, so a
    failing or interrupted run can book its cost too).

    Args:
        results: the shards this run committed (their rows and tokens are the report's counts; the
            plan's pending shards not among them are the report's `rows_not_run`).
        status: "ok", "failed" or "interrupted".
        error: for a failed run, what failed (one line).
        discarded_completion_tokens: output tokens generated for shards that were not committed.
        storage_options: options for the write (default: the spec's).
        engine_steps: the engine's step counters over the run (see `cost.cost_report`).
        device_count: devices the run held (default `spec.devices()`; the flow on a cluster
            passes the number of workers that ran its shards).

    Raises:
        StorageError: the row could not be written.
    """
    spec = plan.spec
    counts = TokenCounts()
    for r in results:
        counts = counts + r.counts
    committed = {r.index for r in results}
    rows_not_run = sum(s.length for s in plan.pending if s.index not in committed)
    report = cost_report(
        job_id=plan.job_id, run_id=plan.run_id, model=model, quantization=quantization, device=device,
        device_count=device_count or spec.devices(), started_at=plan.started_at,
        finished_at=datetime.now(timezone.utc),
        price_per_device_hour=spec.price_per_hour, counts=counts, rows_total=plan.rows_total,
        rows_skipped=plan.rows_skipped, rows_not_run=rows_not_run, output_token_weight=spec.output_token_weight,
        ideal_prefix_hit_rate=plan.stats.ideal_hit_rate, plan=plan.stats.order, status=status, error=error,
        discarded_completion_tokens=discarded_completion_tokens, engine_steps=engine_steps,
        structured=plan.structured, dtype=plan.dtype or spec.dtype, host=_host_line(),
    )
    if spec.output_format is not None and spec.id_column == "custom_id":  # a job over request files
        done = plan.done_before + counts
        report.request_counts = json.dumps(request_counts(plan.rows_total, done.rows_ok, done.rows_error))
    name = f"run-{plan.started_at.strftime('%Y%m%dT%H%M%S%fZ')}-{plan.run_id}.parquet"
    io.write_parquet_atomic(report.as_frame(), manifest.job_url(spec.output, RUNS_DIR, name),
                            storage_options if storage_options is not None else spec.storage_options)
    return report


def _host_line() -> str:
    """This process's host (`engine.host.describe`): the CPU a run's figures were measured on."""
    from engine.host import describe

    return describe()


def abort_job(plan: JobPlan, results: list[ShardResult], exc: BaseException, *, model: str,
              quantization: Optional[str], device: str, discarded_completion_tokens: int = 0,
              device_count: Optional[int] = None, interrupted: bool = False) -> Optional[CostReport]:
    """Book the cost of a run that ended with `exc` (status "interrupted" for KeyboardInterrupt and its
    subclasses, or with `interrupted`, else "failed") and give the lease back. After a storage failure
    both use short timeouts. Never raises: a row that cannot be booked is reported as a warning. The
    booked report goes with `exc` (`booked_report(exc)`), so whoever catches what the caller re-raises
    (the CLI) can show it.

    Args:
        interrupted: `exc` stopped the run as a signal does without being a KeyboardInterrupt (Prefect's
            TerminationSignal, raised in a flow run on SIGTERM): booked "interrupted", as Ctrl-C is.

    Returns:
        The booked report, or None when it could not be written.
    """
    so = plan.spec.storage_options
    quick = isinstance(exc, StorageError) and exc.endpoint_failed
    status = "interrupted" if interrupted or isinstance(exc, KeyboardInterrupt) else "failed"
    error = None if status == "interrupted" else (str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
    report = None
    try:
        report = finish_job(plan, results, model=model, quantization=quantization, device=device, status=status,
                            error=error, discarded_completion_tokens=discarded_completion_tokens,
                            storage_options=quick_options(so) if quick else so, device_count=device_count)
    except StorageError as book_exc:
        warnings.warn(f"this run's cost was not booked ({book_exc.cause}); it ran "
                      f"{(datetime.now(timezone.utc) - plan.started_at).total_seconds():.1f} s", stacklevel=2)
    finally:
        plan.close(quick=quick)
    if report is not None:
        with contextlib.suppress(AttributeError, TypeError):  # an exception that takes no attributes
            exc.tokenmill_report = report  # type: ignore[attr-defined]
    return report


def booked_report(exc: BaseException) -> Optional[CostReport]:
    """The cost report booked for the run that `exc` ended (status "failed" or "interrupted"), as `run_job`
    and the flow re-raise it: a `JobInterrupted`'s `report`, else what `abort_job` attached. None when the
    run ended before it held the output's lease (nothing is booked then) or its row could not be written."""
    if isinstance(exc, JobInterrupted):
        return exc.report
    return getattr(exc, "tokenmill_report", None)


def job_device(plan: JobPlan, results: list[ShardResult], llm: Any = None, look_up: bool = True) -> str:
    """The device name for the report: the spec's, else the engine's, else the one done shards recorded
    (read from storage only with `look_up`)."""
    if plan.spec.device_name:
        return plan.spec.device_name
    for r in results:
        if r.device:
            return r.device
    if llm is not None and getattr(llm, "device_name", None):
        return str(llm.device_name)
    if look_up:
        for r in done_shards(plan.spec).values():
            if r.device:
                return r.device
    return "unknown"


def read_metrics(output: str, storage_options: Optional[dict[str, Any]] = None) -> pl.DataFrame:
    """All runs' cost reports of the job at `output`, one row per run, oldest first (failed and
    interrupted runs included: their `status` says so; a row booked before `rows_not_run` was a column
    gets what its other row counts leave of `rows_total`). A run file that cannot be read (truncated,
    garbage) or is not a cost row (a stray Parquet file without `METRICS_KEY_COLUMNS`) is skipped with
    a warning naming it, so the good runs still show.

    Raises:
        FileNotFoundError: when the job has no metrics yet.
        ValueError: `output` is a file, not a job's output folder (the message names it); or every
            metrics file was skipped (the message says how many).
        StorageError: the storage cannot be reached or denies access.
    """
    fs, path = io.filesystem(output, storage_options)
    with storage_call("check", output, io.resolve_storage_options(output, storage_options)):
        if fs.isfile(path):
            raise ValueError(f"{output} is a file, not a job output folder: give the --output folder of a "
                             f"tokenmill run (it holds part-*.parquet and _job/)")
    urls = []
    legacy = manifest.job_url(output, LEGACY_METRICS)
    if io.exists(legacy, storage_options):
        urls.append(legacy)
    runs = manifest.job_url(output, RUNS_DIR)
    urls += [io.join(runs, name) for name in io.list_names(runs, storage_options)
             if name.startswith("run-") and name.endswith(".parquet")]
    if not urls:
        raise FileNotFoundError(f"no job metrics at {manifest.job_url(output)}")
    frames = []
    for url in urls:
        df = _read_metrics_file(url, storage_options)
        if df is not None:
            frames.append(df)
    if not frames:
        raise ValueError(f"no readable job metrics at {manifest.job_url(output)}: all {len(urls)} metrics "
                         f"file(s) were skipped (see the warnings)")
    df = pl.concat(frames, how="diagonal_relaxed")
    if "status" in df.columns:
        df = df.with_columns(pl.col("status").fill_null("ok"))
    counted = ("rows_total", "rows_ok", "rows_error", "rows_skipped")
    if all(c in df.columns for c in counted):  # rows booked before rows_not_run: what the other columns leave
        left = pl.col("rows_total") - pl.col("rows_ok") - pl.col("rows_error") - pl.col("rows_skipped")
        old = pl.col("rows_not_run") if "rows_not_run" in df.columns else pl.lit(None, dtype=pl.Int64)
        df = df.with_columns(old.fill_null(left.clip(lower_bound=0)).cast(pl.Int64).alias("rows_not_run"))
    return df.sort("started_at", maintain_order=True)


# The columns (and their kinds) that make a Parquet file a run's cost row: what a report sorts and sums by.
METRICS_KEY_COLUMNS = {"job_id": pl.String, "run_id": pl.String, "started_at": pl.Datetime, "cost_usd": pl.Float64}


def _read_metrics_file(url: str, storage_options: Optional[dict[str, Any]]) -> Optional[pl.DataFrame]:
    """One metrics file's rows, or None (with a warning naming the file) when it cannot be read as
    Parquet or does not hold cost rows (`METRICS_KEY_COLUMNS`). A storage failure still raises."""
    try:
        df = io.read_parquet(url, storage_options)
    except (pl.exceptions.PolarsError, pl.exceptions.PanicException) as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        warnings.warn(f"{url}: skipped, not a readable Parquet file ({reason})", stacklevel=3)
        return None
    def fits(column: str, kind: Any) -> bool:
        dtype = df.schema.get(column)
        return dtype is not None and (dtype == kind or (kind == pl.Float64 and dtype.is_numeric()))

    wrong = [f"{c} ({df.schema[c] if c in df.columns else 'missing'})"
             for c, kind in METRICS_KEY_COLUMNS.items() if not fits(c, kind)]
    if wrong:
        warnings.warn(f"{url}: skipped, not a run's cost row (column {', '.join(wrong)})", stacklevel=3)
        return None
    return df
