"""tokenmill's CPU kernel library: the C kernels of this folder, called through ctypes on torch tensors.

What it holds (see each C file's header for the algorithm and its source):

- `gemm.c`: linear layers over weights packed once at load time into panels of
  `nr()` output features; fp32, bf16 (AMX-BF16 tiles where the CPU has them and K is a
  multiple of 32, `bf16_amx`; VDPBF16PS with AVX512-BF16; widened to fp32 elsewhere;
  `gemm_bf16_reference` is its definition), int8 codes dequantized in
  registers, and 4-bit codes times int8 activations in integer arithmetic
  (`gemm_q4_reference` is its definition).
- `gemm_i8.c`: W8A8 (int8 weights x int8 per-token activations, int32 sums), on AMX
  tiles where the CPU has them (`w8a8_amx`).
- `ops.c`: RMSNorm, RoPE, SiLU x up, and the KV-cache write (fp32, fp16, bf16 groups and int8 rows).
- `attention.c`: paged attention over decode rows and prefill chunks, reading KV blocks in place
  (bf16 caches on VDPBF16PS where the build has AVX512-BF16).
- `abi.py`: the C functions' ctypes signatures.
- `pool.c`: the persistent thread pool all of them share (dynamic chunks, spin then sleep).

Every wrapper takes an optional `lib` (a build from `build.load(variant)`), so tests
can run the AVX2 and plain-C builds on a machine whose native build is AVX-512.
Tensors are fp32 (int8/uint8 for codes) on the CPU; 2-D operands need a contiguous
last dimension and may have a larger row stride (views into a fused buffer).

Environment: TOKENMILL_CPU_KERNELS=0 disables the library (PyTorch paths run),
TOKENMILL_NUM_THREADS sets the pool's threads (default: the CPUs this process may
use), TOKENMILL_SPIN_US how long idle workers spin before sleeping (default 50),
TOKENMILL_AMX=0 keeps the W8A8 and bf16 GEMMs off AMX tiles (default: on where the CPU has
AMX-INT8 / AMX-BF16 and Linux grants the process the tile state; W8A8 gives the same bits either
way, bf16 the same values to fp32 rounding of the sums).
"""
from __future__ import annotations

import ctypes
from typing import Optional

import torch

from . import build
from .abi import bind as _bind
from .memory import huge_empty

W_F32, W_Q8, W_Q4 = 0, 1, 2
KV_F32, KV_I8, KV_F16, KV_BF16 = 0, 1, 2, 3  # KV cache row formats (tm_cpu.h's TM_KV_*)


def kv_row_format(cache: torch.Tensor, head_dim: int) -> Optional[int]:
    """The C kernels' code for a KV cache's rows: `KV_F32` (float32 [Hkv, S, D]), `KV_F16`
    (float16 [Hkv, S, D], widened to fp32 as it is read), `KV_BF16` (int16 [Hkv, S, D]: bf16 in the
    group layout of `engine.attention.bf16_kv`) or `KV_I8` (int8 rows [Hkv, S, D + 4]: D codes, then
    the fp32 scale); None for anything else."""
    row = cache.shape[-1]
    if cache.dtype == torch.float32 and row == head_dim:
        return KV_F32
    if cache.dtype == torch.float16 and row == head_dim:
        return KV_F16
    if cache.dtype == torch.int16 and row == head_dim:
        return KV_BF16
    if cache.dtype == torch.int8 and row == head_dim + 4:
        return KV_I8
    return None
ISA_NAMES = {0: "generic", 1: "avx2", 2: "avx512"}

def library(variant: str = "native") -> Optional[ctypes.CDLL]:
    """The built library for `variant` (see `build.VARIANTS`), or None (reason: `why_unavailable`)."""
    lib = build.load(variant)
    return None if lib is None else _bind(lib)


def available() -> bool:
    """True if the native library is built (building it on first call) and loadable."""
    return library() is not None


def why_unavailable(variant: str = "native") -> str:
    """Why the library is unavailable ('' if it is, or was not asked for yet)."""
    return build.why_unavailable(variant)


def _lib(lib: Optional[ctypes.CDLL]) -> ctypes.CDLL:
    lib = lib if lib is not None else library()
    if lib is None:
        raise RuntimeError(why_unavailable() or "the CPU kernel library is unavailable")
    return _bind(lib)


def isa(lib: Optional[ctypes.CDLL] = None) -> str:
    """The instruction set a build's kernels use: "avx512", "avx2" or "generic"."""
    return ISA_NAMES[_lib(lib).tm_isa()]


def nr(lib: Optional[ctypes.CDLL] = None) -> int:
    """Output features per packed weight panel (32 with AVX-512, else 16)."""
    return _lib(lib).tm_gemm_nr()


def set_num_threads(n: int, lib: Optional[ctypes.CDLL] = None) -> int:
    """Threads of the pool (workers plus the caller); 0 = the CPUs this process may use. Returns the number set."""
    return _lib(lib).tm_set_num_threads(int(n))


def get_num_threads(lib: Optional[ctypes.CDLL] = None) -> int:
    """Threads of the pool (starting it with the default if it is not running)."""
    return _lib(lib).tm_get_num_threads()


def _check2d(name: str, t: torch.Tensor, dtype: torch.dtype) -> None:
    if t.device.type != "cpu" or t.dtype != dtype or t.dim() != 2 or (t.shape[1] > 1 and t.stride(1) != 1):
        raise ValueError(f"{name} must be a 2-D {dtype} CPU tensor with a contiguous last dim, got "
                         f"{t.dtype} {tuple(t.shape)} strides {t.stride()} on {t.device}")


