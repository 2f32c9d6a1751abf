"""Compile, cache and load tokenmill's CPU kernel library (the C sources in this folder).

The library is compiled on first use with the system C compiler (`cc`, or `$CC`)
for this CPU (`-march=native`) into a cache directory and loaded with ctypes; it
needs neither PyTorch headers nor a build step at install time. The file name
carries a hash of the sources, the flags, the compiler and the CPU, so a changed
kernel, compiler or machine builds anew. Where no compiler is found or the build
fails, `load()` returns None, a warning says why once, and callers keep their
PyTorch paths.

Variants (for tests on one machine): "native" (what the engine uses), "native-noamx"
(`-mno-amx-tile -mno-amx-int8`: the native build as for a CPU without AMX), "avx2"
(`-mno-avx512f`, the AVX2 + FMA path), "avx2-novnni" (also without AVX-VNNI) and
"generic" (`-DTM_GENERIC`, plain C).

Environment:
    TOKENMILL_CPU_KERNELS=0   never build or use the library.
    TOKENMILL_CACHE_DIR       where built libraries go (default ~/.cache/tokenmill).
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Optional

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
    "avx2": ("-mno-avx512f",),
    "avx2-novnni": ("-mno-avx512f", "-mno-avxvnni"),
    "generic": ("-DTM_GENERIC",),
}
# The plain-C path keeps every k sum in source order (gemm.c's batch invariance; see KSPLIT there)
PLAIN_C_FLAGS = ("-fno-associative-math", "-ffp-contract=off")

_lock = threading.Lock()
_libs: dict[str, Optional[ctypes.CDLL]] = {}
_why_not: dict[str, str] = {}


def cache_dir() -> Path:
    """Folder of built libraries: $TOKENMILL_CACHE_DIR/kernels or ~/.cache/tokenmill/kernels."""
    root = os.environ.get("TOKENMILL_CACHE_DIR") or os.path.join(Path.home(), ".cache", "tokenmill")
    return Path(root) / "kernels"


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
    out = cache_dir() / f"tm_cpu_{variant}_{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        subprocess.run([cc, *flags, *(str(_DIR / f) for f in SOURCES), "-o", tmp, "-lm"], check=True,
                       capture_output=True, text=True)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
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
