"""Input processing (as vLLM v1's InputProcessor): prompts and sampling parameters in the forms
`LLM.generate` takes, checked and tokenized into `Request`s.

A bad prompt or parameter never raises here: it gives a Request whose `error` names it, in the
words a job's error row uses; only arguments of a type no prompt list or parameter list takes
raise (`prompt_list`, `params_list`).
"""
from __future__ import annotations

import reprlib
import time
import warnings
from collections.abc import Mapping
from typing import Any, Optional, Sequence as Seq, Union

import torch

from .config import SamplingParams, prompt_length_error, prompt_text_error, prompt_type_error
from .outputs import RequestMetrics
from .request import Request, Sequence
from .tokenizer import IncrementalDetokenizer, StopStringMatcher

PromptType = Union[str, list[int], Mapping]


def max_tokens_past_context_warning(num_prompt_tokens: int, max_tokens: Optional[int],
                                    max_model_len: int) -> Optional[str]:
    """The warning `LLM.generate` gives (once per LLM) for a `max_tokens` past the room the context
    leaves after the prompt, or None when it fits (or is None: up to the context).

    Such a request runs, as in vLLM, and stops at the end of the context with finish_reason
    "length"; a job refuses such a row instead (`pipeline.schema.length_rule`) unless `--truncate`.
    """
    room = max_model_len - num_prompt_tokens
    if max_tokens is None or max_tokens <= room:
        return None
    tokens = "token" if num_prompt_tokens == 1 else "tokens"
    return (f"max_tokens={max_tokens} is more than the context leaves after the prompt ({num_prompt_tokens} "
            f"{tokens} of max_model_len={max_model_len}, room for {room}): such requests stop at the end of the "
            f"context with finish_reason 'length' (said once per LLM)")


class BadPrompt:
    """A prompt already known to be invalid (e.g. malformed chat messages)."""

    def __init__(self, message: str) -> None:
        self.message = message


def mix_seed(base: int, index: int) -> int:
    """Deterministic 63-bit seed of completion `index` of a request seeded with `base`."""
    x = (base * 6364136223846793005 + (index + 1) * 1442695040888963407) & ((1 << 64) - 1)
    x ^= x >> 29
    return x & ((1 << 63) - 1)


def prompt_list(prompts) -> list:
    """prompts as a list: a single string is one prompt (iterating it would give one prompt per
    character), and so is a single prompt dict and a flat, non-empty list (or tuple) of ints, one
    tokenized prompt, as vLLM reads it (`generate([1, 2, 3])` is `generate([[1, 2, 3]])`, not three
    int prompts); anything else is taken as a sequence of prompts (each a string, a list of token
    ids or a prompt dict; a bad one becomes an error output, never an exception).

    Raises:
        TypeError: prompts is None, bytes or not iterable (the message says what is accepted).
    """
    if isinstance(prompts, (str, Mapping)):
        return [prompts]
    if isinstance(prompts, (list, tuple)) and prompts and all(is_token_id(t) for t in prompts):
        return [list(prompts)]
    try:
        if prompts is None or isinstance(prompts, (bytes, bytearray)):
            raise TypeError
        return list(prompts)
    except TypeError:
        raise TypeError(f"prompts must be a string or a sequence of prompts (strings, lists of token ids or "
                        f"prompt dicts), got "
                        f"{type(prompts).__name__} {reprlib.repr(prompts)}") from None


PROMPT_DICT_KEYS = ("prompt", "prompt_token_ids")


def from_prompt_dict(prompt: Mapping) -> tuple[Any, Optional[str]]:
    """A vLLM-style prompt dict as (what make_requests reads, the text for RequestOutput.prompt).

    `{"prompt": text}` (vLLM's TextPrompt) is the text; `{"prompt_token_ids": ids}` (TokensPrompt)
    is the token ids, and takes precedence when both keys are given, as in vLLM (its "prompt" is
    then only reported back). Any other key (multi-modal data, ...) is refused, as a BadPrompt
    naming it, and so is a dict with neither key.
    """
    extra = sorted(str(k) for k in prompt if k not in PROMPT_DICT_KEYS)
    if extra:
        return BadPrompt(f"prompt: unsupported key(s) {extra}; a prompt dict takes 'prompt' (text) or "
                          f"'prompt_token_ids'"), None
    if "prompt_token_ids" in prompt:
        ids, text = prompt["prompt_token_ids"], prompt.get("prompt")
        if not isinstance(ids, (list, tuple)) or not all(is_token_id(t) for t in ids):
            return BadPrompt(f"prompt_token_ids: must be a list of token ids (ints), got {reprlib.repr(ids)}"), None
        return list(ids), text if isinstance(text, str) else None
    if "prompt" in prompt:
        return prompt["prompt"], None
    return BadPrompt("prompt: a prompt dict needs 'prompt' (text) or 'prompt_token_ids', got an empty dict"), None


