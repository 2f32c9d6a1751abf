"""`tokenmill convert SRC DST`: OpenAI Batch files to Parquet tables and back, on any fsspec URL.

Three directions, chosen by DST's name and SRC's lines:

- request lines -> a prompt table (`requests_to_prompts`; DST ends in .parquet, SRC's lines are
  requests): one row per non-blank line, `id` = custom_id, `model`, `prompt` / `messages` /
  `prompt_token_ids`, `chat_template` (false for /v1/completions: the prompt as given), the sampling
  columns a job reads (`max_tokens`, `temperature`, `top_p`, `seed`, `stop`) and `sampling_params`
  (JSON of the other SamplingParams fields), parsed by `pipeline.openai_batch.parse_request_lines`,
  the same parser a job of request files uses, so `tokenmill run --input prompts.parquet` gives the
  results the request file gives. A bad line is a row whose `request_error` names it and its line
  (the job writes it as an error row).
- a prompt table -> request lines (`prompts_to_requests`; DST ends in .jsonl or .jsonl.gz): one line
  per row, `/v1/chat/completions` for a `messages` row or a `prompt` row under the chat template (a
  user message, after the row's `system`), `/v1/completions` for `prompt_token_ids` or a `prompt` row
  with `chat_template` false; the body's fields from the row's sampling columns
  (`openai_batch.body_fields`). A row that cannot be a request is left out and named.
- output and error lines -> one JSONL file (`merge_results`; DST ends in .jsonl or .jsonl.gz, SRC's
  lines are results): every line of a job's result and error files, in the order of the request
  lines (a job plans rows by shared prefix, so its part files are in input order each, not across
  each other; the order comes from the job's staged requests under SRC/_job/requests/), lines of
  custom_ids the job does not know after them, in the order read.
- output and error lines -> a table (`results_to_table`; DST ends in .parquet, SRC's lines are
  results: a job's output folder, its results-*.jsonl / errors-*.jsonl, or any OpenAI Batch output
  file): one row per line, one column per field (`openai_batch.RESULT_FIELDS`, then `file`, `line`).
  A line that cannot be read is a row whose `error_code` / `error_message` name it and its line.
"""
from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass, field
from typing import Any, Optional

import pyarrow as pa
import pyarrow.parquet as pq

from engine.config import prompt_text_error, prompt_type_error
from pipeline import io
from pipeline.batch_files import STAGED_DIR, jsonl_bytes, parquet_bytes, read_lines
from pipeline.openai_batch import (
    BLANK, CHAT_URL, COMPLETIONS_URL, REQUEST_SUFFIXES, RESULT_FIELDS, LineError, body_fields, json_line,
    parse_request_lines, parse_result_line,
)
from pipeline.schema import CONSTRAINT_COLUMNS, OVERRIDE_COLUMNS, parse_messages, row_overrides
from pipeline.storage import plural, storage_call

PARQUET_MAGIC = b"PAR1"  # the first 4 bytes of a Parquet file

# The sampling fields that get a column of their own in a prompt table (the job reads each), by Arrow type.
SAMPLING_COLUMNS = {"max_tokens": pa.int64(), "temperature": pa.float64(), "top_p": pa.float64(),
                    "seed": pa.int64(), "stop": pa.list_(pa.string())}
MESSAGE_TYPE = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))
PROMPT_SCHEMA = pa.schema([
    ("id", pa.string()), ("model", pa.string()), ("prompt", pa.string()), ("messages", MESSAGE_TYPE),
    ("prompt_token_ids", pa.list_(pa.int64())), ("chat_template", pa.bool_()), *SAMPLING_COLUMNS.items(),
    ("sampling_params", pa.string()), ("request_error", pa.string()),
])
RESULT_SCHEMA = pa.schema([
    ("custom_id", pa.string()), ("id", pa.string()), ("request_id", pa.string()), ("status_code", pa.int64()),
    ("object", pa.string()), ("model", pa.string()), ("created", pa.int64()), ("content", pa.string()),
    ("finish_reason", pa.string()),
    ("choices", pa.list_(pa.struct([("content", pa.string()), ("finish_reason", pa.string())]))),
    ("prompt_tokens", pa.int64()), ("completion_tokens", pa.int64()), ("total_tokens", pa.int64()),
    ("cached_tokens", pa.int64()), ("error_code", pa.string()), ("error_message", pa.string()),
    ("file", pa.string()), ("line", pa.int64()),
])
assert tuple(RESULT_SCHEMA.names[:len(RESULT_FIELDS)]) == RESULT_FIELDS


