"""Parquet and JSON on any fsspec URL (s3://, gs://, file://, local paths), with atomic writes.

Storage options are fsspec/s3fs-style (`endpoint_url`, `key`, `secret`,
`client_kwargs`, ...). For `s3://` URLs, options not given fall back to the
standard AWS environment variables (`AWS_ENDPOINT_URL`, `AWS_ACCESS_KEY_ID`,
`AWS_SECRET_ACCESS_KEY`, `AWS_DEFAULT_REGION`). `polars_storage_options` maps
them to the different keys polars' own object-store reader expects.

Atomic write: a file is written under a temporary name and then moved to its
final name; on S3 the final key appears whole (copy), on a local disk by
rename. Readers never see half a file. `create_exclusive` is the first-wins
form (a conditional PUT on S3, a hard link on a local disk): of two writers of
one name, the first keeps its bytes and the second is told the file exists.

Limits and errors (see `pipeline.storage`): every `s3://` filesystem gets
bounded connect/read timeouts and retries (`config_kwargs`, overridable), a
write has a deadline, and any failure is raised as a `StorageError` naming the
URL, the operation and the likely cause. Buckets are never created: object
stores have no folders, so a write never calls `makedirs` there, and
`check_bucket` names a bucket that does not exist.
"""
from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional, Sequence

import fsspec
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
from fsspec.asyn import AsyncFileSystem
from fsspec.core import url_to_fs
from fsspec.utils import glob_translate

from pipeline.storage import (
    StorageError, bucket_of, config_kwargs, no_such_bucket, printable, s3fs_retries, storage_call, write_deadline_s,
)


# Temp files of atomic writes start with "." so that readers of a folder (pyarrow datasets,
# `part-*` globs) skip them.
TEMP_PREFIX = ".tmp-"


@dataclass(frozen=True)
class InputFile:
    """One input Parquet file.

    Attributes:
        path: the full URL (protocol included, e.g. "s3://bucket/x.parquet").
        size: bytes.
        etag: the store's ETag (S3/GCS) or, for local files, the mtime in ns.
        num_rows: rows, from the Parquet footer.
        columns: column names, from the footer.
        schema: the Arrow schema, from the footer (not part of the job's fingerprint: the
            other fields already identify the file's content).
    """

    path: str
    size: int
    etag: Optional[str]
    num_rows: int
    columns: tuple[str, ...] = ()
    schema: Optional[pa.Schema] = field(default=None, compare=False, repr=False)

    def identity(self) -> dict[str, Any]:
        """The fields that identify the file's content (what a job's fingerprint hashes)."""
        return {"path": self.path, "size": self.size, "etag": self.etag, "num_rows": self.num_rows,
                "columns": list(self.columns)}


