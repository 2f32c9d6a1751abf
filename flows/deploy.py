"""Serve `batch_generate` on a cron schedule, with its JobSpec from a YAML or JSON file.

    python -m flows.deploy job.yaml --cron "0 2 * * *" [--name nightly-labels]

The file holds JobSpec fields at the top level, or under `spec:` next to an
optional `deployment:` section (`name`, `cron` (UTC), `tags`,
`shard_retries`, `retry_delay_s`, `storage_secret`); command-line options win
over the file:

    spec:
      input: s3://datasets/prompts/
      output: s3://datasets/labels/
      max_tokens: 8
      price_per_hour: 3.5
      cluster: tcp://scheduler.internal:8786   # optional: run the windows on this Dask cluster
    deployment:
      name: nightly-labels
      cron: "0 2 * * *"

`cluster:` (a Dask scheduler address) may also sit under `deployment:`; either
way it becomes the spec's `cluster`, so each scheduled run connects to that
scheduler and runs its windows on the cluster's workers (one engine per
worker; see flows/batch_generate.py). The workers need the code, the model and
`PREFECT_API_URL` of the same Prefect server as the serving process.

`flow.serve` registers the deployment with the Prefect API that is configured
(`PREFECT_API_URL`, e.g. a `prefect server start`), then polls for scheduled
runs and executes them in this process until stopped. Each scheduled run
resumes the job at the same output: done shards are skipped, so a nightly
run over an unchanged dataset finishes at once, and a changed dataset is
refused until the spec sets `overwrite: true` or a new output.

Credentials never go in the file: a spec whose `storage_options` hold one is
refused (flow parameters are stored in Prefect's database). The serving
process's AWS_* environment variables are used, or `storage_secret: NAME`
names a Prefect Secret block whose value is a dict of storage options.

The flow runs of a served deployment execute in a new process that loads
`flows/batch_generate.py` and validates the parameters from JSON; the test
`tests/test_flow_deploy_server.py` runs this against a real `prefect server`.

Stopping it (Ctrl-C, SIGTERM) ends with one line of its own, `flows.deploy: stopped ...`, exit
status 0 once Prefect has paused the deployment's schedule (its runner shuts down on either
signal and logs that it paused it), 128 + the signal's number when the signal came before the
deployment was served (while the spec was read, the temporary server started or the deployment
registered), where it had printed the traceback of whatever Prefect was waiting on. Without a
configured server (`PREFECT_API_URL`) the command starts Prefect's temporary server itself
(`start_temporary_server`), so that an interrupt during that start stops it at once.
"""
from __future__ import annotations

import argparse
import signal
import sys
from typing import Any, Optional, Sequence

from pipeline.spec import JobSpec, load_spec_file


def load_deployment(path: str, *, name: Optional[str] = None, cron: Optional[str] = None) -> tuple[JobSpec, dict[str, Any]]:
    """The JobSpec and deployment settings (name, cron, ...) from a spec file plus overrides.

    Raises:
        ValueError: no cron schedule given, invalid spec fields (named, with the file), a spec every
            run would refuse (`pipeline.spec.validate_spec`: `max_tokens: 0`, an unknown engine option, ...),
            a negative deployment.shard_retries, an unknown top-level key, two different clusters, or
            credentials in the spec's storage_options.
    """
    from pydantic import ValidationError

    from flows.batch_generate import check_retry_delay, check_shard_retries, refuse_inline_secrets
    from pipeline.spec import spec_errors, spec_field_lines, validate_spec

    fields, rest = load_spec_file(path)
    unknown = sorted(set(rest) - {"deployment"})
    if unknown:
        raise ValueError(f"{path}: unknown top-level key(s) {unknown}; expected 'spec' and 'deployment' (the cluster "
                         f"goes under either, as cluster: tcp://HOST:8786)")
    dep = dict(rest.get("deployment") or {})
    if "cluster" in dep:  # where the runs go may sit with the schedule; it is the spec's field
        if fields.get("cluster") not in (None, dep["cluster"]):
            raise ValueError(f"{path}: spec.cluster {fields['cluster']!r} and deployment.cluster {dep['cluster']!r} "
                             f"differ; give it once")
        fields["cluster"] = dep.pop("cluster")
    try:
        spec = JobSpec(**fields)
    except ValidationError as exc:
        problems = spec_errors(exc, lines=spec_field_lines(path))  # `line 4: max_tokns: unknown option; ...`
        raise ValueError(f"{path}: invalid job spec:\n  " + "\n  ".join(problems)) from None
    refuse_inline_secrets(spec)
    try:  # what every scheduled run would refuse is refused now, in the run's words
        validate_spec(spec)
        if "shard_retries" in dep:
            check_shard_retries(dep["shard_retries"])
        if "retry_delay_s" in dep:
            check_retry_delay(dep["retry_delay_s"])
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None
    if name:
        dep["name"] = name
    if cron:
        dep["cron"] = cron
    if not dep.get("cron"):
        raise ValueError(f"{path}: no cron schedule (set deployment.cron in the file or pass --cron)")
    dep.setdefault("name", "tokenmill-batch-generate")
    return spec, dep


