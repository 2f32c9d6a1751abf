"""Batched sampling with per-request parameters and per-request random streams.

One call handles every sequence that reached the end of its tokens in this
step. Order of operations per row: mask ids beyond the tokenizer's vocab;
repetition penalty (CTRL, Keskar et al. 2019, arXiv 1909.05858), presence and
frequency penalties (OpenAI API semantics); suppression of EOS / stop ids
(ignore_eos, min_tokens); log-probabilities (of these processed logits,
before temperature); then greedy argmax, or temperature, top-k, top-p
(Holtzman et al. 2019, arXiv 1904.09751) and min-p filtering and a draw.

The draw is inverse-transform sampling: one uniform u per row from the
sequence's own `torch.Generator`, and the token is the first whose cumulative
probability exceeds u times the row's total (a batched cumsum and searchsorted;
tokens of probability 0 are never drawn). A seeded request gets the same tokens
whatever else is in the batch, and a step costs one pass over the vocabulary for
the whole batch plus one random number per row (drawing a vector of V exponentials
per row, as an exponential race would, cost 0.7 ms per row per step here).
"""
from __future__ import annotations

from typing import Optional, Sequence as Seq

import torch

from .request import Sequence


class Sampler:
    """Args:
        tokenizer_vocab_size: ids at or above it are never sampled (padded LM heads).
        eos_token_ids: ids that end a completion unless suppressed.
    """

    def __init__(self, tokenizer_vocab_size: int, eos_token_ids: Seq[int]) -> None:
        self.tokenizer_vocab_size = tokenizer_vocab_size
        self.eos_token_ids = sorted(set(eos_token_ids))

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> tuple[list[int], list[Optional[dict[int, float]]]]:
        """Draw one token per row.

        Args:
            logits: [S, V] float32, row i belongs to seqs[i].
            seqs: the sequences that sample this step.
        Returns:
            (token ids [S], per row a {token_id: logprob} dict or None).
        """
        S, V = logits.shape
        dev = logits.device
        if V > self.tokenizer_vocab_size:
            logits[:, self.tokenizer_vocab_size:] = float("-inf")
        # penalties (only rows that ask for them)
        for i, s in enumerate(seqs):
            p = s.request.params
            if p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty:
                self._apply_penalties(logits[i], s)
        # suppression of end tokens
        rows: list[int] = []
        cols: list[int] = []
        for i, s in enumerate(seqs):
            p = s.request.params
            below_min = s.num_output_tokens < p.min_tokens
            if p.ignore_eos or below_min:
                ids = list(self.eos_token_ids)
                if below_min:
                    ids += list(p.stop_token_ids)
                rows += [i] * len(ids)
                cols += ids
        if rows:
            logits[torch.tensor(rows, device=dev), torch.tensor(cols, device=dev)] = float("-inf")
        # logprobs
        want_lp = [s.request.params.logprobs for s in seqs]
        logprobs_all = None
        if any(k is not None for k in want_lp):
            logprobs_all = torch.log_softmax(logits, dim=-1)
        # greedy vs random rows
        greedy = [i for i, s in enumerate(seqs) if s.request.params.greedy]
        rand = [i for i, s in enumerate(seqs) if not s.request.params.greedy]
        tokens = torch.empty(S, dtype=torch.long, device=dev)
        if greedy:
            gi = torch.tensor(greedy, device=dev)
            tokens[gi] = logits[gi].argmax(dim=-1)
        if rand:
            ri = torch.tensor(rand, device=dev)
            tokens[ri] = self._sample(logits[ri], [seqs[i] for i in rand])
        tok_list = tokens.tolist()
        lps: list[Optional[dict[int, float]]] = [None] * S
        if logprobs_all is not None:
            for i, k in enumerate(want_lp):
                if k is None:
                    continue
                row = logprobs_all[i]
                d: dict[int, float] = {}
                if k > 0:
                    vals, idx = row.topk(k)
                    d = dict(zip(idx.tolist(), vals.tolist()))
                d[tok_list[i]] = float(row[tok_list[i]])
                lps[i] = d
        return tok_list, lps

    @staticmethod
    def _apply_penalties(row: torch.Tensor, s: Sequence) -> None:
        p = s.request.params
        dev = row.device
        V = row.shape[0]
        out_ids = s.output_token_ids
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(s.token_ids)), device=dev, dtype=torch.long)
            seen = seen[seen < V]
            vals = row[seen]
            row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        if out_ids and (p.presence_penalty or p.frequency_penalty):
            counts = torch.bincount(torch.tensor(out_ids, device=dev), minlength=V)[:V].to(row.dtype)
            row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)

    @staticmethod
    def _sample(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        dev = logits.device
        temps = torch.tensor([s.request.params.temperature for s in seqs], device=dev, dtype=logits.dtype)
        logits = logits / temps[:, None]
        top_ks = [s.request.params.top_k for s in seqs]
        if any(k > 0 for k in top_ks):
            V = logits.shape[1]
            k = torch.tensor([k if k > 0 else V for k in top_ks], device=dev)
            sorted_desc = logits.sort(dim=-1, descending=True).values
            kth = sorted_desc.gather(1, (k - 1).clamp(max=V - 1)[:, None])
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        top_ps = [s.request.params.top_p for s in seqs]
        if any(p < 1.0 for p in top_ps):
            tp = torch.tensor(top_ps, device=dev, dtype=probs.dtype)
            sp, si = probs.sort(dim=-1, descending=True)
            cum = sp.cumsum(dim=-1)
            drop_sorted = (cum - sp) >= tp[:, None]  # keep the smallest prefix whose mass reaches top_p
            drop = torch.zeros_like(drop_sorted).scatter(1, si, drop_sorted)
            probs = probs.masked_fill(drop, 0.0)
        min_ps = [s.request.params.min_p for s in seqs]
        if any(m > 0 for m in min_ps):
            mp = torch.tensor(min_ps, device=dev, dtype=probs.dtype)
            thresh = probs.max(dim=-1, keepdim=True).values * mp[:, None]
            probs = probs.masked_fill(probs < thresh, 0.0)
        u = torch.stack([torch.rand((), generator=s.generator, device=dev) for s in seqs]).to(probs.dtype)
        cdf = probs.cumsum(dim=-1)
        total = cdf[:, -1:]
        # strictly below the total, so that the first index whose cdf exceeds it always exists
        target = torch.minimum(u[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))
        return torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=probs.shape[1] - 1)