@dataclass
class Converted:
    """What `convert` did.

    Attributes:
        kind: "requests -> prompts", "prompts -> requests", "results -> table" or "results -> jsonl".
        sources: the files read.
        rows: rows (or lines) written to DST.
        errors: one message per bad line or row ("requests.jsonl line 7: ..."); bad request lines and
            result lines are written as error rows, bad prompt rows are left out.
        without_model: request lines written without body.model (prompts -> requests: no `model` cell, no
            `model` argument); OpenAI's Batch API requires it, tokenmill answers them with its model.
    """

    kind: str
    sources: list[str]
    rows: int
    errors: list[str] = field(default_factory=list)
    without_model: int = 0


def _line_sources(src: str, storage_options: Optional[dict[str, Any]]) -> list[tuple[str, list[bytes]]]:
    found = io.find_files(src, REQUEST_SUFFIXES, "JSONL (.jsonl, .jsonl.gz)", storage_options)
    return [(full, read_lines(full, storage_options)) for full, _ in found]


def _is_result_file(lines: list[bytes]) -> Optional[bool]:
    """Whether a file's first JSON object line is an output line (response / error) rather than a
    request (url / body / method); None when no line tells."""
    for raw in lines:
        try:
            obj = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError):
            continue
        if isinstance(obj, dict) and ({"url", "body", "method"} & set(obj)):
            return False
        if isinstance(obj, dict) and ({"response", "error"} & set(obj)):
            return True
    return None


def _fits(value: Any, typ: pa.DataType) -> bool:
    """Whether a sampling value goes into its typed column as it is (else it stays in sampling_params,
    where the job's own check names it)."""
    if typ == pa.int64():
        return isinstance(value, int) and not isinstance(value, bool) and -2**63 <= value < 2**63
    if typ == pa.float64():
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, list) and all(isinstance(s, str) for s in value)


def _prompt_row(row: dict[str, Any]) -> dict[str, Any]:
    """A parsed request row (`parse_request_lines`) as a prompt table row (`PROMPT_SCHEMA`)."""
    out = {"id": row["custom_id"], "model": row["model"], "prompt": row["prompt"],
           "prompt_token_ids": row["prompt_token_ids"], "chat_template": row["chat_template"],
           "messages": json.loads(row["messages"]) if row["messages"] is not None else None,
           "request_error": row["request_error"], "sampling_params": None}
    fields = json.loads(row["sampling_params"]) if row["sampling_params"] is not None else {}
    for name, typ in SAMPLING_COLUMNS.items():
        value = fields.get(name)
        out[name] = fields.pop(name) if value is not None and _fits(value, typ) else None
    if fields:
        out["sampling_params"] = json.dumps(fields, ensure_ascii=False, sort_keys=True)
    return out


def requests_to_prompts(sources: list[tuple[str, list[bytes]]]) -> tuple[pa.Table, list[str]]:
    """Request files' lines -> (a prompt table, `PROMPT_SCHEMA`; the bad lines' messages). Any `model` is
    accepted (the job that runs the table does not check it); a custom_id repeated across the files is
    an error row, as in a job."""
    seen: dict[str, str] = {}
    rows, errors = [], []
    for full, lines in sources:
        label = full.rsplit("/", 1)[-1]
        for row in parse_request_lines(lines, None, seen, source=label):
            rows.append(_prompt_row(row))
            if row["request_error"] is not None:
                errors.append(row["request_error"])
    return pa.Table.from_pylist(rows, schema=PROMPT_SCHEMA), errors


