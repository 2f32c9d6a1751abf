"""Object-store limits and errors: bounded timeouts and retries, and failures explained in a few lines.

Every `s3://` filesystem the pipeline opens gets botocore limits through s3fs
`config_kwargs` (`DEFAULT_CONFIG_KWARGS`; a `config_kwargs` storage option
overrides them key by key, e.g. `--storage-option config_kwargs='{"read_timeout": 30}'`):

    connect_timeout  5 s    a TCP connection that does not open in time fails the attempt
    read_timeout     5 s    a response that stays silent this long fails the attempt
    retries          3 attempts in botocore's "standard" mode (backoff with jitter)

s3fs retries a timed-out or reset call once more on top (`S3FS_RETRIES` = 2
calls; its default is 5), and file reads nest that layer twice. A write has
a deadline of its own (`write_deadline_s`), because aiohttp does not time
out a PUT while it waits for its `100-continue` answer: without it a
stalled endpoint held a write forever. With the defaults one operation
against a silent endpoint fails within `stall_bound_s()` (86 s for a file
read, 44 s for other calls, 36 s for a small write), and the clean-up after
such a failure (booking the run's cost, releasing its lease) makes one short
attempt per call (`quick_options`, about 15 s together), so a stalled job
ends within about 100 s (84 s measured, a read stalled after the first commit).

`StorageError` names the URL, the operation and the likely cause; `storage_call`
turns whatever s3fs, botocore, aiohttp or the OS raised into one.
"""
from __future__ import annotations

import asyncio
import contextlib
import re
import socket
from typing import Any, Iterator, Optional

CONNECT_TIMEOUT_S = 5.0
READ_TIMEOUT_S = 5.0
MAX_ATTEMPTS = 3
S3FS_RETRIES = 2  # s3fs's own layer: calls per operation on timeouts/resets (its default is 5)
DEFAULT_CONFIG_KWARGS: dict[str, Any] = {
    "connect_timeout": CONNECT_TIMEOUT_S,
    "read_timeout": READ_TIMEOUT_S,
    "retries": {"total_max_attempts": MAX_ATTEMPTS, "mode": "standard"},
}
# For clean-up after a storage failure: one short attempt, so a dead endpoint does not double the wait.
QUICK_CONFIG_KWARGS: dict[str, Any] = {
    "connect_timeout": 2.0,
    "read_timeout": 5.0,
    "retries": {"total_max_attempts": 1, "mode": "standard"},
}
WRITE_BYTES_PER_S = 1 << 20  # the slowest upload a write deadline allows for, bytes per second
BACKOFF_ALLOWANCE_S = 2.0  # botocore standard-mode backoff between attempts is at most 2^attempt s early on

OPERATIONS = ("list", "read", "write", "delete", "check")


class StorageError(OSError):
    """An object-store (or file-system) operation failed. Its message is one line (two with a hint),
    every character printable (see `printable`).

    Attributes:
        operation: "list" | "read" | "write" | "delete" | "check".
        url: the URL operated on.
        cause: what went wrong, in words (one printable line, at most about `MAX_CAUSE_CHARS`).
        hint: what to do about it (one line), or "".
        kind: "timeout" | "connect" | "denied" | "no-bucket" | "not-found" | "credentials" | "reset" | "other".
    """

    def __init__(self, operation: str, url: str, cause: str, hint: str = "", kind: str = "other") -> None:
        self.operation, self.url, self.cause, self.hint, self.kind = operation, url, cause, hint, kind
        text = f"cannot {operation} {url}: {cause}"
        super().__init__(text + (f"\n  {hint}" if hint else ""))

    @property
    def endpoint_failed(self) -> bool:
        """True when the endpoint itself did not answer (timeout, refused, reset): clean-up should be quick."""
        return self.kind in ("timeout", "connect", "reset")


def config_kwargs(storage_options: dict[str, Any]) -> dict[str, Any]:
    """botocore Config arguments for these options: the defaults, overridden key by key by `config_kwargs`."""
    return {**DEFAULT_CONFIG_KWARGS, **(storage_options.get("config_kwargs") or {})}


def _attempts(cfg: dict[str, Any]) -> int:
    retries = cfg.get("retries") or {}
    return int(retries.get("total_max_attempts") or (retries.get("max_attempts", MAX_ATTEMPTS - 1) + 1))


def s3fs_retries(storage_options: Optional[dict[str, Any]] = None) -> int:
    """Calls s3fs makes per operation on timeouts and resets: 1 when botocore is told to try once."""
    return 1 if _attempts(config_kwargs(storage_options or {})) == 1 else S3FS_RETRIES


def stall_bound_s(storage_options: Optional[dict[str, Any]] = None, file_read: bool = True) -> float:
    """Seconds after which one operation against a silent endpoint has failed, for these options
    (a read through a file object nests s3fs's retry layer twice)."""
    cfg = config_kwargs(storage_options or {})
    per_call = _attempts(cfg) * (float(cfg.get("read_timeout", 60)) + BACKOFF_ALLOWANCE_S)
    layers = s3fs_retries(storage_options) ** (2 if file_read else 1)
    return layers * per_call + 2.0


