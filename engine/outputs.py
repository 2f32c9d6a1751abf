"""What `LLM.generate` returns: RequestOutput, CompletionOutput, RequestMetrics (vLLM's shapes)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass
class CompletionOutput:
    """One completion of a request.

    Attributes:
        index: 0..n-1 within the request.
        text: generated text, cut before any matched stop string.
        token_ids: generated token ids (the stop string's tokens are kept, as vLLM does).
        finish_reason: "stop" (EOS, stop token or stop string), "length"
            (max_tokens or max_model_len reached) or "error".
        logprobs: per generated token, a dict {token_id: logprob} of the top-k
            (plus the sampled token), when SamplingParams.logprobs is set.
        stop_reason: the stop string or stop token id that ended it, if any.
        error: message naming the bad parameter when finish_reason == "error".
        valid: for a constrained completion (`SamplingParams.structured_outputs`): True when
            it finished with "stop" and its grammar accepts the whole output; None when
            unconstrained. A completion cut by max_tokens is never valid.
        num_forced_tokens: tokens the grammar forced (jump-forward), included in token_ids.
        label_logprobs: for scoring (`SamplingParams.score_choices`): each choice's
            log-probability (natural log, the sum over its tokens) given the prompt; `text`
            is then the most likely choice.
        cumulative_logprob: when SamplingParams.logprobs is set, the sum of the generated
            tokens' logprobs (natural log; tokens a grammar forced add nothing), else None.
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: Optional[str]
    logprobs: Optional[list[dict[int, float]]] = None
    stop_reason: Optional[object] = None
    error: Optional[str] = None
    valid: Optional[bool] = None
    num_forced_tokens: int = 0
    label_logprobs: Optional[dict[str, float]] = None
    cumulative_logprob: Optional[float] = None


@dataclass
class RequestMetrics:
    """Timings (seconds, `time.time()` clock) and token counts of one request.

    `first_token_time - arrival_time` is the TTFT; `(finish_time -
    first_token_time) / max(output_tokens - 1, 1)` is the TPOT. `spec_draft_tokens`
    and `spec_accepted_tokens` count speculative tokens drafted for the request and
    accepted by verification (all its completions).
    """

    arrival_time: float
    scheduled_time: Optional[float] = None
    first_token_time: Optional[float] = None
    finish_time: Optional[float] = None
    prompt_tokens: int = 0
    output_tokens: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0

    @property
    def ttft(self) -> Optional[float]:
        """Time to first token in seconds, or None if none was produced."""
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def latency(self) -> Optional[float]:
        """Arrival to finish in seconds."""
        if self.finish_time is None:
            return None
        return self.finish_time - self.arrival_time


@dataclass
class RequestOutput:
    """The result of one prompt.

    Attributes:
        request_id: the engine's id (str of the prompt's index in the call).
        prompt: the prompt text (None if token ids were given).
        prompt_token_ids: the tokenized prompt.
        outputs: n CompletionOutputs, ordered by index.
        finished: True once all completions finished.
        num_cached_tokens: prompt tokens served from the prefix cache.
        metrics: timings and token counts.
        error: request-level error (also copied into each completion), else None.
        prompt_logprobs: with `SamplingParams.prompt_logprobs` = k, per prompt token a dict
            {token_id: logprob} of the prompt's own token and the k most likely ones (natural
            log of the model's raw distribution given the tokens before it); None for the first
            token, which nothing predicts (vLLM's layout). None when not asked for.
    """

    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True
    num_cached_tokens: int = 0
    metrics: Optional[RequestMetrics] = None
    error: Optional[str] = None
    prompt_logprobs: Optional[list[Optional[dict[int, float]]]] = None
