"""The bf16 KV cache's layout: bf16 values in groups of 16 slots, laid out for the bf16 dot-product unit.

The C attention kernel (`engine/kernels/cpu/attention.c`, row format `TM_KV_BF16`) reads this cache in
place with VDPBF16PS, so a score or an output element costs one instruction per pair of values and no
conversion. Per KV head the cache [S, D] is cut into groups of `KV_GROUP` consecutive slots of
D * 16 values each (a KV block holds whole groups):

- K of a group as [D / 2][16] pairs: pair i * 16 + o holds dims 2i, 2i + 1 of slot o, so a pair row is
  the 16 keys of a vector;
- V of a group as [8][D] pairs: pair t * D + e holds dim e of slots 2t and 2t + 1, so a pair row is the
  two keys' contributions to D outputs.

The cache's torch dtype is `STORAGE_DTYPE` (int16: the bits of bf16 values), which tells it apart from
a bf16 cache in row order. This module packs rows into it and reads them back, for the PyTorch paths
and the tests; the C kernels write it with `tm_kv_write`.
"""
from __future__ import annotations

import torch

KV_GROUP = 16  # slots per group (tm_cpu.h TM_KV_GROUP)
STORAGE_DTYPE = torch.int16  # the cache tensor's dtype: bf16 bits in the group layout


def is_grouped(cache: torch.Tensor) -> bool:
    """Whether a KV cache tensor holds bf16 values in the group layout."""
    return cache.dtype == STORAGE_DTYPE


def value_index(slots: torch.Tensor, head_dim: int, which: str) -> torch.Tensor:
    """[N, D] int64: where K (`which` "k") or V ("v") dim e of each slot lies in a head's [S * D] values."""
    if which not in ("k", "v"):
        raise ValueError(f"which must be 'k' or 'v', got {which!r}")
    s = slots.to(torch.int64)[:, None]
    e = torch.arange(head_dim, dtype=torch.int64)[None, :]
    base = s // KV_GROUP * KV_GROUP * head_dim
    o = s % KV_GROUP
    if which == "k":
        return base + ((e // 2) * KV_GROUP + o) * 2 + e % 2
    return base + ((o // 2) * head_dim + e) * 2 + o % 2


def write_rows(cache: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor, which: str) -> None:
    """cache [Hkv, S, D] (group layout) <- rows [N, Hkv, D] at `slots` [N], rounded to bf16 as the C writer
    rounds (`tm_float_to_bf16`: nearest even, a denormal to a zero of its sign)."""
    hkv, _, d = cache.shape
    rows = rows.float()
    rows = rows * (rows.abs() >= torch.finfo(torch.float32).tiny)  # denormals -> +-0; NaN stays NaN
    bits = rows.to(torch.bfloat16).view(torch.int16).permute(1, 0, 2).reshape(hkv, -1)  # [Hkv, N * D]
    idx = value_index(slots, d, which).reshape(-1)
    cache.view(hkv, -1).index_copy_(1, idx, bits)


def read_rows(cache: torch.Tensor, which: str) -> torch.Tensor:
    """Whole groups in the group layout [Hkv, n * 16, D] -> the same slots in row order, bf16 [Hkv, n * 16, D]."""
    hkv, s, d = cache.shape
    if s % KV_GROUP:
        raise ValueError(f"a grouped bf16 cache is read in whole groups of {KV_GROUP} slots, got {s}")
    g = cache.contiguous().view(torch.bfloat16).view(hkv, s // KV_GROUP, -1)
    if which == "k":  # [D / 2][16][2] -> [16][D / 2][2]
        return g.view(hkv, -1, d // 2, KV_GROUP, 2).transpose(2, 3).reshape(hkv, s, d)
    if which == "v":  # [8][D][2] -> [8][2][D]
        return g.view(hkv, -1, KV_GROUP // 2, d, 2).transpose(3, 4).reshape(hkv, s, d)
    raise ValueError(f"which must be 'k' or 'v', got {which!r}")