def request_of_row(row: dict[str, Any], columns: set[str], custom_id: Optional[str],
                   model: Optional[str] = None, id_column: str = "id") -> dict[str, Any]:
    """One prompt table row as a request line's object {custom_id, method, url, body}.

    Args:
        row: the row's cells (`prompt` / `messages` / `prompt_token_ids`, the override columns of
            `pipeline.schema`, `model`).
        columns: the table's columns.
        custom_id: the row's id (None: an error, named by `id_column`).
        model: body.model when the row has no `model` cell.

    Raises:
        ValueError: a row that cannot be a request (its `request_error`, a bad cell, no prompt, an
            empty or non-text prompt, two constraint columns, a sampling field no body has), in words
            that name the cell (the job's words for the same row).
    """
    if row.get("request_error") is not None:
        raise ValueError(f"request_error: {row['request_error']}")
    if custom_id is None:
        raise ValueError(f"{id_column} is null")
    cells = row_overrides(row, [c for c in OVERRIDE_COLUMNS if c in columns and c != "request_error"])
    system = cells.pop("system", None)
    token_ids = cells.pop("prompt_token_ids", None)
    templated = cells.pop("chat_template", True)
    constraints = [c for c in CONSTRAINT_COLUMNS if c in cells]
    if len(constraints) > 1:
        raise ValueError(f"set at most one constraint column per row, got {constraints}")
    if constraints:
        name = constraints[0]
        cells["structured_outputs"] = {"json" if name == "json_schema" else name: cells.pop(name)}
    cells.update(cells.pop("sampling_params", {}))
    messages, prompt = row.get("messages"), row.get("prompt")
    if token_ids is not None:  # the prompt as token ids (as the job reads the row): no template, no system
        messages = None
    elif messages is not None:
        messages = parse_messages(messages)
        if system is not None and messages[0]["role"] != "system":
            messages = [{"role": "system", "content": system}, *messages]
    elif prompt is None:
        raise ValueError("prompt and messages are both null")
    else:  # the job's rules for a prompt cell, so a request it would make an error row is left out here
        problem = prompt_type_error(prompt) or prompt_text_error(prompt)
        if problem is not None:
            raise ValueError(problem)
    if token_ids is None and messages is None and templated:
        messages = [*([{"role": "system", "content": system}] if system is not None else []),
                    {"role": "user", "content": prompt}]
    chat = messages is not None
    body: dict[str, Any] = {}
    name = row.get("model") if isinstance(row.get("model"), str) else model
    if name is not None:
        body["model"] = name
    if chat:
        body["messages"] = messages
    elif token_ids is not None:
        body["prompt"] = token_ids
    else:
        body["prompt"] = prompt if system is None else f"{system}\n\n{prompt}"  # as the job joins them
    try:
        body.update(body_fields(cells, chat))
    except LineError as exc:
        raise ValueError(str(exc)) from None
    return {"custom_id": custom_id, "method": "POST", "url": CHAT_URL if chat else COMPLETIONS_URL, "body": body}


def _cell_id(value: Any) -> Optional[str]:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return None
    return str(value) if not isinstance(value, bytes) else value.decode("utf-8", "replace")


def prompts_to_requests(src: str, id_column: str = "id", model: Optional[str] = None,
                        storage_options: Optional[dict[str, Any]] = None) -> tuple[list[str], list[dict], list[str]]:
    """The Parquet files at `src` -> (the files, one request object per good row in order, the bad rows'
    messages: "prompts.parquet row 3 (id 'a'): ..."; rows counted from 0). custom_id is the row's
    `id_column` cell (the row's index across the files when the table has no such column).

    Raises:
        FileNotFoundError, StorageError, ValueError: as `pipeline.io.list_input_files`; a table with
            neither `prompt` nor `messages` (ValueError).
    """
    files = io.list_input_files(src, storage_options)
    so = io.resolve_storage_options(src, storage_options)
    requests, errors, index = [], [], 0
    for f in files:
        columns = set(f.columns)
        if not columns & {"prompt", "messages", "prompt_token_ids"}:
            raise ValueError(f"{f.path} has neither a prompt nor a messages column; found {sorted(columns)}")
        fs, path = io.filesystem(f.path, storage_options)
        with storage_call("read", f.path, so), fs.open(path, "rb") as fh:
            table = pq.read_table(fh)
        label = f.path.rsplit("/", 1)[-1]
        for k, row in enumerate(table.to_pylist()):
            cid = _cell_id(row.get(id_column)) if id_column in columns else str(index)
            index += 1
            where = f"{label} row {k}" + (f" (id {cid!r})" if cid is not None else "")
            try:
                raw = row.get(id_column)
                if cid is None and isinstance(raw, float):  # as a job says it (`pipeline.schema`)
                    raise ValueError(f"{id_column} is NaN (a missing value)")
                requests.append(request_of_row(row, columns, cid, model, id_column))
            except ValueError as exc:
                errors.append(f"{where}: {exc}")
    return [f.path for f in files], requests, errors


def results_to_table(sources: list[tuple[str, list[bytes]]]) -> tuple[pa.Table, list[str]]:
    """Output and error files' lines -> (a table, `RESULT_SCHEMA`: one row per non-blank line, in file
    order; the unreadable lines' messages, each also a row with error_code invalid_json / invalid_result)."""
    rows, errors = [], []
    for full, lines in sources:
        label = full.rsplit("/", 1)[-1]
        for number, raw in enumerate(lines, start=1):
            try:
                obj = json_line(raw)
                if obj is BLANK:
                    continue
                row = parse_result_line(obj)
            except LineError as exc:
                message = f"{label} line {number}: {exc}"
                errors.append(message)
                row = {name: None for name in RESULT_FIELDS} | {"error_code": exc.code, "error_message": message}
            rows.append(row | {"file": label, "line": number})
    return pa.Table.from_pylist(rows, schema=RESULT_SCHEMA), errors


