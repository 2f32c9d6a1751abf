"""Build, load and call the C paged decode-attention kernel (`cpu_decode_attention.c`).

The kernel is compiled on first use with the system C compiler (`cc`, or `$CC`)
for this CPU (`-march=native`) into a cache directory, and loaded with ctypes;
it needs neither PyTorch headers nor a build step at install time. Where no
compiler is found, or the build fails, `available()` is False, a warning says
why once, and the caller keeps its PyTorch path.

Environment:
    TOKENMILL_CPU_KERNELS=0   never build or use the kernel.
    TOKENMILL_CACHE_DIR       where the built library goes (default
                              ~/.cache/tokenmill).
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

import torch

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("cpu_decode_attention.c")
# -fassociative-math and friends let gcc vectorize the dot-product reductions; they do not
# assume finite math, so the kernel's -inf running maximum keeps its meaning.
_FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math", "-fassociative-math",
          "-fno-signed-zeros", "-fPIC", "-shared", "-pthread"]
_MAX_G, _MAX_D, _MAX_BLOCK_SIZE = 16, 256, 64

_lock = threading.Lock()
_lib: Optional[ctypes.CDLL] = None
_tried = False
_why_not = ""


def _cache_dir() -> Path:
    root = os.environ.get("TOKENMILL_CACHE_DIR") or os.path.join(Path.home(), ".cache", "tokenmill")
    return Path(root) / "kernels"


def _cpu_id() -> str:
    """The CPU model and feature flags (what -march=native compiles for), '' where unreadable."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    lines = [ln for ln in info.splitlines() if ln.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(lines)))