def _out(out: Optional[torch.Tensor], m: int, n: int, dtype=torch.float32) -> torch.Tensor:
    if out is None:
        return torch.empty(m, n, dtype=dtype)
    _check2d("out", out, dtype)
    if tuple(out.shape) != (m, n):
        raise ValueError(f"out must be [{m}, {n}], got {tuple(out.shape)}")
    return out


# ---------------------------------------------------------------- fp32 GEMM

def pack_f32(w: torch.Tensor, lib: Optional[ctypes.CDLL] = None) -> torch.Tensor:
    """Pack a weight w [n, k] float32 into panels (a uint8 tensor of `tm_pack_f32_size` bytes)."""
    lib = _lib(lib)
    _check2d("w", w, torch.float32)
    n, k = w.shape
    # (every pack writes its whole buffer: pages fault in as it writes, not in a zeroing pass first)
    buf = huge_empty(lib.tm_pack_f32_size(n, k), populate=False)
    lib.tm_pack_f32(w.data_ptr(), w.stride(0), n, k, buf.data_ptr())
    return buf


def gemm_f32(x: torch.Tensor, packed: torch.Tensor, n: int, bias: Optional[torch.Tensor] = None,
             out: Optional[torch.Tensor] = None, accumulate: bool = False,
             lib: Optional[ctypes.CDLL] = None) -> torch.Tensor:
    """y = x W^T (+ bias) (+ y if accumulate) for W packed by `pack_f32` (same `lib`).

    Args:
        x: [m, k] float32. packed: from pack_f32 of a [n, k] weight. bias: [n] float32 or None.
        out: [m, n] float32 destination (required when accumulate).
    Returns:
        out, [m, n] float32.
    """
    lib = _lib(lib)
    _check2d("x", x, torch.float32)
    m, k = x.shape
    if accumulate and out is None:
        raise ValueError("accumulate needs out")
    y = _out(out, m, n)
    if packed.numel() != lib.tm_pack_f32_size(n, k):
        raise ValueError(f"packed weight of {packed.numel()} bytes does not match n={n}, k={k}")
    lib.tm_gemm_f32(x.data_ptr(), x.stride(0), packed.data_ptr(), None if bias is None else bias.data_ptr(),
                    y.data_ptr(), y.stride(0), m, n, k, int(accumulate))
    return y


def _argmax_args(x: torch.Tensor, n: int, limit: Optional[int], ban: Optional[torch.Tensor],
                 lib: ctypes.CDLL) -> tuple[int, Optional[int], int, torch.Tensor, torch.Tensor]:
    """Checked (limit, ban pointer, nban, out, scratch) for the fused argmax calls."""
    m = x.shape[0]
    limit = n if limit is None else int(limit)
    if limit <= 0:
        raise ValueError(f"limit must be > 0, got {limit}")
    nban = 0
    if ban is not None:
        if ban.dtype != torch.int64 or ban.dim() != 2 or ban.shape[0] != m or not ban.is_contiguous():
            raise ValueError(f"ban must be a contiguous int64 tensor [{m}, nban], got {ban.dtype} {list(ban.shape)}")
        nban = ban.shape[1]
    out = torch.empty(m, dtype=torch.int64)
    scratch = torch.empty(max(1, lib.tm_gemm_argmax_scratch(m)), dtype=torch.uint8)
    return limit, None if not nban else ban.data_ptr(), nban, out, scratch


def gemm_f32_argmax(x: torch.Tensor, packed: torch.Tensor, n: int, bias: Optional[torch.Tensor] = None,
                    limit: Optional[int] = None, ban: Optional[torch.Tensor] = None,
                    lib: Optional[ctypes.CDLL] = None) -> torch.Tensor:
    """Greedy argmax of each row of x W^T (+ bias) for W packed by `pack_f32`, in the GEMM's
    epilogue: the [m, n] logits are never written. The values compared are the ones `gemm_f32`
    would store, bit for bit, so the result equals `argmax_rows(gemm_f32(...))` on the same
    columns.

    Args:
        x: [m, k] float32. packed: from pack_f32 of a [n, k] weight. bias: [n] float32 or None.
        limit: only columns < limit compete (a padded LM head's tokenizer vocabulary); default n.
        ban: [m, nban] int64, per row columns that never win (suppressed end tokens), -1 = none.
    Returns:
        [m] int64: per row the first column holding the largest value; 0 where no allowed value
        is above -inf; a NaN never wins.
    Raises:
        ValueError: a mismatched packed weight, limit <= 0, or a malformed ban.
    """
    lib = _lib(lib)
    _check2d("x", x, torch.float32)
    m, k = x.shape
    if packed.numel() != lib.tm_pack_f32_size(n, k):
        raise ValueError(f"packed weight of {packed.numel()} bytes does not match n={n}, k={k}")
    limit, bp, nban, out, scratch = _argmax_args(x, n, limit, ban, lib)
    lib.tm_gemm_f32_argmax(x.data_ptr(), x.stride(0), packed.data_ptr(), None if bias is None else bias.data_ptr(),
                           m, n, k, limit, bp, nban, out.data_ptr(), scratch.data_ptr())
    return out


