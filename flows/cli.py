"""The `tokenmill` command (the console script): `pipeline.cli.main`, with `--cluster` jobs run through the
Prefect flow on a Dask cluster.

`pipeline` never imports `flows` (nor Prefect): `python -m pipeline` is the same command without
`--cluster`, which it refuses in one line. This module passes `run_on_cluster` to it.
"""
from __future__ import annotations

import sys
from typing import Any, Optional, Sequence

from pipeline.cli import main as pipeline_main
from pipeline.spec import JobSpec


def run_on_cluster(spec: JobSpec) -> dict[str, Any]:
    """Run the job through the Prefect flow on the Dask cluster `spec.cluster`; returns the cost report row.

    Raises:
        ValueError: prefect-dask is not installed, no Prefect server is configured or the one at
            PREFECT_API_URL does not answer (`flows.batch_generate.check_prefect_api`), or what the flow raises.
        JobInterrupted: SIGINT or SIGTERM stopped the flow run once it held the output (its booked
            report on it), as `run_job` raises it.
    """
    try:
        import prefect_dask  # noqa: F401
    except ImportError:
        raise ValueError("--cluster needs prefect-dask and distributed (pip install prefect-dask distributed)") \
            from None
    from flows.batch_generate import batch_generate, check_prefect_api, interruption

    check_prefect_api(spec)
    print(f"tokenmill: running on the Dask cluster {spec.cluster} through the Prefect flow batch-generate",
          file=sys.stderr)
    try:
        return batch_generate(spec)
    except BaseException as exc:
        stopped = interruption(exc)  # SIGTERM: Prefect's TerminationSignal, then our handler's Interrupted
        if stopped is None:
            raise
        raise stopped from None


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the `tokenmill` command; returns the exit code (see `pipeline.cli`)."""
    return pipeline_main(argv, run_on_cluster=run_on_cluster)


if __name__ == "__main__":
    sys.exit(main())
