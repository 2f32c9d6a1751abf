"""Compile, cache and load tokenmill's CPU kernel library (the C sources in this folder).

The library is compiled on first use with the system C compiler (`cc`, or `$CC`)
for this CPU (`-march=native`) into a cache directory and loaded with ctypes; it
needs neither PyTorch headers nor a build step at install time. The file name
carries a hash of the sources, the flags, the compiler and the CPU, so a changed
kernel, compiler or machine builds anew. Where no compiler is found or the build
fails, `load()` returns None, a warning says why once, and callers keep their
PyTorch paths.

Variants (for tests on one machine): "native" (what the engine uses), "native-noamx"
(`-mno-amx-tile -mno-amx-int8`: the native build as for a CPU without AMX), "native-nobf16"
(`-mno-avx512bf16`: AVX-512 whose bf16 kernel widens to fp32), "avx2"
(`-mno-avx512f`, the AVX2 + FMA path), "avx2-novnni" (also without AVX-VNNI) and
"generic" (`-DTM_GENERIC`, plain C).

Environment:
    TOKENMILL_CPU_KERNELS=0   never build or use the library.
    TOKENMILL_CACHE_DIR       where built libraries go (`kernels/` in it; default
                              $XDG_CACHE_HOME/tokenmill, else ~/.cache/tokenmill).
Where that folder cannot be written, a process builds into a temporary folder of its own
(with a warning). A new build removes the variant's libraries not modified for 30 days.
"""
from __future__ import annotations

import atexit
import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Optional

from ...disk_cache import cache_base

log = logging.getLogger(__name__)

_DIR = Path(__file__).resolve().parent
SOURCES = ("pool.c", "gemm.c", "gemm_i8.c", "ops.c", "attention.c", "decoder.c")
HEADERS = ("tm_cpu.h",)
# -fassociative-math lets gcc vectorize reductions; no finite-math assumption, so the
# attention kernel's -inf running maximum keeps its meaning.
FLAGS = ("-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math", "-fassociative-math",
         "-fno-signed-zeros", "-fPIC", "-shared", "-pthread")
VARIANTS = {
    "native": (),
    "native-noamx": ("-mno-amx-tile", "-mno-amx-int8"),
    "native-nobf16": ("-mno-avx512bf16", "-mno-amx-bf16"),
    "avx2": ("-mno-avx512f",),
    "avx2-novnni": ("-mno-avx512f", "-mno-avxvnni"),
    "generic": ("-DTM_GENERIC",),
}
# The plain-C path keeps every k sum in source order (gemm.c's batch invariance; see KSPLIT there)
PLAIN_C_FLAGS = ("-fno-associative-math", "-ffp-contract=off")

_lock = threading.Lock()
_libs: dict[str, Optional[ctypes.CDLL]] = {}
_why_not: dict[str, str] = {}


# built libraries of a variant not modified for this long are removed when a new one is built
# in the shared folder (each source change leaves one behind; about 150 KB each)
STALE_S = 30 * 24 * 3600
_private: Optional[Path] = None


def cache_dir() -> Path:
    """Folder of built libraries: `kernels` under `engine.disk_cache.cache_base()`
    ($TOKENMILL_CACHE_DIR, else $XDG_CACHE_HOME/tokenmill, else ~/.cache/tokenmill). Unlike the
    caches `TOKENMILL_NO_DISK_CACHE` turns off, it holds no derivative of a user's file, and a
    build takes about 10 s, so that switch leaves it on."""
    return Path(cache_base()) / "kernels"


def _private_dir() -> Path:
    """This process's temporary folder for built libraries, removed at exit (a loaded library
    stays mapped after its file is gone)."""
    global _private
    if _private is None:
        _private = Path(tempfile.mkdtemp(prefix="tokenmill-kernels-"))
        atexit.register(shutil.rmtree, str(_private), True)
    return _private