def write_deadline_s(nbytes: int, storage_options: Optional[dict[str, Any]] = None) -> float:
    """Deadline in seconds for writing `nbytes` bytes: every attempt's connect and read timeouts, plus
    the time to send the bytes at `WRITE_BYTES_PER_S`."""
    cfg = config_kwargs(storage_options or {})
    per_attempt = float(cfg.get("connect_timeout", 60)) + float(cfg.get("read_timeout", 60)) + BACKOFF_ALLOWANCE_S
    return _attempts(cfg) * per_attempt + nbytes / WRITE_BYTES_PER_S


def endpoint_of(storage_options: dict[str, Any]) -> str:
    """The endpoint the options point at, for messages."""
    ep = storage_options.get("endpoint_url") or (storage_options.get("client_kwargs") or {}).get("endpoint_url")
    return str(ep) if ep else "the default AWS S3 endpoint"


def bucket_of(url: str) -> Optional[str]:
    """The bucket of an object-store URL ("s3://b/x" -> "b"); None for local paths and for web URLs
    (http, https, ftp: their host is no bucket)."""
    m = re.match(r"^([a-z][a-z0-9+.-]*)://([^/]+)", str(url))
    if not m or m.group(1) in ("file", "local", "http", "https", "ftp"):
        return None
    return m.group(2)


def is_local_url(url: str) -> bool:
    """True for a local path or a `file://` URL, whose permissions are the file system's (no bucket
    policy, no IAM)."""
    m = re.match(r"^([a-z][a-z0-9+.-]*)://", str(url))
    return m is None or m.group(1) in ("file", "local")


def plural(n: int, word: str) -> str:
    """`n` and `word`, with an s unless n is 1 ("1 shard", "3 rows"); for messages."""
    return f"{n} {word}{'' if n == 1 else 's'}"


MAX_CAUSE_CHARS = 300  # a cause longer than this is cut in messages (a library may quote a whole page)


def printable(text: Any, max_chars: int = MAX_CAUSE_CHARS) -> str:
    """`text` (an exception's message, say) made safe for one line of a message: every character that
    is not printable (control bytes a decoder quoted from a damaged file, newlines, tabs) written as
    its Python escape (`\\x0f`, `\\n`), then cut to `max_chars` characters with a note of how many
    more there were. The result satisfies `str.isprintable()`."""
    out = "".join(ch if ch.isprintable() else repr(ch)[1:-1] for ch in str(text))
    if len(out) > max_chars:
        out = f"{out[:max_chars]}... ({len(out) - max_chars} more characters)"
    return out


def _names(exc: BaseException) -> set[str]:
    """Class names of the exception, its causes and contexts (botocore/aiohttp types without importing them)."""
    out: set[str] = set()
    seen = 0
    e: Optional[BaseException] = exc
    while e is not None and seen < 8:
        out.update(c.__name__ for c in type(e).__mro__)
        e = e.__cause__ or e.__context__
        seen += 1
    return out


def explain(exc: BaseException, operation: str, url: str, storage_options: dict[str, Any]) -> StorageError:
    """A StorageError naming the URL, the operation and the likely cause of `exc` (whose message is
    quoted through `printable`: a damaged Parquet page makes pyarrow quote raw bytes)."""
    names = _names(exc)
    endpoint = endpoint_of(storage_options)
    cfg = config_kwargs(storage_options)
    text = printable(str(exc).strip().splitlines()[0]) if str(exc).strip() else type(exc).__name__
    bucket = bucket_of(url)
    resume = "Re-run the same command to resume: committed shards are kept."
    if names & {"ReadTimeoutError", "FSTimeoutError", "TimeoutError", "timeout", "ServerTimeoutError"}:
        return StorageError(
            operation, url,
            f"no answer from {endpoint} within the time limits (read_timeout {cfg.get('read_timeout')} s, "
            f"{plural(_attempts(cfg), 'attempt')})",
            f"The store or the network path stalled. {resume} Raise the limits with --storage-option "
            f"config_kwargs='{{\"read_timeout\": 60}}'.", "timeout")
    if names & {"ConnectTimeoutError", "EndpointConnectionError", "ClientConnectorError", "ConnectionRefusedError",
                "gaierror", "ProxyConnectionError"}:
        why = ("connection refused" if "ConnectionRefusedError" in names else
               f"no connection within connect_timeout {cfg.get('connect_timeout')} s" if "ConnectTimeoutError" in names
               else "host name not found" if "gaierror" in names else "connection failed")
        return StorageError(
            operation, url, f"cannot connect to {endpoint} ({why}, {plural(_attempts(cfg), 'attempt')})",
            "Check the endpoint (AWS_ENDPOINT_URL or --storage-option endpoint_url=...) and that the service is up.",
            "connect")
    if names & {"ConnectionClosedError", "ConnectionResetError", "ServerDisconnectedError", "ClientPayloadError",
                "IncompleteRead"}:
        return StorageError(operation, url, f"{endpoint} kept dropping the connection ({text})",
                            f"A proxy or the store reset the connection on every attempt. {resume}", "reset")
    if "NoCredentialsError" in names or "PartialCredentialsError" in names:
        return StorageError(operation, url, "no credentials found",
                            "Set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or a profile), or use a Prefect "
                            "Secret block with the flow.", "credentials")
    if isinstance(exc, PermissionError) and is_local_url(url):  # a folder's permissions, not a bucket's
        hint = ("The local folder is not writable by this user: check the permissions of the output folder and "
                "of the folders above it, or choose another output."
                if operation in ("write", "delete") else
                "This user may not read it: check the permissions of the file and of the folders above it.")
        return StorageError(operation, url, f"permission denied ({text})", hint, "denied")
    if isinstance(exc, PermissionError) or names & {"AccessDenied"} or "Forbidden" in text or "Access Denied" in text:
        verb = {"list": "list", "read": "read", "write": "write to", "delete": "delete", "check": "see"}[operation]
        return StorageError(operation, url, f"access denied ({text})",
                            f"The credentials in use may not {verb} this object: check the bucket policy and IAM "
                            f"permissions (s3:ListBucket, s3:GetObject, s3:PutObject, s3:DeleteObject).", "denied")
    if isinstance(exc, FileNotFoundError) and ("bucket" in text.lower() and "not exist" in text.lower()):
        return no_such_bucket(operation, url, bucket or "?")
    if isinstance(exc, FileNotFoundError):
        return StorageError(operation, url, "not found", "", "not-found")
    return StorageError(operation, url, f"{type(exc).__name__}: {text}", "", "other")


