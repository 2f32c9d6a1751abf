"""Committing a shard exactly once: its part file, then its done marker.

The invariant: every input row appears exactly once, in one part file, and a done marker's counts are
those of that part file, however many attempts of a shard reach the commit and wherever they stop.
The code that keeps it begins here (`commit_shard`, `drop_markers_of_lost_parts`).

Output layout:

    OUTPUT/part-00000.parquet ...       one per shard, written atomically
    OUTPUT/_job/manifest.json           fingerprint (inputs, spec, model) and shard plan
    OUTPUT/_job/done/part-00000.json    one marker per committed shard, with its counts
    OUTPUT/_job/runs/run-<t>-<id>.parquet  one cost row per run, whatever its status (see pipeline.cost)
    OUTPUT/_job/lease/lease-NNNNNNNN.json  the running run's lease (see pipeline.lease)

A shard is done when its marker exists; the marker is written after the part
file. Both are written first-wins (`io.create_exclusive`: a conditional PUT on
S3, a hard link on a local disk), so of two attempts of one shard that both
reach the commit (a worker declared dead that was still running, a retried
PUT whose answer was lost) the first one's part file stays, whole, and the
second adopts it: it checks that the file holds this shard's ids, counts the
rows from the file, and writes the marker if there is none yet (the first
marker stays too). A run killed between part file and marker leaves the part
file; the re-run computes the shard again and adopts that file. Every input
row appears exactly once, in one part file, and a marker's counts are those of
the part file. A run commits only while it holds the output's lease (workers
check it through a `LeaseToken`), so two runs never compute one shard at the
same time.
"""
from __future__ import annotations

import os
import socket
import time
import warnings
from collections import Counter
from dataclasses import dataclass
from datetime import datetime, timezone
from io import BytesIO
from typing import Optional, Union

import polars as pl

from pipeline import io, manifest
from pipeline.batch_files import PARTS_DIR, write_batch_parts
from pipeline.cost import TokenCounts
from pipeline.lease import Lease, LeaseToken
from pipeline.manifest import ShardResult
from pipeline.planner import Shard
from pipeline.schema import InputLayout, output_schema
from pipeline.spec import JobSpec, JobSpecChanged
from pipeline.storage import storage_call


@dataclass
class ShardState:
    shard: Shard
    frame: pl.DataFrame
    layout: InputLayout
    results: list[Optional[dict]]
    remaining: int
    started: float
    structured: bool = False
    scored: bool = False
    choices: bool = False


def default_worker() -> str:
    """HOST:PID of this process: the worker name recorded for shards run outside a cluster."""
    return f"{socket.gethostname()}:{os.getpid()}"


def _counts(gen: pl.DataFrame, labels: list[str]) -> TokenCounts:
    """The token counts of a part file's generation columns (`labels`: the valid choice labels)."""
    err = gen.get_column("error").is_not_null()
    counts = TokenCounts(
        rows_ok=int((~err).sum()),
        rows_error=int(err.sum()),
        prompt_tokens=int(gen.get_column("prompt_tokens").sum()),
        cached_tokens=int(gen.get_column("cached_tokens").sum()),
        completion_tokens=int(gen.get_column("completion_tokens").sum()),
        spec_draft_tokens=int(gen.get_column("spec_draft_tokens").sum()),
        spec_accepted_tokens=int(gen.get_column("spec_accepted_tokens").sum()),
    )
    if "valid" in gen.columns:
        valid = gen.get_column("valid")
        counts.rows_valid = int(valid.eq(True).sum())
        counts.rows_invalid = int(valid.eq(False).sum())
        counts.labels = {k: int(v) for k, v in sorted(Counter(labels).items())}
    return counts


PART_WORKER_KEY = "tokenmill.worker"  # Parquet key-value metadata of a part file: the worker that wrote it


def _adopt_part(spec: JobSpec, shard: Shard, url: str, ids: pl.Series,
                structured: bool) -> tuple[pl.DataFrame, list[str], str]:
    """The part file another attempt of this shard committed first: (its rows, its valid choice labels,
    the worker that wrote it, from the file's metadata; "" if it has none).

    Labels are counted for a job-wide `choice` constraint or `score_choices`; the labels of rows
    constrained by their own `choice` column are not recovered from the file (only the marker's
    label distribution misses them; the rows are whole).

    Raises:
        JobSpecChanged: the file holds other ids than this shard (something else wrote the output).
        StorageError: it could not be read.
    """
    fs, path = io.filesystem(url, spec.storage_options)
    with storage_call("read", url, io.resolve_storage_options(url, spec.storage_options)):
        data = fs.cat_file(path)
    existing = pl.read_parquet(BytesIO(data))
    writer = pl.read_parquet_metadata(BytesIO(data)).get(PART_WORKER_KEY, "")
    theirs = existing.get_column(ids.name).to_list() if ids.name in existing.columns else None
    if theirs != ids.to_list():
        raise JobSpecChanged(f"{url} already exists and does not hold shard {shard.index}'s rows (was the output "
                             f"written by something else?); re-run with --overwrite to start over")
    labels: list[str] = []
    so = spec.structured_outputs()
    if structured and "valid" in existing.columns and (spec.score_choices is not None or (so and so.kind == "choice")):
        col = "label" if "label" in existing.columns else "generation"
        labels = [v for v, ok in zip(existing.get_column(col).to_list(), existing.get_column("valid").to_list())
                  if ok and v is not None]
    return existing, labels, writer


