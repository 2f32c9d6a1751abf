"""Triton attention over the paged KV cache (the GPU backend; the CPU runs it under TRITON_INTERPRET=1).

Three kernels:

- `_write_kv_kernel`: k, v of the step's new tokens into the cache at their
  slot (block * block_size + offset); a negative slot (a padded token under
  CUDA graphs) is skipped.
- `_decode_kernel` + `_combine_kernel`: one query token per sequence against
  its whole cached sequence, read through the block table. Each program owns
  one (sequence, KV head, split): the G query heads that share a KV head are
  stacked into the rows of one tile (GQA: the KV tile is loaded once for all of
  them), and the sequence is cut into `num_splits` ranges reduced in parallel
  with their log-sum-exp and merged by a second kernel ("flash-decoding",
  Dao et al. 2023), so short batches of long sequences still fill the GPU.
- `_prefill_kernel`: a varlen batch of prefill/extend chunks; each chunk's
  queries attend to its cached prefix and to its own tokens (causally), all
  read from the paged cache after the write (FlashAttention-2 style online
  softmax, Dao 2023, arXiv 2307.08691).

Sliding-window layers (`window` > 0: a query at position p attends keys p - window < j <= p):
the decode kernel splits only the window's keys, and each prefill tile starts at its first
query's earliest visible key; neither reads a block wholly before that, so those blocks'
table entries may point at any valid block.

Cache layout (`cache_shape`): [num_blocks * block_size, num_kv_heads, head_dim]
per layer (token-major: the K of one token for all heads is contiguous, so
the cache write is one contiguous store per token and a decode tile is a row
gather).
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .base import AttentionBackend, AttentionMetadata, check_window

_LOG2E = 1.4426950408889634


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_ks, stride_kch, stride_vs, stride_vch,
    n_heads,
    HEAD_D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    m = (h[:, None] < n_heads) & (d[None, :] < HEAD_D) & (slot >= 0)
    k = tl.load(k_ptr + t * stride_kt + h[:, None] * stride_kh + d[None, :], mask=m)
    v = tl.load(v_ptr + t * stride_vt + h[:, None] * stride_vh + d[None, :], mask=m)
    tl.store(kc_ptr + slot * stride_ks + h[:, None] * stride_kch + d[None, :], k.to(kc_ptr.dtype.element_ty), mask=m)
    tl.store(vc_ptr + slot * stride_vs + h[:, None] * stride_vch + d[None, :], v.to(vc_ptr.dtype.element_ty), mask=m)


@triton.jit
def _decode_kernel(
    q_ptr, kc_ptr, vc_ptr, bt_ptr, lens_ptr, out_ptr, part_ptr, lse_ptr,
    stride_qt, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_bt,
    stride_ot, stride_oh,
    qk_scale, num_splits, window,
    G: tl.constexpr, HEAD_D: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, DIRECT: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    sp = tl.program_id(2)
    seq_len = tl.load(lens_ptr + b).to(tl.int32)
    lo = tl.where(window > 0, tl.maximum(seq_len - window, 0), 0)  # first visible key
    per_split = tl.cdiv(tl.cdiv(seq_len - lo, num_splits), BLOCK_N) * BLOCK_N
    start = lo + sp * per_split
    end = tl.minimum(start + per_split, seq_len)

    g = tl.arange(0, BLOCK_G)
    heads = kvh * G + g
    d = tl.arange(0, BLOCK_D)
    gmask = g < G
    dmask = d < HEAD_D
    q = tl.load(q_ptr + b * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=gmask[:, None] & dmask[None, :], other=0.0)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        nmask = pos < end
        blk = tl.load(bt_ptr + b * stride_bt + pos // PAGE, mask=nmask, other=0).to(tl.int64)
        slot = blk * PAGE + pos % PAGE
        kvmask = nmask[:, None] & dmask[None, :]
        k = tl.load(kc_ptr + slot[:, None] * stride_ks + kvh * stride_kh + d[None, :], mask=kvmask, other=0.0)
        v = tl.load(vc_ptr + slot[:, None] * stride_vs + kvh * stride_vh + d[None, :], mask=kvmask, other=0.0)
        s = tl.dot(q, tl.trans(k.to(q.dtype))) * qk_scale  # [BLOCK_G, BLOCK_N], log2 units
        s = tl.where(nmask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype))
        m_i = m_new
    nonempty = l_i > 0
    o = tl.where(nonempty[:, None], acc / tl.where(nonempty, l_i, 1.0)[:, None], 0.0)
    omask = gmask[:, None] & dmask[None, :]
    if DIRECT:
        tl.store(out_ptr + b * stride_ot + heads[:, None] * stride_oh + d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=omask)
    else:
        # partials: [Bd, Hq, num_splits, HEAD_D] fp32, lse: [Bd, Hq, num_splits] fp32 (log2 units)
        row = (b * (tl.num_programs(1) * G) + heads) * num_splits + sp
        tl.store(part_ptr + row[:, None] * HEAD_D + d[None, :], o, mask=omask)
        lse = tl.where(nonempty, m_i + tl.log2(tl.where(nonempty, l_i, 1.0)), float("-inf"))
        tl.store(lse_ptr + row, lse, mask=gmask)


@triton.jit
def _combine_kernel(
    part_ptr, lse_ptr, out_ptr, stride_ot, stride_oh, num_splits,
    HEAD_D: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    row0 = (b * tl.num_programs(1) + h) * num_splits
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    smask = s < num_splits
    lse = tl.load(lse_ptr + row0 + s, mask=smask, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m)  # 0 for empty splits
    part = tl.load(part_ptr + (row0 + s)[:, None] * HEAD_D + d[None, :],
                   mask=smask[:, None] & (d[None, :] < HEAD_D), other=0.0)
    den = tl.sum(w, 0)
    o = tl.sum(part * w[:, None], 0) / tl.where(den > 0, den, 1.0)
    tl.store(out_ptr + b * stride_ot + h * stride_oh + d, o.to(out_ptr.dtype.element_ty), mask=d < HEAD_D)


@triton.jit
def _prefill_kernel(
    q_ptr, kc_ptr, vc_ptr, out_ptr, bt_ptr, qstart_ptr, qlen_ptr, seqlen_ptr,
    stride_qt, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_ot, stride_oh, stride_bt,
    qk_scale, window,
    G: tl.constexpr, HEAD_D: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    mt = tl.program_id(0)
    h = tl.program_id(1)
    seq = tl.program_id(2).to(tl.int64)
    q_len = tl.load(qlen_ptr + seq).to(tl.int32)
    if mt * BLOCK_M < q_len:
        q_start = tl.load(qstart_ptr + seq).to(tl.int64)
        seq_len = tl.load(seqlen_ptr + seq).to(tl.int32)
        prefix = seq_len - q_len
        kvh = h // G
        m = mt * BLOCK_M + tl.arange(0, BLOCK_M)
        d = tl.arange(0, BLOCK_D)
        mmask = m < q_len
        dmask = d < HEAD_D
        q = tl.load(q_ptr + (q_start + m)[:, None] * stride_qt + h * stride_qh + d[None, :],
                    mask=mmask[:, None] & dmask[None, :], other=0.0)
        qpos = prefix + m  # absolute position of each query row
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        kv_end = tl.minimum(seq_len, prefix + (mt + 1) * BLOCK_M)
        # the tile's first query's earliest visible key (0 without a window)
        kv_start = tl.where(window > 0, tl.maximum(prefix + mt * BLOCK_M - window + 1, 0), 0)
        for n0 in range(kv_start, kv_end, BLOCK_N):
            pos = n0 + tl.arange(0, BLOCK_N)
            nmask = pos < kv_end
            blk = tl.load(bt_ptr + seq * stride_bt + pos // PAGE, mask=nmask, other=0).to(tl.int64)
            slot = blk * PAGE + pos % PAGE
            kvmask = nmask[:, None] & dmask[None, :]
            k = tl.load(kc_ptr + slot[:, None] * stride_ks + kvh * stride_kh + d[None, :], mask=kvmask, other=0.0)
            v = tl.load(vc_ptr + slot[:, None] * stride_vs + kvh * stride_vh + d[None, :], mask=kvmask, other=0.0)
            s = tl.dot(q, tl.trans(k.to(q.dtype))) * qk_scale
            seen = nmask[None, :] & (pos[None, :] <= qpos[:, None])
            seen = seen & ((window == 0) | (pos[None, :] > qpos[:, None] - window))
            s = tl.where(seen, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            # a row whose window starts after these keys has seen none yet: m stays -inf, and the
            # exponents take 0 in its place (exp2(-inf) = 0, not nan); unchanged where m is finite
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_use)
            p = tl.exp2(s - m_use[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype))
            m_i = m_new
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + (q_start + m)[:, None] * stride_ot + h * stride_oh + d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=mmask[:, None] & dmask[None, :])


# ---------------------------------------------------------------- launchers


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store k, v [T, Hkv, D] at cache rows `slot_mapping` [T] (negative: skipped).

    Cache: [num_slots, Hkv, D] (any strides with a contiguous last dim).
    """
    t, hkv, d = k.shape
    if t == 0:
        return
    _write_kv_kernel[(t,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        hkv, HEAD_D=d, BLOCK_H=triton.next_power_of_2(hkv), BLOCK_D=triton.next_power_of_2(d),
    )


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     seq_lens: torch.Tensor, scale: float, page_size: int, num_splits: int = 1,
                     out: Optional[torch.Tensor] = None, block_n: int = 64, window: int = 0) -> torch.Tensor:
    """Attention of one query token per sequence over its paged KV.

    Args:
        q: [B, Hq, D]; k_cache, v_cache: [num_slots, Hkv, D].
        block_tables: [B, max_blocks] int; seq_lens: [B] int (0: output zeros).
        scale: softmax scale (usually D ** -0.5).
        page_size: tokens per block.
        num_splits: KV ranges per sequence reduced in parallel (split-K), >= 1.
        out: optional [B, Hq, D] destination (a view of a larger output is fine).
        window: sliding window in tokens: only the last `window` keys of each sequence are read
            and attended (0: all of them).
    Returns:
        [B, Hq, D] in q's dtype.
    """
    b, hq, d = q.shape
    hkv = k_cache.shape[1]
    g = hq // hkv
    if out is None:
        out = torch.empty_like(q)
    if b == 0:
        return out
    bg = max(16, triton.next_power_of_2(g))
    bd = max(16, triton.next_power_of_2(d))
    common = dict(G=g, HEAD_D=d, PAGE=page_size, BLOCK_G=bg, BLOCK_N=block_n, BLOCK_D=bd)
    args = (q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
            block_tables.stride(0), out.stride(0), out.stride(1), scale * _LOG2E)
    if num_splits <= 1:
        _decode_kernel[(b, hkv, 1)](q, k_cache, v_cache, block_tables, seq_lens, out, out, out, *args, 1, window,
                                    DIRECT=True, num_warps=4, **common)
        return out
    part = torch.empty((b, hq, num_splits, d), dtype=torch.float32, device=q.device)
    lse = torch.empty((b, hq, num_splits), dtype=torch.float32, device=q.device)
    _decode_kernel[(b, hkv, num_splits)](q, k_cache, v_cache, block_tables, seq_lens, out, part, lse, *args,
                                         num_splits, window, DIRECT=False, num_warps=4, **common)
    _combine_kernel[(b, hq)](part, lse, out, out.stride(0), out.stride(1), num_splits,
                             HEAD_D=d, BLOCK_S=max(2, triton.next_power_of_2(num_splits)), BLOCK_D=bd)
    return out


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
                      block_tables: torch.Tensor, q_starts: torch.Tensor, q_lens: torch.Tensor,
                      seq_lens: torch.Tensor, max_q_len: int, scale: float, page_size: int,
                      block_m: int = 64, block_n: int = 64, window: int = 0) -> torch.Tensor:
    """Causal attention of a varlen batch of chunks over their paged KV (prefix + the chunk itself).

    Args:
        q: [T, Hq, D] flattened batch; chunk i is rows q_starts[i] : q_starts[i] + q_lens[i].
        k_cache, v_cache: [num_slots, Hkv, D], already holding the chunks' own k/v.
        out: [T, Hq, D]; only the chunks' rows are written.
        block_tables: [P, max_blocks] int; q_starts, q_lens, seq_lens: [P] int
            (seq_lens = cached prefix + chunk length).
        max_q_len: the longest chunk (sizes the grid).
        window: sliding window in tokens: a query at position p attends keys p - window < j <= p,
            and a tile reads no block before its first query's window (0: keys j <= p).
    """
    p = q_starts.shape[0]
    hq, d = q.shape[1], q.shape[2]
    hkv = k_cache.shape[1]
    if p == 0 or max_q_len == 0:
        return out
    grid = (triton.cdiv(max_q_len, block_m), hq, p)
    _prefill_kernel[grid](
        q, k_cache, v_cache, out, block_tables, q_starts, q_lens, seq_lens,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        out.stride(0), out.stride(1), block_tables.stride(0), scale * _LOG2E, window,
        G=hq // hkv, HEAD_D=d, PAGE=page_size, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_D=max(16, triton.next_power_of_2(d)), num_warps=4 if block_m <= 64 else 8, num_stages=2,
    )
    return out


