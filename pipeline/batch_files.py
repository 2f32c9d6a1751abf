"""OpenAI Batch request files as a job's input, and OpenAI Batch result and error files as its output.

Input: `stage_requests` reads each request file of the input (`.jsonl`, `.jsonl.gz`: one file, a
folder or prefix of them, a glob, on any fsspec URL) once, turns its lines into job rows
(`pipeline.openai_batch.parse_request_lines`: one row per non-blank line, bad lines included, as rows
whose `request_error` names the problem) and keeps them as one Parquet table per file under
`OUTPUT/_job/requests/`. From there the job is a job like any other: it plans the rows (prefix groups
across the whole file), cuts shards, runs, resumes. The job's fingerprint is that of the request files
(path, size, ETag or mtime, lines), so a changed file is a changed job.

Output: `write_batch_parts` writes a committed shard's rows (the part file's rows: those of the
attempt that committed first) as `results-NNNNN.jsonl` (good rows) and `errors-NNNNN.jsonl` (failed
rows, only when there are some), each first-wins like the part file, in the order of the input lines.
When the job writes no Parquet output (`--output-format jsonl`, the default for request files), its
part files, the record the exactly-once commit keeps, go under `OUTPUT/_job/parts/`.
"""
from __future__ import annotations

import gzip
import hashlib
import json
import time
from dataclasses import dataclass
from io import BytesIO
from typing import Any, Optional

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq

from pipeline import io, manifest
from pipeline.storage import StorageError, storage_call
from pipeline.openai_batch import (
    REQUEST_COLUMNS, REQUEST_SUFFIXES, error_line, model_names, parse_request_lines, result_line,
)

REQUEST_SCHEMA = pa.schema([
    ("custom_id", pa.string()), ("line", pa.int64()), ("url", pa.string()), ("model", pa.string()),
    ("prompt", pa.string()), ("messages", pa.string()), ("prompt_token_ids", pa.list_(pa.int64())),
    ("sampling_params", pa.string()), ("chat_template", pa.bool_()), ("request_error", pa.string()),
    ("error_code", pa.string()),
])
assert tuple(REQUEST_SCHEMA.names) == REQUEST_COLUMNS

STAGED_DIR = "requests"  # OUTPUT/_job/requests/requests-NNNNN.parquet: the request files' rows
PARTS_DIR = "parts"  # OUTPUT/_job/parts/part-NNNNN.parquet: part files of a job that writes no Parquet output


def is_request_input(url: str, storage_options: Optional[dict[str, Any]] = None) -> bool:
    """Whether `url` names OpenAI Batch request files: a name (or pattern) ending in .jsonl / .jsonl.gz, or a
    folder or prefix holding such files and no Parquet files. Never raises for a missing input (the
    Parquet listing then says what is missing)."""
    path = str(url).split("?", 1)[0].rstrip("/")
    if path.endswith(REQUEST_SUFFIXES):
        return True
    if path.endswith(".parquet"):
        return False
    try:
        io.find_files(url, (".parquet",), "Parquet", storage_options)
        return False
    except (FileNotFoundError, StorageError):
        pass
    try:
        return bool(io.find_files(url, REQUEST_SUFFIXES, "request (.jsonl)", storage_options))
    except (FileNotFoundError, StorageError):
        return False


def read_lines(url: str, storage_options: Optional[dict[str, Any]]) -> list[bytes]:
    """The lines of one JSONL file (gunzipped when its name ends in .gz), as bytes.

    Raises:
        StorageError: the read failed.
        ValueError: a .gz file that is not gzip.
    """
    fs, path = io.filesystem(url, storage_options)
    with storage_call("read", url, io.resolve_storage_options(url, storage_options)):
        data = fs.cat_file(path)
    if url.endswith(".gz"):
        try:
            data = gzip.decompress(data)
        except (OSError, EOFError) as exc:
            raise ValueError(f"{url} is not a gzip file ({exc})") from None
    return data.splitlines()


@dataclass
class StagedRequests:
    """The rows of a job's request files (`stage_requests`).

    Attributes:
        sources: the request files (their identity is the job's fingerprint; `num_rows`: request lines).
        files: the staged Parquet tables as input files (OUTPUT/_job/requests/...), what the job plans and reads.
        tables: their rows, in the same order.
    """

    sources: list[io.InputFile]
    files: list[io.InputFile]
    tables: list[pa.Table]

    def write(self, storage_options: Optional[dict[str, Any]] = None) -> None:
        """Write each staged table that is not there yet (a resume keeps the first run's; they are the same rows).

        Raises:
            StorageError: a write failed.
        """
        for f, table in zip(self.files, self.tables):
            if not io.exists(f.path, storage_options):
                io.write_bytes(f.path, parquet_bytes(table), storage_options)