def commit_shard(spec: JobSpec, state: ShardState, device: str, run_id: str,
            lease: Optional[Union[Lease, LeaseToken]] = None, worker: str = "") -> ShardResult:
    """Write the shard's part file, then its done marker (after checking the run still holds the output's
    lease), each first-wins: a part file another attempt committed first is kept and adopted (see the
    module docstring), and the returned result is the marker's.

    Raises:
        LeaseLost: another run took the output over, or the run ended; nothing is written.
        JobSpecChanged: a part file at this shard's name holds other rows.
        StorageError: the part file or the marker could not be written; the shard is not done.
    """
    if lease is not None:
        lease.check()
    shard, df, layout = state.shard, state.frame, state.layout
    so = spec.storage_options
    if layout.id_in_input:
        ids = df.get_column(layout.id_column)
    else:
        ids = pl.Series(layout.id_column, shard.dataset_rows(), pl.Int64)
    passthrough = {c: df.schema[c] for c in layout.passthrough}
    schema = output_schema(layout.id_column, ids.dtype, passthrough, spec.n, state.structured, state.scored,
                           state.choices)
    gen_cols = [c for c in schema if c != layout.id_column and c not in passthrough]
    gen = pl.DataFrame({c: [r.get(c) for r in state.results] for c in gen_cols},
                       schema={c: schema[c] for c in gen_cols})
    out = pl.concat([pl.DataFrame([ids.alias(layout.id_column)]), df.select(layout.passthrough), gen],
                    how="horizontal")
    url = part_url(spec, shard.name)
    worker = worker or default_worker()
    buf = BytesIO()
    out.write_parquet(buf, compression="zstd", metadata={PART_WORKER_KEY: worker})
    adopted = not io.create_exclusive(url, buf.getvalue(), so)
    writer = worker
    if adopted:  # an earlier attempt's part file (a worker lost mid-commit, a killed run): keep it
        out, labels, writer = _adopt_part(spec, shard, url, ids.alias(layout.id_column), state.structured)
        writer = writer or worker
        gen = out.select([c for c in gen_cols if c in out.columns])
    else:
        labels = [r.get("_label") for r in state.results if r is not None and r.get("_label") is not None]
    if "jsonl" in spec.output_formats():  # from the committed part file's rows, before the marker
        write_batch_parts(spec.output, shard.name, out, spec.model, so)
    result = ShardResult(index=shard.index, rows=shard.length, counts=_counts(gen, labels), device=device,
                         seconds=time.perf_counter() - state.started, worker=writer)
    return manifest.mark_done(spec.output, shard.name, result,
                              {"run_id": run_id, "finished_at": datetime.now(timezone.utc).isoformat(),
                               "adopted_part": adopted, "committed_by": worker}, so)


def part_url(spec: JobSpec, name: str) -> str:
    """Where a part file `name` goes: the output folder, or `_job/parts/` for a job that writes no Parquet
    output (`--output-format jsonl`: the part file is then only the record of the commit)."""
    if "parquet" in spec.output_formats():
        return io.join(spec.output, name) if name else spec.output
    return manifest.job_url(spec.output, PARTS_DIR, *([name] if name else []))


def drop_markers_of_lost_parts(spec: JobSpec, shards: list[Shard], done: dict[int, ShardResult]
                                ) -> dict[int, ShardResult]:
    """`done` without the shards whose part file is gone (deleted after its commit): their done markers
    are removed, with a warning naming them, so this run computes them again. Called by the run that
    holds the output's lease, before any shard runs; one listing of the output folder."""
    present = set(io.list_names(part_url(spec, ""), spec.storage_options))
    lost = [s for s in shards if s.index in done and s.name not in present]
    if not lost:
        return done
    names = ", ".join(s.name for s in lost[:5]) + (f" and {len(lost) - 5} more" if len(lost) > 5 else "")
    warnings.warn(f"{spec.output}: {names} missing though the job's done marker says committed (deleted "
                  f"since?): {sum(s.length for s in lost)} rows of {len(lost)} shard{'s' if len(lost) > 1 else ''} "
                  f"computed again", stacklevel=3)
    for s in lost:
        io.remove(manifest.marker_url(spec.output, s.name), spec.storage_options)
    return {i: r for i, r in done.items() if i not in {s.index for s in lost}}
