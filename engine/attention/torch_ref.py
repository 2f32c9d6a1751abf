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

    Decode: sequences are sorted into up to 4 length buckets; the KV of each
    bucket is gathered by slot index into [Hkv, nb, Lmax, D] (padded to the
    bucket's longest sequence, padding masked with -inf), and the query heads
    of a KV group are folded together (GQA), so one matmul pair serves a bucket. Prefill: for a chunk with no cached prefix
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
            # Length buckets: sort decoding sequences by KV length and pad each
            # bucket only to its own longest sequence (padding waste of one
            # bucket for lengths 96-768 was 41%; 4 buckets ran decode attention
            # 2-3x faster in a microbenchmark).
            lens = meta.decode_seq_lens.tolist()
            n_buckets = 4 if bd >= 16 else (2 if bd >= 4 else 1)
            order = sorted(range(bd), key=lens.__getitem__) if n_buckets > 1 else list(range(bd))
            buckets = []
            for b in range(n_buckets):
                members = order[b * bd // n_buckets:(b + 1) * bd // n_buckets]
                if not members:
                    continue
                idx = torch.tensor(members, device=dev)
                seq_lens = meta.decode_seq_lens[idx]
                lmax = max(lens[i] for i in members)
                pos = torch.arange(lmax, device=dev)
                blk = meta.decode_block_tables[idx, : (lmax + bs - 1) // bs].long()
                slots = blk.gather(1, (pos // bs).expand(len(members), -1)) * bs + (pos % bs)
                valid = pos[None, :] < seq_lens[:, None]
                slots = torch.where(valid, slots, torch.zeros_like(slots))
                bias = torch.zeros(len(members), lmax, device=dev, dtype=torch.float32)
                bias.masked_fill_(~valid, float("-inf"))
                whole = n_buckets == 1
                buckets.append((None if whole else idx, slots, bias))
            cache["decode_buckets"] = buckets
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

    def _read(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Cache rows gathered by slot -> values in `dtype` (subclasses decode quantized rows here)."""
        return rows.to(dtype)

    def _decode_attention(self, q, k_cache, v_cache, meta, scale, out) -> None:
        """Attention of the first Bd (decode) tokens, one length bucket at a time, written into `out`."""
        hkv, d = k_cache.shape[0], q.shape[2]
        bd, hq = meta.num_decode_tokens, q.shape[1]
        qd_all = q[:bd].view(bd, hkv, hq // hkv, d)
        for idx, slots, bias in meta.cache["decode_buckets"]:
            nb = slots.shape[0]
            kd = self._read(k_cache[:, slots], q.dtype)  # [Hkv, nb, L, D]
            vd = self._read(v_cache[:, slots], q.dtype)
            qd = (qd_all if idx is None else qd_all[idx]).transpose(0, 1)  # [Hkv, nb, G, D]
            scores = torch.matmul(qd, kd.transpose(-1, -2)) * scale  # [Hkv, nb, G, L]
            scores = scores.float() + bias[None, :, None, :]
            probs = torch.softmax(scores, dim=-1).to(q.dtype)
            od = torch.matmul(probs, vd).transpose(0, 1).reshape(nb, hq, d)  # [nb, Hq, D]
            if idx is None:
                out[:bd] = od
            else:
                out[idx] = od

    def forward(self, q, k, v, k_cache, v_cache, meta, scale):
        k_cache.index_copy_(1, meta.slot_mapping, k.transpose(0, 1).to(k_cache.dtype))
        v_cache.index_copy_(1, meta.slot_mapping, v.transpose(0, 1).to(v_cache.dtype))
        out = torch.empty_like(q)
        c = meta.cache
        bd = meta.num_decode_tokens
        if bd > 0:
            self._decode_attention(q, k_cache, v_cache, meta, scale, out)
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
