"""Where tokenmill keeps what it derives from slow-to-read inputs between processes.

One folder per kind (`tokenizers` for GGUF tokenizers converted by transformers, `gguf` for
GGUF indexes, see `engine.gguf_index`, `calibration` for W8A8 calibration statistics, see
`engine.calibration_cache`), under `$TOKENMILL_CACHE_DIR` if set, else
`$XDG_CACHE_HOME/tokenmill` (default `~/.cache/tokenmill`). `TOKENMILL_NO_DISK_CACHE=1`
turns these caches off: every process then derives everything again. The compiled CPU
kernels (`kernels`, `engine.kernels.cpu.build`) live in the same folder whether or not the
caches are off (where it cannot be written, a process builds them into a temporary folder).

Every entry in these folders is a function of its input file and of what its key names, written
atomically and checked when read, so deleting any of them at any time is safe.
"""
from __future__ import annotations

import logging
import os
import tempfile
from typing import Callable, IO, Optional

logger = logging.getLogger(__name__)


def disk_caches_off() -> bool:
    """True when `TOKENMILL_NO_DISK_CACHE` is set to anything but '' or '0'."""
    return os.environ.get("TOKENMILL_NO_DISK_CACHE", "") not in ("", "0")


def cache_base() -> str:
    """tokenmill's cache folder (not created here): $TOKENMILL_CACHE_DIR, else $XDG_CACHE_HOME/tokenmill,
    else ~/.cache/tokenmill, whether or not disk caches are off."""
    return os.environ.get("TOKENMILL_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "tokenmill"
    )


def cache_root(kind: str) -> Optional[str]:
    """Folder of the on-disk cache `kind` (not created here), or None when disk caches are off."""
    if disk_caches_off():
        return None
    return os.path.join(cache_base(), kind)


def write_entry(entry: str, write: Callable[[IO[bytes]], None], what: str) -> None:
    """Write a cache entry atomically: `write` fills a temporary file beside `entry` (opened "wb"), which
    then replaces it (`os.replace`). A concurrent writer or an unwritable folder is not an error: a
    warning names `what` and the entry, and nothing is left behind."""
    folder = os.path.dirname(entry)
    tmp: Optional[str] = None
    try:
        os.makedirs(folder, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=os.path.splitext(entry)[1], dir=folder)
        with os.fdopen(fd, "wb") as fh:
            write(fh)
        os.replace(tmp, entry)
        tmp = None
    except OSError as exc:
        logger.warning("could not cache the %s in %s: %s", what, entry, exc)
    finally:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass
