"""PyTorch reference attention over the paged KV cache (CPU and CUDA; the test oracle)."""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from ..kernels import cpu as _cpu
from . import bf16_kv, cpu_kernel
from .base import AttentionBackend, AttentionMetadata, check_window


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask, scale: float) -> torch.Tensor:
    """Causal (mask None) or masked GQA attention of one sequence: q [Hq, Lq, D], k/v [Hkv, L, D]
    -> [Hq, Lq, D]. Called with a batch dimension, so that PyTorch's fused CPU kernel serves
    GQA directly; the 3-D call falls back to the unfused math path (visible in a profile as
    `_scaled_dot_product_attention_math` instead of `..._flash_attention_for_cpu`)."""
    o = F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask, is_causal=mask is None,
                                       scale=scale, enable_gqa=True)
    return o[0]


def _kv_write_fast(k, v, k_cache, v_cache, meta) -> None:
    """`engine.kernels.cpu.kv_write` with the step's raw call made once (first layer) and reused."""
    call = meta.cache.get("kv_write") if meta.cache is not None else None
    t, hkv, d = k.shape
    if (call is None or k.stride(0) != call[1] or v.stride(0) != call[2] or k.stride(2) != 1 or v.stride(2) != 1
            or k.stride(1) != d or v.stride(1) != d or not k_cache.is_contiguous()):
        _cpu.kv_write(k, v, k_cache, v_cache, meta.slot_mapping)
        if meta.cache is not None and k.stride(1) == d and v.stride(1) == d and k.stride(2) == 1 and v.stride(2) == 1:
            meta.cache["kv_write"] = (_cpu._lib(None).tm_kv_write, k.stride(0), v.stride(0),
                                      _cpu.kv_row_format(k_cache, d))  # every layer's cache has one format
        return
    fn, ldk, ldv, fmt = call
    fn(k.data_ptr(), ldk, v.data_ptr(), ldv, t, hkv, d, meta.slot_mapping.data_ptr(),
       k_cache.data_ptr(), v_cache.data_ptr(), k_cache.shape[1], fmt)