def _build(extra_flags: tuple[str, ...] = ()) -> Path:
    """Compile the kernel into the cache (atomically: temp file, then rename) and return its path.

    The file name carries a hash of the source, the flags, the compiler and the CPU, so a
    changed kernel or compiler builds anew. Raises RuntimeError (no compiler) or
    subprocess.CalledProcessError (the build failed)."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise RuntimeError("no C compiler found (set CC, or install gcc)")
    src = _SOURCE.read_bytes()
    flags = [*_FLAGS, *extra_flags]
    key = hashlib.sha256(src + " ".join([cc, *flags, platform.machine(), _cpu_id()]).encode()).hexdigest()[:16]
    out = _cache_dir() / f"tm_decode_attention_{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        subprocess.run([cc, *flags, str(_SOURCE), "-o", tmp, "-lm"], check=True, capture_output=True, text=True)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def _open(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    fn = lib.tm_paged_decode_attention
    fn.restype = ctypes.c_int
    fn.argtypes = ([ctypes.c_void_p] * 3 + [ctypes.c_int] + [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 7
                   + [ctypes.c_float, ctypes.c_int64])
    return lib


def generic_build() -> ctypes.CDLL:
    """The kernel built without its AVX2 path (-DTM_GENERIC), for tests of the plain-C path;
    pass it as `lib` to `paged_decode_attention`. Raises as `_build` does."""
    return _open(_build(("-DTM_GENERIC",)))


def _load() -> Optional[ctypes.CDLL]:
    global _lib, _tried, _why_not
    with _lock:
        if _tried:
            return _lib
        _tried = True
        if os.environ.get("TOKENMILL_CPU_KERNELS", "1") == "0":
            _why_not = "disabled by TOKENMILL_CPU_KERNELS=0"
            return None
        try:
            _lib = _open(_build())
            return _lib
        except subprocess.CalledProcessError as e:
            _why_not = f"building the C decode-attention kernel failed: {e.stderr.strip()[:500]}"
        except (OSError, RuntimeError) as e:
            _why_not = f"the C decode-attention kernel is unavailable: {e}"
        log.warning("%s; decode attention uses the PyTorch path", _why_not)
        return None


def available() -> bool:
    """True if the kernel is built (building it on first call) and loadable."""
    return _load() is not None


def why_unavailable() -> str:
    """The reason `available()` is False ('' when it is True or was not asked yet)."""
    return _why_not


def _int8_rows(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """True for an int8 cache of rows [D codes, 4 scale bytes], False for fp32; ValueError otherwise."""
    if k_cache.dtype == torch.float32 and k_cache.shape[-1] == q.shape[-1]:
        return False
    if k_cache.dtype == torch.int8 and k_cache.shape[-1] == q.shape[-1] + 4:
        return True
    raise ValueError(f"the C decode-attention kernel reads fp32 caches [Hkv, S, D] or int8 rows [Hkv, S, D + 4]; "
                     f"got {k_cache.dtype} {tuple(k_cache.shape)} for head_dim {q.shape[-1]}")


def supports(q: torch.Tensor, k_cache: torch.Tensor, block_size: int) -> bool:
    """Whether the kernel serves these tensors: CPU, fp32 queries, an fp32 cache or an int8
    cache of rows [D codes, fp32 scale] (torch_quant_kv's layout; not fp8 codes, which share
    the int8 storage: the caller decides), head_dim <= 256, at most 16 query heads per KV
    head, block_size <= 64, and the kernel built."""
    if q.device.type != "cpu" or q.dtype != torch.float32 or k_cache.device.type != "cpu":
        return False
    try:
        _int8_rows(q, k_cache)
    except ValueError:
        return False
    hkv, d = k_cache.shape[0], q.shape[-1]
    if d > _MAX_D or block_size > _MAX_BLOCK_SIZE or q.shape[1] % hkv or q.shape[1] // hkv > _MAX_G:
        return False
    return available()


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int,
                           scale: float, out: Optional[torch.Tensor] = None,
                           num_threads: Optional[int] = None, lib: Optional[ctypes.CDLL] = None) -> torch.Tensor:
    """Decode attention over a paged KV cache, reading each sequence's blocks in place.

    For an int8 cache each row holds D codes and its fp32 scale (value = code * scale), read
    without expanding the cache.

    out[b, h] = softmax(scale * q[b, h] . K_b^T) V_b, where K_b/V_b are the first seq_lens[b]
    slots reached through block_tables[b], for KV head h // (Hq // Hkv) (GQA).

    Args:
        q: [B, Hq, D] float32 (one query token per sequence); made contiguous if it is not.
        k_cache, v_cache: [Hkv, num_blocks * block_size, D] float32, or int8
            [Hkv, num_blocks * block_size, D + 4]; contiguous (the torch backends' head-major layouts).
        block_tables: [B, max_blocks] int32 block ids (entries past a sequence's length ignored).
        seq_lens: [B] int64 KV lengths (>= 1; the new token included).
        block_size: tokens per block (<= 64).
        scale: softmax scale, usually head_dim ** -0.5.
        out: optional [B, Hq, D] float32 contiguous destination.
        num_threads: worker threads (default torch.get_num_threads()).
        lib: a specific build (tests: `generic_build()`); default the one `available()` loads.
    Returns:
        out, [B, Hq, D] float32.
    Raises:
        RuntimeError: if the kernel is unavailable or refuses the shape (check `supports` first).
        ValueError: on a dtype, device or layout it cannot read.
    """
    lib = lib or _load()
    if lib is None:
        raise RuntimeError(_why_not or "the C decode-attention kernel is unavailable")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous")
    if q.dtype != torch.float32 or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"the C decode-attention kernel needs float32 queries and K/V caches of one dtype, got "
                         f"q {q.dtype}, k {k_cache.dtype}, v {v_cache.dtype}")
    is_int8 = _int8_rows(q, k_cache)
    q = q.contiguous()
    bt = block_tables.to(torch.int32).contiguous()
    sl = seq_lens.to(torch.int64).contiguous()
    b, hq, d = q.shape
    hkv, slots, _ = k_cache.shape
    if bt.shape[0] != b or sl.shape[0] != b:
        raise ValueError(f"shape mismatch: q {tuple(q.shape)}, k_cache {tuple(k_cache.shape)}, "
                         f"block_tables {tuple(bt.shape)}, seq_lens {tuple(sl.shape)}")
    if out is None:
        out = torch.empty_like(q)
    elif not out.is_contiguous() or out.shape != q.shape:
        raise ValueError("out must be a contiguous tensor shaped like q")
    rc = lib.tm_paged_decode_attention(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), int(is_int8), bt.data_ptr(), sl.data_ptr(), out.data_ptr(),
        b, hq, hkv, d, slots, bt.shape[1], block_size, float(scale),
        num_threads or torch.get_num_threads())
    if rc == -1:
        raise RuntimeError(f"the C decode-attention kernel refused Hq={hq}, Hkv={hkv}, D={d}, "
                           f"block_size={block_size}")
    return out
