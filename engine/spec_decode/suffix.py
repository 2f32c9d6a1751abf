"""Job-wide suffix matching: drafts from the outputs (and prompts) of requests already served.

A labelling or synthetic job repeats output skeletons across rows ("Topic: ...", JSON
keys, list markers). Suffix Decoding (Oliaro et al. 2024, arXiv 2411.04975) drafts from
a suffix tree over earlier generations, following the most frequent continuation of the
longest matching suffix of the current sequence. Here the tree is kept as a bounded-depth
table: for every context of 1..`max_depth` tokens in the indexed texts, the counts of the
tokens that followed it (contexts keyed by their hash; a collision can only produce a
draft that verification rejects). Drafting looks up the longest context that the
sequence's last tokens match and follows the most frequent next token, re-matching after
each drafted token: a handful of dictionary lookups per token, so a step never waits on it.

Memory is bounded: at most `max_tokens` indexed tokens, evicting the oldest texts first.
Finished texts are indexed a slice per engine step (`step`), never in one long pause.
"""
from __future__ import annotations

from collections import deque
from typing import Optional, Sequence as Seq

from ..request import Sequence
from .base import Proposer


class SuffixIndex:
    """Counts of next tokens after every context of 1..max_depth tokens of the indexed texts.

    Args:
        max_tokens: most tokens held (oldest texts evicted first).
        max_depth: longest context, in tokens.
    """

    def __init__(self, max_tokens: int = 32768, max_depth: int = 6) -> None:
        if max_tokens < 1 or max_depth < 1:
            raise ValueError(f"suffix_max_tokens ({max_tokens}) and suffix_max_depth ({max_depth}) must be >= 1")
        self.max_tokens, self.max_depth = max_tokens, max_depth
        self.table: dict[int, dict[int, int]] = {}
        self.texts: deque[tuple[list[int], int]] = deque()  # (tokens, positions indexed)
        self.num_tokens = 0
        self._todo: deque[int] = deque()  # indices (from the left of `texts`, offset) still being indexed
        self._evicted = 0

    def add(self, tokens: Seq[int]) -> None:
        """Queue a text for indexing (done by `work`)."""
        if len(tokens) < 2:
            return
        self.texts.append((list(tokens), 0))
        self._todo.append(self._evicted + len(self.texts) - 1)
        self.num_tokens += len(tokens)
        while self.num_tokens > self.max_tokens and len(self.texts) > 1:
            self._evict()

    def _keys(self, toks: list[int], i: int):
        """(hash of the context ending before position i, depth) for depths 1..max_depth."""
        for d in range(1, min(self.max_depth, i) + 1):
            yield hash(tuple(toks[i - d: i]))

    def _evict(self) -> None:
        toks, done = self.texts.popleft()
        self._evicted += 1
        self.num_tokens -= len(toks)
        for i in range(1, done):
            nxt = toks[i]
            for key in self._keys(toks, i):
                c = self.table.get(key)
                if c is None:
                    continue
                n = c.get(nxt, 0) - 1
                if n > 0:
                    c[nxt] = n
                else:
                    c.pop(nxt, None)
                    if not c:
                        del self.table[key]
        while self._todo and self._todo[0] < self._evicted:
            self._todo.popleft()

    def work(self, budget: int = 4096) -> None:
        """Index up to `budget` more positions of queued texts."""
        while budget > 0 and self._todo:
            idx = self._todo[0] - self._evicted
            toks, done = self.texts[idx]
            start = max(done, 1)
            stop = min(len(toks), start + budget)
            for i in range(start, stop):
                nxt = toks[i]
                for key in self._keys(toks, i):
                    c = self.table.get(key)
                    if c is None:
                        self.table[key] = {nxt: 1}
                    else:
                        c[nxt] = c.get(nxt, 0) + 1
            budget -= stop - start
            self.texts[idx] = (toks, stop)
            if stop >= len(toks):
                self._todo.popleft()

    def propose(self, context: Seq[int], k: int, min_depth: int = 2, min_prob: float = 0.3) -> list[int]:
        """Up to k tokens following the longest indexed suffix of `context`.

        Each drafted token is the most frequent continuation of the longest indexed context
        (at least `min_depth` tokens) that the sequence ends with; drafting stops when the
        product of the drafted tokens' empirical probabilities (count / (all counts of their
        context + 1), so a context seen once gives 0.5) falls under `min_prob`, the score Suffix Decoding uses to bound a draft,
        so a short, ambiguous match drafts nothing."""
        ctx = list(context[-self.max_depth:])
        out: list[int] = []
        score = 1.0
        while len(out) < k:
            counts: Optional[dict[int, int]] = None
            for d in range(min(self.max_depth, len(ctx)), min_depth - 1, -1):
                counts = self.table.get(hash(tuple(ctx[-d:])))
                if counts:
                    break
            if not counts:
                break
            nxt = max(counts, key=counts.get)
            score *= counts[nxt] / (sum(counts.values()) + 1)  # one unseen continuation: a single
            # occurrence is not a certainty
            if score < min_prob:
                break
            out.append(nxt)
            ctx = (ctx + [nxt])[-self.max_depth:]
        return out


class SuffixProposer(Proposer):
    """Drafts from a job-wide `SuffixIndex` of every finished sequence (prompt and output).

    Args:
        max_tokens, max_depth: the index's bounds (see `SuffixIndex`).
    """

    name = "suffix"
    cheap = True

    def __init__(self, max_tokens: int = 32768, max_depth: int = 6) -> None:
        self.index = SuffixIndex(max_tokens, max_depth)

    def propose(self, seqs: Seq[Sequence], ks: Seq[int]) -> list[list[int]]:
        return [self.index.propose(s.token_ids, k) if k > 0 else [] for s, k in zip(seqs, ks)]

    def on_finished(self, seq: Sequence) -> None:
        self.index.add(seq.token_ids)

    def step(self) -> None:
        self.index.work()
