"""Rotary position embedding applied in place to q and k ("rotate half" layout).

Pairs (i, i + D/2) of each head are rotated by angle position * inv_freq[i]
(Su et al. 2021, arXiv 2104.09864), as in Hugging Face Llama. One program per
token rotates all its q and k heads, reading cos/sin once.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rope_kernel(
    q_ptr, k_ptr, cos_ptr, sin_ptr, pos_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_cs,
    n_q_heads, n_k_heads,
    HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    p = tl.load(pos_ptr + t).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    dmask = d < HALF
    cos = tl.load(cos_ptr + p * stride_cs + d, mask=dmask, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(sin_ptr + p * stride_cs + d, mask=dmask, other=0.0).to(tl.float32)[None, :]
    h = tl.arange(0, BLOCK_H)
    # q heads
    m = (h[:, None] < n_q_heads) & dmask[None, :]
    base = q_ptr + t * stride_qt + h[:, None] * stride_qh + d[None, :]
    x1 = tl.load(base, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(base + HALF, mask=m, other=0.0).to(tl.float32)
    tl.store(base, (x1 * cos - x2 * sin).to(q_ptr.dtype.element_ty), mask=m)
    tl.store(base + HALF, (x2 * cos + x1 * sin).to(q_ptr.dtype.element_ty), mask=m)
    # k heads
    m = (h[:, None] < n_k_heads) & dmask[None, :]
    base = k_ptr + t * stride_kt + h[:, None] * stride_kh + d[None, :]
    x1 = tl.load(base, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(base + HALF, mask=m, other=0.0).to(tl.float32)
    tl.store(base, (x1 * cos - x2 * sin).to(k_ptr.dtype.element_ty), mask=m)
    tl.store(base + HALF, (x2 * cos + x1 * sin).to(k_ptr.dtype.element_ty), mask=m)


def rope_inplace(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 positions: torch.Tensor) -> None:
    """Rotate q and k in place.

    Args:
        q: [T, Hq, D], k: [T, Hkv, D]; any token/head strides (e.g. views into
            a fused qkv output), contiguous last dim.
        cos, sin: [max_pos, D/2] float32 tables (cos/sin of position * inv_freq).
        positions: [T] int64 absolute positions.
    """
    t, hq, d = q.shape
    hk = k.shape[1]
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and cos.stride(-1) == 1
    assert cos.shape[-1] * 2 == d
    if t == 0:
        return
    _rope_kernel[(t,)](
        q, k, cos, sin, positions,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0),
        hq, hk,
        HALF=d // 2, BLOCK_H=triton.next_power_of_2(max(hq, hk)), BLOCK_D=triton.next_power_of_2(d // 2),
    )


def rope_inplace_ref(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     positions: torch.Tensor) -> None:
    """PyTorch reference of `rope_inplace` (same math as `LlamaModel._apply_rope`)."""
    c = cos[positions].unsqueeze(1)
    s = sin[positions].unsqueeze(1)
    for x in (q, k):
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half].float(), x[..., half:].float()
        x.copy_(torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype))