def is_token_id(value: Any) -> bool:
    """An int that is not a bool (a token id's type; its range is checked per request)."""
    return isinstance(value, int) and not isinstance(value, bool)


def params_list(sampling_params, n: int) -> list:
    """One sampling_params entry per prompt: None is SamplingParams() for all, one SamplingParams is
    shared, a sequence gives one per prompt (as in vLLM). A bad entry of the sequence is left for
    `InputProcessor.make_requests` to turn into an error output.

    Raises:
        TypeError: sampling_params is none of these (a dict, a string, a number).
        ValueError: a sequence whose length differs from the prompts'.
    """
    if sampling_params is None:
        sampling_params = SamplingParams()
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * n
    try:
        if isinstance(sampling_params, (str, bytes, bytearray, Mapping)):
            raise TypeError
        params_list = list(sampling_params)
    except TypeError:
        hint = "; build one with SamplingParams(**...)" if isinstance(sampling_params, Mapping) else ""
        raise TypeError(f"sampling_params must be a SamplingParams or a sequence of them, one per prompt (None: "
                        f"the defaults), got {type(sampling_params).__name__} {reprlib.repr(sampling_params)}"
                        f"{hint}") from None
    if len(params_list) != n:
        raise ValueError(f"sampling_params has {len(params_list)} entries but there are {n} prompts")
    return params_list



