"""Output processing (as vLLM v1's OutputProcessor): a finished `Request` as the `RequestOutput`
`LLM.generate` returns, with each completion's validity under its grammar, its cumulative logprob,
and error outputs for refused requests and grammars that failed.
"""
from __future__ import annotations

import time
from typing import Any, Optional

from .config import MAX_N
from .outputs import CompletionOutput, RequestOutput
from .request import Request, Sequence


def grammar_error(seq: Sequence) -> Optional[str]:
    """For a constrained sequence whose matcher ended in error, the error naming the constraint's kind
    (`structured_outputs.regex: lexer error: too many expressions constructed`); else None. The engine
    ends such a sequence at the token that failed (`EngineCore._finishgrammar_error`): its text is the
    part the grammar accepted, and its completion is an error, never a "stop" or "length" that reads
    as complete."""
    g = seq.grammar
    if g is None or not g.is_error():
        return None
    return f"structured_outputs.{seq.request.params.structured_outputs.kind}: {g.error_message()}"


def cumulative_logprob(seq: Sequence) -> Optional[float]:
    """Sum of the sampled tokens' logprobs (natural log) when logprobs were asked for, else None
    (vLLM's `cumulative_logprob`); tokens a grammar forced (no logprob entry) add nothing."""
    if seq.logprobs is None:
        return None
    return float(sum(lp[tok] for tok, lp in zip(seq.output_token_ids, seq.logprobs) if lp is not None and tok in lp))


def error_outputs(params: Any) -> int:
    """How many error completions a refused request gets: its n when that is a valid count (one
    per completion asked for), else 1 (an n of 10**9 is refused, not answered a billion times)."""
    n = getattr(params, "n", 1)
    return n if isinstance(n, int) and not isinstance(n, bool) and 1 <= n <= MAX_N else 1


def is_valid(seq: Sequence, tokenizer: Any) -> Optional[bool]:
    """For a constrained sequence (None for others): finished with "stop" and its grammar accepts
    the output text. A row cut by a stop string is valid only when the cut falls on a token
    boundary where the grammar was complete (`{"a":1` cut from `{"a":1}` by the stop string "}" is
    not); the matcher is left where it was."""
    g = seq.grammar
    if g is None:
        return None
    if seq.finish_reason != "stop" or g.is_error():
        return False
    if not isinstance(seq.stop_reason, str):
        return g.is_accepting()
    out = seq.output_token_ids
    skip = seq.request.params.skip_special_tokens
    k = len(out)
    while k >= 0:  # the longest output prefix whose text is the cut text (the cut is near the end)
        text = tokenizer.decode(out[:k], skip_special_tokens=skip)
        if text == seq.text:
            break
        if len(text) < len(seq.text):
            return False
        k -= 1
    if k < 0:
        return False
    try:
        g.rollback(len(out) - k)
    except Exception:  # noqa: BLE001 - a backend that cannot roll back that far: not provably valid
        return False
    ok = g.is_accepting()
    for tok in out[k:]:
        g.accept_token(tok)
    return ok


class OutputProcessor:
    """Builds `RequestOutput`s of finished requests.

    Args:
        tokenizer: the engine's `Tokenizer` (a stop-string cut's validity re-decodes the output).
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def make_output(self, req: Request) -> RequestOutput:
        """The RequestOutput of a finished (or refused, or scored) request."""
        m = req.metrics
        if req.error is None and req.scores is not None:
            label = max(req.scores, key=lambda c: req.scores[c])  # the first of equal maxima
            outs = [CompletionOutput(index=0, text=label, token_ids=[], finish_reason="stop", valid=True,
                                     label_logprobs=dict(req.scores))]
            return RequestOutput(request_id=req.request_id, prompt=req.prompt, prompt_token_ids=req.prompt_token_ids,
                                 outputs=outs, finished=True, num_cached_tokens=0, metrics=m,
                                 prompt_logprobs=req.prompt_logprobs)
        if req.error is not None:
            if m.finish_time is None:
                m.finish_time = time.time()
            outs = [CompletionOutput(index=j, text="", token_ids=[], finish_reason="error", error=req.error)
                    for j in range(error_outputs(req.params))]
        else:
            outs = [CompletionOutput(index=s.index, text=s.text, token_ids=s.output_token_ids,
                                     finish_reason=s.finish_reason, logprobs=s.logprobs, stop_reason=s.stop_reason,
                                     valid=is_valid(s, self.tokenizer), num_forced_tokens=s.num_forced_tokens,
                                     cumulative_logprob=cumulative_logprob(s))
                    if (problem := grammar_error(s)) is None else
                    CompletionOutput(index=s.index, text=s.text, token_ids=s.output_token_ids, finish_reason="error",
                                     logprobs=s.logprobs, error=problem, valid=False,
                                     num_forced_tokens=s.num_forced_tokens, cumulative_logprob=cumulative_logprob(s))
                    for s in req.seqs]
        m.output_tokens = sum(len(o.token_ids) for o in outs)
        cached = req.seqs[0].num_cached_tokens if req.seqs else 0
        error = req.error
        if error is None and outs and all(o.finish_reason == "error" for o in outs):
            error = outs[0].error  # every completion failed (a grammar the backend gave up on)
        return RequestOutput(request_id=req.request_id, prompt=req.prompt, prompt_token_ids=req.prompt_token_ids,
                             outputs=outs, finished=True, num_cached_tokens=cached, metrics=m, error=error,
                             prompt_logprobs=req.prompt_logprobs if error is None else None)