def resolve_storage_options(url: str, storage_options: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """Options for fsspec: the given ones, plus AWS environment defaults and the botocore limits
    (`pipeline.storage.DEFAULT_CONFIG_KWARGS`, overridden key by key by a `config_kwargs` option) for s3:// URLs."""
    opts = dict(storage_options or {})
    if str(url).startswith(("s3://", "s3a://")):
        opts["config_kwargs"] = config_kwargs(opts)
        env = os.environ
        if "endpoint_url" not in opts and env.get("AWS_ENDPOINT_URL"):
            opts["endpoint_url"] = env["AWS_ENDPOINT_URL"]
        if "key" not in opts and env.get("AWS_ACCESS_KEY_ID"):
            opts["key"] = env["AWS_ACCESS_KEY_ID"]
        if "secret" not in opts and env.get("AWS_SECRET_ACCESS_KEY"):
            opts["secret"] = env["AWS_SECRET_ACCESS_KEY"]
        region = env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION")
        if region and "client_kwargs" not in opts:
            opts["client_kwargs"] = {"region_name": region}
    return opts


def polars_storage_options(storage_options: dict[str, Any]) -> dict[str, str]:
    """Translate s3fs-style options to polars' (object_store) keys.

    polars silently ignores `key`/`secret` and then tries instance metadata,
    so they must be renamed: key -> aws_access_key_id, secret ->
    aws_secret_access_key, endpoint_url -> aws_endpoint_url, region -> aws_region.
    """
    out: dict[str, str] = {}
    names = {"key": "aws_access_key_id", "secret": "aws_secret_access_key",
             "endpoint_url": "aws_endpoint_url", "token": "aws_session_token"}
    for k, v in storage_options.items():
        if k in names:
            out[names[k]] = str(v)
    region = (storage_options.get("client_kwargs") or {}).get("region_name")
    if region:
        out["aws_region"] = region
    if out.get("aws_endpoint_url", "").startswith("http://"):
        out["aws_allow_http"] = "true"
    return out


def filesystem(url: str, storage_options: Optional[dict[str, Any]] = None) -> tuple[fsspec.AbstractFileSystem, str]:
    """(filesystem, path without protocol) for a URL.

    Raises:
        ValueError: an unknown protocol or a bad storage option (the message names the URL).
    """
    opts = resolve_storage_options(url, storage_options)
    if str(url).startswith(("http://", "https://")):
        opts = _http_options(opts)
    try:
        fs, path = url_to_fs(str(url), **opts)
    except (ValueError, TypeError, ImportError) as exc:
        raise ValueError(f"cannot open {url}: {exc}") from None
    if "s3" in _protocols(fs):
        fs.retries = s3fs_retries(storage_options)  # s3fs's own retry layer, on top of botocore's attempts
    return fs, path


def _http_options(opts: dict[str, Any]) -> dict[str, Any]:
    """fsspec HTTP options with the same connect and read limits as s3:// URLs get (`connect_timeout`,
    `read_timeout` of `pipeline.storage.DEFAULT_CONFIG_KWARGS`, overridden by a `config_kwargs` option),
    as aiohttp's `ClientTimeout(sock_connect, sock_read)`; no limit on a whole transfer. Without them a
    server that accepts the connection and never answers held a job for aiohttp's 5 minutes per
    request, HEAD and then GET. A `timeout` in the given `client_kwargs` is kept."""
    import aiohttp  # fsspec's HTTP file system runs on it

    out = dict(opts)
    cfg = config_kwargs(out)
    out.pop("config_kwargs", None)  # botocore's settings: the HTTP file system would pass them to each request
    client = dict(out.get("client_kwargs") or {})
    client.setdefault("timeout", aiohttp.ClientTimeout(total=None, sock_connect=float(cfg["connect_timeout"]),
                                                       sock_read=float(cfg["read_timeout"])))
    out["client_kwargs"] = client
    return out


def _protocols(fs: fsspec.AbstractFileSystem) -> tuple[str, ...]:
    return fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)


def is_local(fs: fsspec.AbstractFileSystem) -> bool:
    """True for the local file system (which has real folders)."""
    return bool({"file", "local"} & set(_protocols(fs)))


def check_bucket(url: str, storage_options: Optional[dict[str, Any]] = None, operation: str = "check") -> None:
    """Raise unless the bucket of an object-store URL exists (nothing to check for local paths).

    Raises:
        StorageError: kind "no-bucket" naming the bucket, or why the check itself failed
            (cannot connect, timeout, ...). Access denied on the bucket counts as existing:
            the operation itself will then say what is denied.
    """
    bucket = bucket_of(url)
    if bucket is None:
        return
    fs, _ = filesystem(url, storage_options)
    if is_local(fs):
        return
    so = resolve_storage_options(url, storage_options)
    try:
        with storage_call(operation, url, so, passthrough=(FileNotFoundError, PermissionError)):
            if "s3" in _protocols(fs):
                fs.call_s3("head_bucket", Bucket=bucket)
            elif not fs.exists(bucket):
                raise FileNotFoundError(bucket)
    except FileNotFoundError:
        raise no_such_bucket(operation, url, bucket) from None
    except PermissionError:
        return


def _full_url(fs: fsspec.AbstractFileSystem, path: str) -> str:
    return fs.unstrip_protocol(path)


def _etag(info: dict[str, Any]) -> Optional[str]:
    for key in ("ETag", "etag", "md5Hash", "mtime", "LastModified", "created"):
        if info.get(key) is not None:
            v = info[key]
            return str(v).strip('"') if key.lower() == "etag" else f"{key}:{v}"
    return None


GLOB_CHARS = "*?["  # fsspec's glob: `*` and `?` within a path segment, `**` across segments, `[...]` a set


def is_glob(url: str) -> bool:
    """True when `url` is a glob pattern (`data/*.parquet`, `s3://b/2026-*/part-*.parquet`)."""
    return any(ch in str(url) for ch in GLOB_CHARS)