def num_decode_splits(batch: int, num_kv_heads: int, max_len: int, num_sms: int, min_tokens_per_split: int = 256,
                      max_splits: int = 16) -> int:
    """Split-K factor: enough (sequence, KV head, split) programs for about 4 per SM, each split
    covering at least `min_tokens_per_split` tokens. Depends only on its arguments, so a CUDA graph
    captured for a batch size and a block-table width keeps a valid split count."""
    want = triton.cdiv(4 * num_sms, max(1, batch * num_kv_heads))
    by_len = triton.cdiv(max(1, max_len), min_tokens_per_split)
    return max(1, min(want, by_len, max_splits))


class TritonAttentionBackend(AttentionBackend):
    """Paged attention in Triton kernels; decode via split-K flash-decoding, prefill/extend varlen.

    Args:
        num_splits: force the decode split-K factor (tests); None picks it from
            the batch and the block-table width (`num_decode_splits`).
        block_m, block_n: prefill query / key tile sizes; decode_block_n: decode key tile.
    """

    supports_cuda_graphs = True  # a decode-only step reads no device value in prepare/forward

    def __init__(self, num_splits: Optional[int] = None, block_m: int = 64, block_n: int = 64,
                 decode_block_n: int = 64) -> None:
        self.num_splits = num_splits
        self.block_m = block_m
        self.block_n = block_n
        self.decode_block_n = decode_block_n
        self._num_sms: Optional[int] = None

    def cache_shape(self, num_blocks, block_size, num_kv_heads, head_dim):
        return (num_blocks * block_size, num_kv_heads, head_dim)

    def _sms(self, device: torch.device) -> int:
        if self._num_sms is None:
            self._num_sms = (torch.cuda.get_device_properties(device).multi_processor_count
                             if device.type == "cuda" else 1)
        return self._num_sms

    def prepare(self, meta: AttentionMetadata) -> None:
        """Move the prefill chunk table to the device as int32 tensors (decode needs nothing:
        its block tables and lengths are used as given, so a decode-only step reads no device
        value and can be captured in a CUDA graph)."""
        dev = meta.slot_mapping.device
        c: dict = {}
        p = len(meta.prefill_query_lens)
        if p > 0:
            # padded on the tables' own device: no per-chunk device-to-host copy
            c["prefill_bt"] = torch.nn.utils.rnn.pad_sequence(
                [t.to(dev) for t in meta.prefill_block_tables], batch_first=True).to(torch.int32)
            info = torch.tensor([meta.prefill_query_starts, meta.prefill_query_lens, meta.prefill_seq_lens],
                                dtype=torch.int32)
            c["prefill_info"] = info.to(dev, non_blocking=True)
            c["max_q_len"] = max(meta.prefill_query_lens)
        meta.cache = c
        if meta.window_meta is not None and meta.window_meta is not meta:
            self.prepare(meta.window_meta)  # the sliding-window layers' own block tables

    def forward(self, q, k, v, k_cache, v_cache, meta, scale, out=None, window=0):
        window = check_window(window)
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        if out is None:
            out = torch.empty_like(q)
        c = meta.cache
        bd = meta.num_decode_tokens
        if bd > 0:
            max_len = meta.decode_block_tables.shape[1] * meta.block_size
            splits = self.num_splits or num_decode_splits(bd, k_cache.shape[1], max_len, self._sms(q.device))
            decode_attention(q[:bd], k_cache, v_cache, meta.decode_block_tables, meta.decode_seq_lens, scale,
                             meta.block_size, splits, out=out[:bd], block_n=self.decode_block_n, window=window)
        if "prefill_info" in c:
            info = c["prefill_info"]
            prefill_attention(q, k_cache, v_cache, out, c["prefill_bt"], info[0], info[1], info[2],
                              c["max_q_len"], scale, meta.block_size, self.block_m, self.block_n, window)
        return out