def _compile(cc: str, flags: list[str], folder: Path, name: str) -> Path:
    """Build the library into folder / name (atomically: a temporary file, then a rename).

    Raises OSError (the folder cannot be written, or no compiler runs) or
    subprocess.CalledProcessError (the build failed)."""
    out = folder / name
    folder.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=folder)
    os.close(fd)
    try:
        subprocess.run([cc, *flags, *(str(_DIR / f) for f in SOURCES), "-o", tmp, "-lm"], check=True,
                       capture_output=True, text=True)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def _prune(folder: Path, variant: str, keep: Path) -> None:
    """Remove the variant's other libraries in folder not modified for STALE_S seconds (best effort:
    another process may be removing them too)."""
    now = time.time()
    for old in folder.glob(f"tm_cpu_{variant}_*.so"):
        try:
            if old != keep and now - old.stat().st_mtime > STALE_S:
                old.unlink()
        except OSError:
            pass


def cpu_id() -> str:
    """The CPU model and feature flags (what -march=native compiles for), '' where unreadable."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    lines = [ln for ln in info.splitlines() if ln.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(lines)))


def cpu_flags() -> set[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where unreadable)."""
    for ln in cpu_id().splitlines():
        if ln.startswith("flags"):
            return set(ln.split(":", 1)[1].split())
    return set()


def _build(variant: str) -> Path:
    """Compile the library (atomically: temp file, then rename) and return its path.

    Raises RuntimeError (no compiler) or subprocess.CalledProcessError (the build failed)."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise RuntimeError("no C compiler found (set CC, or install gcc)")
    src = b"".join((_DIR / f).read_bytes() for f in (*SOURCES, *HEADERS))
    flags = [*FLAGS, *VARIANTS[variant]]
    if variant == "generic" or (variant == "native" and not {"avx2", "fma"} <= cpu_flags()):
        flags += PLAIN_C_FLAGS
    key = hashlib.sha256(src + " ".join([cc, *flags, platform.machine(), cpu_id()]).encode()).hexdigest()[:16]
    name = f"tm_cpu_{variant}_{key}.so"
    folder = cache_dir()
    if (folder / name).exists():
        return folder / name
    try:
        out = _compile(cc, flags, folder, name)
    except OSError as e:
        if shutil.which(cc) is None:
            raise
        log.warning("cannot write the CPU kernel cache %s (%s); building into a temporary folder for this "
                    "process (set TOKENMILL_CACHE_DIR to a writable folder to keep the build)", folder, e)
        return _compile(cc, flags, _private_dir(), name)
    _prune(folder, variant, out)
    return out


def load(variant: str = "native") -> Optional[ctypes.CDLL]:
    """The library built for `variant` (building it on first call), or None with a reason in `why_unavailable`.

    Raises:
        ValueError: for an unknown variant.
    """
    if variant not in VARIANTS:
        raise ValueError(f"unknown CPU kernel variant {variant!r}; known: {sorted(VARIANTS)}")
    with _lock:
        if variant in _libs:
            return _libs[variant]
        lib = None
        if os.environ.get("TOKENMILL_CPU_KERNELS", "1") == "0":
            _why_not[variant] = "disabled by TOKENMILL_CPU_KERNELS=0"
        else:
            try:
                lib = ctypes.CDLL(str(_build(variant)))
            except subprocess.CalledProcessError as e:
                _why_not[variant] = f"building the CPU kernels failed: {e.stderr.strip()[:800]}"
            except (OSError, RuntimeError) as e:
                _why_not[variant] = f"the CPU kernels are unavailable: {e}"
            if lib is None and variant == "native":
                log.warning("%s; the engine uses its PyTorch paths on the CPU", _why_not[variant])
        _libs[variant] = lib
        return lib


def why_unavailable(variant: str = "native") -> str:
    """Why `load(variant)` returned None ('' if it did not, or was not called yet)."""
    return _why_not.get(variant, "")