def glob_base(path: str) -> str:
    """The folder part of a glob pattern before its first wildcard segment (`b/in/*.parquet` -> `b/in`)."""
    cut = min((path.index(ch) for ch in GLOB_CHARS if ch in path), default=len(path))
    return path[:cut].rsplit("/", 1)[0] if "/" in path[:cut] else ""


def glob_matches(pattern_path: str, path: str) -> bool:
    """Whether `path` (no protocol) is one that the glob `pattern_path` (no protocol) matches, by fsspec's rules."""
    return re.match(glob_translate(pattern_path), path) is not None


def _hidden_under(path: str, base: str) -> bool:
    """True when a component of `path` below `base` starts with "_" or "." (job metadata, temp files)."""
    return any(part.startswith(("_", ".")) for part in path[len(base):].split("/"))


def list_input_files(url: str, storage_options: Optional[dict[str, Any]] = None) -> list[InputFile]:
    """The Parquet files at `url`, sorted: one file, every *.parquet under a folder/prefix, or every
    *.parquet file a glob pattern matches (`data/*.parquet`, `s3://bucket/prefix/*.parquet`, `**` for
    any depth; fsspec's glob, on local paths and object stores alike).

    Files whose names (or folders, below the folder or the pattern's fixed part) start with "_" or "."
    are skipped (job metadata, temp files).

    Raises:
        FileNotFoundError: when nothing is found: a local path that does not exist (`input <url> does
            not exist`, see `missing_local_input`), a folder or prefix without Parquet files (`no
            Parquet files at <url>`), a pattern no Parquet file matches (named).
        StorageError: an http(s) URL whose server cannot be reached (`cannot read <url>: the URL could
            not be reached (<error class>: <message>)`) or answers an error status (`cannot read <url>:
            the server answered HTTP 404 (Not Found)`), or another storage failure.
        ValueError: a file that is not Parquet (the message names it).
    """
    so = resolve_storage_options(url, storage_options)
    fs, _ = filesystem(url, storage_options)
    files = []
    for full, info in find_files(url, (".parquet",), "Parquet", storage_options):
        with storage_call("read", full, so), fs.open(info["name"], "rb") as f:
            try:
                pf = pq.ParquetFile(f)
            except pa.ArrowInvalid as exc:  # e.g. "Parquet magic bytes not found", without the file's name
                raise ValueError(f"{full} is not a Parquet file ({printable(exc)})") from None
            num_rows, columns = pf.metadata.num_rows, tuple(pf.schema_arrow.names)
            schema = pf.schema_arrow
        files.append(InputFile(path=full, size=int(info["size"]), etag=_etag(info),
                               num_rows=num_rows, columns=columns, schema=schema))
    return files


def find_files(url: str, suffixes: tuple[str, ...], kind: str,
               storage_options: Optional[dict[str, Any]] = None) -> list[tuple[str, dict[str, Any]]]:
    """(full URL, fsspec info) of the files at `url` whose names end with one of `suffixes`, sorted: one
    file, those under a folder/prefix, or those a glob pattern matches (see `list_input_files`; `kind`
    names them in messages: "Parquet").

    Raises:
        FileNotFoundError, StorageError: as `list_input_files`.
    """
    fs, path = filesystem(url, storage_options)
    so = resolve_storage_options(url, storage_options)
    path = path.rstrip("/")
    pattern = is_glob(path)
    base = glob_base(path) if pattern else path
    _invalidate(fs, base)
    if not pattern and _is_web(fs):
        _check_reachable(fs, path, url, so)
    with storage_call("list", url, so, passthrough=(FileNotFoundError,)):
        try:
            if pattern:
                found = fs.glob(path, detail=True)
                infos = [info for p, info in sorted(found.items())
                         if info.get("type") == "file" and p.endswith(suffixes) and not _hidden_under(p, base)]
            elif fs.isfile(path):
                infos = [fs.info(path)]
            else:
                found = fs.find(path, detail=True)
                infos = [info for p, info in sorted(found.items())
                         if p.endswith(suffixes) and not _hidden_under(p, path)]
        except FileNotFoundError:
            infos = []
    if not infos:
        check_bucket(url, storage_options, "list")
        if pattern:
            raise FileNotFoundError(f"no {kind} files match the pattern {url}")
        if is_local(fs) and not fs.exists(path):
            raise FileNotFoundError(missing_local_input(url, path))
        raise FileNotFoundError(f"no {kind} files at {url}")
    return [(_full_url(fs, info["name"]), info) for info in infos]


def file_etag(info: dict[str, Any]) -> Optional[str]:
    """The store's ETag of a file (S3/GCS), or for a local file its mtime in ns, from its fsspec info."""
    return _etag(info)


def missing_local_input(url: str, path: str) -> str:
    """The message for a local input path that does not exist: `input <url> does not exist`, and for a
    relative path the folder it was read from (a spec file's relative paths are read from the current
    folder, not the spec's)."""
    where = "" if os.path.isabs(str(url)) or "://" in str(url) else f" (read from the current folder, {os.getcwd()})"
    return f"input {url} does not exist{where}"


@contextlib.contextmanager
def _damaged_data(url: str) -> Iterator[None]:
    """Name the file when pyarrow finds its data damaged (`ArrowInvalid`, e.g. "Invalid or truncated
    PLAIN-encoded BYTE_ARRAY data", which names no file); its first line is quoted through `printable`.
    Damage pyarrow reports as an OSError (a page header that does not parse) becomes a StorageError
    in `storage_call`, quoted the same way.

    Raises:
        ValueError: `cannot read <url>: <pyarrow's message>`.
    """
    try:
        yield
    except pa.ArrowInvalid as exc:
        text = str(exc).strip()
        raise ValueError(f"cannot read {url}: {printable(text.splitlines()[0]) if text else 'ArrowInvalid'}") from None


def _is_web(fs: fsspec.AbstractFileSystem) -> bool:
    """True for fsspec's HTTP file system (http:// and https:// URLs)."""
    return bool({"http", "https"} & set(_protocols(fs)))


def _check_reachable(fs: fsspec.AbstractFileSystem, path: str, url: str, storage_options: dict[str, Any]) -> None:
    """Raise when the server of an http(s) URL cannot be reached at all, or answers an error status.

    fsspec's HTTP file system answers "no such file" (`isfile` False, `find` empty) whatever went
    wrong, so a refused connection, an unknown host or a timeout would read as "no Parquet files at
    <url>", and so would a 404. One HEAD/GET here tells them apart: a server that answers with a
    success status passes (the listing then says what it finds); an error status is named.

    Raises:
        StorageError: kind "connect", naming the URL and the connection error's class and message;
            for an error status (HEAD and then GET both answered one), naming the status and its
            reason: `cannot read <url>: the server answered HTTP 404 (Not Found)` (kind "not-found"
            for 404 and 410, "denied" for 401 and 403, "other" otherwise).
    """
    import aiohttp  # fsspec's HTTP file system runs on it

    try:
        fs.info(path)
        return
    except FileNotFoundError as exc:  # fsspec's wrapping of whatever the request raised
        cause = exc.__cause__ or exc.__context__
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
        cause = exc
    if isinstance(cause, aiohttp.ClientResponseError):  # the server answered, with an error status
        status, reason = cause.status, printable(cause.message or "").strip()
        kind = {404: "not-found", 410: "not-found", 401: "denied", 403: "denied"}.get(status, "other")
        raise StorageError("read", url, f"the server answered HTTP {status}" + (f" ({reason})" if reason else ""),
                           kind=kind)
    if cause is None:
        return
    if not isinstance(cause, (aiohttp.ClientError, asyncio.TimeoutError, OSError)):
        return
    text = str(cause).strip()
    detail = f"{type(cause).__name__}: {printable(text.splitlines()[0])}" if text else type(cause).__name__
    raise StorageError("read", url, f"the URL could not be reached ({detail})", kind="connect")


INVALID_UTF8_COLUMN = "__tokenmill_invalid_utf8__"
"""Added by the readers below where a row's text is not valid UTF-8: the names of its bad string
columns (comma-separated; null for good rows). `pipeline.schema.build_request` makes such a row an
error row; the job drops the column before writing."""


def _strings_as_bytes(t: pa.DataType) -> pa.DataType:
    """t with every string type in it (also inside lists and structs) made large_binary."""
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return pa.large_binary()
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        inner = pa.field(t.value_field.name, _strings_as_bytes(t.value_type), t.value_field.nullable)
        return pa.list_(inner) if pa.types.is_list(t) else pa.large_list(inner)
    if pa.types.is_struct(t):
        return pa.struct([pa.field(f.name, _strings_as_bytes(f.type), f.nullable) for f in t])
    return t


