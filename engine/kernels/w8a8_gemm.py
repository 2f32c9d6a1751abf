"""W8A8 GEMM in Triton (the CUDA path of quantization="w8a8"), beside its PyTorch reference.

The same scheme as the CPU kernels (`engine/kernels/cpu/gemm_i8.c`): int8 weights with a
scale per output channel, int8 activations with a scale per token and group of `gs`
input columns, quantized each step (`quantize_act`), products summed exactly in int32
within a group (`tl.dot` on int8 tiles, int32 accumulator), then in fp32 across groups:

    y[m, n] = sw[n] * sum_g sa[m, g] * (sum_{k in g} qa[m, k] qw[n, k])  (+ bias[n])

Activation codes are signed (no offset: tensor-core int8 dots take signed operands), with
scale max|x| / 127 over the group and round half to even, as the CPU path.

The tile sizes are first guesses, not yet measured on a GPU (benchmarks/gpu_check.py).
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl


# ---------------------------------------------------------------- activations

@triton.jit
def _rint(x):
    """Round half to even, in fp32 (adding and removing 1.5 * 2^23 does it for |x| < 2^22; the
    kernel that uses it is compiled with enable_fp_fusion=False, or the add fuses with the product
    before it into one FMA and skips the product's rounding)."""
    big = 12582912.0
    return (x + big) - big


@triton.jit
def _quant_act_kernel(x_ptr, q_ptr, s_ptr, K, stride_x, stride_q, NG, GS: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    cols = g * GS + tl.arange(0, BLOCK)
    mask = (tl.arange(0, BLOCK) < GS) & (cols < K)
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=0)
    # IEEE-rounded divisions (compiled for CUDA, `/` is an approximate division) and no FMA
    # fusion (see _rint): without both, codes near a half differed from quantize_act_ref's on an H200
    inv = tl.where(amax > 0, tl.math.div_rn(127.0, tl.maximum(amax, 1e-30)), 0.0)
    q = _rint(x * inv)
    q = tl.minimum(tl.maximum(q, -127.0), 127.0)
    tl.store(q_ptr + row * stride_q + cols, q.to(tl.int8), mask=mask)
    tl.store(s_ptr + row * NG + g, tl.math.div_rn(amax, 127.0))


def quantize_act(x: torch.Tensor, group_size: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (fp32/bf16/fp16) -> (codes int8 [M, K], scales fp32 [M, ceil(K / group_size)])."""
    m, k = x.shape
    ng = triton.cdiv(k, group_size)
    codes = torch.empty(m, k, dtype=torch.int8, device=x.device)
    scales = torch.empty(m, ng, dtype=torch.float32, device=x.device)
    if m:
        _quant_act_kernel[(m, ng)](x, codes, scales, k, x.stride(0), codes.stride(0), ng, GS=group_size,
                                   BLOCK=triton.next_power_of_2(group_size), enable_fp_fusion=False)
    return codes, scales


def quantize_act_ref(x: torch.Tensor, group_size: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch reference of `quantize_act`."""
    m, k = x.shape
    ng = -(-k // group_size)
    xp = torch.nn.functional.pad(x.float(), (0, ng * group_size - k)).view(m, ng, group_size)
    amax = xp.abs().amax(-1)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    q = torch.round(xp * inv[..., None]).clamp(-127, 127).to(torch.int8).view(m, ng * group_size)[:, :k]
    return q.contiguous(), amax / 127.0


# ---------------------------------------------------------------- GEMM

@triton.jit
def _w8a8_kernel(a_ptr, sa_ptr, w_ptr, sw_ptr, b_ptr, y_ptr, M, N, K, NG, stride_a, stride_w, stride_y,
                 HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GS: tl.constexpr):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, GS)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for g in range(0, NG):
        kk = g * GS + ks
        a = tl.load(a_ptr + rows[:, None].to(tl.int64) * stride_a + kk[None, :],
                    mask=(rows[:, None] < M) & (kk[None, :] < K), other=0)
        w = tl.load(w_ptr + cols[None, :].to(tl.int64) * stride_w + kk[:, None],
                    mask=(cols[None, :] < N) & (kk[:, None] < K), other=0)
        part = tl.dot(a, w, out_dtype=tl.int32)  # exact int32 sums of the group
        sa = tl.load(sa_ptr + rows.to(tl.int64) * NG + g, mask=rows < M, other=0.0)
        acc += part.to(tl.float32) * sa[:, None]
    sw = tl.load(sw_ptr + cols, mask=cols < N, other=0.0)
    acc = acc * sw[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rows[:, None].to(tl.int64) * stride_y + cols[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=(rows[:, None] < M) & (cols[None, :] < N))


def w8a8_matmul(codes: torch.Tensor, scales: torch.Tensor, w_codes: torch.Tensor, w_scale: torch.Tensor,
                group_size: int = 64, bias: Optional[torch.Tensor] = None,
                out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """y [M, N] = dequant(codes, scales) @ dequant(w_codes, w_scale)^T (+ bias).

    Args:
        codes: int8 [M, K] and scales fp32 [M, ceil(K / group_size)], from `quantize_act`.
        w_codes: int8 [N, K]; w_scale: fp32 [N].
        group_size: the activation group (>= 16, a power of two: one K step per group).
    Raises:
        ValueError: group_size not a power of two >= 16.
    """
    if group_size < 16 or group_size & (group_size - 1):
        raise ValueError(f"the Triton W8A8 kernel needs a power-of-two group_size >= 16, got {group_size}")
    m, k = codes.shape
    n = w_codes.shape[0]
    y = torch.empty(m, n, dtype=out_dtype, device=codes.device)
    if m == 0:
        return y
    bm = 16 if m <= 16 else 64
    bn = 64
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
    _w8a8_kernel[grid](codes, scales, w_codes, w_scale, bias if bias is not None else w_scale, y, m, n, k,
                       scales.shape[1], codes.stride(0), w_codes.stride(0), y.stride(0), HAS_BIAS=bias is not None,
                       BLOCK_M=bm, BLOCK_N=bn, GS=group_size)
    return y


def w8a8_matmul_ref(codes: torch.Tensor, scales: torch.Tensor, w_codes: torch.Tensor, w_scale: torch.Tensor,
                    group_size: int = 64, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """PyTorch reference of `w8a8_matmul` (exact integer sums per group, fp64 accumulation), fp32 out.

    The group sums are fp64 matmuls of the integer codes: exact (|sum| <= K * 127^2 < 2^53), and
    available on CUDA, which has no int64 matmul."""
    m, k = codes.shape
    y = torch.zeros(m, w_codes.shape[0], dtype=torch.float64, device=codes.device)
    for g in range(scales.shape[1]):
        sl = slice(g * group_size, min((g + 1) * group_size, k))
        part = codes[:, sl].double() @ w_codes[:, sl].double().t()
        y += part * scales[:, g].double()[:, None]
    y = y * w_scale.double()[None, :]
    if bias is not None:
        y += bias.double()
    return y.float()


class W8A8TritonLinear(torch.nn.Module):
    """The CUDA face of quantization="w8a8": int8 weights per output channel, activations
    quantized per token and group of `group_size` each call (`quantize_act`), `w8a8_matmul`.
    Same forward contract as `models.llama.Linear` (out / residual).

    Args:
        q: int8 codes [out, in]; scale: fp32 [out]; bias: [out] or None; all on the device.
        group_size: activation columns per scale (a power of two >= 16).
        dtype: the output (activation) dtype.
    """

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, bias: Optional[torch.Tensor] = None,
                 group_size: int = 64, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.out_features, self.in_features = q.shape
        self.group_size, self.dtype = group_size, dtype
        self.register_buffer("weight", q.contiguous())
        self.register_buffer("scale", scale.float().contiguous())
        self.bias = None if bias is None else torch.nn.Parameter(bias.float().contiguous(), requires_grad=False)

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, group_size: int = 64,
                   dtype: torch.dtype = torch.float32) -> "W8A8TritonLinear":
        """Quantize a float weight [out, in] per output channel with the CPU layers' codes
        (`engine.kernels.cpu.layers.quantize_w8a8`: s = max|w_row| / 63, q = round(w / s)), so that
        both devices compute with the same weights."""
        from .cpu.layers import quantize_w8a8

        q, s = quantize_w8a8(weight.detach().to("cpu"))
        return cls(q.to(weight.device), s.to(weight.device), bias, group_size, dtype)

    def dequantize(self) -> torch.Tensor:
        """The fp32 weight [out, in] the codes represent."""
        return self.weight.float() * self.scale[:, None]

    def forward(self, x: torch.Tensor, out: Optional[torch.Tensor] = None,
                residual: Optional[torch.Tensor] = None) -> torch.Tensor:
        codes, scales = quantize_act(x, self.group_size)
        y = w8a8_matmul(codes, scales, self.weight, self.scale, self.group_size, self.bias, x.dtype)
        if residual is not None:
            return residual.add_(y)
        return y if out is None else out.copy_(y)

    def weight_bytes(self) -> int:
        """Bytes read per forward pass (codes, scales, bias)."""
        return self.weight.numel() + self.scale.numel() * 4 + (0 if self.bias is None else self.bias.numel() * 4)
