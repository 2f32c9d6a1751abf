"""The proposer interface of speculative decoding."""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Sequence as Seq

from ..request import Sequence


class Proposer(ABC):
    """Proposes draft tokens that the target model then verifies in one pass.

    A proposer is deterministic (its drafts depend on the tokens only), so verification
    accepts a draft token x with probability p(x) (`engine.sampler.Sampler.verify`).

    Attributes:
        name: "ngram", "suffix" or "draft_model" (metrics and per-proposer acceptance).
        cheap: True when `propose` takes microseconds, so the policy may ask for drafts
            before deciding how many to run; False (a draft model) means the policy decides
            the lengths first and `propose` runs once for the chosen sequences.
    """

    name = "proposer"
    cheap = True

    @abstractmethod
    def propose(self, seqs: Seq[Sequence], ks: Seq[int]) -> list[list[int]]:
        """Up to ks[i] draft tokens to follow seqs[i]'s tokens (possibly none)."""

    def on_verified(self, seq: Sequence, drafted: int, accepted: int) -> None:
        """A draft of `drafted` tokens for seq was verified and `accepted` of them kept."""

    def on_finished(self, seq: Sequence) -> None:
        """seq finished (its tokens are final)."""

    def on_preempted(self, seq: Sequence) -> None:
        """seq lost its KV blocks (it will be recomputed)."""

    def step(self) -> None:
        """Called once per engine step: a bounded slice of background work."""
