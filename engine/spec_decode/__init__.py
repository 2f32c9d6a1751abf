"""Speculative decoding: proposers draft tokens, the target model verifies them in its ordinary step.

- `ngram.NgramProposer`: prompt lookup within the sequence.
- `suffix.SuffixProposer`: a job-wide, bounded suffix index of earlier sequences.
- `draft_model.DraftModelProposer`: a smaller model (or the target's first layers).
- `policy`: the step-cost model and the goodput choice of draft lengths.
- `decoder.SpecDecoder`: ties them to the scheduler and the engine.

Verification is `engine.sampler.Sampler.verify` (exact: greedy output equals speculation
off; sampled output keeps the target distribution).
"""
from .base import Proposer
from .decoder import SpecDecoder, SpecStats
from .draft_model import DraftModelProposer
from .ngram import NgramProposer
from .suffix import SuffixIndex, SuffixProposer

__all__ = ["DraftModelProposer", "NgramProposer", "Proposer", "SpecDecoder", "SpecStats", "SuffixIndex",
           "SuffixProposer"]
