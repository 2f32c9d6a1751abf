"""A deterministic stand-in for `engine.LLM`, for fast tests of the job logic (no model, no torch).

It follows the engine's contract: `tokenizer` (encode, decode,
apply_chat_template, has_chat_template), `max_model_len`, `device_name`, and
`iter_outputs(prompts, sampling_params, use_tqdm)` yielding RequestOutputs
whose `request_id` is the prompt's index, in an order different from the
input (as a real engine finishes them). A bad request comes back with
finish_reason="error", never as an exception.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Iterator, Optional, Sequence

from engine.config import SamplingParams, prompt_length_error, prompt_text_error
from engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from engine.tokenizer import incomplete_utf8_tail


class FakeTokenizer:
    """One token per UTF-8 byte (+3); ChatML-style template."""

    has_chat_template = True
    eos_token_ids = [2]
    vocab_size = 259

    def encode(self, text: str) -> list[int]:
        return [b + 3 for b in text.encode()]

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(i - 3 for i in ids if i >= 3).decode(errors="replace")

    def decode_complete(self, ids: Sequence[int]) -> str:
        """`decode` without a last character whose bytes are not all in `ids` (a generation cut by
        `max_tokens` inside a multi-byte character), as `engine.tokenizer.Tokenizer.decode_complete`:
        the engine's texts never end in a U+FFFD that no model wrote."""
        data = bytes(i - 3 for i in ids if i >= 3)
        return data[:len(data) - incomplete_utf8_tail(data)].decode(errors="replace")

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        for m in messages:
            if not isinstance(m, dict) or "role" not in m or not isinstance(m.get("content"), str):
                raise ValueError(f"malformed message {m!r}")
        text = "".join(f"<|{m['role']}|>{m['content']}\n" for m in messages)
        return text + ("<|assistant|>" if add_generation_prompt else "")


class FakeLLM:
    """Generates `max_tokens` tokens spelling the last word of the prompt, repeated (the text of a
    completion cut inside a multi-byte character ends before it, as the engine's does).

    Args:
        delay_s: seconds of sleep before each output (a slow engine, for interrupt and kill tests).
        on_output: called with the number of outputs yielded so far, before each one is yielded
            (tests block or raise in it).
    """

    def __init__(self, max_model_len: int = 512, device_name: str = "fake", delay_s: float = 0.0,
                 on_output: Optional[Callable[[int], None]] = None) -> None:
        self.tokenizer = FakeTokenizer()
        self.max_model_len = max_model_len
        self.device_name = device_name
        self.delay_s = delay_s
        self.on_output = on_output
        self.calls = 0
        self.prompts_seen = 0
        self.outputs = 0

    def _one(self, i: int, prompt, params: SamplingParams) -> RequestOutput:
        now = time.time()
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        problem = prompt_text_error(prompt) if isinstance(prompt, str) else None
        if problem is None and not ids:
            problem = "prompt is empty"
        problem = problem or params.validate(self.tokenizer.vocab_size)
        if problem is None:
            problem = prompt_length_error(len(ids), self.max_model_len)
        if problem is not None:
            comps = [CompletionOutput(0, "", [], "error", error=problem)]
            return RequestOutput(str(i), None, ids, comps, metrics=RequestMetrics(now), error=problem)
        word = (self.tokenizer.decode(ids).replace("<|assistant|>", "").split() or ["x"])[-1][:8]
        comps = []
        for k in range(params.n):
            out = self.tokenizer.encode((f"{word}{k} " * 64))[: params.max_tokens]
            comps.append(CompletionOutput(k, self.tokenizer.decode_complete(out), out, "length"))
        m = RequestMetrics(now, now, now + 0.001, now + 0.002, len(ids), sum(len(c.token_ids) for c in comps))
        return RequestOutput(str(i), None, ids, comps, num_cached_tokens=0, metrics=m)

    def iter_outputs(self, prompts, sampling_params=None, use_tqdm: bool = True) -> Iterator[RequestOutput]:
        self.calls += 1
        self.prompts_seen += len(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        order = list(range(len(prompts)))
        order = order[1::2] + order[0::2]  # finish out of order
        for i in order:
            if self.delay_s:
                time.sleep(self.delay_s)
            if self.on_output is not None:
                self.on_output(self.outputs)
            self.outputs += 1
            yield self._one(i, prompts[i], sampling_params[i])

    def generate(self, prompts, sampling_params=None, use_tqdm: bool = True) -> list[RequestOutput]:
        outs = list(self.iter_outputs(prompts, sampling_params, use_tqdm))
        return sorted(outs, key=lambda o: int(o.request_id))


def run_job_in_child(spec_fields: dict[str, Any], delay_s: float = 0.0) -> None:
    """Run `pipeline.run_job` on a FakeLLM (for tests that kill a real process at a random point)."""
    from pipeline import JobSpec, run_job

    run_job(JobSpec(**spec_fields), FakeLLM(delay_s=delay_s))
