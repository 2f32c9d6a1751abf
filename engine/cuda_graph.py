"""CUDA graphs for decode steps: one graph per batch-size bucket, inputs padded to the bucket.

A decode step of a large model launches hundreds of small kernels; replaying
a captured graph removes their launch cost. A graph replays fixed addresses
and shapes, so each bucket owns static input buffers (token ids, positions,
slot mapping, KV lengths, block tables of the full `max_model_len` width) and
the padded rows are made harmless: slot -1 (the KV write skips it) and KV
length 0 (decode attention returns zeros).

The captured function is the model's own `LlamaModel.forward` (on CUDA its
small ops are the Triton kernels of `models.ops.TritonOps`, and it reads no
device value: the RoPE tables are sized for `max_model_len` up front).
Graphs are captured lazily, the first time a bucket is used, from that step's
real inputs: the warm-up run computes the step (its KV writes are the step's
own), then the capture records it, then the replay recomputes it identically.

Needs the Triton attention backend (its decode path reads no device value).
On a CPU (tests, under TRITON_INTERPRET=1) the same bucketing and padding run
without a graph.
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from .attention import AttentionBackend, AttentionMetadata
from .models.llama import LlamaModel


def decode_buckets(max_batch: int) -> list[int]:
    """Batch sizes that get a graph: 1, 2, 4, 8, then every 16 up to `max_batch` (and max_batch)."""
    out = [b for b in (1, 2, 4, 8) if b < max_batch] + list(range(16, max_batch, 16))
    return sorted(set(out + [max_batch]))


class DecodeCudaGraphs:
    """Decode steps of up to `max_batch` sequences, replayed from per-bucket CUDA graphs.

    Args:
        model, kv_caches, backend: as the model runner holds them.
        max_batch: largest decode batch (max_num_seqs).
        max_model_len: longest sequence; sizes the block-table width and the RoPE tables.
        block_size: tokens per KV block.
        use_graphs: capture and replay graphs (default: on CUDA); False runs the padded
            static-buffer path eagerly (CPU tests).
        buckets: batch sizes to capture (default `decode_buckets(max_batch)`).
    """

    def __init__(self, model: LlamaModel, kv_caches, backend: AttentionBackend, max_batch: int,
                 max_model_len: int, block_size: int, use_graphs: Optional[bool] = None,
                 buckets: Optional[list[int]] = None) -> None:
        self.model, self.kv_caches, self.backend = model, kv_caches, backend
        self.block_size = block_size
        self.buckets = sorted(buckets) if buckets else decode_buckets(max_batch)
        self.max_batch = self.buckets[-1]
        self.width = -(-max_model_len // block_size)
        dev = model.device
        self.use_graphs = dev.type == "cuda" if use_graphs is None else use_graphs
        model._rope_tables(max_model_len + 1)  # never regrown (and reallocated) under a graph
        b = self.max_batch
        self.ids = torch.zeros(b, dtype=torch.int64, device=dev)
        self.pos = torch.zeros(b, dtype=torch.int64, device=dev)
        self.slots = torch.full((b,), -1, dtype=torch.int64, device=dev)
        self.seq_lens = torch.zeros(b, dtype=torch.int32, device=dev)
        self.block_tables = torch.zeros(b, self.width, dtype=torch.int32, device=dev)
        self.rows = torch.arange(b, device=dev)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = torch.cuda.graph_pool_handle() if self.use_graphs else None
        self.num_steps = 0  # decode steps run through this path

    def fits(self, num_decodes: int, max_blocks: int) -> bool:
        """Whether a decode-only step of this size can use a bucket."""
        return 0 < num_decodes <= self.max_batch and max_blocks <= self.width

    def _bucket(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    def _forward(self, b: int) -> torch.Tensor:
        meta = AttentionMetadata(
            slot_mapping=self.slots[:b], num_decode_tokens=b, decode_seq_lens=self.seq_lens[:b],
            decode_block_tables=self.block_tables[:b], prefill_query_starts=[], prefill_query_lens=[],
            prefill_seq_lens=[], prefill_block_tables=[], block_size=self.block_size,
        )
        self.backend.prepare(meta)
        return self.model.forward(self.ids[:b], self.pos[:b], meta, self.kv_caches, self.backend, self.rows[:b])

    def _capture(self, b: int) -> None:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self._forward(b)  # warm-up: compiles the kernels; computes this step for real
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = self._forward(b)
        self.graphs[b] = (graph, out)

    @torch.inference_mode()
    def run(self, ids: list[int], pos: list[int], slots: list[int], seq_lens: list[int],
            block_tables: np.ndarray, logits_idx: list[int]) -> torch.Tensor:
        """One decode step of n = len(ids) sequences, padded to its bucket.

        Args:
            ids, pos, slots, seq_lens: per sequence (lists of n ints).
            block_tables: [n, blocks] int array, blocks <= the static width.
            logits_idx: which of the n rows need logits.
        Returns:
            [len(logits_idx), vocab] float32.
        """
        n = len(ids)
        b = self._bucket(n)
        nb = block_tables.shape[1]
        self.ids[:n].copy_(torch.as_tensor(ids), non_blocking=True)
        self.pos[:n].copy_(torch.as_tensor(pos), non_blocking=True)
        self.slots[:n].copy_(torch.as_tensor(slots), non_blocking=True)
        self.seq_lens[:n].copy_(torch.as_tensor(seq_lens, dtype=torch.int32), non_blocking=True)
        self.block_tables[:n, :nb].copy_(torch.from_numpy(np.ascontiguousarray(block_tables, dtype=np.int32)),
                                         non_blocking=True)
        if b > n:  # padding rows: no KV write, zero-length attention
            self.ids[n:b].zero_()
            self.pos[n:b].zero_()
            self.slots[n:b].fill_(-1)
            self.seq_lens[n:b].zero_()
        if not self.use_graphs:
            out = self._forward(b)
        else:
            if b not in self.graphs:
                self._capture(b)
            graph, out = self.graphs[b]
            graph.replay()
        self.num_steps += 1
        idx = torch.as_tensor(logits_idx, dtype=torch.int64).to(out.device, non_blocking=True)
        return out[idx]
