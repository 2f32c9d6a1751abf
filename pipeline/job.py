"""A batch job: `prepare_job` and `run_job(spec)`.

A run goes: `prepare_job` (validate every option and the input's columns
before anything is written, take the output's lease, plan shards, check or
write the manifest, find the shards already done) -> `plan_windows` (cut the
pending shards into windows of consecutive shards, `shards_in_flight` each,
never splitting a prefix group that fits) -> `run_window` for each window
(read its shards, validate rows, stream them all through one
`LLM.iter_outputs` call, commit each shard's part file as soon as its last row
finishes) -> `finish_job` (book the run's cost report), or `abort_job` when
the run failed or was interrupted (book it with that status) ->
`JobPlan.close()` (give the lease back). The Prefect flow calls the same
steps, with a task per window: on one machine the windows run in plan order
through one engine, exactly as here; on a Dask cluster each worker process
runs its windows through its own engine.

The rooms: `pipeline.spec` (the options), `pipeline.plan` (shards and windows), `pipeline.engines`
(the engine and the run loop), `pipeline.commit` (committing each shard exactly once),
`pipeline.bookkeeping` (the cost report).
"""
from __future__ import annotations

import signal
import sys
import time
import uuid
import warnings
from datetime import datetime, timezone
from typing import Any, Callable, Optional

from pipeline import io, manifest
from pipeline.batch_files import is_request_input, stage_requests
from pipeline.bookkeeping import JobInterrupted, abort_job, finish_job, job_device
from pipeline.commit import drop_markers_of_lost_parts
from pipeline.cost import CostReport, TokenCounts
from pipeline.engines import (
    add_steps, engine_quantization, engine_spec, get_llm, host_dtype, loaded_llm, run_window, sampled_tokens,
)
from pipeline.lease import Lease
from pipeline.manifest import ShardResult
from pipeline.plan import (
    JobPlan, check_ids, check_inputs, done_shards, plan_job, plan_windows, recorded_dtype,
    refuse_inputs_the_job_would_replace, refuse_output_overlapping_input,
)
from pipeline.planner import PlanStats, Shard
from pipeline.schema import CONSTRAINT_COLUMNS
from pipeline.spec import JobSpec, JobSpecChanged, validate_spec
from pipeline.storage import StorageError, plural, quick_options, storage_call