def no_such_bucket(operation: str, url: str, bucket: str) -> StorageError:
    """The error for a bucket that does not exist (tokenmill never creates buckets)."""
    return StorageError(operation, url, f"bucket {bucket!r} does not exist",
                        "tokenmill never creates buckets: check the URL for a typo, or create the bucket first.",
                        "no-bucket")


@contextlib.contextmanager
def storage_call(operation: str, url: str, storage_options: Optional[dict[str, Any]] = None,
                 passthrough: tuple[type[BaseException], ...] = ()) -> Iterator[None]:
    """Run the block; turn any storage failure into a `StorageError` (exceptions in `passthrough`, a
    StorageError, KeyboardInterrupt and SystemExit pass unchanged).

    Raises:
        StorageError: naming `operation`, `url` and the likely cause.
    """
    assert operation in OPERATIONS, operation
    try:
        yield
    except (StorageError, KeyboardInterrupt, SystemExit, GeneratorExit):
        raise
    except passthrough:
        raise
    except (OSError, asyncio.TimeoutError, socket.timeout) as exc:
        raise explain(exc, operation, url, storage_options or {}) from exc
    except Exception as exc:  # noqa: BLE001 - botocore/aiohttp errors are not OSErrors
        if _names(exc) & {"BotoCoreError", "ClientError", "ClientConnectionError", "FSTimeoutError"}:
            raise explain(exc, operation, url, storage_options or {}) from exc
        raise


def quick_options(storage_options: dict[str, Any]) -> dict[str, Any]:
    """The same options with one short attempt (`QUICK_CONFIG_KWARGS`, or the configured timeouts when
    those are shorter): for clean-up after the endpoint failed."""
    cfg = config_kwargs(storage_options)
    quick = dict(QUICK_CONFIG_KWARGS)
    for name in ("connect_timeout", "read_timeout"):
        quick[name] = min(float(cfg.get(name, quick[name])), quick[name])
    return {**storage_options, "config_kwargs": {**(storage_options.get("config_kwargs") or {}), **quick}}


# Option names whose values are credentials (s3fs, botocore, polars, gcsfs, adlfs spellings).
_SECRET_NAME = re.compile(r"(secret|token|password|passwd|credential|private|sas|account_key|^key$|access_key)",
                          re.IGNORECASE)
MASK = "**********"


def secret_keys(storage_options: dict[str, Any], prefix: str = "") -> list[str]:
    """Dotted names of the options (nested dicts included) that hold a credential value (masked ones too)."""
    out = []
    for k, v in (storage_options or {}).items():
        name = f"{prefix}{k}"
        if isinstance(v, dict):
            out += secret_keys(v, name + ".")
        elif _SECRET_NAME.search(str(k)) and v not in (None, ""):
            out.append(name)
    return out


def mask_secrets(storage_options: dict[str, Any]) -> dict[str, Any]:
    """A copy with every credential value replaced by `MASK` (nested dicts included)."""
    out: dict[str, Any] = {}
    for k, v in (storage_options or {}).items():
        if isinstance(v, dict):
            out[k] = mask_secrets(v)
        elif _SECRET_NAME.search(str(k)) and v not in (None, ""):
            out[k] = MASK
        else:
            out[k] = v
    return out
