"""Batched sampling with per-request parameters and per-request random streams, and the
verification of speculative drafts.

One call handles every row that needs a token this step. Order of operations per row:
mask ids beyond the tokenizer's vocab; the grammar's token bitmask for rows of constrained
sequences (`engine.structured`: one [R, ceil(V / 32)] int32 mask per step, unpacked with
one vectorised shift, a disallowed token's logit set to -inf); repetition penalty (CTRL, Keskar et al. 2019,
arXiv 1909.05858), presence and frequency penalties (OpenAI API semantics); suppression
of EOS / stop ids (ignore_eos, min_tokens); log-probabilities (of these processed
logits, before temperature); then greedy argmax, or temperature, top-k, top-p (Holtzman
et al. 2019, arXiv 1904.09751) and min-p filtering and a draw.

A row may stand for a position inside a speculative draft: its `extra` tokens (the
drafted tokens before it) count as generated for the penalties and for min_tokens, so
every drafted position sees exactly the distribution that plain decoding would.

The draw is inverse-transform sampling: one uniform u per row from the sequence's own
`torch.Generator`, and the token is the first whose cumulative probability exceeds u
times the row's total (a batched cumsum and searchsorted; tokens of probability 0 are
never drawn). A seeded request gets the same tokens whatever else is in the batch, and
a step costs one pass over the vocabulary for the whole batch plus one random number per
row (drawing a vector of V exponentials per row, as an exponential race would, cost 0.7
ms per row per step here).

Verification (`verify`) follows speculative sampling (Leviathan et al. 2023, arXiv
2211.17192; Chen et al. 2023, arXiv 2302.01318) for deterministic proposers: draft x at
a position is accepted with probability p(x) under the fully processed target
distribution p; on a rejection the token is drawn from p with x removed and
renormalised; after a full acceptance one more token (the bonus) is drawn from the next
position's p. It is drawn as sample-and-compare (the target token from the position's
own uniform, accepted when it equals the draft), which has exactly that law and uses
the same uniforms as plain decoding, so seeded rows do not depend on the drafts. Greedy rows accept the longest prefix of drafts equal to the target's
argmax and append the argmax after it. Either way the output has the target's
distribution (greedy: its exact tokens).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence as Seq

import torch

from .request import Sequence
from .structured.bitmask import apply_token_bitmask_

MIN_TEMPERATURE = 0.01
"""The smallest temperature a draw divides the logits by: a request's temperature in [1e-5, 0.01) is raised
to it (as vLLM does), so that the scaled logits stay finite in fp32 (below `engine.config.SAMPLING_EPS`,
1e-5, a request is greedy and never drawn)."""


@dataclass
class SampleRow:
    """One logits row: the sequence it belongs to and the drafted tokens before its position."""

    seq: Sequence
    extra: list[int] = field(default_factory=list)

    @property
    def num_output_tokens(self) -> int:
        return self.seq.num_output_tokens + len(self.extra)


@dataclass
class FusedGreedy:
    """A step whose sampling rows are all plain greedy: the LM head can take each row's argmax in
    its GEMM epilogue instead of writing logits (`CpuLinear.argmax`).

    limit: only token ids < limit compete (the tokenizer's vocabulary of a padded head).
    ban: [S, nban] int64 per row ids that never win (EOS and stop ids suppressed by ignore_eos
        or min_tokens), -1 = none; None when no row suppresses any.
    """

    limit: int
    ban: Optional[torch.Tensor] = None


class Sampler:
    """Args:
        tokenizer_vocab_size: ids at or above it are never sampled (padded LM heads).
        eos_token_ids: ids that end a completion unless suppressed.
        cpu_kernels: take greedy argmaxes over fp32 CPU logits with the CPU kernel library
            (`engine.kernels.cpu.argmax_rows`: every row in place, on the library's threads, no
            copy of the rows) where it builds; else `torch.argmax` on the greedy rows.
    """

    def __init__(self, tokenizer_vocab_size: int, eos_token_ids: Seq[int], cpu_kernels: bool = False) -> None:
        self.tokenizer_vocab_size = tokenizer_vocab_size
        self.eos_token_ids = sorted(set(eos_token_ids))
        self._argmax_rows = None
        if cpu_kernels:
            from .kernels import cpu

            if cpu.available():
                self._argmax_rows = cpu.argmax_rows

    def greedy_argmax(self, logits: torch.Tensor, idx: list[int]) -> torch.Tensor:
        """The argmax token of logits rows `idx` (all rows when idx covers them): [len(idx)] int64."""
        if (self._argmax_rows is not None and logits.device.type == "cpu" and logits.dtype == torch.float32
                and logits.dim() == 2 and logits.stride(1) == 1):
            # every row (a row that is not greedy costs a few microseconds) beats copying the rows out
            am = self._argmax_rows(logits)
            return am if len(idx) == logits.shape[0] else am[torch.tensor(idx)]
        if len(idx) == logits.shape[0]:
            return logits.argmax(dim=-1)
        return logits[torch.tensor(idx, device=logits.device)].argmax(dim=-1)

    def fused_greedy(self, seqs: list[Sequence]) -> Optional[FusedGreedy]:
        """The argmax-in-the-LM-head plan for a step whose sampling rows are `seqs` (in row
        order), or None when any row needs the logits themselves: a temperature draw,
        logprobs, a penalty, or a grammar. Taking the argmax there gives exactly `__call__`'s
        tokens: the same values, with the same ids masked to -inf (those past the tokenizer's
        vocabulary, and EOS / stop ids suppressed as `process` does)."""
        if not seqs:
            return None
        bans: list[list[int]] = []
        for s in seqs:
            p = s.request.params
            if (not p.greedy or p.logprobs is not None or s.grammar is not None or p.repetition_penalty != 1.0
                    or p.presence_penalty or p.frequency_penalty):
                return None
            below_min = s.num_output_tokens < p.min_tokens
            ids: list[int] = []
            if p.ignore_eos or below_min:
                ids = list(self.eos_token_ids) + (list(p.stop_token_ids) if below_min else [])
            bans.append(ids)
        width = max(len(b) for b in bans)
        ban = None
        if width:  # one tensor from padded lists (a tensor per row costs ~10 us each)
            ban = torch.tensor([b + [-1] * (width - len(b)) for b in bans], dtype=torch.int64)
        return FusedGreedy(self.tokenizer_vocab_size, ban)

    # ------------------------------------------------------------ plain sampling
    def __call__(self, logits: torch.Tensor, seqs: list[Sequence], bitmask: Optional[torch.Tensor] = None
                 ) -> tuple[list[int], list[Optional[dict[int, float]]]]:
        """Draw one token per row.

        Args:
            logits: [S, V] float32, row i belongs to seqs[i] (processed in place).
            seqs: the sequences that sample this step.
            bitmask: [S, ceil(V / 32)] int32 token bitmask (rows of constrained sequences are
                applied), or None.
        Returns:
            (token ids [S], per row a {token_id: logprob} dict or None).
        """
        rows = [SampleRow(s) for s in seqs]
        logprobs_all = self.process(logits, rows, bitmask)
        tokens = self.draw(logits, rows)
        tok_list = tokens.tolist()
        return tok_list, self.logprob_dicts(logprobs_all, rows, tok_list)

    def process(self, logits: torch.Tensor, rows: list[SampleRow], bitmask: Optional[torch.Tensor] = None
                ) -> Optional[torch.Tensor]:
        """Apply the vocab mask, the grammar bitmask, penalties and end-token suppression to
        logits [R, V] in place.

        Args:
            bitmask: [R, ceil(V / 32)] int32, or None; only rows whose sequence has a grammar
                are applied (the others may hold anything).
        Returns:
            log_softmax of the processed logits [R, V] if any row wants logprobs, else None.
        """
        R, V = logits.shape
        dev = logits.device
        if V > self.tokenizer_vocab_size:
            logits[:, self.tokenizer_vocab_size:] = float("-inf")
        constrained = [i for i, r in enumerate(rows) if r.seq.grammar is not None] if bitmask is not None else []
        if constrained:
            if len(constrained) == R:
                apply_token_bitmask_(logits, bitmask)
            else:
                ci = torch.tensor(constrained, device=dev)
                sub = logits[ci]
                apply_token_bitmask_(sub, bitmask[torch.tensor(constrained)])
                logits[ci] = sub
        for i, r in enumerate(rows):
            p = r.seq.request.params
            if p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty:
                self._apply_penalties(logits[i], r)
        sup_rows: list[int] = []
        sup_cols: list[int] = []
        for i, r in enumerate(rows):
            p = r.seq.request.params
            below_min = r.num_output_tokens < p.min_tokens
            if p.ignore_eos or below_min:
                ids = list(self.eos_token_ids)
                if below_min:
                    ids += list(p.stop_token_ids)
                sup_rows += [i] * len(ids)
                sup_cols += ids
        if sup_rows:
            logits[torch.tensor(sup_rows, device=dev), torch.tensor(sup_cols, device=dev)] = float("-inf")
        if constrained and self.eos_token_ids:
            # a finished grammar allows only EOS; with EOS suppressed (min_tokens, ignore_eos) no
            # token is left: let EOS through rather than sample from an empty distribution
            ci = torch.tensor(constrained, device=dev)
            dead = ci[torch.isneginf(logits[ci]).all(dim=1)]
            if dead.numel():
                logits[dead, self.eos_token_ids[0]] = 0.0
        if any(r.seq.request.params.logprobs is not None for r in rows):
            return torch.log_softmax(logits, dim=-1)
        return None

    def draw(self, logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
        """One token per processed row: argmax for greedy rows, a seeded draw for the others. [R] int64."""
        R = logits.shape[0]
        dev = logits.device
        greedy = [i for i, r in enumerate(rows) if r.seq.request.params.greedy]
        rand = [i for i, r in enumerate(rows) if not r.seq.request.params.greedy]
        tokens = torch.empty(R, dtype=torch.long, device=dev)
        if greedy:
            am = self.greedy_argmax(logits, greedy)
            if len(greedy) == R:
                tokens = am.to(dev)
            else:
                tokens[torch.tensor(greedy, device=dev)] = am.to(dev)
        if rand:
            ri = torch.tensor(rand, device=dev)
            probs = self.probs(logits[ri], [rows[i] for i in rand])
            tokens[ri] = self._inverse_cdf(probs, [rows[i].seq.generator for i in rand])
        return tokens

    @staticmethod
    def logprob_dicts(logprobs_all: Optional[torch.Tensor], rows: list[SampleRow],
                      tokens: list[int]) -> list[Optional[dict[int, float]]]:
        """Per row a {token_id: logprob} dict of the top-k plus the chosen token, or None."""
        lps: list[Optional[dict[int, float]]] = [None] * len(rows)
        if logprobs_all is None:
            return lps
        for i, r in enumerate(rows):
            k = r.seq.request.params.logprobs
            if k is None:
                continue
            row = logprobs_all[i]
            d: dict[int, float] = {}
            if k > 0:
                vals, idx = row.topk(k)
                d = dict(zip(idx.tolist(), vals.tolist()))
            d[tokens[i]] = float(row[tokens[i]])
            lps[i] = d
        return lps

    # ------------------------------------------------------------ speculative verification
    def verify(self, logits: torch.Tensor, drafts: list[tuple[Sequence, list[int]]],
               bitmask: Optional[torch.Tensor] = None
               ) -> list[tuple[list[int], list[Optional[dict[int, float]]], int]]:
        """Verify speculative drafts.

        Args:
            logits: [sum(len(d) + 1), V] float32: for each (seq, draft) in order, the rows of
                the positions of the sequence's last token and of each drafted token (row j
                predicts the token after draft[:j]). Processed in place.
            drafts: (sequence, drafted tokens) per chunk.
            bitmask: [sum(len(d) + 1), ceil(V / 32)] int32 or None: for a constrained sequence,
                row j holds the grammar's mask after draft[:j] (drafts are validated against the
                grammar before the forward pass, so every such state exists).
        Returns:
            per chunk (new tokens: the accepted drafts then one target token; their logprob
            dicts or None; the number of drafts accepted).
        """
        rows: list[SampleRow] = []
        for seq, d in drafts:
            rows += [SampleRow(seq, list(d[:j])) for j in range(len(d) + 1)]
        logprobs_all = self.process(logits, rows, bitmask)
        out = []
        r0 = 0
        greedy_idx = [i for i, r in enumerate(rows) if r.seq.request.params.greedy]
        argmax = {}
        if greedy_idx:
            argmax = dict(zip(greedy_idx, self.greedy_argmax(logits, greedy_idx).tolist()))
        rand_idx = [i for i, r in enumerate(rows) if not r.seq.request.params.greedy]
        probs = {}
        if rand_idx:
            ri = torch.tensor(rand_idx, device=logits.device)
            p = self.probs(logits[ri], [rows[i] for i in rand_idx])
            probs = {i: p[j] for j, i in enumerate(rand_idx)}
        for seq, d in drafts:
            n = len(d) + 1
            if seq.request.params.greedy:
                target = [argmax[r0 + j] for j in range(n)]
                a = 0
                while a < len(d) and d[a] == target[a]:
                    a += 1
                new = list(d[:a]) + [target[a]]
            else:
                new, a = self._rejection(d, [probs[r0 + j] for j in range(n)], seq.generator)
            lps = self.logprob_dicts(None if logprobs_all is None else logprobs_all[r0:r0 + len(new)],
                                     rows[r0:r0 + len(new)], new)
            out.append((new, lps, a))
            r0 += n
        return out

    def _rejection(self, draft: list[int], probs: list[torch.Tensor], gen) -> tuple[list[int], int]:
        """Speculative sampling for a deterministic draft, drawn as sample-and-compare.

        At each drafted position j the target token y_j is drawn from p_j with the
        sequence's next uniform (the same draw plain decoding makes at that position); the
        draft x_j is accepted when y_j == x_j, which happens with probability p_j(x_j), and
        on a mismatch y_j is kept, distributed as p_j with x_j removed and renormalised:
        exactly the acceptance rule and residual distribution of Leviathan et al. for a
        draft distribution that is a point mass. After a full accept the bonus token is
        drawn from the last row. One uniform is used per emitted token, in order, so a
        seeded sequence emits the same tokens with speculation on or off, whatever the
        draft lengths.
        """
        new: list[int] = []
        for j, x in enumerate(draft):
            y = int(self._inverse_cdf(probs[j][None], [gen])[0])
            new.append(y)
            if y != x:
                return new, j
        new.append(int(self._inverse_cdf(probs[len(draft)][None], [gen])[0]))
        return new, len(draft)

    # ------------------------------------------------------------ pieces
    @staticmethod
    def _apply_penalties(row: torch.Tensor, r: SampleRow) -> None:
        s = r.seq
        p = s.request.params
        dev = row.device
        V = row.shape[0]
        out_ids = s.output_token_ids + r.extra
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(s.token_ids) | set(r.extra)), device=dev, dtype=torch.long)
            seen = seen[seen < V]
            vals = row[seen]
            row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        if out_ids and (p.presence_penalty or p.frequency_penalty):
            counts = torch.bincount(torch.tensor(out_ids, device=dev), minlength=V)[:V].to(row.dtype)
            row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)

    @staticmethod
    def probs(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
        """The sampling distribution of processed rows [R, V]: temperature, top-k, top-p, min-p."""
        dev = logits.device
        # at least MIN_TEMPERATURE (vLLM's floor too): logits over 1e-39 overflow fp32 to inf, and the
        # softmax of those is NaN, which drew tokens at random where a near-zero temperature means
        # nearly greedy
        temps = torch.tensor([max(r.seq.request.params.temperature, MIN_TEMPERATURE) for r in rows], device=dev,
                             dtype=logits.dtype)
        logits = logits / temps[:, None]
        top_ks = [r.seq.request.params.top_k for r in rows]
        if any(k > 0 for k in top_ks):
            V = logits.shape[1]
            k = torch.tensor([k if k > 0 else V for k in top_ks], device=dev)
            sorted_desc = logits.sort(dim=-1, descending=True).values
            kth = sorted_desc.gather(1, (k - 1).clamp(max=V - 1)[:, None])
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        top_ps = [r.seq.request.params.top_p for r in rows]
        if any(p < 1.0 for p in top_ps):
            tp = torch.tensor(top_ps, device=dev, dtype=probs.dtype)
            sp, si = probs.sort(dim=-1, descending=True)
            cum = sp.cumsum(dim=-1)
            drop_sorted = (cum - sp) >= tp[:, None]  # keep the smallest prefix whose mass reaches top_p
            drop = torch.zeros_like(drop_sorted).scatter(1, si, drop_sorted)
            probs = probs.masked_fill(drop, 0.0)
        min_ps = [r.seq.request.params.min_p for r in rows]
        if any(m > 0 for m in min_ps):
            mp = torch.tensor(min_ps, device=dev, dtype=probs.dtype)
            thresh = probs.max(dim=-1, keepdim=True).values * mp[:, None]
            probs = probs.masked_fill(probs < thresh, 0.0)
        return probs

    @staticmethod
    def _inverse_cdf(probs: torch.Tensor, generators: list) -> torch.Tensor:
        """One token per row of (unnormalised) probs [R, V], a uniform from each row's generator."""
        dev = probs.device
        u = torch.stack([torch.rand((), generator=g, device=dev) for g in generators]).to(probs.dtype)
        cdf = probs.cumsum(dim=-1)
        total = cdf[:, -1:]
        # strictly below the total, so that the first index whose cdf exceeds it always exists
        target = torch.minimum(u[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))
        return torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=probs.shape[1] - 1)
