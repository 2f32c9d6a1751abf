"""Serve `batch_generate` on a cron schedule, with its JobSpec from a YAML or JSON file.

    python -m flows.deploy job.yaml --cron "0 2 * * *" [--name nightly-labels]

The file holds JobSpec fields at the top level, or under `spec:` next to an
optional `deployment:` section (`name`, `cron` (UTC), `tags`,
`shard_retries`, `retry_delay_s`); command-line options win over the file:

    spec:
      input: s3://datasets/prompts/
      output: s3://datasets/labels/
      max_tokens: 8
      price_per_hour: 3.5
    deployment:
      name: nightly-labels
      cron: "0 2 * * *"

`flow.serve` registers the deployment with the Prefect API that is configured
(`PREFECT_API_URL`, e.g. a `prefect server start`), then polls for scheduled
runs and executes them in this process until stopped. Each scheduled run
resumes the job at the same output: done shards are skipped, so a nightly
run over an unchanged dataset finishes at once, and a changed dataset is
refused until the spec sets `overwrite: true` or a new output. Keep
credentials out of the file (they would be stored as flow parameters): the
serving process's AWS_* environment variables are used by default.
"""
from __future__ import annotations

import argparse
import sys
from typing import Any, Optional, Sequence

from pipeline.job import JobSpec, load_spec_file


def load_deployment(path: str, *, name: Optional[str] = None, cron: Optional[str] = None) -> tuple[JobSpec, dict[str, Any]]:
    """The JobSpec and deployment settings (name, cron, ...) from a spec file plus overrides.

    Raises:
        ValueError: no cron schedule given, or invalid spec fields.
    """
    fields, rest = load_spec_file(path)
    spec = JobSpec(**fields)
    dep = dict(rest.get("deployment") or {})
    if name:
        dep["name"] = name
    if cron:
        dep["cron"] = cron
    if not dep.get("cron"):
        raise ValueError(f"{path}: no cron schedule (set deployment.cron in the file or pass --cron)")
    dep.setdefault("name", "tokenmill-batch-generate")
    return spec, dep


def serve(path: str, *, name: Optional[str] = None, cron: Optional[str] = None) -> None:
    """Serve the flow on the file's schedule (blocks until interrupted)."""
    from flows.batch_generate import batch_generate

    spec, dep = load_deployment(path, name=name, cron=cron)
    params: dict[str, Any] = {"spec": spec.model_dump(mode="json")}
    for key in ("shard_retries", "retry_delay_s"):
        if key in dep:
            params[key] = dep[key]
    batch_generate.serve(
        name=dep["name"],
        cron=dep["cron"],
        parameters=params,
        tags=list(dep.get("tags") or ["tokenmill"]),
        description=f"tokenmill batch job {spec.input} -> {spec.output}",
    )


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flows.deploy", description=__doc__.split("\n\n")[0])
    parser.add_argument("spec_file", help="YAML or JSON JobSpec file")
    parser.add_argument("--cron", help='cron schedule, e.g. "0 2 * * *" (overrides the file)')
    parser.add_argument("--name", help="deployment name (overrides the file)")
    args = parser.parse_args(argv)
    serve(args.spec_file, name=args.name, cron=args.cron)
    return 0


if __name__ == "__main__":
    sys.exit(main())
