"""The llguidance grammar backend (guidance-ai/llguidance; vLLM's fallback backend).

llguidance compiles JSON Schema, regex and Lark grammars into a lazily built lexer plus an
Earley parser and computes token masks over the tokenizer's trie; it reports grammar
problems as matcher state (`is_error` / `get_error`), never as exceptions. Compiling is
building an `LLMatcher` from the grammar; each sequence then gets `deep_copy()` of that
start-state matcher, so a constraint compiles once however many rows use it.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

from .backend import CompiledGrammar, GrammarBackend, GrammarError, GrammarMatcher
from .params import StructuredOutputsParams


def _llg():
    import llguidance  # imported on first use: engines without constraints never load it

    return llguidance


class LLGuidanceMatcher(GrammarMatcher):
    """An `llguidance.LLMatcher` behind the matcher interface."""

    def __init__(self, m: Any) -> None:
        self.m = m

    def accept_token(self, token: int) -> bool:
        return bool(self.m.consume_token(int(token)))

    def validate_tokens(self, tokens: Sequence[int]) -> int:
        return int(self.m.validate_tokens([int(t) for t in tokens])) if tokens else 0

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self.m.rollback(num_tokens)

    def is_accepting(self) -> bool:
        return bool(self.m.is_accepting())

    def is_error(self) -> bool:
        return bool(self.m.is_error())

    def forced_tokens(self) -> list[int]:
        return list(self.m.compute_ff_tokens())

    def is_stopped(self) -> bool:
        return bool(self.m.is_stopped())

    def error_message(self) -> str | None:
        if not self.m.is_error():
            return None
        text = self.m.get_error().strip()  # its first line; a dump of the parser's state follows
        return text.splitlines()[0] if text else "the grammar rejected the output"


class LLGuidanceGrammar(CompiledGrammar):
    def __init__(self, template: Any) -> None:
        self.template = template

    def matcher(self) -> LLGuidanceMatcher:
        return LLGuidanceMatcher(self.template.deep_copy())


class LLGuidanceBackend(GrammarBackend):
    """Args:
        tokenizer: the engine's `engine.tokenizer.Tokenizer` (a Hugging Face fast tokenizer).
            A matched output ends with the tokenizer's own EOS (`eos_token_id`), the one end
            token the masks allow, so that jump-forward can append it without a forward pass
            and give exactly what sampling would; a tokenizer without one allows every id of
            `eos_token_ids`.
        num_threads: threads of llguidance's mask executor (None: its default).

    Building the token trie takes about 0.3 s for a 49k vocabulary: build one backend per engine.
    """

    name = "llguidance"

    def __init__(self, tokenizer: Any, num_threads: int | None = None) -> None:
        llg = _llg()
        import llguidance.hf

        self.vocab_size = int(tokenizer.vocab_size)
        primary = tokenizer.eos_token_id
        self.eos_token_id = int(primary) if primary is not None else None
        eos = [self.eos_token_id] if primary is not None else sorted(tokenizer.eos_token_ids)
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer.hf, n_vocab=self.vocab_size, eos_token=eos)
        self.executor = llg.LLExecutor(num_threads) if num_threads else llg.LLExecutor()

    @staticmethod
    def grammar_text(params: StructuredOutputsParams) -> str:
        """The llguidance grammar (its JSON form) of a validated constraint.

        Raises:
            GrammarError: text that cannot even be converted (e.g. malformed GBNF).
        """
        llg = _llg()
        kind, spec = params.kind, params.spec()
        try:
            if kind in ("json", "json_object"):
                opts = {"whitespace_flexible": not params.disable_any_whitespace}
                return llg.LLMatcher.grammar_from_json_schema(spec, overrides=opts)
            if kind == "regex":  # \d means [0-9], as users of OpenAI / Python-style patterns expect
                return llg.LLMatcher.grammar_from_lark("start: /" + llg.regex_to_lark(spec, "d") + "/")
            if kind == "choice":
                return llg.grammar_from("choice", list(spec))
            return llg.grammar_from("grammar", spec)
        except (ValueError, TypeError) as exc:
            raise GrammarError(f"structured_outputs.{kind}: {exc}") from None

    def compile(self, params: StructuredOutputsParams) -> LLGuidanceGrammar:
        llg = _llg()
        m = llg.LLMatcher(self.tokenizer, self.grammar_text(params), log_level=0)
        if m.is_error():
            raise GrammarError(f"structured_outputs.{params.kind}: {m.get_error().strip()}")
        return LLGuidanceGrammar(m)

    def fill_bitmasks(self, items: Sequence[tuple[GrammarMatcher, int, Sequence[int]]], bitmask: torch.Tensor) -> None:
        if not items:
            return
        if bitmask.dtype != torch.int32 or bitmask.device.type != "cpu" or not bitmask.is_contiguous():
            raise ValueError("bitmask must be a contiguous int32 CPU tensor")
        R, W = bitmask.shape
        row_bytes = W * 4
        plain = [(it[0].m, it[1]) for it in items if not it[2]]
        if plain:  # one call for the batch; llguidance releases the GIL and spreads it over its threads
            self.executor.unsafe_compute_mask_ptr(plain, bitmask.data_ptr(), row_bytes, R)
        base = bitmask.data_ptr()
        for matcher, row, draft in items:
            if not draft:
                continue
            m = matcher.m
            done = 0
            for j in range(len(draft) + 1):
                m.unsafe_compute_mask_ptr(base + (row + j) * row_bytes, row_bytes)
                if j < len(draft):
                    if not m.consume_token(int(draft[j])):
                        raise ValueError(f"draft token {draft[j]} is not valid for the grammar "
                                         f"(validate drafts first)")
                    done += 1
            m.rollback(done)


def check_constraint(params: StructuredOutputsParams) -> str | None:
    """None if a constraint is well-formed and compiles, else the message (no tokenizer needed;
    for refusing a job's default constraint before anything runs)."""
    problem = params.validate()
    if problem is not None:
        return problem
    llg = _llg()
    try:
        text = LLGuidanceBackend.grammar_text(params)
    except GrammarError as exc:
        return str(exc)
    err = llg.LLMatcher.validate_grammar(text, None)
    return f"structured_outputs.{params.kind}: {err.strip()}" if err else None
