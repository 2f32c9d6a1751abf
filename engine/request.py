"""Request and sequence state inside the engine.

A `Request` is one prompt with its SamplingParams; it owns `n` `Sequence`s
(one per completion). Derived lengths are properties, never counters kept in
sync by hand.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Optional

import torch

from .config import SamplingParams
from .outputs import RequestMetrics


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """One completion being generated.

    Attributes:
        seq_id: engine-unique id (admission order; larger is younger).
        request: the owning Request.
        index: completion index within the request (0..n-1).
        token_ids: prompt followed by generated tokens.
        num_computed_tokens: tokens whose K/V are in the cache.
        block_table: KV pool block ids of the main layer group, in order (`engine.kv_cache.KVLayout`);
            `NULL_BLOCK` (-1) for a block given back behind the window when every layer slides.
        window_table: pool block ids of the sliding-window group of a model that mixes full and
            sliding-window layers (else empty), `NULL_BLOCK` for blocks given back behind the window.
        generator: the sampling RNG of this completion (seeded per request).
        grammar: the `engine.structured.GrammarMatcher` of a constrained completion (advanced
            on every appended token), else None.
    """

    seq_id: int
    request: "Request"
    index: int
    token_ids: list[int]
    generator: Optional[torch.Generator] = None
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    window_table: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: Optional[str] = None
    stop_reason: Optional[object] = None
    text: str = ""
    logprobs: Optional[list[dict[int, float]]] = None
    detokenizer: Optional[object] = None
    num_cached_tokens: int = 0
    stop_matcher: Optional[object] = None
    # (hash, key) of each full block of token_ids, in order, and how many are indexed (prefix caching)
    block_keys: list[tuple] = field(default_factory=list)
    num_registered_blocks: int = 0
    was_admitted: bool = False
    pending_range: tuple[int, int] = (0, 0)
    num_wanted_blocks: int = 0  # leading block_keys marked wanted in the pool while waiting
    grammar: Optional[object] = None
    num_forced_tokens: int = 0  # tokens appended by jump-forward (the grammar forced them)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.request.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens still to run through the model before the next sample (1 when decoding)."""
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_prefill(self) -> bool:
        return self.num_uncomputed_tokens > 1

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED


@dataclass(eq=False)
class Request:
    """One prompt: its token ids, sampling parameters and completions.

    Attributes:
        request_id: str of the prompt's index in the call.
        index: position in the caller's list.
        prompt: prompt text, or None when token ids were given.
        prompt_token_ids: the tokenized prompt.
        params: sampling parameters.
        seqs: the n completions.
        error: a message naming the bad parameter, for requests refused at admission.
        metrics: timings and counts.
        scores: for a scoring request (`SamplingParams.score_choices`), each choice's
            log-probability once scored, else None.
        prompt_logprobs: with `SamplingParams.prompt_logprobs`, per prompt token a dict
            {token_id: logprob} (None for the first token), once computed, else None.
    """

    request_id: str
    index: int
    prompt: Optional[str]
    prompt_token_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    seqs: list[Sequence] = field(default_factory=list)
    error: Optional[str] = None
    scores: Optional[dict[str, float]] = None
    prompt_logprobs: Optional[list[Optional[dict[int, float]]]] = None

    @property
    def is_finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)