def serve(path: str, *, name: Optional[str] = None, cron: Optional[str] = None) -> None:
    """Serve the flow on the file's schedule (blocks until interrupted).

    Raises:
        ValueError: the file's spec or deployment settings are refused (see `load_deployment`).
        FileNotFoundError: no such file.
    """
    from flows.batch_generate import batch_generate

    spec, dep = load_deployment(path, name=name, cron=cron)
    start_temporary_server()
    params: dict[str, Any] = {"spec": spec.model_dump(mode="json")}
    for key in ("shard_retries", "retry_delay_s", "storage_secret"):
        if key in dep:
            params[key] = dep[key]
    batch_generate.serve(
        name=dep["name"],
        cron=dep["cron"],
        parameters=params,
        tags=list(dep.get("tags") or ["tokenmill"]),
        description=f"tokenmill batch job {spec.input} -> {spec.output}",
    )


def start_temporary_server() -> None:
    """Start Prefect's temporary API server in this thread when no server is configured (no
    `PREFECT_API_URL`), before `flow.serve` would start it from Prefect's event-loop thread: there
    a Ctrl-C did not reach the start, which went on until the server answered or its startup timeout
    (90 s, see flows/__init__.py) ran out, a second Ctrl-C ignored too. Here an interrupt (Ctrl-C,
    or SIGTERM through `_stop_on_sigterm`) stops the server process it started and goes on up (so the
    command ends with its one line); Prefect then finds the server running and uses it.

    Raises:
        KeyboardInterrupt: the start was interrupted; the server process is stopped.
        RuntimeError: the server did not answer within the startup timeout (Prefect's message).
    """
    from prefect.settings import PREFECT_API_URL, PREFECT_SERVER_EPHEMERAL_ENABLED

    if PREFECT_API_URL.value() or not PREFECT_SERVER_EPHEMERAL_ENABLED.value():
        return
    from prefect.server.api.server import SubprocessASGIServer

    server = SubprocessASGIServer()
    try:
        server.start()
    except BaseException:
        _stop_server(server)
        raise


def _stop_server(server: Any) -> None:
    """Stop a temporary server whose start was cut short: terminate its process, kill it after 5 s or at
    another interrupt, and drop Prefect's record of it."""
    proc = server.server_process
    try:
        if proc is not None and proc.poll() is None:
            proc.terminate()
            proc.wait(timeout=5)
    except BaseException:  # a second Ctrl-C, or it did not stop within 5 s
        proc.kill()
        proc.wait()
    finally:
        server.stop()


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flows.deploy", description=__doc__.split("\n\n")[0],
                                     allow_abbrev=False)  # `--cro` is refused, not taken for --cron (as tokenmill)
    parser.add_argument("spec_file", help="YAML or JSON JobSpec file")
    parser.add_argument("--cron", help='cron schedule, e.g. "0 2 * * *" (overrides the file)')
    parser.add_argument("--name", help="deployment name (overrides the file)")
    args = parser.parse_args(argv)
    previous = _stop_on_sigterm()
    try:
        serve(args.spec_file, name=args.name, cron=args.cron)
    except (ValueError, FileNotFoundError) as exc:
        print(f"flows.deploy: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as exc:  # before Prefect's runner took the signals over: nothing is served
        signum = int(getattr(exc, "signum", signal.SIGINT))
        print(f"flows.deploy: stopped by {signal.Signals(signum).name} before the deployment was served",
              file=sys.stderr)
        return 128 + signum
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    print("flows.deploy: stopped; Prefect paused the deployment's schedule (serve it again to resume)",
          file=sys.stderr)
    return 0


class _Stopped(KeyboardInterrupt):
    """SIGTERM, raised as an interrupt (as Ctrl-C's SIGINT is), so that one `except` ends the command."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _stop_on_sigterm() -> object:
    """Make SIGTERM raise `_Stopped` until Prefect's runner installs its own handler (its graceful
    shutdown); Python's default ends the process with no word. Returns the handler it replaced, or
    None where it cannot set one (not the main thread)."""
    def stop(signum: int, frame: object) -> None:
        raise _Stopped(signum)

    try:
        return signal.signal(signal.SIGTERM, stop)
    except ValueError:
        return None


if __name__ == "__main__":
    sys.exit(main())