class TorchAttentionBackend(AttentionBackend):
    """Decode tokens in one batched, masked matmul; each prefill chunk through SDPA.

    Cache layout: [num_kv_heads, num_blocks * block_size, head_dim] per layer
    (head-major), so that gathering slots yields tensors that the batched
    matmuls and SDPA read without another transpose copy.

    On the CPU (fp32 queries; fp32, fp16 or int8 KV) one C kernel call per layer (`engine.kernels.cpu`,
    attention.c) serves every row of the step, decodes and prefill chunks alike, reading each
    sequence's blocks in place (no gather, no padding), and new K/V rows are written by one C
    call. What follows is the PyTorch path (other devices, no compiler, and the tests' oracle). Elsewhere, or without a C compiler:
    leading blocks shared by every decoding sequence are read once and
    attended by all queries in one matmul. The rest: sequences are sorted into
    up to 4 length buckets; the KV of each bucket is gathered by whole blocks
    into [Hkv, nb, Lmax, D] (padded to the bucket's longest sequence, padding
    masked with -inf), and the query heads of a KV group are folded together
    (GQA), so one matmul pair serves a bucket. Prefill: for a chunk with no cached prefix
    the fresh k/v are used directly with a causal mask; otherwise the prefix is
    gathered from the cache and the mask is offset by the prefix length.

    Sliding-window layers (`forward(..., window=w)`): the C kernel skips the blocks wholly before
    each tile's window; the PyTorch path gathers, per decoding sequence and per prefill chunk, only
    the blocks from the one holding its first query's earliest visible key (p - w + 1) on, and
    masks the keys outside each query's window; both read every sequence's keys through the cache.

    Args:
        cpu_kernel: use the C decode kernel where it serves the tensors (None: yes unless
            TOKENMILL_CPU_KERNELS=0; False: always the PyTorch path, as the tests' oracle).
    """

    use_cpu_kernel = True
    # the caches the C decoder reads (`fused_decoder_plan`); int16: bf16 in the group layout (`bf16_kv`)
    decoder_cache_dtypes = (torch.float32, torch.float16, bf16_kv.STORAGE_DTYPE)

    def __init__(self, cpu_kernel: bool | None = None) -> None:
        self.use_cpu_kernel = cpu_kernel is not False

    def cache_shape(self, num_blocks, block_size, num_kv_heads, head_dim):
        return (num_kv_heads, num_blocks * block_size, head_dim)

    def prepare(self, meta: AttentionMetadata) -> None:
        cache: dict = {}
        bd = meta.num_decode_tokens
        bs = meta.block_size
        dev = meta.slot_mapping.device
        cache["decode_shared"] = None
        cache["decode_kernel"] = None
        if bd > 0 and self.use_cpu_kernel and dev.type == "cpu" and cpu_kernel.available():
            # Checked again per layer against the tensors (dtype, shape) in `_decode_attention`,
            # where the task order (longest first) is made once for all layers of the step.
            lens = meta.decode_seq_lens.to(torch.int64).contiguous()
            cache["decode_kernel"] = (meta.decode_block_tables.to(torch.int32).contiguous(), lens)
        if bd > 0 and cache["decode_kernel"] is None:
            self._prepare_decode_buckets(meta, cache)
        pre = []
        for start, qlen, slen, bt in zip(
            meta.prefill_query_starts, meta.prefill_query_lens, meta.prefill_seq_lens, meta.prefill_block_tables
        ):
            prefix = slen - qlen
            if prefix == 0:
                pre.append((start, qlen, None, slen, None))
                continue
            blocks = self._block_rows_index(bt[: (slen + bs - 1) // bs].to(dev).long())
            pos = torch.arange(slen, device=dev)
            # query i (absolute position prefix + i) sees keys j <= prefix + i
            mask = pos[None, :] <= (prefix + torch.arange(qlen, device=dev))[:, None]
            pre.append((start, qlen, blocks, slen, mask))
        cache["prefill"] = pre
        meta.cache = cache
        if meta.window_meta is not None and meta.window_meta is not meta:
            self.prepare(meta.window_meta)  # the sliding-window layers' own block tables

    def _prepare_decode_buckets(self, meta: AttentionMetadata, cache: dict) -> None:
        """The PyTorch decode path's plan: the shared leading blocks and the length buckets."""
        bd = meta.num_decode_tokens
        bs = meta.block_size
        dev = meta.slot_mapping.device
        lens = meta.decode_seq_lens.tolist()
        tables = meta.decode_block_tables
        # Leading blocks that every decoding sequence holds (a job's shared instruction,
        # through the prefix cache): attended once for the whole batch as one matmul
        # instead of once per sequence (shared-prefix attention as in Hydragen,
        # arXiv 2402.05099). Only blocks below every sequence's last position qualify,
        # so they are full and each sequence keeps at least one position of its own.
        shared = 0
        if bd >= 2:
            most = (min(lens) - 1) // bs
            if most > 0:
                head = tables[:, :most]
                shared = int((head == head[:1]).all(0).long().cumprod(0).sum())
        if shared:
            cache["decode_shared"] = self._block_rows_index(tables[0, :shared].long())
        # Length buckets: sort decoding sequences by KV length and pad each
        # bucket only to its own longest sequence (padding waste of one
        # bucket for lengths 96-768 was 41%; 4 buckets ran decode attention
        # 2-3x faster in a microbenchmark).
        n_buckets = 4 if bd >= 16 else (2 if bd >= 4 else 1)
        order = sorted(range(bd), key=lens.__getitem__) if n_buckets > 1 else list(range(bd))
        buckets = []
        for b in range(n_buckets):
            members = order[b * bd // n_buckets:(b + 1) * bd // n_buckets]
            if not members:
                continue
            whole = n_buckets == 1
            idx = torch.tensor(members, device=dev)
            seq_lens = meta.decode_seq_lens if whole else meta.decode_seq_lens[idx]
            nblk = (max(lens[i] for i in members) + bs - 1) // bs - shared
            blocks = (tables if whole else tables[idx])[:, shared:shared + nblk].long()
            pos = torch.arange(shared * bs, (shared + nblk) * bs, device=dev)
            bias = torch.zeros(len(members), nblk * bs, device=dev, dtype=torch.float32)
            bias.masked_fill_(pos[None, :] >= seq_lens[:, None], float("-inf"))
            buckets.append((None if whole else idx, blocks.reshape(-1), nblk * bs, bias))
        cache["decode_buckets"] = buckets

    def _read(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Cache rows gathered by slot -> values in `dtype` (subclasses decode quantized rows here)."""
        return rows.to(dtype)

    @staticmethod
    def _block_rows_index(blocks: torch.Tensor):
        """A run of consecutive block ids as a slice (read as a view, no copy), else the ids."""
        b0 = int(blocks[0])
        if bool((blocks == torch.arange(b0, b0 + len(blocks), device=blocks.device)).all()):
            return slice(b0, b0 + len(blocks))
        return blocks

    @staticmethod
    def _gather_blocks(cache: torch.Tensor, blocks, block_size: int, which: str = "k") -> torch.Tensor:
        """Rows of whole blocks: cache [Hkv, slots, C] -> [Hkv, len(blocks) * block_size, C].
        Copies whole blocks (block_size * C contiguous elements each), not single slots. A grouped
        bf16 cache (`bf16_kv`) comes back as bf16 rows in slot order, read as its K or V (`which`)."""
        hkv, _, c = cache.shape
        if isinstance(blocks, slice):
            rows = cache[:, blocks.start * block_size:blocks.stop * block_size]
        else:
            rows = cache.view(hkv, -1, block_size * c).index_select(1, blocks).view(hkv, -1, c)
        return bf16_kv.read_rows(rows, which) if bf16_kv.is_grouped(cache) else rows

    def _decode_attention(self, q, k_cache, v_cache, meta, scale, out) -> None:
        """Attention of the first Bd (decode) tokens, written into `out`: the blocks all of them
        share once for the batch, the rest one length bucket at a time, under one softmax."""
        hkv, d = k_cache.shape[0], q.shape[2]
        bd, hq = meta.num_decode_tokens, q.shape[1]
        g = hq // hkv
        bs = meta.block_size
        kernel = meta.cache.get("decode_kernel")
        if kernel is not None and cpu_kernel.supports(q, k_cache, bs):
            order = meta.cache.get("decode_task_order")
            if order is None:
                order = meta.cache["decode_task_order"] = cpu_kernel.decode_task_order(kernel[1], hkv)
            cpu_kernel.paged_decode_attention(q[:bd], k_cache, v_cache, kernel[0], kernel[1], bs, scale,
                                              out=out[:bd], order=order)
            return
        if "decode_buckets" not in meta.cache:
            self._prepare_decode_buckets(meta, meta.cache)
        qh = q[:bd].view(bd, hkv, g, d).transpose(0, 1)  # [Hkv, Bd, G, D]
        shared = meta.cache["decode_shared"]
        if shared is not None:
            kp = self._read(self._gather_blocks(k_cache, shared, bs), q.dtype)  # [Hkv, P, D]
            vp = self._read(self._gather_blocks(v_cache, shared, bs, "v"), q.dtype)
            p_len = kp.shape[1]
            sp = torch.matmul(qh.reshape(hkv, bd * g, d), kp.transpose(-1, -2)).view(hkv, bd, g, p_len)
        for idx, blocks, length, bias in meta.cache["decode_buckets"]:
            nb = bias.shape[0]
            kd = self._read(self._gather_blocks(k_cache, blocks, bs), q.dtype).view(hkv, nb, length, d)
            vd = self._read(self._gather_blocks(v_cache, blocks, bs, "v"), q.dtype).view(hkv, nb, length, d)
            qd = qh if idx is None else qh[:, idx]  # [Hkv, nb, G, D]
            scores = torch.matmul(qd, kd.transpose(-1, -2)).float() + bias[None, :, None, :]  # [Hkv, nb, G, L]
            if shared is not None:
                scores = torch.cat((sp if idx is None else sp[:, idx], scores), dim=-1)
            probs = torch.softmax(scores * scale, dim=-1).to(q.dtype)
            if shared is not None:
                od = torch.matmul(probs[..., p_len:], vd)
                od += torch.matmul(probs[..., :p_len].reshape(hkv, nb * g, p_len), vp).view(hkv, nb, g, d)
            else:
                od = torch.matmul(probs, vd)  # [Hkv, nb, G, D]
            od = od.transpose(0, 1).reshape(nb, hq, d)
            if idx is None:
                out[:bd] = od
            else:
                out[idx] = od

    def _window_plan(self, meta: AttentionMetadata, window: int):
        """The PyTorch path's plan for a `window` (made on the first layer of that window, reused by
        the others). Decodes: per sequence the blocks from the one holding its first visible key
        (len - window) to its last, padded to the batch's widest with its last block, as
        (block ids [Bd * nw], keys per sequence nw * block_size, bias [Bd, nw * block_size] with -inf
        outside the window); prefill chunks: (start, qlen, blocks, first gathered position, seq len,
        mask [qlen, keys] True where a query attends)."""
        key = ("window", window)
        plan = meta.cache.get(key)
        if plan is not None:
            return plan
        bd, bs = meta.num_decode_tokens, meta.block_size
        dev = meta.slot_mapping.device
        dec = None
        if bd > 0:
            lens = meta.decode_seq_lens.to(dev).long()
            lo = (lens - window).clamp_min(0)  # first visible key
            first, last = lo // bs, (lens - 1) // bs
            nw = int((last - first).max()) + 1
            j = first[:, None] + torch.arange(nw, device=dev)  # [Bd, nw] block positions
            blocks = meta.decode_block_tables.to(dev).long().gather(1, torch.minimum(j, last[:, None]))
            pos = (j[:, :, None] * bs + torch.arange(bs, device=dev)).reshape(bd, nw * bs)
            bias = torch.zeros(bd, nw * bs, device=dev, dtype=torch.float32)
            bias.masked_fill_((pos >= lens[:, None]) | (pos < lo[:, None]), float("-inf"))
            dec = (blocks.reshape(-1), nw * bs, bias)
        pre = []
        for start, qlen, slen, bt in zip(meta.prefill_query_starts, meta.prefill_query_lens, meta.prefill_seq_lens,
                                         meta.prefill_block_tables):
            prefix = slen - qlen
            f = max(0, prefix - window + 1) // bs  # the block of the first query's earliest key
            blocks = self._block_rows_index(bt[f: (slen + bs - 1) // bs].to(dev).long())
            pos = torch.arange(f * bs, slen, device=dev)
            qp = prefix + torch.arange(qlen, device=dev)
            mask = (pos[None, :] <= qp[:, None]) & (pos[None, :] > qp[:, None] - window)
            pre.append((start, qlen, blocks, f * bs, slen, mask))
        plan = meta.cache[key] = (dec, pre)
        return plan

    def _window_attention(self, q, k_cache, v_cache, meta, scale, out, window: int) -> None:
        """Sliding-window attention of every row (the PyTorch path), written into `out`: the decodes
        in one masked matmul pair over their windows' blocks, each prefill chunk through SDPA over
        its window's blocks."""
        dec, pre = self._window_plan(meta, window)
        hkv, d = k_cache.shape[0], q.shape[2]
        bd, hq, bs = meta.num_decode_tokens, q.shape[1], meta.block_size
        if bd > 0:
            blocks, length, bias = dec
            qh = q[:bd].view(bd, hkv, hq // hkv, d).transpose(0, 1)  # [Hkv, Bd, G, D]
            kd = self._read(self._gather_blocks(k_cache, blocks, bs), q.dtype).view(hkv, bd, length, d)
            vd = self._read(self._gather_blocks(v_cache, blocks, bs, "v"), q.dtype).view(hkv, bd, length, d)
            scores = torch.matmul(qh, kd.transpose(-1, -2)).float() + bias[None, :, None, :]
            probs = torch.softmax(scores * scale, dim=-1).to(q.dtype)
            out[:bd] = torch.matmul(probs, vd).transpose(0, 1).reshape(bd, hq, d)
        for start, qlen, blocks, p0, slen, mask in pre:
            qs = q[start: start + qlen].transpose(0, 1)  # [Hq, qlen, D]
            ks = self._read(self._gather_blocks(k_cache, blocks, bs)[:, : slen - p0], q.dtype)
            vs = self._read(self._gather_blocks(v_cache, blocks, bs, "v")[:, : slen - p0], q.dtype)
            out[start: start + qlen] = _sdpa(qs, ks, vs, mask, scale).transpose(0, 1)

    def _write_kv(self, k, v, k_cache, v_cache, meta) -> None:
        """New K/V rows into the cache: one C call on the CPU (fp32 rows, fp32 or fp16 cache), else
        two index_copy_ (the same fp16 bits: both round to nearest even)."""
        if (self.use_cpu_kernel and k_cache.device.type == "cpu" and k_cache.dtype in self.decoder_cache_dtypes
                and k.dtype == torch.float32 and cpu_kernel.available()):
            _kv_write_fast(k, v, k_cache, v_cache, meta)
            return
        if bf16_kv.is_grouped(k_cache):
            bf16_kv.write_rows(k_cache, meta.slot_mapping, k, "k")
            bf16_kv.write_rows(v_cache, meta.slot_mapping, v, "v")
            return
        k_cache.index_copy_(1, meta.slot_mapping, k.transpose(0, 1).to(k_cache.dtype))
        v_cache.index_copy_(1, meta.slot_mapping, v.transpose(0, 1).to(v_cache.dtype))

    def _kernel_plan(self, meta: AttentionMetadata, q: torch.Tensor, k_cache: torch.Tensor):
        """The C kernel's view of the step (made on the first layer, reused by the others): one
        block-table row per sequence (decodes, then prefill chunks), each query row's table row
        and visible KV length (position + 1), and the work tiles, longest KV first."""
        plan = meta.cache.get("kernel_plan")
        if plan is not None:
            return plan
        bd, bs = meta.num_decode_tokens, meta.block_size
        if not meta.prefill_query_lens:  # decode only: one row per sequence, longest first
            # in numpy: cheaper than torch ops on tensors this small
            lens = meta.decode_seq_lens.numpy().astype(np.int64)
            tiles = np.ones((bd, 2), dtype=np.int64)
            tiles[:, 0] = np.argsort(-lens, kind="stable")
            plan = meta.cache["kernel_plan"] = (meta.decode_block_tables.to(torch.int32).contiguous(), None,
                                                torch.from_numpy(lens), torch.from_numpy(tiles))
            return plan
        group = q.shape[1] // k_cache.shape[0]
        tile_rows = _cpu.attention_tile_rows(group)
        chunks = list(zip(meta.prefill_query_starts, meta.prefill_query_lens, meta.prefill_seq_lens,
                          meta.prefill_block_tables))
        width = max([meta.decode_block_tables.shape[1] if bd else 1] + [-(-sl // bs) for _, _, sl, _ in chunks])
        tables = torch.zeros(bd + len(chunks), width, dtype=torch.int32)
        row_seq = [torch.arange(bd, dtype=torch.int32)]
        kv_len = [meta.decode_seq_lens[:bd].to(torch.int64)]
        tile_start = [torch.arange(bd, dtype=torch.int64)]
        tile_rows_l = [torch.ones(bd, dtype=torch.int64)]
        if bd:
            tables[:bd, : meta.decode_block_tables.shape[1]] = meta.decode_block_tables
        for i, (start, qlen, slen, bt) in enumerate(chunks):
            nb = -(-slen // bs)
            tables[bd + i, :nb] = bt[:nb].to(torch.int32)
            row_seq.append(torch.full((qlen,), bd + i, dtype=torch.int32))
            kv_len.append(torch.arange(slen - qlen + 1, slen + 1, dtype=torch.int64))
            offs = torch.arange(0, qlen, tile_rows, dtype=torch.int64)
            tile_start.append(start + offs)
            tile_rows_l.append((qlen - offs).clamp(max=tile_rows))
        kv_len_t = torch.cat(kv_len)
        starts, rows = torch.cat(tile_start), torch.cat(tile_rows_l)
        order = torch.argsort(kv_len_t[starts + rows - 1], descending=True, stable=True)
        tiles = torch.stack((starts[order], rows[order]), dim=1).contiguous()
        plan = meta.cache["kernel_plan"] = (tables, torch.cat(row_seq), kv_len_t, tiles)
        return plan

    def _kernel_serves(self, q, k_cache, meta) -> bool:
        """Whether the C kernel serves this step (decided on its first layer: every layer's
        tensors have the same dtypes and shapes)."""
        ok = meta.cache.get("kernel_serves")
        if ok is None:
            ok = meta.cache["kernel_serves"] = (self.use_cpu_kernel and meta.slot_mapping.device.type == "cpu"
                                                and cpu_kernel.supports(q, k_cache, meta.block_size))
        return ok

    def fused_decoder_plan(self, q, k_cache, meta):
        """The C kernel's plan where it serves the step over a cache of `decoder_cache_dtypes` (the C
        decoder computes this class's attention); None otherwise, and for a subclass with a `forward`
        of its own."""
        if (type(self).forward is not TorchAttentionBackend.forward
                or k_cache.dtype not in self.decoder_cache_dtypes or not self._kernel_serves(q, k_cache, meta)):
            return None
        return self._kernel_plan(meta, q, k_cache)

    def forward(self, q, k, v, k_cache, v_cache, meta, scale, out=None, window=0):
        window = check_window(window)
        self._write_kv(k, v, k_cache, v_cache, meta)
        if out is None:
            out = torch.empty_like(q)
        if self._kernel_serves(q, k_cache, meta):
            # decodes and prefill chunks alike: one C call reads every row's KV in place
            tables, row_seq, kv_len, tiles = self._kernel_plan(meta, q, k_cache)
            return _cpu.paged_attention(q, k_cache, v_cache, tables, row_seq, kv_len, tiles, meta.block_size,
                                        scale, out, window=window)
        if window:
            self._window_attention(q, k_cache, v_cache, meta, scale, out, window)
            return out
        c = meta.cache
        bd = meta.num_decode_tokens
        if bd > 0:
            self._decode_attention(q, k_cache, v_cache, meta, scale, out)
        for start, qlen, blocks, slen, mask in c["prefill"]:
            qs = q[start : start + qlen].transpose(0, 1)  # [Hq, qlen, D]
            if blocks is None:
                ks = k[start : start + qlen].transpose(0, 1)
                vs = v[start : start + qlen].transpose(0, 1)
                if k_cache.dtype != ks.dtype:  # a narrower cache (fp16 for fp32 rows): attend over what it
                    # holds, as decode steps and the C kernel do, so chunking does not change a logit
                    held = torch.bfloat16 if bf16_kv.is_grouped(k_cache) else k_cache.dtype
                    ks, vs = ks.to(held).to(ks.dtype), vs.to(held).to(vs.dtype)
                o = _sdpa(qs, ks, vs, None, scale)
            else:
                ks = self._read(self._gather_blocks(k_cache, blocks, meta.block_size)[:, :slen], q.dtype)
                vs = self._read(self._gather_blocks(v_cache, blocks, meta.block_size, "v")[:, :slen], q.dtype)
                o = _sdpa(qs, ks, vs, mask, scale)
            out[start : start + qlen] = o.transpose(0, 1)
        return out
