"""PyTorch reference attention over the paged KV cache (CPU and CUDA; the test oracle)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .base import AttentionBackend, AttentionMetadata


class TorchAttentionBackend(AttentionBackend):
    """Decode tokens in one batched, masked matmul; each prefill chunk through SDPA.

    Cache layout: [num_kv_heads, num_blocks * block_size, head_dim] per layer
    (head-major), so that gathering slots yields tensors that the batched
    matmuls and SDPA read without another transpose copy.

    Decode: the KV of every decoding sequence is gathered by slot index into
    [Hkv, Bd, Lmax, D] (padded to the longest sequence, padding masked with
    -inf), and the query heads of a KV group are folded together (GQA), so one
    matmul pair serves all sequences. Prefill: for a chunk with no cached prefix
    the fresh k/v are used directly with a causal mask; otherwise the prefix is
    gathered from the cache and the mask is offset by the prefix length.
    """

    def cache_shape(self, num_blocks, block_size, num_kv_heads, head_dim):
        return (num_kv_heads, num_blocks * block_size, head_dim)

    def prepare(self, meta: AttentionMetadata) -> None:
        cache: dict = {}
        bd = meta.num_decode_tokens
        bs = meta.block_size
        dev = meta.slot_mapping.device
        if bd > 0:
            lmax = int(meta.decode_seq_lens.max())
            pos = torch.arange(lmax, device=dev)
            blk = meta.decode_block_tables[:, : (lmax + bs - 1) // bs].long()
            slots = blk.gather(1, (pos // bs).expand(bd, -1)) * bs + (pos % bs)
            valid = pos[None, :] < meta.decode_seq_lens[:, None]
            cache["decode_slots"] = torch.where(valid, slots, torch.zeros_like(slots))
            bias = torch.zeros(bd, lmax, device=dev, dtype=torch.float32)
            bias.masked_fill_(~valid, float("-inf"))
            cache["decode_bias"] = bias
        pre = []
        for start, qlen, slen, bt in zip(
            meta.prefill_query_starts, meta.prefill_query_lens, meta.prefill_seq_lens, meta.prefill_block_tables
        ):
            prefix = slen - qlen
            if prefix == 0:
                pre.append((start, qlen, None, None))
                continue
            pos = torch.arange(slen, device=dev)
            slots = bt.to(dev).long()[pos // bs] * bs + pos % bs
            # query i (absolute position prefix + i) sees keys j <= prefix + i
            mask = pos[None, :] <= (prefix + torch.arange(qlen, device=dev))[:, None]
            pre.append((start, qlen, slots, mask))
        cache["prefill"] = pre
        meta.cache = cache

    def forward(self, q, k, v, k_cache, v_cache, meta, scale):
        hkv, _, d = k_cache.shape
        hq = q.shape[1]
        g = hq // hkv
        k_cache.index_copy_(1, meta.slot_mapping, k.transpose(0, 1).to(k_cache.dtype))
        v_cache.index_copy_(1, meta.slot_mapping, v.transpose(0, 1).to(v_cache.dtype))
        out = torch.empty_like(q)
        c = meta.cache
        bd = meta.num_decode_tokens
        if bd > 0:
            slots = c["decode_slots"]  # [Bd, L]
            kd = k_cache[:, slots].to(q.dtype)  # [Hkv, Bd, L, D]
            vd = v_cache[:, slots].to(q.dtype)
            qd = q[:bd].view(bd, hkv, g, d).transpose(0, 1)  # [Hkv, Bd, G, D]
            scores = torch.matmul(qd, kd.transpose(-1, -2)) * scale  # [Hkv, Bd, G, L]
            scores = scores.float() + c["decode_bias"][None, :, None, :]
            probs = torch.softmax(scores, dim=-1).to(q.dtype)
            od = torch.matmul(probs, vd)  # [Hkv, Bd, G, D]
            out[:bd] = od.transpose(0, 1).reshape(bd, hq, d)
        for start, qlen, slots, mask in c["prefill"]:
            qs = q[start : start + qlen].transpose(0, 1)  # [Hq, qlen, D]
            if slots is None:
                ks = k[start : start + qlen].transpose(0, 1)
                vs = v[start : start + qlen].transpose(0, 1)
                o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=True)
            else:
                ks = k_cache[:, slots].to(q.dtype)  # [Hkv, slen, D]
                vs = v_cache[:, slots].to(q.dtype)
                o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale, enable_gqa=True)
            out[start : start + qlen] = o.transpose(0, 1)
        return out
