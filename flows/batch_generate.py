"""The Prefect flow `batch_generate(spec)`: a task per window of shards, retries with backoff, artifacts.

    from flows import batch_generate
    from pipeline import JobSpec
    batch_generate(JobSpec(input="s3://bucket/prompts/", output="s3://bucket/out/"),
                   storage_secret="tokenmill-s3")   # optional: a Prefect Secret block with storage options
    batch_generate(JobSpec(..., cluster="tcp://scheduler:8786"))   # the windows on a Dask cluster

The flow process plans the job (`pipeline.prepare_job`: lease, manifest),
cuts the pending shards into windows (`pipeline.plan_windows`, as `run_job`
does) and submits one `generate-window` task per window. A task runs its
window with `pipeline.run_window`, the loop `run_job` uses: every shard of the
window in flight in one engine, each committed (part file, then done marker)
as it finishes. The flow collects the per-window results (counts, never rows)
and books the cost report. So the flow and `tokenmill run` give the same part
files and the same report.

Where the windows run:
- By default on one thread of this process (`ThreadPoolTaskRunner(max_workers=1)`):
  one engine computes one window at a time anyway, and one thread keeps the
  windows in plan order, so the prefix cache carries over from window to window
  as in `run_job`. With no Prefect server configured the flow runs against
  Prefect's temporary local API.
- With `spec.cluster` (a Dask scheduler address, `tokenmill run --cluster`, or
  `cluster:` in a deployment's spec file), on that cluster through
  prefect-dask's `DaskTaskRunner`; or on any task runner given with
  `batch_generate.with_options(task_runner=...)` (a `DaskTaskRunner` with a
  cluster class, prefect-ray's `RayTaskRunner`). Each worker process loads the
  engine once (`pipeline.get_llm`) and keeps it for every window it runs; it
  reads its shards' rows from storage and writes its part files there itself
  (credentials from its own environment, or the `storage_secret` block, loaded
  by the task). With `device: cuda...` each task asks for the Dask resource
  `GPU: 1` (start workers with `dask worker --nthreads 1 --resources GPU=1`).
  Process workers report to the Prefect API, so a cluster job needs a Prefect
  server (`PREFECT_API_URL`, set for the flow and for every worker); the flow
  refuses to start without one.
- A worker that dies mid-window has its task rerun on another worker by Dask;
  commits are first-wins (see `pipeline.commit`), so every row lands once. The
  done marker of each shard names the worker that committed it, and the cost
  report's `device_count` is the number of workers that committed shards.

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
import concurrent.futures
import contextlib
import json
import math
import signal
import time
from typing import Any, Iterator, Optional

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_progress_artifact, create_table_artifact, update_progress_artifact
from prefect.cache_policies import NO_CACHE
from prefect.context import FlowRunContext
from prefect.exceptions import ExternalSignal
from prefect.futures import as_completed
from prefect.task_runners import ThreadPoolTaskRunner
from prefect.tasks import exponential_backoff

from pipeline import (
    JobInterrupted, JobSpec, ShardResult, WindowRun, finish_job, format_report, get_llm, prepare_job,
)
from pipeline.bookkeeping import abort_job, job_device
from pipeline.commit import default_worker
from pipeline.engines import add_steps, engine_lock, engine_spec, run_window
from pipeline.job import as_planned
from pipeline.plan import plan_windows
from pipeline.lease import LeaseToken
from pipeline.manifest import committed_by_run, read_marker
from pipeline.planner import Shard
from pipeline.storage import StorageError, secret_keys

PROGRESS_KEY = "tokenmill-progress"
# What stops the flow itself rather than failing a window: Ctrl-C, and the termination Prefect raises in a
# flow run's process on SIGTERM. (One arriving while a window's result was being counted was taken for that
# window's failure, and the flow then ran every remaining window before it stopped.)
_INTERRUPTS = (KeyboardInterrupt, ExternalSignal)
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


def check_shard_retries(shard_retries: Any) -> None:
    """Refuse a `shard_retries` that is not a whole number of retries (the flow's parameter, and a
    deployment's setting, checked when it is served).

    Raises:
        ValueError: naming shard_retries and the value given.
    """
    if isinstance(shard_retries, bool) or not isinstance(shard_retries, int) or shard_retries < 0:
        raise ValueError(f"shard_retries must be an integer >= 0 (retries per window task), got {shard_retries!r}")


def check_retry_delay(retry_delay_s: Any) -> None:
    """Refuse a `retry_delay_s` that is not a finite number of seconds >= 0 (it was taken as 0 when
    negative).

    Raises:
        ValueError: naming retry_delay_s and the value given.
    """
    if (isinstance(retry_delay_s, bool) or not isinstance(retry_delay_s, (int, float))
            or not math.isfinite(retry_delay_s) or retry_delay_s < 0):
        raise ValueError(f"retry_delay_s must be a number of seconds >= 0 (the first retry's delay), "
                         f"got {retry_delay_s!r}")


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


def worker_name() -> str:
    """The name a done marker records for this process: the Dask worker's address inside a Dask worker,
    else HOST:PID."""
    try:
        from distributed import get_worker

        return str(get_worker().address)
    except (ImportError, ValueError):
        return default_worker()


def _window_run_name() -> str:
    """A window task run's name: shards-FIRST-LAST (shard indices)."""
    from prefect.runtime import task_run

    window = task_run.parameters.get("window") or []
    return f"shards-{window[0].index:05d}-{window[-1].index:05d}" if window else "shards-none"


@task(name="generate-window", task_run_name=_window_run_name, retries=3,
      retry_delay_seconds=exponential_backoff(backoff_factor=5), retry_jitter_factor=0.5, cache_policy=NO_CACHE)
def generate_window(spec: JobSpec, window: list[Shard], run_id: str, lease: Optional[LeaseToken] = None,
                    storage_secret: Optional[str] = None, columns: Optional[dict] = None,
                    structured: Optional[bool] = None) -> dict[str, Any]:
    """Run one window of consecutive shards through this process's engine, committing each shard as it
    finishes (`pipeline.run_window`); returns the WindowRun as a dict (counts, no rows).

    A retry recomputes the window's shards that are not done; a shard's commit is first-wins, so an
    attempt that finds the shard committed by another adopts that commit.

    Args:
        window: consecutive shards (`pipeline.plan_windows`), in flight together.
        lease: the run's `LeaseToken`, checked before each commit.
        storage_secret: a Prefect Secret block with storage options, loaded here (by the worker).
        columns: the output types of the id / pass-through columns (`JobPlan.columns`).
        structured: the job writes the structured-output columns (`JobPlan.structured`).

    Raises:
        ValueError: an empty window.
        LeaseLost: the run that submitted this task no longer holds the output.
        Whatever `pipeline.run_window` raises.
    """
    if not window:
        raise ValueError("window: expected at least one shard")
    spec = resolve_storage_secret(spec, storage_secret)
    # a rerun (retry, or Dask rerunning the task of a lost worker) skips the shards already committed
    done = {s.index: r for s in window if (r := read_marker(spec.output, s.name, spec.storage_options)) is not None}
    todo = [s for s in window if s.index not in done]
    if not todo:
        return WindowRun([done[s.index] for s in window], worker_name()).to_json()
    llm = get_llm(spec)
    token = lease.bind(spec.storage_options) if lease is not None else None
    with engine_lock(llm):
        run = run_window(spec, todo, llm, run_id=run_id, columns=columns, structured=structured, lease=token,
                         worker=worker_name())
    run.results = [done[s.index] for s in window if s.index in done] + run.results
    return run.to_json()


def _require_api_for_cluster(spec: JobSpec) -> None:
    """Refuse a cluster job without a Prefect server: each worker process would start its own temporary API.

    Raises:
        ValueError: `spec.cluster` is set and `PREFECT_API_URL` is not.
    """
    from prefect.settings import PREFECT_API_URL

    if spec.cluster and not PREFECT_API_URL.value():
        raise ValueError(f"cluster={spec.cluster!r} needs a Prefect server: the Dask workers report their task runs to "
                         f"it. Start one (prefect server start) and set PREFECT_API_URL (e.g. "
                         f"http://HOST:4200/api) here and in every worker's environment.")


def check_prefect_api(spec: JobSpec, timeout_s: float = 5.0) -> None:
    """Refuse a cluster job whose Prefect server is not configured or does not answer (`GET
    PREFECT_API_URL/health`, within `timeout_s` seconds), before the flow is called: Prefect
    would fail entering the flow, with a long traceback of its own. The CLI calls it.

    Raises:
        ValueError: `spec.cluster` is set and PREFECT_API_URL is not, or the server at it does not
            answer (the message names PREFECT_API_URL, its value and the cause).
    """
    _require_api_for_cluster(spec)
    if not spec.cluster:
        return
    import httpx
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL

    url = PREFECT_API_URL.value()
    with get_client(httpx_settings={"timeout": timeout_s}, sync_client=True) as client:
        problem = client.api_healthcheck()
    if problem is None:
        return
    if isinstance(problem, httpx.HTTPStatusError):
        cause = f"HTTP {problem.response.status_code} from {problem.request.url}: not a Prefect server's API?"
    elif isinstance(problem, httpx.TimeoutException):
        cause = f"no answer within {timeout_s:g} s"
    else:
        cause = f"{type(problem).__name__}: {problem}"
    raise ValueError(f"cannot reach the Prefect server at PREFECT_API_URL={url} ({cause}); start it (prefect "
                     f"server start) or set PREFECT_API_URL to the server the Dask workers report to")


@contextlib.contextmanager
def _cluster_runner(spec: JobSpec) -> Iterator[Any]:
    """A started DaskTaskRunner connected to `spec.cluster`, or None (the flow's own task runner).

    Raises:
        ValueError: this process has a default Dask client of another scheduler (DaskTaskRunner
            would submit to that one instead of `spec.cluster`).
    """
    if not spec.cluster:
        yield None
        return
    import distributed
    from distributed.comm import resolve_address
    from prefect_dask import DaskTaskRunner

    try:
        current = distributed.Client.current()
    except ValueError:
        current = None
    if current is not None and resolve_address(current.scheduler.address) != resolve_address(spec.cluster):
        raise ValueError(f"cluster={spec.cluster!r}: this process's default Dask client is connected to "
                         f"{current.scheduler.address}, and prefect-dask submits to a default client before an "
                         f"address; close that client or create it with set_as_default=False")
    with DaskTaskRunner(address=spec.cluster) as runner:
        yield runner


def _resources(spec: JobSpec, runner: Any) -> contextlib.AbstractContextManager:
    """Dask resources the window tasks ask for: `GPU: 1` for a CUDA job on Dask (one engine per GPU)."""
    if not str(spec.device).startswith("cuda"):
        return contextlib.nullcontext()
    on_dask = runner is not None or type(FlowRunContext.get().task_runner).__name__ == "DaskTaskRunner"
    if not on_dask:
        return contextlib.nullcontext()
    import dask

    return dask.annotate(resources={"GPU": 1})


DASK_POLL_S = 0.5  # seconds between two looks at the Dask workers while windows cancelled there still run


def _settle_windows(futures: list[Any], collect: Any, logger: Any) -> None:
    """After a Ctrl-C (or a termination) reached the flow with window tasks in flight: cancel the windows
    that have not started, and wait for the running ones to end (each ends after its window, committing
    the shards it finishes, as it would have), counting what they return with `collect`, so the run's
    cost row is booked after its last commit, not before. A second Ctrl-C stops the wait (one line
    says so): the run then books what is committed by then, and gives its lease back, so the window
    still running commits nothing more (a shard it is committing at that moment may be missing from
    the row).

    On a Dask cluster every window's future is cancelled (its future does not say whether a worker runs
    it yet), but a window already running goes on in its worker's thread, committing its shards: the
    wait then asks the workers every DASK_POLL_S seconds until, twice in a row, none of them runs (or
    holds) one of this run's windows, so that those commits are read back from their done markers
    before the run books (it used to book at once, and a window could commit after that). The wait
    also ends when the workers cannot be asked (the scheduler is gone).
    """
    try:
        running, on_dask = [], []
        for fut in futures:
            wrapped = getattr(fut, "wrapped_future", None)
            if wrapped is not None and not isinstance(wrapped, concurrent.futures.Future) \
                    and hasattr(wrapped, "client") and hasattr(wrapped, "key"):
                on_dask.append(wrapped)  # a distributed.Future
            elif wrapped is None or not wrapped.cancel():  # a concurrent.futures future: only a window not started
                running.append(fut)
        keys = _cancel_on_dask(on_dask, logger) if on_dask else []
        if not running and not on_dask:
            return
        if running or keys:
            logger.warning("interrupted: waiting for the %d window(s) in flight to finish, so this run's cost "
                           "counts every shard it commits (Ctrl-C again to stop waiting)",
                           len(running) + len(keys or []))
        for fut in running:
            try:
                collect(fut)
            except _INTERRUPTS:
                raise
            except BaseException:  # noqa: BLE001 - a window that failed: its commits are read back from storage
                pass
        idle = 0 if keys else 1  # "none" twice in a row: a window sent to a worker just before the cancel shows
        while on_dask and keys is not None and idle < 2:
            time.sleep(DASK_POLL_S)
            keys = _windows_on_workers(on_dask[0].client, keys or [f.key for f in on_dask], logger)
            idle = 0 if keys else idle + 1
    except _INTERRUPTS:  # a second Ctrl-C (or SIGTERM)
        logger.warning("interrupted again: not waiting for the window in flight; booking what this run "
                       "committed so far and giving the output's lease back (the window commits nothing more)")


def _cancel_on_dask(futures: list[Any], logger: Any) -> Optional[list[Any]]:
    """Cancel the window tasks `futures` (distributed.Futures of one client) in one call; returns the keys
    of those that a worker still runs or holds to run (`_windows_on_workers`), or None (with a warning)
    when the cluster cannot be reached."""
    client = futures[0].client
    try:
        client.cancel(futures)
    except Exception as exc:  # noqa: BLE001 - the scheduler is gone: nothing more to wait for
        logger.warning("could not cancel this run's windows on the Dask cluster (%s: %s); booking what is "
                       "committed", type(exc).__name__, exc)
        return None
    return _windows_on_workers(client, [f.key for f in futures], logger)


def _windows_running(keys: list[Any], dask_worker: Any = None) -> list[Any]:
    """On a Dask worker (through `Client.run`): those of the task `keys` that this worker runs (also when
    cancelled: a running task's thread goes on until it returns) or holds to run."""
    state = dask_worker.state
    running = {ts.key for ts in (*state.executing, *state.long_running)}
    held = {k for k in keys if getattr(state.tasks.get(k), "state", None) in ("ready", "constrained", "waiting")}
    return [k for k in keys if k in running or k in held]


def _windows_on_workers(client: Any, keys: list[Any], logger: Any) -> Optional[list[Any]]:
    """Those of the window task `keys` that a worker of `client`'s cluster still runs or holds to run;
    None (with a warning) when the workers cannot be asked."""
    try:
        found = client.run(_windows_running, keys, on_error="ignore")
    except Exception as exc:  # noqa: BLE001 - the scheduler is gone: nothing more to wait for
        logger.warning("could not ask the Dask workers whether this run's windows still run (%s: %s); booking "
                       "what is committed", type(exc).__name__, exc)
        return None
    busy = {k for ks in found.values() if isinstance(ks, list) for k in ks}
    return [k for k in keys if k in busy]


def interruption(exc: BaseException) -> Optional[JobInterrupted]:
    """The JobInterrupted of a flow run that a signal stopped, from what reached its caller: the
    JobInterrupted itself (Ctrl-C), or the one on the TerminationSignal that SIGTERM raised, also when
    Prefect's re-delivered SIGTERM made the caller's own handler raise another exception while that one
    was handled (its `__context__`); None for any other ending."""
    seen: set[int] = set()
    cause: Optional[BaseException] = exc
    while cause is not None and id(cause) not in seen:
        if isinstance(cause, JobInterrupted):
            return cause
        stopped = getattr(cause, "tokenmill_interrupted", None)
        if isinstance(stopped, JobInterrupted):
            return stopped
        seen.add(id(cause))
        cause = cause.__cause__ or cause.__context__
    return None


def _committed_without_result(plan: Any, results: list[ShardResult], exc: BaseException,
                              logger: Any) -> list[ShardResult]:
    """The shards this run committed that no window result reported (a window that failed or was
    interrupted after some of its commits), read back from their done markers (`manifest.committed_by_run`);
    none after a storage failure (the store is not answering) or when they cannot be read."""
    counted = {r.index for r in results}
    names = [s.name for s in plan.pending if s.index not in counted]
    if not names or (isinstance(exc, StorageError) and exc.endpoint_failed):
        return []
    try:
        return committed_by_run(plan.spec.output, names, plan.run_id, plan.spec.storage_options)
    except StorageError as read_exc:
        logger.warning("could not read back this run's done markers (%s); its cost row counts the windows "
                       "that returned", read_exc)
        return []


@flow(name="batch-generate", log_prints=True, task_runner=ThreadPoolTaskRunner(max_workers=1))
def batch_generate(spec: JobSpec, shard_retries: int = 3, retry_delay_s: float = 5.0,
                   storage_secret: Optional[str] = None) -> dict[str, Any]:
    """Run the job `spec` with a task per window of pending shards; returns this run's cost report (a dict).

    However the run ends, its cost is booked (status "ok", "failed" or "interrupted": Ctrl-C, and
    SIGTERM as well) and its lease on the output given back.

    Args:
        spec: the job (the same JobSpec as the CLI and `pipeline.run_job`), without credentials;
            `spec.cluster` runs the windows on that Dask cluster.
        shard_retries: retries per window task (a worker lost mid-task is rerun by Dask as well).
        retry_delay_s: first retry delay; later ones double (exponential backoff, with jitter).
        storage_secret: name of a Prefect Secret block holding storage options (credentials).

    Raises:
        ValueError: a negative shard_retries or retry_delay_s, credentials inside spec.storage_options, a cluster without
            a Prefect server, or a bad spec (see `pipeline.prepare_job`).
        pipeline.JobSpecChanged: the output holds a job with another spec (set spec.overwrite).
        pipeline.JobLocked: another run holds the output's lease.
        pipeline.JobInterrupted: Ctrl-C (a KeyboardInterrupt) stopped the run: its cost is booked
            "interrupted", counting every shard it committed (`report`); Prefect marks the run Crashed.
        prefect.exceptions.TerminationSignal: SIGTERM stopped the run: booked as Ctrl-C is, the
            JobInterrupted as its `tokenmill_interrupted` (see `interruption`); Prefect marks the run
            Cancelled (a cancel from the server) or Crashed, and passes the signal on to the process's
            own SIGTERM handler.
        Any window's error once its retries are spent; done shards stay done for a re-run.
    """
    logger = get_run_logger()
    check_shard_retries(shard_retries)
    check_retry_delay(retry_delay_s)
    refuse_inline_secrets(spec)
    _require_api_for_cluster(spec)
    if spec.cluster and any("://" not in str(u) or str(u).startswith("file://") for u in (spec.input, spec.output)):
        logger.warning("cluster job with a local input or output path (%s -> %s): every worker must see it at the "
                       "same path (a shared file system); object storage needs no sharing", spec.input, spec.output)
    job_spec = resolve_storage_secret(spec, storage_secret)
    plan = prepare_job(job_spec)
    runs: list[WindowRun] = []
    results: list[ShardResult] = []

    def device_count() -> Optional[int]:
        workers = {r.worker for r in results}
        return len(workers) if workers - {worker_name()} else None  # None: this process ran them (spec's count)

    def quantization() -> Optional[str]:
        return spec.quantization or next((r.quantization for r in runs if r.quantization), None)

    try:
        todo_rows = plan.rows_total - plan.rows_skipped
        windows = plan_windows(plan.pending, spec.shards_in_flight)
        logger.info("job %s: %d shards, %d rows; %d shards (%d rows) already done; %d windows to run%s", plan.job_id,
                    len(plan.shards), plan.rows_total, len(plan.shards) - len(plan.pending), plan.rows_skipped,
                    len(windows), f" on the Dask cluster {spec.cluster}" if spec.cluster else "")
        progress_id = create_progress_artifact(
            progress=0.0 if todo_rows else 100.0, key=PROGRESS_KEY,
            description=f"rows done of {todo_rows} for {spec.output}")

        window_task = generate_window.with_options(
            retries=shard_retries,
            retry_delay_seconds=exponential_backoff(backoff_factor=retry_delay_s) if retry_delay_s > 0 else 0,
        )
        token = plan.lease.token() if plan.lease is not None else None
        done_rows = 0
        failure: Optional[BaseException] = None

        collected: set[int] = set()  # the window futures counted (or failed)

        def collect(fut: Any) -> None:
            """Count a finished window's result once (raises what the window raised)."""
            nonlocal done_rows
            try:
                value = fut.result()
            except _INTERRUPTS:
                raise
            except BaseException:
                collected.add(id(fut))
                raise
            if id(fut) in collected:
                return
            run = WindowRun.from_json(value)
            collected.add(id(fut))
            runs.append(run)
            results.extend(run.results)
            done_rows += sum(r.rows for r in run.results)
            update_progress_artifact(progress_id, 100.0 * done_rows / max(todo_rows, 1))

        with _cluster_runner(spec) as runner:
            futures: list[Any] = []
            try:
                with _resources(spec, runner):
                    for window in windows:
                        # "auto" as the manifest recorded it: every window computes with the job's dtype
                        params = dict(spec=engine_spec(as_planned(spec, plan), plan.dtype), window=window, run_id=plan.run_id, lease=token,
                                      storage_secret=storage_secret, columns=plan.columns,
                                      structured=plan.structured)
                        futures.append(runner.submit(window_task, parameters=params) if runner is not None
                                       else window_task.submit(**params))
                for fut in as_completed(futures):
                    try:
                        collect(fut)
                    except _INTERRUPTS:
                        raise
                    except BaseException as exc:  # noqa: BLE001 - let the other windows finish, then fail
                        failure = failure or exc
            except BaseException:  # Ctrl-C (or Prefect's TerminationSignal) with windows in flight
                _settle_windows([f for f in futures if id(f) not in collected], collect, logger)
                raise
        if failure is not None:
            raise failure
        steps = None
        for run in runs:
            steps = add_steps(steps, run.engine_steps)
        report = finish_job(plan, results, model=spec.model, quantization=quantization(),
                            device=job_device(plan, results), engine_steps=steps, device_count=device_count())
    except BaseException as exc:
        results.extend(_committed_without_result(plan, results, exc, logger))
        interrupted = isinstance(exc, _INTERRUPTS)
        booked = abort_job(plan, results, exc, model=spec.model, quantization=quantization(),
                           device=job_device(plan, results, look_up=False), device_count=device_count(),
                           interrupted=interrupted)
        if interrupted and not isinstance(exc, JobInterrupted):
            done = len(plan.shards) - len(plan.pending) + len(results)
            signum = getattr(exc, "signum", None) or getattr(exc, "signal", None) or signal.SIGINT
            stopped = JobInterrupted(done, len(plan.shards), int(signum), booked)
            if isinstance(exc, KeyboardInterrupt):
                raise stopped from None
            # Prefect's TerminationSignal (SIGTERM) goes on up as it is: Prefect marks the run Cancelled (a
            # cancel from the server) or Crashed by it, then delivers SIGTERM to the process's own handler
            # (`tokenmill run --cluster`: 143). `interruption(exc)` finds `stopped` on it.
            exc.tokenmill_interrupted = stopped  # type: ignore[attr-defined]
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