def _decode_strings(value: Any) -> tuple[Any, bool]:
    """value (from `_strings_as_bytes`'s type) with its bytes decoded as UTF-8 (U+FFFD for bad bytes),
    and whether every one was valid."""
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8"), True
        except UnicodeDecodeError:
            return value.decode("utf-8", "replace"), False
    if isinstance(value, list):
        items = [_decode_strings(v) for v in value]
        return [v for v, _ in items], all(ok for _, ok in items)
    if isinstance(value, dict):
        items = {k: _decode_strings(v) for k, v in value.items()}
        return {k: v for k, (v, _) in items.items()}, all(ok for _, ok in items.values())
    return value, True


def _to_polars(table: pa.Table) -> pl.DataFrame:
    """`pl.from_arrow(table)`, with the values of string columns that are not valid UTF-8 replaced.

    Parquet writers such as pyarrow store whatever bytes a string column was given, and polars
    trusts them until it converts a value to Python, where it panics (the whole job would die on
    one row). A bad value is decoded with U+FFFD for its bad bytes (so outputs stay valid Parquet),
    and its row named in `INVALID_UTF8_COLUMN`. Strings nested in lists and structs (a `messages`
    column of {role, content}) are checked too.
    """
    bad: dict[int, list[str]] = {}
    for i, field in enumerate(table.schema):
        as_bytes = _strings_as_bytes(field.type)
        if as_bytes == field.type:  # no strings in it
            continue
        column = table.column(i)
        try:
            column.validate(full=True)
            continue
        except pa.ArrowInvalid:
            pass
        raw = column.cast(as_bytes, safe=False).to_pylist()
        fixed = []
        for r, value in enumerate(raw):
            decoded, ok = _decode_strings(value)
            fixed.append(decoded)
            if not ok:
                bad.setdefault(r, []).append(field.name)
        table = table.set_column(i, field, pa.array(fixed, field.type))
    df = pl.from_arrow(table)
    if bad:
        df = df.with_columns(pl.Series(INVALID_UTF8_COLUMN, [", ".join(bad[r]) if r in bad else None
                                                             for r in range(table.num_rows)], dtype=pl.String))
    return df


def read_rows(url: str, offset: int, length: int, storage_options: Optional[dict[str, Any]] = None) -> pl.DataFrame:
    """Rows [offset, offset+length) of one Parquet file, reading only the row groups that hold them
    (text that is not valid UTF-8: see `_to_polars`).

    Raises:
        StorageError: the read failed (names the URL and the cause, in printable characters).
        ValueError: the file's data is damaged (`cannot read <url>: ...`).
    """
    fs, path = filesystem(url, storage_options)
    with storage_call("read", url, resolve_storage_options(url, storage_options)), _damaged_data(url), \
            fs.open(path, "rb") as f:
        pf = pq.ParquetFile(f)
        groups, start, first_start = [], 0, None
        for g in range(pf.metadata.num_row_groups):
            n = pf.metadata.row_group(g).num_rows
            if start + n > offset and start < offset + length:
                groups.append(g)
                if first_start is None:
                    first_start = start
            start += n
        if not groups:
            table = pf.schema_arrow.empty_table()
            return pl.from_arrow(table)
        table = pf.read_row_groups(groups)
    table = table.slice(offset - first_start, length)
    return _to_polars(table)


def join(url: str, *parts: str) -> str:
    """URL join with "/" (works for local paths and object stores)."""
    return "/".join([str(url).rstrip("/"), *parts])


def _put(fs: fsspec.AbstractFileSystem, path: str, data: bytes, so: dict[str, Any], exclusive: bool = False) -> None:
    """Write `data` at `path`: under the write deadline on object stores, creating folders only on a local disk.

    With `exclusive`, the file is created only if absent (else FileExistsError), and whole: on a
    local disk it is written under a temp name and hard-linked to `path` (`link` fails if `path`
    exists, and a reader never sees half a file); on S3 one conditional PUT (`If-None-Match: *`).
    """
    if is_local(fs):
        parent = path.rsplit("/", 1)[0]
        fs.makedirs(parent, exist_ok=True)
        if not exclusive:
            with fs.open(path, "wb") as f:
                f.write(data)
            return
        tmp = f"{parent}/{TEMP_PREFIX}{uuid.uuid4().hex}-{path.rsplit('/', 1)[-1]}"
        try:  # the temp file goes whether the write (a full disk) or the link fails
            try:
                f = open(tmp, "xb")
            except FileNotFoundError:  # the folder went since makedirs (a run releasing the output's lease
                fs.makedirs(parent, exist_ok=True)  # removes `_job/lease/` when empty): make it again
                f = open(tmp, "xb")
            with f:
                f.write(data)
            os.link(tmp, path)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
    elif isinstance(fs, AsyncFileSystem):
        fs.pipe_file(path, data, mode="create" if exclusive else "overwrite",
                     timeout=write_deadline_s(len(data), so))
    else:
        if exclusive and fs.exists(path):
            raise FileExistsError(path)
        fs.pipe_file(path, data)


