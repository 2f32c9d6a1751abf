"""Drafts from a smaller model that shares the target's tokenizer, with its own paged KV cache.

The draft runs greedily for k tokens: one pass over the tokens it has not seen yet (the
last verification's accepted tokens and correction, or a new sequence's whole prompt)
that also yields the first draft token, then k - 1 single-token passes. Its KV cache
has the target's block size and block count, so a sequence's block table (which the
scheduler grows for the draft before proposing) addresses both caches.

Draft models available here:
- "self:<m>": the target's first m layers with its final norm and LM head (early exit
  as a draft, LayerSkip, Elhoushi et al. 2024, arXiv 2404.16710), sharing the target's
  weights;
- "target": the target itself (every greedy draft is accepted: a test of the machinery);
- a model string the engine can load (on a GPU: Llama-3-8B drafted by a 1B model).
"""
from __future__ import annotations

import dataclasses
from typing import Sequence as Seq

import torch
import torch.nn as nn

from ..request import Sequence
from .base import Proposer


class DraftModelProposer(Proposer):
    """Args:
        target: the engine's LlamaModel.
        spec: "self:<m>", "target" or a model string.
        num_blocks, block_size: the engine's KV pool geometry.
        backend: the engine's attention backend (stateless between steps; shared).
        cache_dtype: KV cache storage dtype.
        sampler: the engine's `Sampler`; the draft's logits go through its `process` (vocab
            mask, penalties, EOS suppression under ignore_eos / min_tokens) before the argmax,
            so the draft never proposes a token the target cannot emit.
    Raises:
        ValueError: m out of range, or a draft model whose vocabulary differs.
    """

    name = "draft_model"
    cheap = False

    def __init__(self, target, spec: str, num_blocks: int, block_size: int, backend, cache_dtype,
                 sampler=None) -> None:
        from ..kv_cache import KVCache
        from ..model_runner import ModelRunner
        from ..models.llama import LlamaModel

        if spec == "target":
            model = target
        elif spec.startswith("self:"):
            m = int(spec[5:])
            if not 1 <= m <= target.cfg.num_layers:
                raise ValueError(f"draft_model 'self:{m}' needs 1..{target.cfg.num_layers} layers")
            model = LlamaModel(dataclasses.replace(target.cfg, num_layers=m), target.dtype, target.device)
            model.embed, model.final_norm, model.lm_head, model.ops = (target.embed, target.final_norm,
                                                                       target.lm_head, target.ops)
            model.layers = nn.ModuleList(list(target.layers[:m]))
        else:
            from ..loader import load_model
            from ..weights import resolve_model

            model, _ = load_model(resolve_model(spec), target.dtype, str(target.device), 0)
            if model.cfg.vocab_size != target.cfg.vocab_size:
                raise ValueError(f"draft model {spec!r} has vocabulary {model.cfg.vocab_size}, the target "
                                 f"{target.cfg.vocab_size}: they must share a tokenizer")
        model._rope_tables(target._rope_len)
        cfg = model.cfg
        shape = backend.cache_shape(num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        self.model = model
        self.kv = KVCache(cfg, num_blocks, block_size, cache_dtype, target.device, shape)
        self.runner = ModelRunner(model, self.kv, backend)
        self.computed: dict[int, int] = {}  # seq_id -> positions whose draft K/V are valid
        self.sampler = sampler

    def _greedy(self, logits: torch.Tensor, seqs: list, drafts: dict) -> list[int]:
        """The draft's token per row: argmax of the processed logits [R, V] (row i after seqs[i]'s
        drafts so far)."""
        if self.sampler is not None:
            from ..sampler import SampleRow

            self.sampler.process(logits, [SampleRow(s, list(drafts[s.seq_id])) for s in seqs])
        return logits.argmax(dim=-1).tolist()

    def propose(self, seqs: Seq[Sequence], ks: Seq[int]) -> list[list[int]]:
        from ..model_runner import ChunkSpec

        live = [(s, k) for s, k in zip(seqs, ks) if k > 0]
        drafts: dict[int, list[int]] = {s.seq_id: [] for s, _ in live}
        if not live:
            return [[] for _ in seqs]
        # catch up on unseen tokens; the last position's logits give the first draft token
        specs = []
        for s, _ in live:
            start = min(self.computed.get(s.seq_id, 0), s.num_computed_tokens, len(s.token_ids) - 1)
            specs.append(ChunkSpec(s.token_ids, start, len(s.token_ids) - start, s.block_table, "last"))
        is_dec = [c.num_tokens == 1 and c.start > 0 for c in specs]
        order = [i for i, d in enumerate(is_dec) if d] + [i for i, d in enumerate(is_dec) if not d]
        dec = [specs[i] for i in order if is_dec[i]]
        pre = [specs[i] for i in order if not is_dec[i]]
        with torch.inference_mode():
            logits = self.runner.run(self.runner.prepare(dec, pre))
        first = self._greedy(logits, [live[i][0] for i in order], drafts)
        for row, i in enumerate(order):
            drafts[live[i][0].seq_id].append(first[row])
        # k - 1 more tokens, one pass each, for the sequences that want them
        for j in range(1, max(k for _, k in live)):
            batch = [(s, k) for s, k in live if k > j]
            if not batch:
                break
            ctx = [s.token_ids + drafts[s.seq_id] for s, _ in batch]  # the draft's own continuation
            specs = [ChunkSpec(c, len(c) - 1, 1, s.block_table, "last") for c, (s, _) in zip(ctx, batch)]
            with torch.inference_mode():
                logits = self.runner.run(self.runner.prepare(specs, []))
            for (s, _), t in zip(batch, self._greedy(logits, [s for s, _ in batch], drafts)):
                drafts[s.seq_id].append(t)
        for s, k in live:
            self.computed[s.seq_id] = len(s.token_ids) + k - 1
        return [drafts.get(s.seq_id, [])[:k] if k > 0 else [] for s, k in zip(seqs, ks)]

    def on_verified(self, seq: Sequence, drafted: int, accepted: int) -> None:
        # the draft's K/V are right up to the last accepted draft token (its inputs there are final)
        before = len(seq.token_ids) - accepted - 1
        self.computed[seq.seq_id] = min(self.computed.get(seq.seq_id, 0), before + accepted)

    def on_preempted(self, seq: Sequence) -> None:
        self.computed.pop(seq.seq_id, None)

    def on_finished(self, seq: Sequence) -> None:
        self.computed.pop(seq.seq_id, None)
