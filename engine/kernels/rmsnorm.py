"""RMSNorm fused with the residual add (Zhang & Sennrich 2019, arXiv 1910.07467).

In a pre-norm decoder each sub-block ends with `h = h + delta` and the next one
starts with `x = rmsnorm(h) * w`; one kernel does both, reading h and delta
once and writing h and x once (4 passes over [T, H] instead of 6).
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl


@triton.jit
def _add_rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr,
    stride_x, stride_res, stride_out,
    n_cols, eps,
    HAS_RES: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        x += tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(res_ptr + row * stride_res + cols, x.to(res_ptr.dtype.element_ty), mask=mask)
    var = tl.sum(x * x, axis=0) / n_cols
    y = x * tl.rsqrt(var + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (y * w).to(out_ptr.dtype.element_ty), mask=mask)


def fused_add_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
                       residual: Optional[torch.Tensor] = None) -> torch.Tensor:
    """`residual += x` in place (if given), then RMSNorm of the sum times `weight`.

    Args:
        x: [T, H] (rows may be strided; the last dim contiguous).
        weight: [H].
        eps: added to the mean square.
        residual: [T, H] or None; updated in place to residual + x.
    Returns:
        [T, H] in x's dtype: rmsnorm(residual + x) * weight (or rmsnorm(x) * weight).
        Statistics in fp32.
    """
    assert x.dim() == 2 and x.stride(-1) == 1, "x must be [T, H] with a contiguous last dim"
    t, h = x.shape
    out = torch.empty((t, h), dtype=x.dtype, device=x.device)
    if t == 0:
        return out
    res = residual if residual is not None else x
    assert res.stride(-1) == 1
    _add_rms_norm_kernel[(t,)](
        x, res, weight, out, x.stride(0), res.stride(0), out.stride(0), h, eps,
        HAS_RES=residual is not None, BLOCK=triton.next_power_of_2(h),
    )
    return out


def fused_add_rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float,
                           residual: Optional[torch.Tensor] = None) -> torch.Tensor:
    """PyTorch reference of `fused_add_rms_norm` (same in-place contract on `residual`)."""
    if residual is not None:
        residual.add_(x)
        x = residual
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * weight.float()).to(x.dtype)