def _atomic_put(url: str, data: bytes, storage_options: Optional[dict[str, Any]]) -> None:
    fs, path = filesystem(url, storage_options)
    so = resolve_storage_options(url, storage_options)
    parent = path.rsplit("/", 1)[0]
    tmp = f"{parent}/{TEMP_PREFIX}{uuid.uuid4().hex}-{path.rsplit('/', 1)[-1]}"
    with storage_call("write", url, so):
        try:  # a write that fails half way (a full disk) leaves no temp file either
            _put(fs, tmp, data, so)
            fs.mv(tmp, path)
        except BaseException:
            try:
                fs.rm(tmp)
            except Exception:  # noqa: BLE001 - a temp file left behind is skipped by readers, cleared by --overwrite
                pass
            raise


def create_exclusive(url: str, data: bytes, storage_options: Optional[dict[str, Any]] = None) -> bool:
    """Create the file at `url` holding `data`, whole, only if it does not exist: first writer wins (a
    conditional put on S3: `If-None-Match: *`; a temp file hard-linked into place on a local disk).
    Returns False when it already exists (also when an earlier try of this same put reached the store
    but its answer was lost: read the file to tell).

    Raises:
        StorageError: the write failed for another reason.
    """
    fs, path = filesystem(url, storage_options)
    so = resolve_storage_options(url, storage_options)
    try:
        with storage_call("write", url, so, passthrough=(FileExistsError,)):
            _put(fs, path, data, so, exclusive=True)
    except FileExistsError:
        return False
    _invalidate(fs, path)
    return True


def write_bytes(url: str, data: bytes, storage_options: Optional[dict[str, Any]] = None) -> None:
    """Replace the file at `url` with `data`, whole: one put on an object store (a PUT is atomic there),
    a temp file and a rename on a local disk.

    Raises:
        StorageError: the write failed.
    """
    fs, path = filesystem(url, storage_options)
    if is_local(fs):
        _atomic_put(url, data, storage_options)
        return
    so = resolve_storage_options(url, storage_options)
    with storage_call("write", url, so):
        _put(fs, path, data, so)


def write_parquet_atomic(df: pl.DataFrame, url: str, storage_options: Optional[dict[str, Any]] = None) -> None:
    """Write `df` as one Parquet file at `url`, whole or not at all (temp name, then move).

    Raises:
        StorageError: the write failed (names the URL and the cause); nothing appears at `url`.
    """
    buf = io.BytesIO()
    df.write_parquet(buf, compression="zstd")
    _atomic_put(url, buf.getvalue(), storage_options)


def read_parquet(url: str, storage_options: Optional[dict[str, Any]] = None) -> pl.DataFrame:
    """Read one Parquet file through fsspec."""
    fs, path = filesystem(url, storage_options)
    with storage_call("read", url, resolve_storage_options(url, storage_options)), fs.open(path, "rb") as f:
        return pl.read_parquet(f)


def write_json_atomic(obj: Any, url: str, storage_options: Optional[dict[str, Any]] = None) -> None:
    """Write `obj` as indented JSON at `url`, whole or not at all."""
    _atomic_put(url, json.dumps(obj, indent=2, sort_keys=True, default=str).encode(), storage_options)