def _input_order(src: str, storage_options: Optional[dict[str, Any]]) -> dict[Any, tuple[int, int]]:
    """{custom_id: (request file index, line)} from a job output's staged requests
    (SRC/_job/requests/*.parquet, `pipeline.batch_files.stage_requests`), and for a line without a
    custom_id {("error", its error message): (file index, line)}; {} where SRC has none."""
    base = src.split("?", 1)[0].rstrip("/")
    try:
        found = io.find_files(io.join(base, "_job", STAGED_DIR), (".parquet",), "Parquet", storage_options)
    except (OSError, ValueError):  # no staged requests there (FileNotFoundError), or not a folder
        return {}
    order: dict[Any, tuple[int, int]] = {}
    for n, (full, _) in enumerate(found):
        df = io.read_parquet(full, storage_options).select("custom_id", "line", "request_error")
        for cid, line, error in df.iter_rows():
            key = cid if cid is not None else ("error", error)
            order.setdefault(key, (n, int(line or 0)))
    return order


def merge_results(src: str, sources: list[tuple[str, list[bytes]]],
                  storage_options: Optional[dict[str, Any]] = None) -> tuple[list[dict], list[str]]:
    """(every output and error line of `sources`, in the order of the job's request lines; the bad
    lines, named by file and line). A line is placed by its custom_id, or without one by its error
    message (which names its request line); lines the job's staged requests do not place come after
    the others, in the order read."""
    order = _input_order(src, storage_options)
    keyed, errors = [], []
    for n, (full, lines) in enumerate(sources):
        for k, raw in enumerate(lines, 1):
            if not raw.strip():
                continue
            try:
                obj = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                errors.append(f"{full} line {k}: not JSON ({exc})")
                continue
            if not isinstance(obj, dict):
                errors.append(f"{full} line {k}: not a JSON object")
                continue
            cid, err = obj.get("custom_id"), obj.get("error")
            message = err.get("message") if isinstance(err, dict) else None
            where = order.get(cid) if isinstance(cid, str) else order.get(("error", message))
            keyed.append(((0, *where) if where else (1, n, k), obj))
    keyed.sort(key=lambda t: t[0])
    return [obj for _, obj in keyed], errors


def convert(src: str, dst: str, id_column: str = "id", model: Optional[str] = None, overwrite: bool = False,
            storage_options: Optional[dict[str, Any]] = None) -> Converted:
    """Convert `src` into `dst` (the direction from DST's suffix and SRC's lines; see the module docstring).

    Args:
        src: request or output files (.jsonl / .jsonl.gz: a file, a folder or prefix, a glob), or a prompt
            table (Parquet: a file, a folder, a glob); any fsspec URL.
        dst: one file: .parquet, or .jsonl / .jsonl.gz (gzip).
        id_column: the prompt table's id column (prompts -> requests).
        model: body.model for rows without a `model` cell (prompts -> requests).
        overwrite: replace an existing `dst` (otherwise refused).

    Raises:
        ValueError: a DST of another kind, an existing DST without `overwrite`, SRC lines that are
            neither requests nor results.
        FileNotFoundError, StorageError: nothing at SRC, a failed read or write.
    """
    path = dst.split("?", 1)[0]
    if not path.endswith((".parquet", *REQUEST_SUFFIXES)):
        raise ValueError(f"convert writes .parquet, .jsonl or .jsonl.gz files; {dst} is none of them")
    if not overwrite and io.exists(dst, storage_options):
        raise ValueError(f"{dst} exists; pass --overwrite to replace it")
    if path.endswith(REQUEST_SUFFIXES) and not src.split("?", 1)[0].endswith(".parquet"):
        try:
            sources = _line_sources(src, storage_options)
        except FileNotFoundError:
            sources = []  # no JSONL at SRC: a prompt table
        kinds = {_is_result_file(lines) for _, lines in sources} - {None}
        if sources and kinds == {True}:
            lines, errors = merge_results(src, sources, storage_options)
            io.write_bytes(dst, jsonl_bytes(lines, path.endswith(".gz")), storage_options)
            return Converted("results -> jsonl", [full for full, _ in sources], len(lines), errors)
        if sources and kinds == {False}:  # (it was read as a Parquet table: "... is not a Parquet file")
            raise ValueError(f"{src} holds request lines already: a job reads them as they are; convert writes "
                             f"them as a prompt table to a .parquet DST")
    if path.endswith(REQUEST_SUFFIXES):
        files, requests, errors = prompts_to_requests(src, id_column, model, storage_options)
        io.write_bytes(dst, jsonl_bytes(requests, path.endswith(".gz")), storage_options)
        without_model = sum(1 for r in requests if "model" not in r.get("body", {}))
        return Converted("prompts -> requests", files, len(requests), errors, without_model)
    try:
        sources = _line_sources(src, storage_options)
    except FileNotFoundError as exc:
        raise FileNotFoundError(f"{exc}{_parquet_output_hint(src, storage_options)}") from None
    tables = [full for full, lines in sources if lines and lines[0].startswith(PARQUET_MAGIC)]
    if tables:  # (its bytes were read as request lines: one invalid_json row per "line")
        name = src if len(sources) == 1 else tables[0]
        raise ValueError(f"{name} is a Parquet table already: a job reads it as it is; convert writes a prompt "
                         f"table as request lines to a .jsonl DST")
    kinds = {_is_result_file(lines) for _, lines in sources} - {None}
    if len(kinds) > 1:
        raise ValueError(f"{src} holds both request lines and output lines; convert them one kind at a time")
    if kinds == {True}:
        table, errors = results_to_table(sources)
        kind = "results -> table"
    else:
        table, errors = requests_to_prompts(sources)
        kind = "requests -> prompts"
    io.write_bytes(dst, parquet_bytes(table), storage_options)
    return Converted(kind, [full for full, _ in sources], table.num_rows, errors)


