"""PyTorch attention over a quantized paged KV cache (int8, or fp8 e4m3 on GPU).

A separate backend, so the float cache path (`TorchAttentionBackend`) is untouched.

Storage: one 1-byte tensor per layer for K (and one for V), shape
[num_kv_heads, num_blocks * block_size, head_dim + 4]: each (head, slot) row
holds head_dim codes followed by its fp32 scale as 4 raw bytes (a per-token,
per-head scale). The KVCache and block pool need no extra tensors.

    int8:     scale = max|x| / 127, code = round(x / scale)       (symmetric)
    fp8_e4m3: scale = max|x| / 448, code = float8_e4m3fn(x / scale)

Every attention read goes through the stored (quantized) K/V, prefill chunks
included (`prepare` gives every chunk its blocks; `TorchAttentionBackend.forward` reads
them through `_read`, which decodes), so a sequence's logits do not depend on how its
prompt was chunked or batched.
"""
from __future__ import annotations

import torch

from . import cpu_kernel
from .base import AttentionMetadata
from .torch_ref import TorchAttentionBackend, _kv_write_fast

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
    decoder_cache_dtypes = (torch.int8,)  # (`fused_decoder_plan`: the C decoder reads int8 rows in place)

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

    def _kernel_serves(self, q, k_cache, meta) -> bool:
        """As for the float cache, for int8 rows only (the C kernels read no fp8 codes)."""
        return self.kv_cache_dtype == "int8" and super()._kernel_serves(q, k_cache, meta)