def read_json(url: str, storage_options: Optional[dict[str, Any]] = None) -> Optional[Any]:
    """The JSON at `url`, or None when it does not exist.

    Raises:
        ValueError: the file is not valid JSON (names the URL).
    """
    fs, path = filesystem(url, storage_options)
    _invalidate(fs, path)
    try:
        with storage_call("read", url, resolve_storage_options(url, storage_options),
                          passthrough=(FileNotFoundError,)):
            data = fs.cat_file(path)
    except FileNotFoundError:
        return None
    try:
        return json.loads(data)
    except ValueError as exc:  # a damaged file (truncated, garbage): name it
        hint = "; --overwrite starts the job over" if "/_job/" in str(url) else ""
        raise ValueError(f"{url} is not valid JSON ({exc}){hint}") from None


def exists(url: str, storage_options: Optional[dict[str, Any]] = None) -> bool:
    """Whether a file or folder exists at `url`."""
    fs, path = filesystem(url, storage_options)
    _invalidate(fs, path)
    with storage_call("check", url, resolve_storage_options(url, storage_options)):
        return fs.exists(path)


def _invalidate(fs: fsspec.AbstractFileSystem, path: str) -> None:
    """Drop cached listings (s3fs caches them; another process may have written since)."""
    try:
        fs.invalidate_cache(path)
    except Exception:  # noqa: BLE001 - not every fs caches listings
        pass


def list_names(url: str, storage_options: Optional[dict[str, Any]] = None) -> list[str]:
    """Base names of the files directly under a folder/prefix (empty when it does not exist)."""
    fs, path = filesystem(url, storage_options)
    _invalidate(fs, path)
    try:
        with storage_call("list", url, resolve_storage_options(url, storage_options),
                          passthrough=(FileNotFoundError,)):
            entries = fs.ls(path, detail=False)
    except FileNotFoundError:
        return []
    base = path.rstrip("/")
    return sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in entries if p.rstrip("/") != base)


def remove(url: str, storage_options: Optional[dict[str, Any]] = None) -> None:
    """Delete one file, or a folder recursively, if it exists."""
    fs, path = filesystem(url, storage_options)
    with storage_call("delete", url, resolve_storage_options(url, storage_options)):
        if fs.exists(path):
            fs.rm(path, recursive=True)


def iter_batches(url: str, columns: list[str], batch_rows: int = 4096,
                 storage_options: Optional[dict[str, Any]] = None) -> Iterator[pl.DataFrame]:
    """The file's `columns` (only those are read), `batch_rows` rows at a time, in file order
    (text that is not valid UTF-8: see `_to_polars`).

    Raises:
        StorageError: the read failed (names the URL and the cause, in printable characters).
        ValueError: the file's data is damaged (`cannot read <url>: ...`).
    """
    fs, path = filesystem(url, storage_options)
    with storage_call("read", url, resolve_storage_options(url, storage_options)), _damaged_data(url), \
            fs.open(path, "rb") as f:
        pf = pq.ParquetFile(f)
        for batch in pf.iter_batches(batch_size=batch_rows, columns=columns):
            yield _to_polars(pa.Table.from_batches([batch]))


def read_rows_at(url: str, rows: Sequence[int], storage_options: Optional[dict[str, Any]] = None) -> pl.DataFrame:
    """Rows `rows` (row numbers, any order, no repeats needed) of one Parquet file, in that order
    (text that is not valid UTF-8: see `_to_polars`).

    Reads only the row groups that hold them, one at a time (memory: one row group plus the result).

    Raises:
        StorageError: the read failed (names the URL and the cause, in printable characters).
        ValueError: the file's data is damaged (`cannot read <url>: ...`).
        IndexError: a row number past the file's end.
    """
    fs, path = filesystem(url, storage_options)
    want = sorted(set(rows))
    pieces = []
    with storage_call("read", url, resolve_storage_options(url, storage_options)), _damaged_data(url), \
            fs.open(path, "rb") as f:
        pf = pq.ParquetFile(f)
        start, k = 0, 0
        for g in range(pf.metadata.num_row_groups):
            n = pf.metadata.row_group(g).num_rows
            local = []
            while k < len(want) and want[k] < start + n:
                local.append(want[k] - start)
                k += 1
            if local:
                pieces.append(pf.read_row_group(g).take(pa.array(local, pa.int64())))
            start += n
            if k == len(want):
                break
        if k < len(want):
            raise IndexError(f"{url} has {start} rows; row {want[k]} asked for")
        table = pa.concat_tables(pieces) if pieces else pf.schema_arrow.empty_table()
    pos = {r: i for i, r in enumerate(want)}
    return _to_polars(table.take(pa.array([pos[r] for r in rows], pa.int64())))