def _parquet_output_hint(src: str, storage_options: Optional[dict[str, Any]]) -> str:
    """A clause for a SRC folder that holds a Parquet job's part files (`part-*.parquet`) and no JSONL, else ""."""
    try:
        parts = [n for n in io.list_names(src, storage_options) if n.startswith("part-") and n.endswith(".parquet")]
    except (OSError, ValueError):
        return ""
    return (f": it holds a job's Parquet part files ({parts[0]}, ...), which are a table already; convert reads "
            f"OpenAI Batch request or results JSONL into one") if parts else ""


# ---------------------------------------------------------------- the command

def add_parser(sub: Any, parents: list[argparse.ArgumentParser], kv: Any) -> argparse.ArgumentParser:
    """Add `tokenmill convert` to the `tokenmill` subparsers (`kv`: the KEY=VALUE option type)."""
    p = sub.add_parser("convert", parents=parents,
                       help="OpenAI Batch request JSONL <-> a Parquet prompt table; output JSONL -> a Parquet table")
    p.add_argument("src", help="requests.jsonl(.gz), a job's output folder or results file, or a Parquet prompt table")
    p.add_argument("dst", help="the file to write: .parquet, .jsonl or .jsonl.gz")
    p.add_argument("--id-column", default="id", help="the prompt table's id column (Parquet -> JSONL; default id)")
    p.add_argument("--model", help="body.model for rows without a model column (Parquet -> JSONL)")
    p.add_argument("--overwrite", action="store_true", help="replace DST when it exists")
    p.add_argument("--storage-option", dest="storage_options", type=kv, action="append", metavar="KEY=VALUE",
                   help="fsspec/s3fs option, as for run")
    p.set_defaults(func=cmd_convert, command_parser=p)
    return p


def cmd_convert(args: argparse.Namespace) -> int:
    """Run `tokenmill convert`: print what was written, and each bad line or row on stderr; exit 0 (bad
    lines and rows do not fail it: they are error rows, or left out and named)."""
    import sys

    so = dict(args.storage_options) if args.storage_options else None
    done = convert(args.src, args.dst, args.id_column, args.model, args.overwrite, so)
    back = done.kind in ("prompts -> requests", "results -> jsonl")  # lines written; bad ones left out
    print(f"{done.kind}: {plural(done.rows, 'line' if back else 'row')} from {plural(len(done.sources), 'file')} "
          f"-> {args.dst}")
    if done.errors:
        verdict = "left out" if back else "kept as error rows"
        print(f"tokenmill convert: {plural(len(done.errors), 'bad row' if back else 'bad line')} ({verdict}):",
              file=sys.stderr)
        for message in done.errors[:20]:
            print(f"  {message}", file=sys.stderr)
        if len(done.errors) > 20:
            print(f"  ... and {len(done.errors) - 20} more", file=sys.stderr)
    if done.without_model:
        print(f"tokenmill convert: warning: {plural(done.without_model, 'line')} without body.model (OpenAI's Batch "
              f"API requires it; --model sets it, a `model` column sets it per row)", file=sys.stderr)
    return 0
