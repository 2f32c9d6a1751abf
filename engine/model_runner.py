"""Builds one step's flattened tensors and runs the model.

For the scheduled chunks (decodes first, then prefill chunks) it makes:
input ids [T], positions [T], the slot mapping [T] (cache slot of each new
token: block_table[pos // block_size] * block_size + pos % block_size), block
tables and KV lengths, and the indices of the positions whose logits are
needed (the last token of each chunk that completes its sequence).
"""
from __future__ import annotations

import time
from typing import Optional

import numpy as np
import torch

from .attention import AttentionBackend, AttentionMetadata
from .kv_cache import KVCache
from .models.llama import LlamaModel
from .scheduler import SchedulerOutput


class ModelRunner:
    """Owns the model, the KV cache and the attention backend.

    Args:
        model: the loaded LlamaModel.
        kv_cache: the paged cache.
        backend: attention backend.
    """

    def __init__(self, model: LlamaModel, kv_cache: KVCache, backend: AttentionBackend) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.backend = backend
        self.device = model.device
        self.block_size = kv_cache.block_size
        self.time_model = 0.0  # seconds inside the forward pass, cumulative
        self.cuda_graphs = None  # an engine.cuda_graph.DecodeCudaGraphs for decode-only steps, if set

    def _to(self, arr, dtype=torch.int64) -> torch.Tensor:
        t = torch.from_numpy(np.asarray(arr, dtype=np.int64))
        if dtype != torch.int64:
            t = t.to(dtype)
        return t.to(self.device, non_blocking=True) if self.device.type != "cpu" else t

    def execute(self, out: SchedulerOutput) -> Optional[torch.Tensor]:
        """Run one forward pass over the step's chunks.

        Returns:
            [S, vocab] float32 logits, one row per chunk whose `samples` is
            True, in chunk order (decodes, then prefills); None if S == 0
            (the pass still ran, filling the cache).
        """
        bs = self.block_size
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        logits_idx: list[int] = []
        # decodes
        dec = out.decodes
        dec_lens = []
        max_blocks = 0
        for c in dec:
            s = c.seq
            p = s.num_computed_tokens
            ids.append(s.token_ids[p])
            pos.append(p)
            slots.append(s.block_table[p // bs] * bs + p % bs)
            dec_lens.append(p + 1)
            max_blocks = max(max_blocks, len(s.block_table))
            if c.samples:
                logits_idx.append(len(ids) - 1)
        bt = np.zeros((len(dec), max(max_blocks, 1)), dtype=np.int64)
        for i, c in enumerate(dec):
            bt[i, : len(c.seq.block_table)] = c.seq.block_table
        # prefills
        q_starts, q_lens, s_lens, p_tables = [], [], [], []
        for c in out.prefills:
            s = c.seq
            p0, n = s.num_computed_tokens, c.num_tokens
            q_starts.append(len(ids))
            q_lens.append(n)
            s_lens.append(p0 + n)
            ids.extend(s.token_ids[p0 : p0 + n])
            rng = np.arange(p0, p0 + n)
            table = np.asarray(s.block_table, dtype=np.int64)
            pos.extend(rng.tolist())
            slots.extend((table[rng // bs] * bs + rng % bs).tolist())
            p_tables.append(self._to(table))
            if c.samples:
                logits_idx.append(len(ids) - 1)
        meta = AttentionMetadata(
            slot_mapping=self._to(slots),
            num_decode_tokens=len(dec),
            decode_seq_lens=self._to(dec_lens),
            decode_block_tables=self._to(bt),
            prefill_query_starts=q_starts,
            prefill_query_lens=q_lens,
            prefill_seq_lens=s_lens,
            prefill_block_tables=p_tables,
            block_size=bs,
        )
        t0 = time.perf_counter()
        if self.cuda_graphs is not None and not q_starts and self.cuda_graphs.fits(len(dec), bt.shape[1]):
            logits = self.cuda_graphs.run(ids, pos, slots, dec_lens, bt, logits_idx)
        else:
            self.backend.prepare(meta)
            logits = self.model.forward(
                self._to(ids), self._to(pos), meta, self.kv_cache.layers, self.backend, self._to(logits_idx)
            )
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.time_model += time.perf_counter() - t0
        return logits if logits_idx else None

    def compute_logits(self, token_ids: list[int], block_table: list[int]) -> torch.Tensor:
        """Logits of the last position of `token_ids` run as one fresh sequence.

        Args:
            token_ids: the prompt.
            block_table: ceil(len / block_size) blocks the caller allocated as scratch.

        Returns:
            [vocab] float32.
        """
        from .request import Sequence  # local: avoid a cycle
        from .scheduler import ScheduledChunk

        class _Tmp:  # minimal stand-in for a Request
            prompt_token_ids = token_ids

        n = len(token_ids)
        seq = Sequence(seq_id=-1, request=_Tmp(), index=0, token_ids=list(token_ids))
        seq.block_table = list(block_table)
        out = SchedulerOutput(decodes=[], prefills=[ScheduledChunk(seq, n)])
        if n == 1:
            out = SchedulerOutput(decodes=[ScheduledChunk(seq, 1)], prefills=[])
        return self.execute(out)[0]
