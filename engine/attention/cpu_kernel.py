"""The C paged decode-attention kernel (`engine/kernels/cpu/attention.c`) on torch tensors.

The kernel lives in tokenmill's CPU kernel library (`engine.kernels.cpu`), built on
first use for this CPU; where it is unavailable (no compiler, or
TOKENMILL_CPU_KERNELS=0) `available()` is False and the attention backends keep
their PyTorch paths.
"""
from __future__ import annotations

import ctypes
from typing import Optional

import torch

from ..kernels import cpu as _cpu

_MAX_G, _MAX_D, _MAX_BLOCK_SIZE = 16, 256, 64


def available() -> bool:
    """True if the CPU kernel library is built (building it on first call) and loadable."""
    return _cpu.available()


def why_unavailable() -> str:
    """The reason `available()` is False ('' when it is True or was not asked yet)."""
    return _cpu.why_unavailable()


def generic_build() -> ctypes.CDLL:
    """The library built without its SIMD paths (-DTM_GENERIC), for tests of the plain-C path;
    pass it as `lib` to `paged_decode_attention`. Raises RuntimeError if it cannot be built."""
    lib = _cpu.library("generic")
    if lib is None:
        raise RuntimeError(_cpu.why_unavailable("generic"))
    return lib


def _row_format(q: torch.Tensor, k_cache: torch.Tensor) -> int:
    """The cache's row format (`engine.kernels.cpu.kv_row_format`); ValueError for one the kernel cannot read."""
    fmt = _cpu.kv_row_format(k_cache, q.shape[-1])
    if fmt is None:
        raise ValueError(f"the C decode-attention kernel reads fp32 or fp16 caches [Hkv, S, D] or int8 rows "
                         f"[Hkv, S, D + 4]; got {k_cache.dtype} {tuple(k_cache.shape)} for head_dim {q.shape[-1]}")
    return fmt


def supports(q: torch.Tensor, k_cache: torch.Tensor, block_size: int) -> bool:
    """Whether the kernel serves these tensors: CPU, fp32 queries, an fp32 or fp16 cache, a grouped
    bf16 cache (`bf16_kv`; block_size a multiple of 16, head_dim of 32) or an int8 cache of rows
    [D codes, fp32 scale] (torch_quant_kv's layout; not fp8 codes, which share the int8 storage:
    the caller decides), head_dim <= 256, at most 16 query heads per KV head, block_size <= 64,
    and the kernel built."""
    if q.device.type != "cpu" or q.dtype != torch.float32 or k_cache.device.type != "cpu":
        return False
    if _cpu.kv_row_format(k_cache, q.shape[-1]) is None:
        return False
    hkv, d = k_cache.shape[0], q.shape[-1]
    if d > _MAX_D or block_size > _MAX_BLOCK_SIZE or q.shape[1] % hkv or q.shape[1] // hkv > _MAX_G:
        return False
    if k_cache.dtype == torch.int16 and (block_size % 16 or d % 32):  # grouped bf16 (`bf16_kv`): whole groups
        return False
    return available()


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int,
                           scale: float, out: Optional[torch.Tensor] = None,
                           num_threads: Optional[int] = None, lib: Optional[ctypes.CDLL] = None,
                           order: Optional[torch.Tensor] = None, window: int = 0) -> torch.Tensor:
    """Decode attention over a paged KV cache, reading each sequence's blocks in place.

    For an int8 cache each row holds D codes and its fp32 scale (value = code * scale), read
    without expanding the cache; an fp16 cache's values are widened to fp32 as they are read.

    out[b, h] = softmax(scale * q[b, h] . K_b^T) V_b, where K_b/V_b are the first seq_lens[b]
    slots reached through block_tables[b], for KV head h // (Hq // Hkv) (GQA); with a sliding
    `window` > 0 only the last `window` of them, the blocks before those never read.

    Args:
        q: [B, Hq, D] float32 (one query token per sequence); made contiguous if it is not.
        k_cache, v_cache: [Hkv, num_blocks * block_size, D] float32 or float16, or int8
            [Hkv, num_blocks * block_size, D + 4]; contiguous (the torch backends' head-major layouts).
        block_tables: [B, max_blocks] int32 block ids (entries past a sequence's length ignored).
        seq_lens: [B] int64 KV lengths (>= 1; the new token included).
        block_size: tokens per block (<= 64).
        scale: softmax scale, usually head_dim ** -0.5.
        out: optional [B, Hq, D] float32 contiguous destination.
        num_threads: ignored (the kernel library's thread pool size applies; kept for callers).
        lib: a specific build (tests: `generic_build()`); default the one `available()` loads.
        order: optional [B] int64, the sequences in the order to hand them to the threads,
            longest first (`decode_task_order`, the default).
        window: sliding window in tokens (0: the whole sequence).
    Returns:
        out, [B, Hq, D] float32.
    Raises:
        RuntimeError: if the kernel is unavailable or refuses the shape (check `supports` first).
        ValueError: on a dtype, device or layout it cannot read, or a negative window.
    """
    lib = lib or _cpu.library()
    if lib is None:
        raise RuntimeError(why_unavailable() or "the C decode-attention kernel is unavailable")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous")
    if q.dtype != torch.float32 or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"the C decode-attention kernel needs float32 queries and K/V caches of one dtype, got "
                         f"q {q.dtype}, k {k_cache.dtype}, v {v_cache.dtype}")
    _row_format(q, k_cache)
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
    if order is None:
        order = decode_task_order(sl, 1) if b > 1 else torch.zeros(b, dtype=torch.int64)
    tiles = torch.stack((order, torch.ones_like(order)), dim=1).contiguous()
    _cpu.paged_attention(q, k_cache, v_cache, bt, None, sl, tiles, block_size, scale, out, lib=lib, window=window)
    return out


def decode_task_order(seq_lens: torch.Tensor, num_kv_heads: int = 1) -> torch.Tensor:
    """The sequences of a decode batch, longest first: [B] int64 (num_kv_heads is unused, kept
    for callers). Handing long tasks out first leaves short ones for the end, so the threads
    finish together."""
    return torch.argsort(seq_lens, descending=True, stable=True).contiguous()
