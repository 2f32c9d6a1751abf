"""Weight-only quantized GEMM: y = x @ W^T (+ bias), W dequantized tile by tile in the kernel.

The weight layout is `engine.quant.QuantLinear`'s (one scale, and optionally
one min, per group of `group_size` consecutive input columns of a row):

    w[n, k] = q[n, k] * scale[n, k // gs] (+ min[n, k // gs])

- bits=8: `codes` int8 [N, K_pad].
- bits=4: `codes` uint8 [N, K_pad // 2]; within each group, byte j holds element
  j in its low nibble and element j + gs/2 in its high nibble. This is the
  block layout of GGUF Q4_0 / Q4_1 (ggml `block_q4_0.qs`: 16 bytes for 32
  values, low nibbles first half, high nibbles second half), generalised to
  any even group size.

W is never materialised. The K loop is aligned to groups: a K-step covers
`TILE` consecutive columns that lie inside one group (for int4, `TILE` bytes,
i.e. two runs of `TILE` columns: the low-nibble run and the high-nibble run
gs/2 further on), so each step needs one scale (and min) per output row and
the scale is applied after the dot, on the fp32 partial sum:

    sum_k x[m,k] * (q[n,k] * s[n] + mn[n]) = s[n] * (x @ q)[m,n] + mn[n] * sum_k x[m,k]

The codes enter the dot as exact integers in x's dtype (int8 and 0..15 are
exact in bf16/fp16), products accumulate in fp32; fp32 inputs use an IEEE fp32
dot (no TF32). `TILE` is the largest power of two <= the configuration's tile
that divides the group (or half group, int4); a group whose size has no such
divisor >= 16 still works, its last step of each group being masked (as does
a single per-channel group of any width: the K tail is masked).

Two launch configurations, chosen by M (`DECODE_MAX_M`):
- decode (M <= 16): one program per N-tile holding all M rows (M == 1 uses an
  FMA reduction, 2..16 a 16-row dot), with split-K when there are too few
  N-tiles to fill the GPU (partial sums in fp32, reduced in PyTorch).
- prefill: M x N tiles (grouped order for L2 reuse), `tl.dot` per K-step.

The tile sizes below are first guesses, not yet measured on a GPU
(`benchmarks/gpu_check.py`, section quant_gemm, times them).
"""
from __future__ import annotations

import builtins
from typing import Optional

import torch
import triton
import triton.language as tl

DECODE_MAX_M = 16
# (BLOCK_M, BLOCK_N, tile, GROUP_M, num_warps, num_stages); tile = columns (bits 8) or bytes (bits 4) per K-step
_DECODE = (16, 64, 128, 1, 4, 3)
_PREFILL = (64, 64, 64, 8, 4, 3)


@triton.jit
def _step(x_rows, m_mask, cols, col_mask, q, TILE: tl.constexpr, USE_DOT: tl.constexpr, IEEE: tl.constexpr):
    """(x[rows, cols] @ q, row sums of x[rows, cols]): [BLOCK_M, BLOCK_N] and [BLOCK_M], fp32.
    q: [TILE, BLOCK_N] integer codes held as fp32."""
    x = tl.load(x_rows + cols[None, :], mask=m_mask[:, None] & col_mask[None, :], other=0.0)
    if USE_DOT:
        if IEEE:
            d = tl.dot(x, q, input_precision="ieee")
        else:
            d = tl.dot(x, q.to(x.dtype))
    else:  # BLOCK_M == 1: a plain multiply-reduce over K
        d = tl.sum(tl.reshape(x.to(tl.float32), (TILE, 1)) * q, axis=0)[None, :]
    return d, tl.sum(x.to(tl.float32), axis=1)


