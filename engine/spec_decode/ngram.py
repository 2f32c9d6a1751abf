"""Prompt lookup: drafts copied from where the sequence's last n tokens occurred before.

For n from `max_n` down to `min_n`, if the sequence's last n tokens (prompt and output)
occurred earlier in it, the tokens that followed their most recent earlier occurrence are
the draft (vLLM's "ngram" method; prompt lookup decoding, Saxena 2023). Each sequence
keeps, per n, a map from every n-gram it holds to the position after its latest
occurrence, extended as tokens arrive, so a proposal is a few dictionary lookups.
"""
from __future__ import annotations

from typing import Sequence as Seq

from ..request import Sequence
from .base import Proposer


class NgramProposer(Proposer):
    """Args:
        min_n, max_n: n-gram lengths tried, longest first (1 <= min_n <= max_n).
    Raises:
        ValueError: for bad lengths.
    """

    name = "ngram"
    cheap = True

    def __init__(self, min_n: int = 2, max_n: int = 5) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"prompt_lookup_min ({min_n}) and prompt_lookup_max ({max_n}) need 1 <= min <= max")
        self.min_n, self.max_n = min_n, max_n
        self._index: dict[int, tuple[int, list[dict]]] = {}  # seq_id -> (positions indexed, maps per n)

    def _maps(self, seq: Sequence) -> list[dict]:
        toks = seq.token_ids
        done, maps = self._index.get(seq.seq_id, (0, None))
        if maps is None:
            maps = [dict() for _ in range(self.max_n - self.min_n + 1)]
        # index n-grams ending at positions < len - 1 (the last token's own n-gram is the query)
        for i in range(done, len(toks) - 1):
            for j, n in enumerate(range(self.min_n, self.max_n + 1)):
                if i - n + 1 >= 0:
                    maps[j][tuple(toks[i - n + 1: i + 1])] = i + 1
        self._index[seq.seq_id] = (max(done, len(toks) - 1), maps)
        return maps

    def propose(self, seqs: Seq[Sequence], ks: Seq[int]) -> list[list[int]]:
        out = []
        for seq, k in zip(seqs, ks):
            toks = seq.token_ids
            draft: list[int] = []
            if k > 0 and len(toks) > self.min_n:
                maps = self._maps(seq)
                for j in range(self.max_n - self.min_n, -1, -1):
                    n = self.min_n + j
                    if len(toks) < n + 1:
                        continue
                    pos = maps[j].get(tuple(toks[-n:]))
                    if pos is not None:
                        draft = list(toks[pos: pos + k])
                        break
            out.append(draft)
        return out

    def on_finished(self, seq: Sequence) -> None:
        self._index.pop(seq.seq_id, None)
