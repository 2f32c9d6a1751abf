"""PyTorch attention over a quantized paged KV cache (int8, or fp8 e4m3 on GPU).

A separate backend, so the float cache path (`TorchAttentionBackend`) is untouched.

Storage: one 1-byte tensor per layer for K (and one for V), shape
[num_kv_heads, num_blocks * block_size, head_dim + 4]: each (head, slot) row
holds head_dim codes followed by its fp32 scale as 4 raw bytes (a per-token,
per-head scale). The KVCache and block pool need no extra tensors.

    int8:     scale = max|x| / 127, code = round(x / scale)       (symmetric)
    fp8_e4m3: scale = max|x| / 448, code = float8_e4m3fn(x / scale)

Every attention read goes through the stored (quantized) K/V, prefill chunks
included, so a sequence's logits do not depend on how its prompt was chunked
or batched.
"""
from __future__ import annotations

import torch

from ..kernels import cpu as _cpu
from . import cpu_kernel
from .base import AttentionMetadata, check_window
from .torch_ref import TorchAttentionBackend, _kv_write_fast, _sdpa

_QMAX = {"int8": 127.0, "fp8_e4m3": 448.0}
_SCALE_BYTES = 4


class TorchQuantKVAttentionBackend(TorchAttentionBackend):
    """`TorchAttentionBackend` with K/V stored as 1-byte codes plus a per-token per-head fp32 scale.

    Args:
        kv_cache_dtype: "int8" or "fp8_e4m3".
    Raises:
        ValueError: for another kv_cache_dtype.
    """

    storage_dtype = torch.int8

    def __init__(self, kv_cache_dtype: str = "int8") -> None:
        if kv_cache_dtype not in _QMAX:
            raise ValueError(f"quantized KV cache dtype must be int8 or fp8_e4m3, got {kv_cache_dtype!r}")
        self.kv_cache_dtype = kv_cache_dtype
        self.qmax = _QMAX[kv_cache_dtype]
        # the C decode kernel reads int8 rows in place; fp8 codes only through PyTorch (GPU)
        self.use_cpu_kernel = kv_cache_dtype == "int8"

    def cache_shape(self, num_blocks, block_size, num_kv_heads, head_dim):
        return (num_kv_heads, num_blocks * block_size, head_dim + _SCALE_BYTES)

    # ------------------------------------------------------------ codec
    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, Hkv, D] float -> rows [Hkv, T, D + 4] int8 (codes, then the fp32 scale's bytes)."""
        xt = x.transpose(0, 1).float()
        scale = (xt.abs().amax(-1, keepdim=True) / self.qmax).clamp_min(1e-12)  # [Hkv, T, 1]
        if self.kv_cache_dtype == "int8":
            codes = torch.round(xt / scale).clamp_(-127, 127).to(torch.int8)
        else:
            codes = (xt / scale).to(torch.float8_e4m3fn).view(torch.int8)
        return torch.cat((codes, scale.view(torch.int8)), dim=-1)

    def decode(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """rows [..., D + 4] int8 -> values [..., D] in `dtype`."""
        d = rows.shape[-1] - _SCALE_BYTES
        scale = rows[..., d:].contiguous().view(torch.float32)  # [..., 1]
        codes = rows[..., :d]
        if self.kv_cache_dtype != "int8":
            codes = codes.view(torch.float8_e4m3fn)
        return (codes.float() * scale).to(dtype)

    def _read(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return self.decode(rows, dtype)

    # ------------------------------------------------------------ steps
    def prepare(self, meta: AttentionMetadata) -> None:
        super().prepare(meta)
        bs = meta.block_size
        dev = meta.slot_mapping.device
        pre = []
        for (start, qlen, blocks, slen, mask), bt in zip(meta.cache["prefill"], meta.prefill_block_tables):
            if blocks is None:  # no cached prefix: still read the chunk back from the cache
                blocks = self._block_rows_index(bt[: (qlen + bs - 1) // bs].to(dev).long())
                pos = torch.arange(qlen, device=dev)
                mask = pos[None, :] <= pos[:, None]
            pre.append((start, qlen, blocks, slen, mask))
        meta.cache["prefill"] = pre

    def _write_kv(self, k, v, k_cache, v_cache, meta) -> None:
        """Encode and write new rows: one C call for int8 on the CPU (same codes and scales as
        `encode`), else `encode` + index_copy_."""
        if (self.kv_cache_dtype == "int8" and self.use_cpu_kernel and k_cache.device.type == "cpu"
                and k.dtype == torch.float32 and cpu_kernel.available()):
            _kv_write_fast(k, v, k_cache, v_cache, meta)
            return
        k_cache.index_copy_(1, meta.slot_mapping, self.encode(k))
        v_cache.index_copy_(1, meta.slot_mapping, self.encode(v))

    def fused_decoder_plan(self, q, k_cache, meta):
        """The C kernel's plan where it serves the step over an int8 cache (rows of codes and a scale go
        through the same C kernels); None for fp8 and otherwise."""
        if (type(self).forward is not TorchQuantKVAttentionBackend.forward or self.kv_cache_dtype != "int8"
                or k_cache.dtype != torch.int8 or not self._kernel_serves(q, k_cache, meta)):
            return None
        return self._kernel_plan(meta, q, k_cache)

    def forward(self, q, k, v, k_cache, v_cache, meta, scale, out=None, window=0):
        window = check_window(window)
        self._write_kv(k, v, k_cache, v_cache, meta)
        if out is None:
            out = torch.empty_like(q)
        if self.kv_cache_dtype == "int8" and self._kernel_serves(q, k_cache, meta):
            tables, row_seq, kv_len, tiles = self._kernel_plan(meta, q, k_cache)
            return _cpu.paged_attention(q, k_cache, v_cache, tables, row_seq, kv_len, tiles, meta.block_size,
                                        scale, out, window=window)
        if window:  # (reads every row's keys back through the cache, as below)
            self._window_attention(q, k_cache, v_cache, meta, scale, out, window)
            return out
        c = meta.cache
        bd = meta.num_decode_tokens
        if bd > 0:
            self._decode_attention(q, k_cache, v_cache, meta, scale, out)
        for start, qlen, blocks, slen, mask in c["prefill"]:
            qs = q[start : start + qlen].transpose(0, 1)  # [Hq, qlen, D]
            ks = self.decode(self._gather_blocks(k_cache, blocks, meta.block_size)[:, :slen], q.dtype)
            vs = self.decode(self._gather_blocks(v_cache, blocks, meta.block_size)[:, :slen], q.dtype)
            o = _sdpa(qs, ks, vs, mask, scale)
            out[start : start + qlen] = o.transpose(0, 1)
        return out