class InputProcessor:
    """Turns prompts and sampling parameters into seeded `Request`s for `EngineCore.add_requests`.

    Args:
        tokenizer: the engine's `Tokenizer`.
        structured: the engine's `StructuredOutputManager` (compiles `structured_outputs`).
        max_model_len: the engine's context length in tokens.
        context_bound: what sets it, in words (`engine.loader.context_bound`), for the error of a too-long prompt.
        seed: the engine's seed (requests without one draw from it, in arrival order).
        device: where the per-completion generators live.
    """

    def __init__(self, tokenizer: Any, structured: Any, max_model_len: int, seed: int, device: torch.device,
                 context_bound: Optional[str] = None) -> None:
        self.tokenizer = tokenizer
        self.structured = structured
        self.max_model_len = max_model_len
        self.context_bound = context_bound
        self.seed = seed
        self.device = device
        self.seq_counter = 0
        self.request_counter = 0
        self.warned_max_tokens = False  # `max_tokens_past_context_warning` is given once per engine

    def chat_prompts(self, conversations: Any, add_generation_prompt: bool = True) -> list:
        """The prompt text of each conversation ({role, content} dicts) under the chat template, or a
        `BadPrompt` naming what is wrong with it (`engine.tokenizer.validate_messages`'s words: the
        message's index, the field and the bad value); a single conversation is a list of one.

        Raises:
            TypeError: conversations is not a list of conversations or one conversation (None, a
                string, a single message dict, a number).
        """
        if isinstance(conversations, Mapping):
            raise TypeError(f"conversations must be a list of conversations or one conversation (a list of "
                            f"{{role, content}} dicts), got one message dict {reprlib.repr(conversations)}: wrap "
                            f"it in a list")
        if conversations is None or isinstance(conversations, (str, bytes, bytearray)) or not isinstance(
                conversations, (list, tuple, Seq)):
            raise TypeError(f"conversations must be a list of conversations or one conversation (a list of "
                            f"{{role, content}} dicts), got {type(conversations).__name__} "
                            f"{reprlib.repr(conversations)}")
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]  # a single conversation
        prompts: list = []
        for conv in conversations:
            try:
                prompts.append(self.tokenizer.apply_chat_template(conv, add_generation_prompt=add_generation_prompt))
            except ValueError as e:  # validate_messages: already says which message and what is wrong
                prompts.append(BadPrompt(str(e)))
            except Exception as e:  # noqa: BLE001 - one bad conversation never fails the batch
                prompts.append(BadPrompt(f"messages: {type(e).__name__}: {e}"))
        return prompts

    def make_requests(self, prompts: list, params_list: list[SamplingParams]) -> list[Request]:
        """Validate and tokenize prompts into Requests for `core.add_requests` (the one place the
        prompt and parameter rules are checked).

        A bad prompt or parameter gives a Request whose `error` names it (never raises); each
        valid one gets its n Sequences, seeded (a request without a seed draws from the engine's).
        """
        vocab = self.tokenizer.vocab_size
        shown: dict[int, str] = {}  # a TokensPrompt's own "prompt" text, reported back as RequestOutput.prompt
        prompts = list(prompts)
        for i, p in enumerate(prompts):
            if isinstance(p, Mapping):
                prompts[i], text = from_prompt_dict(p)
                if text is not None:
                    shown[i] = text
        texts = [(i, p) for i, p in enumerate(prompts) if isinstance(p, str) and prompt_text_error(p) is None]
        encoded = dict(zip((i for i, _ in texts), self.tokenizer.encode_batch([p for _, p in texts]))) if texts else {}
        now = time.time()
        reqs: list[Request] = []
        for i, (prompt, params) in enumerate(zip(prompts, params_list)):
            error = None
            text: Optional[str] = None
            ids: list[int] = []
            if isinstance(prompt, BadPrompt):
                error = prompt.message
            elif isinstance(prompt, str):
                text = prompt
                ids = encoded.get(i, [])
                error = prompt_text_error(prompt)
                if error is None and not ids:
                    error = "prompt is empty after tokenization"
            elif isinstance(prompt, (list, tuple)) and all(is_token_id(t) for t in prompt):
                ids = list(prompt)
                text = shown.get(i)
                if not ids:
                    error = "prompt is empty"
                elif any(t < 0 or t >= vocab for t in ids):
                    bad = next(t for t in ids if t < 0 or t >= vocab)
                    error = f"prompt: token id {bad} is outside the vocabulary [0, {vocab})"
            elif isinstance(prompt, (list, tuple)):
                error = f"prompt: must be a string or a list of token ids (ints), got {reprlib.repr(prompt)}"
            else:  # None, an int, ...: the words a job's row uses
                error = prompt_type_error(prompt)
            if error is None and not isinstance(params, SamplingParams):
                error = f"sampling_params: expected SamplingParams, got {type(params).__name__}"
            if error is None:
                error = params.validate(vocab)
            if error is None:
                error = prompt_length_error(len(ids), self.max_model_len, self.context_bound)
            if error is None and not self.warned_max_tokens and params.score_choices is None:
                message = max_tokens_past_context_warning(len(ids), params.max_tokens, self.max_model_len)
                if message is not None:
                    self.warned_max_tokens = True
                    warnings.warn(message, stacklevel=3)
            grammar = None
            if error is None and params.structured_outputs is not None:
                grammar, error = self.structured.matcher_for(params.structured_outputs)
            metrics = RequestMetrics(arrival_time=now, prompt_tokens=len(ids))
            req = Request(str(i), i, text, ids, params if isinstance(params, SamplingParams) else SamplingParams(),
                          metrics, error=error)
            if error is None:
                base = params.seed if params.seed is not None else mix_seed(self.seed, self.request_counter)
                self.request_counter += 1
                for j in range(params.n):
                    gen = None
                    if not params.greedy:
                        gen = torch.Generator(device=self.device)
                        gen.manual_seed(mix_seed(base, j))
                    seq = Sequence(seq_id=self.seq_counter, request=req, index=j, token_ids=list(ids), generator=gen)
                    seq.detokenizer = IncrementalDetokenizer(self.tokenizer, ids, params.skip_special_tokens)
                    seq.stop_matcher = StopStringMatcher(params.stop)
                    seq.logprobs = [] if params.logprobs is not None else None
                    if grammar is not None:  # one matcher per completion, all from one compiled grammar
                        seq.grammar = grammar if j == 0 else self.structured.matcher_for(params.structured_outputs)[0]
                    self.seq_counter += 1
                    req.seqs.append(seq)
            reqs.append(req)
        return reqs