def prepare_job(spec: JobSpec, tokenizer: Any = None, max_model_len: Optional[int] = None) -> JobPlan:
    """Validate, take the output's lease, check the manifest (refuse a changed job unless `overwrite`), plan.

    Nothing is written before every option, the output location and the input's columns
    are checked (`validate_spec`, `io.check_bucket`, an output that overlaps the input,
    `check_inputs`). Then the run takes
    the output's lease (`pipeline.lease`): a second run on the same output refuses. A new
    job (or `overwrite`) is planned (`plan_job`) and its plan written to the manifest; a
    resumed job reads its plan from the manifest, so the shards are exactly those of the
    first run. Planning also warns about null and repeated ids (`check_ids`).

    The caller must end the run with `finish_job` / `abort_job` and `JobPlan.close()`
    (which gives the lease back); `run_job` does all of that. An interruption once the lease is
    held (while planning: loading the tokenizer, tokenising) books the run's cost here (status
    "interrupted", no rows, the wall time so far) and gives the lease back; one before it writes
    nothing.

    Args:
        tokenizer: for planning (default: `job_tokenizer(spec)`, loaded only when planning).
        max_model_len: the engine's context length, for planning (see `plan_job`).

    Raises:
        ValueError: a bad option, output or input (the message names it).
        FileNotFoundError: no input files.
        StorageError: the storage cannot be reached, denies access, or a bucket does not exist.
        JobLocked: another run holds the output's lease.
        JobSpecChanged: the output holds another job (other spec, input or model).
        JobInterrupted: a KeyboardInterrupt once the lease was held (`shards_total` None: the job
            was not planned yet); its `report` is the cost row booked for the run.
        KeyboardInterrupt: an interruption before the lease was taken (nothing was written).
    """
    started_at = datetime.now(timezone.utc)
    so = spec.storage_options
    validate_spec(spec)  # job-level mistakes are refused before anything is read or written
    io.check_bucket(spec.output, so, "write")
    out_fs, out_path = io.filesystem(spec.output, so)
    with storage_call("check", spec.output, io.resolve_storage_options(spec.output, so)):
        if out_fs.isfile(out_path):
            raise ValueError(f"output {spec.output} is a file; give a folder (or prefix) URL")
        refuse_output_overlapping_input(spec, out_fs, out_path)
    staged = None
    if is_request_input(spec.input, so):  # OpenAI Batch request files: their lines become rows (`batch_files`)
        spec = request_job_spec(spec)
        staged = stage_requests(spec.output, spec.input, spec.model, spec.served_model_name, so)
        sources, files = staged.sources, staged.files
    else:
        if "jsonl" in spec.output_formats():
            raise ValueError(f"output_format {spec.output_format!r}: OpenAI Batch result files (jsonl) are written "
                             f"for OpenAI Batch request files (.jsonl) only; {spec.input} holds Parquet")
        files = sources = io.list_input_files(spec.input, so)
    refuse_inputs_the_job_would_replace(spec, sources, out_fs, out_path)
    columns = check_inputs(spec, files)
    digest, doc = manifest.fingerprint(sources, spec.fingerprint_fields())
    readable = {"constraint": text} if (text := spec.constraint_text()) is not None else {}  # not hashed
    run_id = uuid.uuid4().hex[:12]
    lease = Lease.acquire(spec.output, so, run_id=run_id, ttl_s=spec.lease_ttl_s)
    try:
        previous = manifest.read_manifest(spec.output, so, check_version=not spec.overwrite)
        if spec.overwrite:
            manifest.clear_output(spec.output, so)
        elif previous is not None and previous.get("fingerprint") != digest:
            what = (f"{spec.output} already holds a job with a different spec or input "
                    f"({manifest.describe_change(previous, {**doc, **readable})}).")
            fix = "to discard its outputs and start over, or choose another output."
            raise JobSpecChanged(f"{what} Re-run with --overwrite (overwrite=True) {fix}",
                                 cli_message=f"{what} Re-run with --overwrite {fix}")
        elif previous is None and (stray := manifest.part_files(spec.output, so)):
            shown = ", ".join(stray[:3]) + (f" and {len(stray) - 3} more" if len(stray) > 3 else "")
            raise JobSpecChanged(
                f"{spec.output} holds {len(stray)} file(s) named like a job's part files ({shown}) but no job "
                f"manifest (_job/manifest.json), so they are not outputs this run can resume; re-run with "
                f"--overwrite to delete them, or choose another output."
            )
        if staged is not None:
            staged.write(so)  # (a resume finds them there: the same rows)
        if spec.overwrite or previous is None:
            # (request lines without a usable custom_id are error lines already, each naming its line)
            for message in (check_ids(files, spec.id_column, spec.limit, so) if staged is None else []):
                warnings.warn(f"{spec.input}: {message}", stacklevel=2)
            shards, stats = plan_job(spec, files, tokenizer, max_model_len)
            dtype = host_dtype(spec)
            manifest.write_manifest(spec.output, {"fingerprint": digest, **doc, **readable, "plan": stats.to_json(),
                                                  "shards": [s.to_json() for s in shards], "dtype": dtype,
                                                  "created_at": started_at.isoformat()}, so)
        else:
            shards = [Shard.from_json(d) for d in previous["shards"]]
            stats = PlanStats(**previous.get("plan", {}))
            dtype = recorded_dtype(spec, previous)
        done = done_shards(spec)
        if done:
            done = drop_markers_of_lost_parts(spec, shards, done)
    except BaseException as exc:
        if isinstance(exc, KeyboardInterrupt):  # the run holds the output: it books its cost as every run does
            plan = JobPlan(spec=spec, job_id=digest[:16], run_id=run_id, shards=[], pending=[], started_at=started_at,
                           lease=lease)
            booked = abort_job(plan, [], exc, model=spec.model, quantization=spec.quantization,
                               device=job_device(plan, [], look_up=False))  # gives the lease back
            raise JobInterrupted(0, None, int(getattr(exc, "signum", signal.SIGINT)), booked) from None
        # refused before any shard ran: the folders the lease created go too, where nothing else was written
        lease.release(quick_options(so) if isinstance(exc, StorageError) and exc.endpoint_failed else so, tidy=True)
        raise
    pending = [s for s in shards if s.index not in done]
    structured = spec.constrained or any(c in f.columns for f in files for c in CONSTRAINT_COLUMNS)
    done_before = sum((r.counts for i, r in done.items()), TokenCounts())
    return JobPlan(spec=spec, job_id=digest[:16], run_id=run_id, shards=shards, pending=pending,
                   started_at=started_at, stats=stats, columns=columns, lease=lease, structured=structured,
                   dtype=dtype, done_before=done_before)


PLANNED_FIELDS = ("id_column", "output_format")
"""JobSpec fields `prepare_job` settles for request-file inputs (`request_job_spec`); `JobPlan.spec` holds them."""


def request_job_spec(spec: JobSpec) -> JobSpec:
    """The spec of a job over OpenAI Batch request files: ids are the lines' `custom_id`, and the output is
    result and error files (`output_format` jsonl) unless the spec asks for Parquet too (or instead).

    Raises:
        ValueError: an `id_column` other than custom_id (a request file's ids are its custom_ids).
    """
    if spec.id_column not in ("id", "custom_id"):
        raise ValueError(f"id_column {spec.id_column!r}: the ids of OpenAI Batch request lines are their custom_id")
    return spec.model_copy(update={"id_column": "custom_id", "output_format": spec.output_format or "jsonl"})


def as_planned(spec: JobSpec, plan: JobPlan) -> JobSpec:
    """`spec` with the fields `prepare_job` settled (`PLANNED_FIELDS`) as `plan` has them: what a run's
    windows run with (the flow passes `spec` itself on, storage secrets unresolved)."""
    return spec.model_copy(update={k: getattr(plan.spec, k) for k in PLANNED_FIELDS})


def _say(spec: JobSpec, text: str) -> None:
    """A progress line on stderr (with the progress bar's `progress` option)."""
    if spec.progress:
        print(f"tokenmill: {text}", file=sys.stderr, flush=True)


def run_job(
    spec: JobSpec,
    llm: Any = None,
    *,
    on_shard_done: Optional[Callable[[ShardResult], None]] = None,
) -> CostReport:
    """Run a whole job in this process: resume done shards, write outputs and the cost report.

    However the run ends, its cost is booked (a `status` of "ok", "failed" or
    "interrupted") and its lease on the output given back; a failed or interrupted run
    keeps every shard it committed, and re-running the same spec resumes.

    Args:
        spec: the job.
        llm: an `engine.LLM` to use (default: `get_llm(spec)`, loaded once per process).
        on_shard_done: called after each shard commits (progress, tests).

    Returns:
        This run's CostReport (also booked under `OUTPUT/_job/runs/`).

    Raises:
        JobInterrupted: a KeyboardInterrupt (or a subclass carrying `signum`) stopped the run; its
            `report` is the partial cost report booked for it.
        ValueError: `spec.cluster` is set (a cluster job runs through the flow).
        Everything `prepare_job` raises, and whatever failed the run (e.g. StorageError, LeaseLost).
    """
    if spec.cluster is not None:
        raise ValueError(f"cluster={spec.cluster!r}: run_job runs in this process; a cluster job runs through the "
                         f"Prefect flow (flows.batch_generate(spec), or `tokenmill run --cluster ...`)")
    plan = prepare_job(spec, tokenizer=llm.tokenizer if llm is not None else None,
                       max_model_len=getattr(llm, "max_model_len", None) if llm is not None else None)
    spec = engine_spec(as_planned(spec, plan), plan.dtype)  # "auto" as the manifest recorded it (a resume keeps it)
    results: list[ShardResult] = []
    bar = None
    out_tokens = 0
    t0 = time.perf_counter()

    def on_rows(rows: int, tokens: int) -> None:
        nonlocal out_tokens
        out_tokens += tokens
        if bar is not None:
            bar.update(rows)
            bar.set_postfix_str(f"{out_tokens / max(time.perf_counter() - t0, 1e-9):.1f} out tok/s", refresh=False)

    def quantization() -> Optional[str]:
        return engine_quantization(spec, llm)

    def committed(result: ShardResult) -> None:
        results.append(result)
        if on_shard_done is not None:
            on_shard_done(result)

    steps: Optional[dict] = None
    sampled0: Optional[int] = None
    try:
        todo = plan.rows_total - plan.rows_skipped
        if plan.rows_total == 0:
            _say(spec, f"0 rows in {spec.input}: nothing to generate, no part files")
        elif plan.pending:
            done_before = len(plan.shards) - len(plan.pending)
            _say(spec, f"{plural(todo, 'row')} in {plural(len(plan.pending), 'shard')} to run"
                       + (f" ({plural(done_before, 'shard')} done before)" if plan.rows_skipped else ""))
        if llm is None and plan.pending:
            if loaded_llm(spec) is None:
                _say(spec, f"loading model {spec.model} ...")
            loading = loaded_llm(spec) is None
            t_load = time.perf_counter()
            llm = get_llm(spec)
            if loading:
                _say(spec, f"model loaded in {time.perf_counter() - t_load:.1f} s")
        if spec.progress and plan.pending:
            from tqdm.auto import tqdm

            bar = tqdm(total=todo, unit="row", desc="tokenmill", dynamic_ncols=True, smoothing=0.05)
        t0 = time.perf_counter()
        sampled0 = sampled_tokens(llm)
        for window in plan_windows(plan.pending, spec.shards_in_flight):
            run = run_window(spec, window, llm, run_id=plan.run_id, columns=plan.columns, structured=plan.structured,
                             lease=plan.lease, on_rows=on_rows, on_shard_done=committed)
            steps = add_steps(steps, run.engine_steps)
        if bar is not None:
            bar.close()
            bar = None
        report = finish_job(plan, results, model=spec.model, quantization=quantization(),
                            device=job_device(plan, results, llm), engine_steps=steps)
    except BaseException as exc:
        if bar is not None:
            bar.close()
        kept = sum(r.counts.completion_tokens for r in results)
        sampled = sampled_tokens(llm) if sampled0 is not None else None
        # rows that finished but whose shard was not committed, and the rows cut off mid-generation
        discarded = max(out_tokens - kept, (sampled - sampled0 - kept) if sampled is not None else 0, 0)
        booked = abort_job(plan, results, exc, model=spec.model, quantization=quantization(),
                           device=job_device(plan, results, llm, look_up=False),
                           discarded_completion_tokens=discarded)
        if isinstance(exc, KeyboardInterrupt) and not isinstance(exc, JobInterrupted):
            done = len(plan.shards) - len(plan.pending) + len(results)
            raise JobInterrupted(done, len(plan.shards), int(getattr(exc, "signum", signal.SIGINT)), booked) from None
        raise
    plan.close()
    return report
