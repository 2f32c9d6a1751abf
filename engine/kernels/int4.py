"""Int4 weight packing: two 4-bit codes per byte, GGUF Q4_0's layout within each group (the low
nibbles hold a group's first half, the high nibbles its second). What `engine.quant.QuantLinear`
stores and the CPU and Triton kernels read.
"""
from __future__ import annotations

import torch


def pack_int4(q: torch.Tensor, group_size: int) -> torch.Tensor:
    """Pack codes 0..15 [out, in] (any int dtype) into uint8 [out, in // 2], GGUF Q4_0 layout per group."""
    out, n = q.shape
    g = q.to(torch.uint8).view(out, n // group_size, 2, group_size // 2)
    return (g[:, :, 0] | (g[:, :, 1] << 4)).reshape(out, n // 2)


def unpack_int4(p: torch.Tensor, group_size: int) -> torch.Tensor:
    """Inverse of `pack_int4`: uint8 [out, in // 2] -> uint8 codes [out, in]."""
    out, half = p.shape
    g = p.view(out, half * 2 // group_size, group_size // 2)
    return torch.stack((g & 15, g >> 4), dim=2).reshape(out, half * 2)