def gemm_f32_silu(x: torch.Tensor, packed: torch.Tensor, inter: int, bias: Optional[torch.Tensor] = None,
                  out: Optional[torch.Tensor] = None, lib: Optional[ctypes.CDLL] = None) -> torch.Tensor:
    """SwiGLU in the gate/up GEMM's epilogue: out = silu(x Wg^T) * (x Wu^T) for a fused weight
    W = [Wg | Wu] [2 inter, k] packed by `pack_f32` (Shazeer 2020, arXiv 2002.05202). Each value
    is the one `silu_mul` gives on the stored product; the [m, 2 inter] product is never written.

    Args:
        x: [m, k] float32. bias: [2 inter] float32 or None. out: [m, inter] float32 or None.
    Returns:
        out [m, inter] float32.
    Raises:
        ValueError: inter not a multiple of `nr()`, or a mismatched packed weight.
    """
    lib = _lib(lib)
    _check2d("x", x, torch.float32)
    m, k = x.shape
    if packed.numel() != lib.tm_pack_f32_size(2 * inter, k):
        raise ValueError(f"packed weight of {packed.numel()} bytes does not match n={2 * inter}, k={k}")
    y = _out(out, m, inter)
    if lib.tm_gemm_f32_silu(x.data_ptr(), x.stride(0), packed.data_ptr(), None if bias is None else bias.data_ptr(),
                            y.data_ptr(), y.stride(0), m, inter, k):
        raise ValueError(f"gemm_f32_silu needs inter to be a multiple of {lib.tm_gemm_nr()}, got {inter}")
    return y


# ---------------------------------------------------------------- bf16 weights, fp32 activations

def bf16_native(lib: Optional[ctypes.CDLL] = None) -> bool:
    """Whether a build's bf16 GEMM runs on VDPBF16PS (AVX512-BF16); False: it widens bf16 to fp32
    in registers and uses FMAs (same products, slower than fp32 weights)."""
    return bool(_lib(lib).tm_bf16_native())


def to_bf16(x: torch.Tensor) -> torch.Tensor:
    """x rounded to bf16 as the kernels round activations (VCVTNE2PS2BF16): nearest even, a
    denormal to a zero of its sign. x: float32, any shape; returns bfloat16 of its shape."""
    y = x.float().to(torch.bfloat16)
    tiny = x.abs() < torch.finfo(torch.float32).tiny
    return torch.where(tiny, torch.zeros_like(y).copysign(x.to(torch.bfloat16)), y)


def cast_bf16(x: torch.Tensor, lib: Optional[ctypes.CDLL] = None) -> torch.Tensor:
    """x [m, k] float32 rounded to bf16 by the kernel library, as every bf16 GEMM call rounds its
    activations (the bits `to_bf16` defines). Returns [m, k] bfloat16."""
    lib = _lib(lib)
    _check2d("x", x, torch.float32)
    m, k = x.shape
    out = torch.empty(m, k + (k & 1), dtype=torch.bfloat16)
    lib.tm_to_bf16(x.data_ptr(), x.stride(0), m, k, out.data_ptr(), out.shape[1])
    return out[:, :k]


def pack_bf16(w: torch.Tensor, lib: Optional[ctypes.CDLL] = None) -> torch.Tensor:
    """Pack a weight w [n, k] (rounded to bf16 if it is not) into pair panels for `gemm_bf16`.

    Returns:
        a uint8 tensor of `tm_pack_bf16_size(n, k)` bytes.
    Raises:
        ValueError: w is not a 2-D CPU tensor with a contiguous last dim.
    """
    lib = _lib(lib)
    if w.dim() != 2 or w.device.type != "cpu":
        raise ValueError(f"w must be a 2-D CPU tensor, got {w.dtype} {tuple(w.shape)} on {w.device}")
    wb = w.to(torch.bfloat16).contiguous()
    n, k = wb.shape
    buf = huge_empty(lib.tm_pack_bf16_size(n, k), populate=False)
    lib.tm_pack_bf16(wb.data_ptr(), k, n, k, buf.data_ptr())
    return buf


def _check_bf16_packed(lib: ctypes.CDLL, packed: torch.Tensor, n: int, k: int) -> None:
    if packed.numel() != lib.tm_pack_bf16_size(n, k):
        raise ValueError(f"packed bf16 weight of {packed.numel()} bytes does not match n={n}, k={k}")


def gemm_bf16(x: torch.Tensor, packed: torch.Tensor, n: int, bias: Optional[torch.Tensor] = None,
              out: Optional[torch.Tensor] = None, accumulate: bool = False,
              lib: Optional[ctypes.CDLL] = None) -> torch.Tensor:
    """y = bf16(x) W^T (+ bias) (+ y if accumulate) for W packed by `pack_bf16`: x rounded to bf16
    once (`to_bf16`), the exact bf16 products summed in fp32 (`gemm_bf16_reference`).

    Args:
        x: [m, k] float32. bias: [n] float32 or None. out: [m, n] float32 (required when accumulate).
    Returns:
        out, [m, n] float32.
    Raises:
        ValueError: a mismatched packed weight, or the kernel cannot allocate its bf16 copy of x.
    """
    lib = _lib(lib)
    _check2d("x", x, torch.float32)
    m, k = x.shape
    if accumulate and out is None:
        raise ValueError("accumulate needs out")
    y = _out(out, m, n)
    _check_bf16_packed(lib, packed, n, k)
    if lib.tm_gemm_bf16(x.data_ptr(), x.stride(0), packed.data_ptr(), None if bias is None else bias.data_ptr(),
                        y.data_ptr(), y.stride(0), m, n, k, int(accumulate)):
        raise ValueError(f"tm_gemm_bf16 could not allocate its bf16 copy of x ({m} x {k})")
    return y


