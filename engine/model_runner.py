"""Builds one step's flattened tensors and runs the model.

`prepare` turns the step's chunks (decodes first, then prefill chunks) into
`StepInputs`: input ids [T], positions [T], the slot mapping [T] (cache slot of
each new token: block_table[pos // block_size] * block_size + pos % block_size),
block tables and KV lengths, and the indices of the positions whose logits are
needed. It is the one place a step's inputs are built: scheduled steps
(`execute`), single prompts (`compute_logits`) and scoring (`LLM.score`) all go
through it. Tokens and tables are gathered once per step into numpy arrays and
the per-token arrays are computed vectorised (no per-token Python work).

With tensor parallelism the runner of the driver (rank 0) also hands every step to the
worker group (`engine.parallel.WorkerGroup`): `StepInputs.pack` flattens the step into one
int64 tensor, broadcast once; each worker's runner rebuilds the same `StepInputs`
(`StepInputs.unpack`) and runs the same `run` on its shard of the model and its own KV cache.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch

from .attention import AttentionBackend, AttentionMetadata
from .kv_cache import KVCache
from .models.llama import LlamaModel
from .scheduler import SchedulerOutput


@dataclass
class ChunkSpec:
    """`num_tokens` tokens of a sequence from position `start`, with the sequence's block table.

    Attributes:
        token_ids: the sequence's tokens (at least start + num_tokens of them).
        start: first position of the chunk (tokens before it are in the KV cache).
        num_tokens: tokens in the chunk.
        block_table: physical KV blocks of the sequence, covering start + num_tokens.
        logits: "last" (the chunk's last position), "all" (every position) or None.
        extra: tokens after `token_ids` that the chunk ends with (a speculative draft):
            the chunk runs token_ids[start:] + extra, num_tokens in all.
        logits_from: with logits "all", the first chunk position (0-based within the chunk)
            whose logits are returned (scoring needs only the positions from the prompt's end).
        window_table: the sliding-window group's pool blocks (`Sequence.window_table`) of a model
            that mixes full and sliding-window layers; None for any other model.

    `block_table` (and `window_table`) hold KV pool blocks; `ModelRunner.prepare` turns them
    into the page tables the attention backends read (`KVCache.main_pages`).
    """

    token_ids: Sequence[int]
    start: int
    num_tokens: int
    block_table: Sequence[int]
    logits: Optional[str] = None
    extra: Sequence[int] = ()
    logits_from: int = 0
    window_table: Optional[Sequence[int]] = None


@dataclass
class StepInputs:
    """One step's model inputs (decode rows first, then prefill chunks).

    Attributes:
        input_ids, positions: [T] int64 on the model's device.
        logits_indices: [S] int64, the rows whose logits the step returns.
        meta: the attention metadata (not yet `backend.prepare`d).
        num_decodes: leading rows that are single-token decodes.
        decode_arrays: (ids, positions, slots, seq lens, block tables, logits rows) as numpy
            arrays, for the CUDA-graph path of decode-only steps.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    logits_indices: torch.Tensor
    meta: AttentionMetadata
    num_decodes: int
    decode_arrays: tuple

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_logits(self) -> int:
        return int(self.logits_indices.shape[0])

    # the packed form's header: token count T, logits rows S, decode rows Bd, decode table width W,
    # prefill chunks P, block size, window decode table width (-1: no window metadata)
    HEADER = 7

    def pack(self) -> torch.Tensor:
        """The step as one int64 tensor on the inputs' device (what a tensor-parallel driver
        broadcasts): a header [T, S, Bd, W, P, block_size, W2], then per prefill chunk its query
        start, query length, KV length and table length [4 P] (and, with window metadata, its
        window table length [P]), input ids [T], positions [T], logits rows [S], slot mapping [T],
        decode KV lengths [Bd], decode block tables [Bd * W], the prefill block tables one after
        another; with window metadata (W2 >= 0) then its slot mapping [T], decode block tables
        [Bd * W2] and prefill block tables."""
        m = self.meta
        w = m.window_meta
        bt = m.decode_block_tables
        dev = self.input_ids.device
        small = torch.tensor([self.num_tokens, self.num_logits, m.num_decode_tokens, bt.shape[1],
                              len(m.prefill_query_lens), m.block_size,
                              -1 if w is None else w.decode_block_tables.shape[1]]
                             + list(m.prefill_query_starts) + list(m.prefill_query_lens) + list(m.prefill_seq_lens)
                             + [int(t.shape[0]) for t in m.prefill_block_tables]
                             + ([] if w is None else [int(t.shape[0]) for t in w.prefill_block_tables]),
                             dtype=torch.int64)
        parts = [small.to(dev), self.input_ids, self.positions, self.logits_indices, m.slot_mapping,
                 m.decode_seq_lens, bt.reshape(-1)] + list(m.prefill_block_tables)
        if w is not None:
            parts += [w.slot_mapping, w.decode_block_tables.reshape(-1)] + list(w.prefill_block_tables)
        return torch.cat([p.to(device=dev, dtype=torch.int64) for p in parts])

    @classmethod
    def unpack(cls, flat: torch.Tensor) -> "StepInputs":
        """Inverse of `pack` (tensors are views of `flat`; `decode_arrays` is empty: the
        CUDA-graph path does not run under tensor parallelism)."""
        T, S, nd, w, P, bs, w2 = (int(x) for x in flat[: cls.HEADER].tolist())
        nl = 4 + (w2 >= 0)
        lists = flat[cls.HEADER: cls.HEADER + nl * P].tolist()
        q_starts, q_lens, s_lens, t_lens = (lists[i * P:(i + 1) * P] for i in range(4))
        o = cls.HEADER + nl * P

        def take(n: int) -> torch.Tensor:
            nonlocal o
            o += n
            return flat[o - n:o]

        ids, pos, logits, slots, d_lens = take(T), take(T), take(S), take(T), take(nd)
        d_bt = take(nd * w).view(nd, w)
        tables = [take(n) for n in t_lens]
        meta = AttentionMetadata(slot_mapping=slots, num_decode_tokens=nd, decode_seq_lens=d_lens,
                                 decode_block_tables=d_bt, prefill_query_starts=q_starts,
                                 prefill_query_lens=q_lens, prefill_seq_lens=s_lens,
                                 prefill_block_tables=tables, block_size=bs)
        if w2 >= 0:
            w_slots, w_bt = take(T), take(nd * w2).view(nd, w2)
            w_tables = [take(n) for n in lists[4 * P:5 * P]]
            meta.window_meta = AttentionMetadata(
                slot_mapping=w_slots, num_decode_tokens=nd, decode_seq_lens=d_lens, decode_block_tables=w_bt,
                prefill_query_starts=q_starts, prefill_query_lens=q_lens, prefill_seq_lens=s_lens,
                prefill_block_tables=w_tables, block_size=bs)
        return cls(ids, pos, logits, meta, nd, ())


class ModelRunner:
    """Owns the model, the KV cache and the attention backend.

    Args:
        model: the loaded LlamaModel (on a tensor-parallel rank: its shard).
        kv_cache: the paged cache (on a tensor-parallel rank: its KV heads).
        backend: attention backend.
        tp: the tensor-parallel group (`engine.parallel.TPGroup`) of a sharded model, else None.
        workers: on the driver of a tensor-parallel engine, its `engine.parallel.WorkerGroup`:
            every `run` and `copy_blocks` is handed to the workers first.
    """

    def __init__(self, model: LlamaModel, kv_cache: KVCache, backend: AttentionBackend, tp=None,
                 workers=None) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.backend = backend
        self.tp = tp
        self.workers = workers
        self.device = model.device
        self.block_size = kv_cache.block_size
        self.cuda_graphs = None  # an engine.cuda_graph.DecodeCudaGraphs for decode-only steps, if set

    def _to(self, arr: np.ndarray) -> torch.Tensor:
        t = torch.from_numpy(np.ascontiguousarray(arr, dtype=np.int64))
        return t.to(self.device, non_blocking=True) if self.device.type != "cpu" else t

    # ------------------------------------------------------------ prepare
    def _pages(self, table, window: bool):
        """The page table of a chunk's pool-block table (main or window group): the list itself
        when pool blocks are pages (a full-attention model), else `KVCache.main_pages` /
        `window_pages` (placeholders become page 0)."""
        kv = self.kv_cache
        lay = getattr(kv, "layout", None)
        if window:
            return kv.window_pages(table)
        if lay is None or (lay.rows == 1 and lay.main_window == 0):
            return table
        return kv.main_pages(table)

    def _tables(self, decodes: Sequence[ChunkSpec], prefills: Sequence[ChunkSpec], d_pos: np.ndarray,
                window: bool) -> tuple:
        """(decode block tables [Bd, W], decode slots [Bd], per prefill chunk its page table and
        slots) of one layer group."""
        bs = self.block_size
        nd = len(decodes)
        d_tables = [self._pages(c.window_table if window else c.block_table, window) for c in decodes]
        width = max((len(t) for t in d_tables), default=1) or 1
        d_bt = np.zeros((nd, width), dtype=np.int64)
        for i, t in enumerate(d_tables):  # a row copy per sequence (its table is a Python list)
            d_bt[i, : len(t)] = t
        rows = np.arange(nd)
        d_slots = d_bt[rows, d_pos // bs] * bs + d_pos % bs if nd else np.zeros(0, dtype=np.int64)
        p_tables, p_slots = [], []
        for c in prefills:
            table = np.asarray(self._pages(c.window_table if window else c.block_table, window), dtype=np.int64)
            rng = np.arange(c.start, c.start + c.num_tokens, dtype=np.int64)
            p_slots.append(table[rng // bs] * bs + rng % bs)
            p_tables.append(table)
        return d_bt, d_slots, p_tables, p_slots

    def prepare(self, decodes: Sequence[ChunkSpec], prefills: Sequence[ChunkSpec]) -> StepInputs:
        """Flattened inputs of a step: `decodes` (one token each) then `prefills` (any length).

        A model mixing full and sliding-window layers gets `meta.window_meta` too: the same
        tokens over the window group's tables (`ChunkSpec.window_table`).

        Raises:
            ValueError: a decode chunk of more than one token; a chunk without a window_table
                for a model that mixes full and sliding-window layers.
        """
        bs = self.block_size
        nd = len(decodes)
        # decodes: one token each, all vectorised over the batch
        if any(c.num_tokens != 1 for c in decodes):
            raise ValueError("decode chunks have exactly one token")
        lay = getattr(self.kv_cache, "layout", None)
        hybrid = lay is not None and lay.hybrid
        if hybrid and any(c.window_table is None for c in (*decodes, *prefills)):
            raise ValueError("window_table: this model mixes full and sliding-window layers, so every chunk "
                             "needs its window group's blocks (KVCacheManager.allocate_scratch)")
        d_pos = np.fromiter((c.start for c in decodes), dtype=np.int64, count=nd)
        d_ids = np.fromiter((c.token_ids[c.start] for c in decodes), dtype=np.int64, count=nd)
        d_bt, d_slots, p_tables, p_slots = self._tables(decodes, prefills, d_pos, False)
        d_logits = np.fromiter((i for i, c in enumerate(decodes) if c.logits), dtype=np.int64)
        # prefill chunks: one contiguous slice each
        ids, pos, logits = [d_ids], [d_pos], [d_logits]
        q_starts, q_lens, s_lens = [], [], []
        row = nd
        for c in prefills:
            p0, n = c.start, c.num_tokens
            if c.extra:
                ids.append(np.asarray(list(c.token_ids[p0: p0 + n - len(c.extra)]) + list(c.extra), dtype=np.int64))
            else:
                ids.append(np.asarray(c.token_ids[p0: p0 + n], dtype=np.int64))
            pos.append(np.arange(p0, p0 + n, dtype=np.int64))
            q_starts.append(row)
            q_lens.append(n)
            s_lens.append(p0 + n)
            if c.logits == "last":
                logits.append(np.array([row + n - 1], dtype=np.int64))
            elif c.logits == "all":
                logits.append(np.arange(row + c.logits_from, row + n, dtype=np.int64))
            row += n
        ids_a, pos_a, logits_a = (np.concatenate(x) for x in (ids, pos, logits))
        d_lens = self._to(d_pos + 1)

        def meta_of(tables: tuple) -> AttentionMetadata:
            bt, slots, p_tabs, p_sl = tables
            return AttentionMetadata(
                slot_mapping=self._to(np.concatenate([slots] + p_sl)),
                num_decode_tokens=nd,
                decode_seq_lens=d_lens,
                decode_block_tables=self._to(bt),
                prefill_query_starts=q_starts,
                prefill_query_lens=q_lens,
                prefill_seq_lens=s_lens,
                prefill_block_tables=[self._to(t) for t in p_tabs],
                block_size=bs,
            )

        meta = meta_of((d_bt, d_slots, p_tables, p_slots))
        if hybrid:
            meta.window_meta = meta_of(self._tables(decodes, prefills, d_pos, True))
        return StepInputs(self._to(ids_a), self._to(pos_a), self._to(logits_a), meta, nd,
                          (d_ids, d_pos, d_slots, d_pos + 1, d_bt, d_logits))

    def prepare_scheduled(self, out: SchedulerOutput) -> StepInputs:
        """`prepare` for a scheduler step: each chunk continues its sequence from `num_computed_tokens`."""
        lay = getattr(self.kv_cache, "layout", None)
        hybrid = lay is not None and lay.hybrid

        def spec(c) -> ChunkSpec:
            s = c.seq
            wt = s.window_table if hybrid else None
            if c.draft:  # a verification: logits at the last token and at every drafted one
                return ChunkSpec(s.token_ids, s.num_computed_tokens, c.num_tokens, s.block_table, "all", c.draft,
                                 window_table=wt)
            return ChunkSpec(s.token_ids, s.num_computed_tokens, c.num_tokens, s.block_table,
                             "last" if c.samples else None, window_table=wt)

        verify = [spec(c) for c in out.decodes if c.draft]
        return self.prepare([spec(c) for c in out.decodes if not c.draft],
                            verify + [spec(c) for c in out.prefills])

    # ------------------------------------------------------------ run
    @property
    def fused_argmax_ok(self) -> bool:
        """Whether `run` can take greedy argmaxes in the LM head (`argmax=`): a single-process CPU
        model whose head the CPU kernel library serves."""
        return (self.workers is None and self.cuda_graphs is None and self.tp is None
                and bool(getattr(self.model, "fused_argmax_ok", False)))

    def run(self, inputs: StepInputs, argmax=None) -> Optional[torch.Tensor]:
        """One forward pass over the step. Returns [S, vocab] float32 logits of
        `inputs.logits_indices` in order, or None if S == 0 (the pass still fills the cache;
        on a tensor-parallel worker always None). With `argmax` (an `engine.sampler.FusedGreedy`,
        only where `fused_argmax_ok`): [S] int64 greedy token ids instead of the logits.

        Raises:
            engine.parallel.WorkerError: a tensor-parallel worker died or failed (the engine
                cannot run further steps).
        """
        if self.workers is not None:
            with self.workers.guard():
                self.workers.run_step(inputs)
                return self._run(inputs)
        return self._run(inputs, argmax)

    def _run(self, inputs: StepInputs, argmax=None) -> Optional[torch.Tensor]:
        meta = inputs.meta
        if (self.cuda_graphs is not None and inputs.num_decodes == inputs.num_tokens
                and self.cuda_graphs.fits(inputs.num_decodes, meta.decode_block_tables.shape[1])):
            d_ids, d_pos, d_slots, d_lens, d_bt, d_logits = inputs.decode_arrays
            logits = self.cuda_graphs.run(d_ids.tolist(), d_pos.tolist(), d_slots.tolist(), d_lens.tolist(), d_bt,
                                          d_logits.tolist())
        else:
            self.backend.prepare(meta)
            if meta.window_meta is not None:  # the sliding-window layers' own tables
                self.backend.prepare(meta.window_meta)
            kw = {} if argmax is None else {"argmax": argmax}
            logits = self.model.forward(inputs.input_ids, inputs.positions, meta, self.kv_cache.layers,
                                        self.backend, inputs.logits_indices, self.tp, **kw)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return logits if inputs.num_logits else None

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        """Copy the K and V of pool blocks `src` into pool blocks `dst` (pairwise) in every layer: of
        this cache and, on a tensor-parallel driver, of every worker's."""
        if self.workers is not None:
            with self.workers.guard():
                self.workers.copy_blocks(src, dst)
        self.kv_cache.copy_blocks(src, dst)

    def execute(self, out: SchedulerOutput, argmax=None) -> Optional[torch.Tensor]:
        """Prepare and run a scheduler step: [S, vocab] float32 logits, in this order: one row per
        plain decode that samples, then 1 + len(draft) rows per verification chunk (decodes
        with drafts, in order), then one row per prefill chunk that samples; None if S == 0.
        With `argmax` (see `run`): [S] int64 greedy token ids in that order."""
        return self.run(self.prepare_scheduled(out), argmax)

    def compute_logits(self, token_ids: list[int], block_table: list[int],
                       window_table: Optional[list[int]] = None) -> torch.Tensor:
        """Logits of the last position of `token_ids` run as one fresh sequence.

        Args:
            token_ids: the prompt.
            block_table, window_table: scratch tables the caller allocated
                (`KVCacheManager.allocate_scratch`; window_table None for a model without a
                window group).
        Returns:
            [vocab] float32.
        """
        spec = ChunkSpec(token_ids, 0, len(token_ids), block_table, "last", window_table=window_table)
        inputs = self.prepare([spec], []) if len(token_ids) == 1 else self.prepare([], [spec])
        return self.run(inputs)[0]