@triton.jit
def _quant_matmul_kernel(
    x_ptr, q_ptr, s_ptr, mn_ptr, b_ptr, y_ptr,
    M, N, K, gs, unit, steps_per_group, total_steps, steps_per_split,
    stride_xm, stride_qn, stride_sn, stride_ym, stride_ys,
    BITS: tl.constexpr, HAS_MIN: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TILE: tl.constexpr, GROUP_M: tl.constexpr,
    USE_DOT: tl.constexpr, IEEE: tl.constexpr,
):
    # grouped program order: GROUP_M row-tiles sweep the N-tiles together (W tiles stay in L2)
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    width = GROUP_M * num_pid_n
    first_m = (pid // width) * GROUP_M
    size_m = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % size_m
    pid_n = (pid % width) // size_m
    split = tl.program_id(1)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    q_rows = q_ptr + offs_n.to(tl.int64)[None, :] * stride_qn
    s_rows = s_ptr + offs_n.to(tl.int64) * stride_sn
    mn_rows = mn_ptr + offs_n.to(tl.int64) * stride_sn
    lane = tl.arange(0, TILE)

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    t_lo = split * steps_per_split
    t_hi = tl.minimum(t_lo + steps_per_split, total_steps)
    for t in range(t_lo, t_hi):
        g = t // steps_per_group
        offs = (t % steps_per_group) * TILE + lane  # position inside the group's unit (gs or gs/2 columns)
        in_unit = offs < unit
        q_mask = in_unit[:, None] & n_mask[None, :]
        cols = g * gs + offs
        if BITS == 8:
            q = tl.load(q_rows + cols[:, None], mask=q_mask, other=0).to(tl.float32)
            d, xs = _step(x_rows, m_mask, cols, in_unit & (cols < K), q, TILE, USE_DOT, IEEE)
        else:
            p = tl.load(q_rows + (g * unit + offs)[:, None], mask=q_mask, other=0)
            d, xs = _step(x_rows, m_mask, cols, in_unit & (cols < K), (p & 15).to(tl.float32), TILE, USE_DOT, IEEE)
            cols_hi = cols + unit
            d_hi, xs_hi = _step(x_rows, m_mask, cols_hi, in_unit & (cols_hi < K), (p >> 4).to(tl.float32),
                                TILE, USE_DOT, IEEE)
            d += d_hi
            xs += xs_hi
        s = tl.load(s_rows + g, mask=n_mask, other=0.0).to(tl.float32)
        acc += d * s[None, :]
        if HAS_MIN:
            mn = tl.load(mn_rows + g, mask=n_mask, other=0.0).to(tl.float32)
            acc += xs[:, None] * mn[None, :]

    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    y = y_ptr + split.to(tl.int64) * stride_ys + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def _check(x, codes, scale, min, bits, group_size, in_features, bias) -> int:
    """Validate the arguments; returns the stored (padded) width K_pad."""
    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, got {bits}")
    want = torch.int8 if bits == 8 else torch.uint8
    if codes.dim() != 2 or codes.dtype != want:
        raise ValueError(f"codes must be a 2-D {want} tensor for bits={bits}, got {codes.dtype} {tuple(codes.shape)}")
    k_pad = codes.shape[1] * (2 if bits == 4 else 1)
    if group_size <= 0 or k_pad % group_size or (bits == 4 and group_size % 2):
        raise ValueError(f"group_size {group_size} must be positive{', even' if bits == 4 else ''} "
                         f"and divide the stored width {k_pad}")
    if not 0 <= k_pad - in_features < group_size:
        raise ValueError(f"in_features {in_features} is not the stored width {k_pad} less under one group "
                         f"({group_size})")
    if x.dim() != 2 or x.shape[1] != in_features:
        raise ValueError(f"x must be [M, {in_features}], got {tuple(x.shape)}")
    groups = (codes.shape[0], k_pad // group_size)
    if scale.shape != groups:
        raise ValueError(f"scale must be {groups}, got {tuple(scale.shape)}")
    if min is not None and min.shape != groups:
        raise ValueError(f"min must be {groups}, got {tuple(min.shape)}")
    if bias is not None and bias.shape != (codes.shape[0],):
        raise ValueError(f"bias must be [{codes.shape[0]}], got {tuple(bias.shape)}")
    return k_pad


def _tile(unit: int, n_groups: int, target: int) -> int:
    """K-step width: a power of two (>= 16, for tl.dot) <= target, dividing `unit` where it can."""
    if n_groups == 1:
        return max(16, min(target, triton.next_power_of_2(unit)))
    t = target
    while t > 16 and unit % t:
        t //= 2
    return t


def quant_matmul(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, min: Optional[torch.Tensor],
                 bits: int, group_size: int, in_features: int, bias: Optional[torch.Tensor] = None,
                 out_dtype: Optional[torch.dtype] = None, *, split_k: Optional[int] = None) -> torch.Tensor:
    """y = x @ W^T (+ bias) with W = dequantized (codes, scale, min), in one Triton kernel.

    Args:
        x: [M, in_features], fp32 / bf16 / fp16 (rows may be strided; made contiguous along K).
        codes: int8 [N, K_pad] (bits=8) or uint8 [N, K_pad // 2] (bits=4, GGUF Q4_0/Q4_1 nibble layout
            per group, see the module docstring). K_pad = in_features rounded up to a whole group;
            the padding columns are never read into y (x is masked to 0 there).
        scale: [N, K_pad // group_size], any float dtype (read as fp32).
        min: [N, K_pad // group_size] or None (symmetric).
        bits: 8 or 4.
        group_size: input columns per scale (K_pad for per-channel); even for bits=4.
        in_features: K, the width of x (K_pad - group_size < K <= K_pad).
        bias: [N] or None (added in fp32).
        out_dtype: dtype of y; x's dtype by default.
        split_k: K-splits of the decode launch; None picks by the GPU's SM count (1 off CUDA).
    Returns:
        y [M, N] in out_dtype; fp32 accumulation.
    Raises:
        ValueError: bits not 4/8; codes of the wrong dtype or rank; group_size not dividing the stored
            width (or odd for int4); in_features inconsistent with the stored width; x, scale, min or
            bias of the wrong shape. Each message names the argument.
    """
    k_pad = _check(x, codes, scale, min, bits, group_size, in_features, bias)
    m, n = x.shape[0], codes.shape[0]
    out_dtype = out_dtype or x.dtype
    if m == 0 or n == 0:
        return torch.zeros(m, n, dtype=out_dtype, device=x.device)
    if x.stride(1) != 1:
        x = x.contiguous()
    scale = scale.float().contiguous()
    min = None if min is None else min.float().contiguous()
    codes = codes.contiguous()

    decode = m <= DECODE_MAX_M
    block_m, block_n, target, group_m, warps, stages = _DECODE if decode else _PREFILL
    if decode and m == 1:
        block_m = 1
    n_groups = k_pad // group_size
    unit = group_size if bits == 8 else group_size // 2
    tile = _tile(unit, n_groups, target)
    per_group = triton.cdiv(unit, tile)
    steps = n_groups * per_group
    tiles_mn = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    if split_k is None:
        split_k = 1
        if decode and x.is_cuda:
            sms = torch.cuda.get_device_properties(x.device).multi_processor_count
            split_k = max(1, builtins.min(triton.cdiv(2 * sms, tiles_mn), steps // 4))
    per_split = triton.cdiv(steps, max(1, builtins.min(split_k, steps)))
    split_k = triton.cdiv(steps, per_split)  # no empty splits

    out = torch.empty((split_k, m, n), dtype=out_dtype if split_k == 1 else torch.float32, device=x.device)
    has_bias = bias is not None and split_k == 1
    _quant_matmul_kernel[(tiles_mn, split_k)](
        x, codes, scale, scale if min is None else min, bias if has_bias else scale, out,
        m, n, in_features, group_size, unit, per_group, steps, per_split,
        x.stride(0), codes.stride(0), scale.stride(0), out.stride(1), out.stride(0),
        BITS=bits, HAS_MIN=min is not None, HAS_BIAS=has_bias,
        BLOCK_M=block_m, BLOCK_N=block_n, TILE=tile, GROUP_M=group_m,
        USE_DOT=block_m > 1, IEEE=x.dtype == torch.float32, num_warps=warps, num_stages=stages,
    )
    if split_k == 1:
        return out[0]
    y = out.sum(0)
    if bias is not None:
        y += bias.float()
    return y.to(out_dtype)


def dequantize_ref(codes: torch.Tensor, scale: torch.Tensor, min: Optional[torch.Tensor], bits: int,
                   group_size: int, in_features: int) -> torch.Tensor:
    """The fp32 weight [N, in_features] of (codes, scale, min), in PyTorch (the kernels' oracle)."""
    n = codes.shape[0]
    if bits == 8:
        q = codes.float()
    else:  # per group: low nibbles are the first half, high nibbles the second
        p = codes.reshape(n, -1, group_size // 2)
        q = torch.cat((p & 15, p >> 4), dim=-1).reshape(n, -1).float()
    g = q.view(n, -1, group_size) * scale.float()[..., None]
    if min is not None:
        g = g + min.float()[..., None]
    return g.reshape(n, -1)[:, :in_features]


def quant_matmul_ref(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, min: Optional[torch.Tensor],
                     bits: int, group_size: int, in_features: int, bias: Optional[torch.Tensor] = None,
                     out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """PyTorch reference of `quant_matmul` (same arguments, checks and errors): dequantize to fp32,
    then one fp32 matmul; y [M, N] in out_dtype (x's dtype by default)."""
    _check(x, codes, scale, min, bits, group_size, in_features, bias)
    y = x.float() @ dequantize_ref(codes, scale, min, bits, group_size, in_features).t()
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype or x.dtype)