def gemm_bf16_reference(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """What `gemm_bf16` computes, in float64: to_bf16(x) @ bf16(w)^T (+ bias). The kernel sums the
    same exact products in fp32, so it agrees to fp32 rounding of a k-term sum.

    Args:
        x: [m, k] float32; w: [n, k] (any float dtype; rounded to bf16); bias: [n] or None.
    Returns:
        [m, n] float64.
    """
    y = to_bf16(x).double() @ w.to(torch.bfloat16).double().t()
    return y if bias is None else y + bias.double()


def gemm_bf16_silu(x: torch.Tensor, packed: torch.Tensor, inter: int, bias: Optional[torch.Tensor] = None,
                   out: Optional[torch.Tensor] = None, lib: Optional[ctypes.CDLL] = None) -> torch.Tensor:
    """`gemm_f32_silu` for a fused [gate | up] weight [2 inter, k] packed by `pack_bf16`: out [m, inter].

    Raises:
        ValueError: inter not a multiple of `nr()`, or a mismatched packed weight.
    """
    lib = _lib(lib)
    _check2d("x", x, torch.float32)
    m, k = x.shape
    _check_bf16_packed(lib, packed, 2 * inter, k)
    y = _out(out, m, inter)
    rc = lib.tm_gemm_bf16_silu(x.data_ptr(), x.stride(0), packed.data_ptr(), None if bias is None else bias.data_ptr(),
                               y.data_ptr(), y.stride(0), m, inter, k)
    if rc == -1:
        raise ValueError(f"gemm_bf16_silu needs inter to be a multiple of {lib.tm_gemm_nr()}, got {inter}")
    if rc:
        raise ValueError(f"tm_gemm_bf16_silu could not allocate its bf16 copy of x ({m} x {k})")
    return y


def gemm_bf16_argmax(x: torch.Tensor, packed: torch.Tensor, n: int, bias: Optional[torch.Tensor] = None,
                     limit: Optional[int] = None, ban: Optional[torch.Tensor] = None,
                     lib: Optional[ctypes.CDLL] = None) -> torch.Tensor:
    """`gemm_f32_argmax` for W packed by `pack_bf16` (the values `gemm_bf16` would store).

    Returns:
        [m] int64 argmax columns (see `gemm_f32_argmax`).
    """
    lib = _lib(lib)
    _check2d("x", x, torch.float32)
    m, k = x.shape
    _check_bf16_packed(lib, packed, n, k)
    limit, bp, nban, out, scratch = _argmax_args(x, n, limit, ban, lib)
    if lib.tm_gemm_bf16_argmax(x.data_ptr(), x.stride(0), packed.data_ptr(), None if bias is None else bias.data_ptr(),
                               m, n, k, limit, bp, nban, out.data_ptr(), scratch.data_ptr()):
        raise ValueError(f"tm_gemm_bf16_argmax could not allocate its bf16 copy of x ({m} x {k})")
    return out


# ---------------------------------------------------------------- quantized weights, fp32 activations

def pack_q(codes: torch.Tensor, scale: torch.Tensor, min: Optional[torch.Tensor], bits: int, group_size: int,
           lib: Optional[ctypes.CDLL] = None) -> torch.Tensor:
    """Pack quantized weights w = q * s (+ m) for `gemm_q`.

    Args:
        codes: [n, kpad], one code per element: int8 for bits=8; uint8 0..15 for bits=4 (unpacked).
        scale, min: [n, kpad // group_size] float32 (min None: symmetric).
    Returns:
        the packed uint8 tensor.
    Raises:
        ValueError: on shapes that do not agree, kpad not a multiple of group_size, or (bits=4)
            group_size not a multiple of 4.
    """
    lib = _lib(lib)
    kind = W_Q8 if bits == 8 else W_Q4
    n, kpad = codes.shape
    if bits not in (4, 8) or kpad % group_size or tuple(scale.shape) != (n, kpad // group_size):
        raise ValueError(f"bad quantized weight: bits {bits}, codes {tuple(codes.shape)}, scale "
                         f"{tuple(scale.shape)}, group_size {group_size}")
    codes = codes.contiguous()
    scale = scale.float().contiguous()
    mn = None if min is None else min.float().contiguous()
    buf = huge_empty(lib.tm_pack_q_size(kind, int(mn is not None), n, kpad, group_size), populate=False)
    rc = lib.tm_pack_q(kind, codes.data_ptr(), scale.data_ptr(), None if mn is None else mn.data_ptr(), n, kpad,
                       group_size, buf.data_ptr())
    if rc:
        raise ValueError(f"tm_pack_q refused kpad={kpad}, group_size={group_size}")
    return buf


def gemm_q(x: torch.Tensor, packed: torch.Tensor, n: int, kpad: int, bits: int, group_size: int, has_min: bool,
           bias: Optional[torch.Tensor] = None, out: Optional[torch.Tensor] = None, accumulate: bool = False,
           lib: Optional[ctypes.CDLL] = None) -> torch.Tensor:
    """y = x W^T (+ bias) (+ y) for quantized W packed by `pack_q`; x [m, k] float32 with k <= kpad.

    bits=8 dequantizes the codes in registers (fp32 arithmetic); bits=4 quantizes x to int8 per row
    and group first and sums in integers (`gemm_q4_reference` gives the result it computes).

    Raises:
        ValueError: if the kernel refuses the shapes, or cannot allocate its activation scratch.
    """
    lib = _lib(lib)
    _check2d("x", x, torch.float32)
    m, k = x.shape
    if accumulate and out is None:
        raise ValueError("accumulate needs out")
    y = _out(out, m, n)
    kind = W_Q8 if bits == 8 else W_Q4
    rc = lib.tm_gemm_q(kind, int(has_min), x.data_ptr(), x.stride(0), packed.data_ptr(),
                       None if bias is None else bias.data_ptr(), y.data_ptr(), y.stride(0), m, n, k, kpad,
                       group_size, int(accumulate))
    if rc:
        raise ValueError(gemm_q_error(rc, k, kpad, group_size))
    return y


def gemm_q_error(rc: int, k: int, kpad: int, group_size: int) -> str:
    """The message for a nonzero return code of tm_gemm_q (-1 shapes, -2 memory)."""
    if rc == -2:
        return f"tm_gemm_q could not allocate its int8 activation scratch (k={k}, group_size={group_size})"
    return f"tm_gemm_q refused k={k}, kpad={kpad}, group_size={group_size}"


def quantize_act_q4(x: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The activations `gemm_q` computes with for 4-bit weights, in PyTorch (the kernel's definition).

    Per row and group of `group_size` columns (the last group zero-padded): sa = max|x| / 127,
    q = round(x * (127 / max|x|)) (round half to even, in [-127, 127]; 0 for an all-zero group), and
    sx = the group's sum (the kernel sums in fp32 in its own order; here in float64).

    Args:
        x: [m, k] float32.
    Returns:
        (q int64 [m, groups, group_size], sa float32 [m, groups], sx float64 [m, groups]).
    """
    m, k = x.shape
    ng = -(-k // group_size)
    xp = torch.nn.functional.pad(x.float(), (0, ng * group_size - k)).view(m, ng, group_size)
    amax = xp.abs().amax(-1)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    q = torch.round(xp * inv[..., None]).clamp(-127, 127).to(torch.int64)
    return q, amax / 127.0, xp.double().sum(-1)


def gemm_q4_reference(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, min: Optional[torch.Tensor],
                      group_size: int) -> torch.Tensor:
    """What `gemm_q` computes for 4-bit weights, in float64: the Q4 x Q8 dot product of llama.cpp's
    CPU backend (its Q4_1 x Q8_1 blocks), with the min's term taken on the exact group sum:

        y[r, n] = sum_g s[n, g] sa[r, g] (sum_{k in g} q[n, k] qa[r, k]) + m[n, g] sx[r, g]

    Args:
        x: [m, k] float32; codes: [n, kpad] integer codes 0..15; scale, min: [n, kpad // group_size]
            (min None: no min term).
    Returns:
        [m, n] float64. The kernel agrees to fp32 rounding of the per-group steps (about 1e-6 of
        the largest output); its integer sums are exact.
    """
    qa, sa, sx = quantize_act_q4(x, group_size)
    ng = qa.shape[1]
    w = codes.to(torch.int64)[:, :ng * group_size].reshape(codes.shape[0], ng, group_size)
    isum = torch.einsum("mgk,ngk->mng", qa.double(), w.double())  # exact: integers below 2^53
    y = (isum * (scale[:, :ng].double()[None] * sa.double()[:, None, :])).sum(-1)
    if min is not None:
        y = y + (min[:, :ng].double()[None] * sx[:, None, :]).sum(-1)
    return y


def gemm_q_silu(x: torch.Tensor, packed: torch.Tensor, inter: int, kpad: int, bits: int, group_size: int,
                has_min: bool, bias: Optional[torch.Tensor] = None, out: Optional[torch.Tensor] = None,
                lib: Optional[ctypes.CDLL] = None) -> torch.Tensor:
    """`gemm_f32_silu` for a quantized fused [gate | up] weight packed by `pack_q`: out [m, inter].

    Raises:
        ValueError: inter not a multiple of `nr()`, or a kpad / group size the kernel refuses.
    """
    lib = _lib(lib)
    _check2d("x", x, torch.float32)
    m, k = x.shape
    y = _out(out, m, inter)
    kind = W_Q8 if bits == 8 else W_Q4
    if lib.tm_gemm_q_silu(kind, int(has_min), x.data_ptr(), x.stride(0), packed.data_ptr(),
                          None if bias is None else bias.data_ptr(), y.data_ptr(), y.stride(0), m, inter, k, kpad,
                          group_size):
        raise ValueError(f"tm_gemm_q_silu refused inter={inter} (a multiple of {lib.tm_gemm_nr()}), k={k}, "
                         f"kpad={kpad}, group_size={group_size}")
    return y


def gemm_q_argmax(x: torch.Tensor, packed: torch.Tensor, n: int, kpad: int, bits: int, group_size: int,
                  has_min: bool, bias: Optional[torch.Tensor] = None, limit: Optional[int] = None,
                  ban: Optional[torch.Tensor] = None, lib: Optional[ctypes.CDLL] = None) -> torch.Tensor:
    """`gemm_f32_argmax` for quantized W packed by `pack_q` (the values `gemm_q` would store).

    Returns:
        [m] int64 argmax columns (see `gemm_f32_argmax`).
    Raises:
        ValueError: as `gemm_f32_argmax`, or a kpad / group size the kernel refuses.
    """
    lib = _lib(lib)
    _check2d("x", x, torch.float32)
    m, k = x.shape
    limit, bp, nban, out, scratch = _argmax_args(x, n, limit, ban, lib)
    kind = W_Q8 if bits == 8 else W_Q4
    rc = lib.tm_gemm_q_argmax(kind, int(has_min), x.data_ptr(), x.stride(0), packed.data_ptr(),
                              None if bias is None else bias.data_ptr(), m, n, k, kpad, group_size, limit, bp, nban,
                              out.data_ptr(), scratch.data_ptr())
    if rc:
        raise ValueError(f"tm_gemm_q_argmax refused k={k}, kpad={kpad}, group_size={group_size}")
    return out


# ---------------------------------------------------------------- W8A8

W8A8_GROUP = 64  # activation columns per scale (see gemm_i8.c's header for the measurement)


def quantize_act(x: torch.Tensor, group_size: int = W8A8_GROUP, codes: Optional[torch.Tensor] = None,
                 scales: Optional[torch.Tensor] = None,
                 lib: Optional[ctypes.CDLL] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per token and group of `group_size` columns: scale = max|x| / 127 over the
    group, q = round(x / scale) in [-127, 127] (half to even).

    Returns:
        (codes uint8 [m, kp] holding q + `act_offset()`, kp = k rounded up to 4;
         scales float32 [m, ceil(kp / group_size)]).
    Raises:
        ValueError: group_size not a positive multiple of 4.
    """
    lib = _lib(lib)
    _check2d("x", x, torch.float32)
    if group_size <= 0 or group_size % 4:
        raise ValueError(f"group_size must be a positive multiple of 4, got {group_size}")
    m, k = x.shape
    kp = -(-k // 4) * 4
    ng = -(-kp // group_size)
    codes = torch.empty(m, kp, dtype=torch.uint8) if codes is None else codes
    scales = torch.empty(m, ng, dtype=torch.float32) if scales is None else scales
    lib.tm_quantize_act(x.data_ptr(), x.stride(0), m, k, kp, group_size, codes.data_ptr(), scales.data_ptr())
    return codes, scales


def act_offset(lib: Optional[ctypes.CDLL] = None) -> int:
    """What a build adds to activation codes (128: the unsigned operand of vpdpbusd / vpmaddubsw)."""
    return _lib(lib).tm_w8a8_act_offset()


def pack_w8a8(q: torch.Tensor, scale: torch.Tensor, group_size: int = W8A8_GROUP,
              lib: Optional[ctypes.CDLL] = None) -> torch.Tensor:
    """Pack int8 weight codes q [n, k] in [-64, 64] (per-row scales [n] float32) for `gemm_w8a8`
    with activation groups of `group_size` columns.

    Raises:
        ValueError: group_size not a positive multiple of 4; a code outside [-64, 64] (named by
            row and column); scale not [n], or not finite (named by row).
    """
    lib = _lib(lib)
    _check2d("q", q, torch.int8)
    n, k = q.shape
    scale = scale.float().contiguous()
    if scale.shape != (n,):
        raise ValueError(f"scale must be [{n}], got {tuple(scale.shape)}")
    if group_size <= 0 or group_size % 4:
        raise ValueError(f"group_size must be a positive multiple of 4, got {group_size}")
    bad_scale = (~torch.isfinite(scale)).nonzero()
    if len(bad_scale):
        r = int(bad_scale[0])
        raise ValueError(f"W8A8 scales must be finite; row {r} holds {float(scale[r])}")
    buf = huge_empty(lib.tm_pack_w8a8_size(n, k, group_size), populate=False)
    rc = lib.tm_pack_w8a8(q.data_ptr(), q.stride(0), scale.data_ptr(), n, k, group_size, buf.data_ptr())
    if rc == -2:  # a code outside the kernels' range (tm_w8a8_weight_max): name the first one
        wmax = lib.tm_w8a8_weight_max()
        r, c = ((q > wmax) | (q < -wmax)).nonzero()[0].tolist()
        raise ValueError(f"W8A8 weight codes must lie in [-{wmax}, {wmax}] (see quantize_w8a8); row {r} column {c} "
                         f"holds {int(q[r, c])}")
    if rc:
        raise ValueError(f"tm_pack_w8a8 refused the weight (code {rc})")
    return buf


def w8a8_amx(enable: Optional[bool] = None, lib: Optional[ctypes.CDLL] = None) -> bool:
    """Whether `gemm_w8a8` runs its blocks of 16 rows on AMX tiles (TDPBUSD; gemm_i8.c's header),
    after turning that on or off for this process when `enable` is given. On needs a build for a CPU
    with AMX-INT8 and Linux's grant of the tile state; otherwise this stays False. Either way the
    results are the same bits (the vpdpbusd path computes the same int32 sums and fp32 operations).
    Until set, on where possible unless TOKENMILL_AMX=0."""
    return bool(_lib(lib).tm_w8a8_amx(-1 if enable is None else int(bool(enable))))


def bf16_amx(enable: Optional[bool] = None, lib: Optional[ctypes.CDLL] = None) -> bool:
    """Whether `gemm_bf16` (and its SwiGLU and argmax forms) runs weights with K a multiple of 32 on
    AMX-BF16 tiles (TDPBF16PS; gemm.c's amx_bf16_rows), after turning that on or off for this process
    when `enable` is given. On needs a build for a CPU with AMX-BF16 and Linux's grant of the tile
    state; otherwise this stays False. Such a weight takes the tiles for every call, one row or many,
    so a row's result never depends on its batch; against VDPBF16PS the sums of the same bf16 products
    differ only in their fp32 rounding. Until set, on where possible unless TOKENMILL_AMX=0."""
    return bool(_lib(lib).tm_bf16_amx(-1 if enable is None else int(bool(enable))))


def bf16_amx_calls(lib: Optional[ctypes.CDLL] = None) -> int:
    """bf16 GEMM calls that ran on AMX tiles in this process (a count for tests that the path ran)."""
    return int(_lib(lib).tm_bf16_amx_calls())


def w8a8_amx_blocks(lib: Optional[ctypes.CDLL] = None) -> int:
    """Blocks of 16 activation rows x one weight panel (`nr()` columns) that `gemm_w8a8` has computed
    on AMX tiles in this process (a count for tests that the path ran)."""
    return int(_lib(lib).tm_w8a8_amx_blocks())


def gemm_w8a8(codes: torch.Tensor, scales: torch.Tensor, packed: torch.Tensor, n: int,
              group_size: int = W8A8_GROUP, bias: Optional[torch.Tensor] = None,
              out: Optional[torch.Tensor] = None, accumulate: bool = False,
              lib: Optional[ctypes.CDLL] = None) -> torch.Tensor:
    """y = (codes scales) (W sw)^T (+ bias) (+ y) from `quantize_act` output and a `pack_w8a8`
    weight made with the same group_size."""
    lib = _lib(lib)
    m, kp = codes.shape
    if accumulate and out is None:
        raise ValueError("accumulate needs out")
    y = _out(out, m, n)
    if lib.tm_gemm_w8a8(codes.data_ptr(), scales.data_ptr(), kp, group_size, packed.data_ptr(),
                        None if bias is None else bias.data_ptr(), y.data_ptr(), y.stride(0), m, n, int(accumulate)):
        raise ValueError(f"tm_gemm_w8a8 refused kp={kp}, group_size={group_size}")
    return y


# ---------------------------------------------------------------- small ops

def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float, out: Optional[torch.Tensor] = None,
             lib: Optional[ctypes.CDLL] = None) -> torch.Tensor:
    """out = x / sqrt(mean(x^2) + eps) * w, per row of x [m, k] float32 (fp32 statistics)."""
    lib = _lib(lib)
    _check2d("x", x, torch.float32)
    m, k = x.shape
    y = _out(out, m, k)
    lib.tm_rms_norm(x.data_ptr(), x.stride(0), w.data_ptr(), y.data_ptr(), y.stride(0), m, k, float(eps))
    return y


def rope_(x: torch.Tensor, heads: int, head_dim: int, positions: torch.Tensor, cos: torch.Tensor,
          sin: torch.Tensor, lib: Optional[ctypes.CDLL] = None) -> torch.Tensor:
    """Rotary embedding in place on the first `heads` heads of each row of x [t, >= heads * head_dim]
    ("rotate half" pairs (i, i + head_dim / 2)); positions [t] int64; cos/sin [max_pos, head_dim / 2] float32."""
    lib = _lib(lib)
    _check2d("x", x, torch.float32)
    if positions.dtype != torch.int64 or not positions.is_contiguous() or not (cos.is_contiguous() and sin.is_contiguous()):
        raise ValueError("positions must be contiguous int64 and cos/sin contiguous float32")
    lib.tm_rope(x.data_ptr(), x.stride(0), x.shape[0], heads, head_dim, positions.data_ptr(), cos.data_ptr(),
                sin.data_ptr())
    return x


def silu_mul(gu: torch.Tensor, out: Optional[torch.Tensor] = None, lib: Optional[ctypes.CDLL] = None) -> torch.Tensor:
    """out = silu(gate) * up for gu [m, 2n] = [gate | up]; out [m, n] float32."""
    lib = _lib(lib)
    _check2d("gu", gu, torch.float32)
    m, n2 = gu.shape
    y = _out(out, m, n2 // 2)
    lib.tm_silu_mul(gu.data_ptr(), gu.stride(0), y.data_ptr(), y.stride(0), m, n2 // 2)
    return y


def argmax_rows(x: torch.Tensor, out: Optional[torch.Tensor] = None,
                lib: Optional[ctypes.CDLL] = None) -> torch.Tensor:
    """Index of the largest value of each row of x [m, n] float32 (contiguous last dim): [m] int64,
    the first index on ties as `torch.argmax`; NaN is never chosen (torch would choose it), and a
    row with nothing above -inf gives 0. Rows are shared out over the thread pool.

    Raises:
        ValueError: x is not a 2-D float32 CPU tensor with a contiguous last dim, or n == 0.
    """
    lib = _lib(lib)
    _check2d("x", x, torch.float32)
    m, n = x.shape
    if n == 0:
        raise ValueError("argmax_rows needs at least one column")
    if out is None:
        out = torch.empty(m, dtype=torch.int64)
    elif out.dtype != torch.int64 or not out.is_contiguous() or out.numel() != m:
        raise ValueError(f"out must be a contiguous int64 tensor of {m} elements")
    lib.tm_argmax_rows(x.data_ptr(), x.stride(0), m, n, out.data_ptr())
    return out


def kv_write(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, lib: Optional[ctypes.CDLL] = None) -> None:
    """Write rows k, v [t, hkv, d] (or [t, hkv * d] views) into the caches at `slot_mapping` [t] int64.

    Caches: [hkv, slots, d] float32; [hkv, slots, d] float16 (rounded to nearest even, the bits
    `k.to(torch.float16)` gives); [hkv, slots, d] int16, bf16 in the group layout (rounded to nearest
    even: `engine.attention.bf16_kv.write_rows` writes the same bits); or int8 rows [hkv, slots, d + 4]
    (codes, then the fp32 scale max|x| / 127, as `TorchQuantKVAttentionBackend.encode`).

    Raises:
        ValueError: for caches of another dtype or layout, or not contiguous.
    """
    lib = _lib(lib)
    hkv, s, row = k_cache.shape
    t = k.shape[0]
    d = row - 4 if k_cache.dtype == torch.int8 else row
    fmt = kv_row_format(k_cache, d)
    if (fmt is None or not (k_cache.is_contiguous() and v_cache.is_contiguous()) or v_cache.dtype != k_cache.dtype
            or v_cache.shape != k_cache.shape):
        raise ValueError("caches must be contiguous float32, float16 or grouped bf16 [hkv, s, d], or int8 [hkv, s, d + 4], "
                         f"K and V alike; got {k_cache.dtype} {tuple(k_cache.shape)} and {v_cache.dtype} "
                         f"{tuple(v_cache.shape)}")
    k2, v2 = k.reshape(t, hkv * d), v.reshape(t, hkv * d)
    _check2d("k", k2, torch.float32)
    _check2d("v", v2, torch.float32)
    lib.tm_kv_write(k2.data_ptr(), k2.stride(0), v2.data_ptr(), v2.stride(0), t, hkv, d, slot_mapping.data_ptr(),
                    k_cache.data_ptr(), v_cache.data_ptr(), s, fmt)


# ---------------------------------------------------------------- attention

def attention_tile_rows(group: int, lib: Optional[ctypes.CDLL] = None) -> int:
    """Most query rows one attention tile may hold for `group` query heads per KV head (rows x group <= 16)."""
    return _lib(lib).tm_attention_tile_rows(int(group))


def attention_bf16(lib: Optional[ctypes.CDLL] = None) -> bool:
    """Whether a build reads bf16 caches (`KV_BF16`) on VDPBF16PS; False: one value at a time, in fp32."""
    return bool(_lib(lib).tm_attention_bf16())


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    row_seq: Optional[torch.Tensor], kv_len: torch.Tensor, tiles: torch.Tensor, block_size: int,
                    scale: float, out: torch.Tensor, lib: Optional[ctypes.CDLL] = None,
                    window: int = 0) -> torch.Tensor:
    """Causal attention of query rows over the paged KV cache, blocks read in place (`attention.c`).

    Args:
        q: [T, Hq, D] float32 (rows may be strided, heads and D contiguous).
        k_cache, v_cache: [Hkv, S, D] float32 or float16, int16 (bf16 in the group layout of
            `engine.attention.bf16_kv`: read on VDPBF16PS where `attention_bf16`, the queries and
            probabilities rounded to bf16 too; block_size a multiple of 16 and D of 32), or int8 rows
            [Hkv, S, D + 4]; contiguous (`kv_row_format`).
        block_tables: [num_seqs, max_blocks] int32 contiguous.
        row_seq: [T] int32, the block-table row of each query row (None: row r uses row r).
        kv_len: [T] int64, keys row r sees (its position + 1).
        tiles: [num_tiles, 2] int64 (first row, rows): consecutive rows of one sequence, at most
            `attention_tile_rows(Hq // Hkv)` rows each; every row in exactly one tile.
        out: [T, Hq, D] float32 (rows may be strided), written.
        window: sliding window in tokens: row r attends only keys kv_len[r] - window <= j < kv_len[r]
            (position p sees p - window < j <= p), and the blocks wholly before a tile's window are
            not read (their table entries may point at any valid block); 0: every key below kv_len[r].
    Returns:
        out.
    Raises:
        ValueError: a negative window, or a cache the kernel cannot read.
        RuntimeError: a shape the kernel does not serve (check `engine.attention.cpu_kernel.supports`).
    """
    if window < 0:
        raise ValueError(f"window must be >= 0 tokens (0: full attention), got {window}")
    lib = _lib(lib)
    t, hq, d = q.shape
    hkv, s, _ = k_cache.shape
    fmt = kv_row_format(k_cache, d)
    if fmt is None or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"the CPU attention kernel reads float32, float16 or grouped bf16 [Hkv, S, D] or int8 [Hkv, S, D + 4] "
                         f"caches, K and V alike; got {k_cache.dtype} {tuple(k_cache.shape)} and {v_cache.dtype} "
                         f"for head_dim {d}")
    rc = lib.tm_paged_attention(
        q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), fmt, block_tables.data_ptr(),
        block_tables.shape[1], None if row_seq is None else row_seq.data_ptr(), kv_len.data_ptr(),
        tiles.data_ptr(), tiles.shape[0], out.data_ptr(), out.stride(0), hq, hkv, d, s, block_size, float(scale),
        int(window))
    if rc:
        raise RuntimeError(f"the CPU attention kernel refused Hq={hq}, Hkv={hkv}, D={d}, block_size={block_size}")
    return out