def parquet_bytes(table: pa.Table) -> bytes:
    """`table` as the bytes of a zstd-compressed Parquet file."""
    buf = BytesIO()
    pq.write_table(table, buf, compression="zstd")
    return buf.getvalue()


def stage_requests(output: str, input_url: str, model: str, served_model_name: Optional[list[str]] = None,
                   storage_options: Optional[dict[str, Any]] = None) -> StagedRequests:
    """Read and parse every request file at `input_url` (nothing is written: `StagedRequests.write` does).

    A repeated custom_id is found across the files too (the first line keeps it). A `model` that is not
    the job's (`openai_batch.model_names` of `model` and `served_model_name`) makes an error line.

    Raises:
        FileNotFoundError: no request files there.
        StorageError: a read failed.
        ValueError: a .gz file that is not gzip.
    """
    found = io.find_files(input_url, REQUEST_SUFFIXES, "request (.jsonl)", storage_options)
    names = model_names(model, served_model_name)
    seen: dict[str, str] = {}
    sources, files, tables = [], [], []
    for k, (full, info) in enumerate(found):
        lines = read_lines(full, storage_options)
        label = full.rsplit("/", 1)[-1] if len(found) > 1 else ""
        rows = parse_request_lines(lines, names, seen, source=label)
        table = pa.Table.from_pylist(rows, schema=REQUEST_SCHEMA)
        url = manifest.job_url(output, STAGED_DIR, f"requests-{k:05d}.parquet")
        sources.append(io.InputFile(path=full, size=int(info["size"]), etag=io.file_etag(info),
                                    num_rows=len(rows), columns=("custom_id", "method", "url", "body")))
        files.append(io.InputFile(path=url, size=0, etag=None, num_rows=table.num_rows,
                                  columns=tuple(REQUEST_SCHEMA.names), schema=REQUEST_SCHEMA))
        tables.append(table)
    return StagedRequests(sources, files, tables)


# ---------------------------------------------------------------- output

def result_names(part_name: str) -> tuple[str, str]:
    """The result and error file names of a part file: part-00003.parquet -> (results-00003.jsonl,
    errors-00003.jsonl)."""
    stem = part_name.removeprefix("part-").removesuffix(".parquet")
    return f"results-{stem}.jsonl", f"errors-{stem}.jsonl"


def job_key(output: str) -> str:
    """A short stable key of a job's output, from which the ids in its lines are derived."""
    return hashlib.blake2b(str(output).encode(), digest_size=6).hexdigest()


def batch_lines(rows: list[dict], output: str, model: str, created: Optional[int] = None
                ) -> tuple[list[dict], list[dict]]:
    """(result lines, error lines) of a part file's rows, in input line order."""
    key = job_key(output)
    created = int(time.time()) if created is None else created
    ordered = sorted(rows, key=lambda r: r.get("line") or 0)
    results = [result_line(r, key, model, created) for r in ordered if r.get("error") is None]
    errors = [error_line(r, key) for r in ordered if r.get("error") is not None]
    return results, errors


def jsonl_bytes(lines: list[dict], gzipped: bool = False) -> bytes:
    """`lines` as JSONL bytes (one JSON object a line, UTF-8), gzip-compressed when `gzipped`."""
    data = "".join(json.dumps(x, ensure_ascii=False) + "\n" for x in lines).encode()
    return gzip.compress(data) if gzipped else data


def write_batch_parts(output: str, part_name: str, rows: pl.DataFrame, model: str,
                      storage_options: Optional[dict[str, Any]] = None) -> None:
    """Write a committed part file's rows as OUTPUT/results-NNNNN.jsonl and (when some failed)
    OUTPUT/errors-NNNNN.jsonl, first-wins: a file an earlier attempt wrote (from the same part file) stays.

    Raises:
        StorageError: a write failed (the shard is not done; a rerun writes what is missing).
    """
    results, errors = batch_lines(rows.to_dicts(), output, model)
    res_name, err_name = result_names(part_name)
    io.create_exclusive(io.join(output, res_name), jsonl_bytes(results), storage_options)
    if errors:
        io.create_exclusive(io.join(output, err_name), jsonl_bytes(errors), storage_options)


def is_output_name(name: str) -> bool:
    """Whether a file name at the output is one of a job's result or error files."""
    return name.startswith(("results-", "errors-")) and name.endswith(".jsonl")
