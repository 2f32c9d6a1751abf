"""The xgrammar grammar backend (mlc-ai/xgrammar; vLLM's and SGLang's default), an optional
alternative to llguidance: `EngineConfig(structured_outputs_backend="xgrammar")`, installed
with `pip install 'tokenmill[xgrammar]'`.

xgrammar compiles JSON Schema, regular expressions, EBNF and Lark grammars into a pushdown
automaton whose token masks are precomputed per state where they do not depend on the
stack (its "adaptive token mask cache"); a matcher walks one sequence through it.

Differences from the llguidance backend, each behind the same interface:

- a rejected token leaves the matcher where it was; this wrapper records the rejection
  and reports `is_error()` from then on, as llguidance does;
- `validate_tokens` stops before an end token (a matcher that accepted it has no next
  mask), so a draft's end token is left for the target to produce;
- forced tokens come from `find_jump_forward_tokens` (xgrammar's own tokenization of the
  forced text, without its last token when that could still grow);
- `is_stopped()` is never reported (knowing that only the end token is left would take a
  mask per token), so the end token of a complete grammar is sampled, not appended;
- `choice` compiles to an EBNF alternation of the (JSON-escaped) strings; `grammar` is read
  as Lark, or as EBNF/GBNF when it contains `::=`;
- a JSON schema with an `allOf` of two or more branches is refused (a GrammarError naming where):
  xgrammar 0.2.9 compiles it with a warning that its support is unfinished, and the grammar
  then accepts any object, values of the wrong type and missing required keys included.
"""
from __future__ import annotations

import json
import re
from typing import Any, Sequence

import torch

from .backend import CompiledGrammar, GrammarBackend, GrammarError, GrammarMatcher
from .params import StructuredOutputsParams


def _xgr():
    import xgrammar  # optional: imported only when this backend is chosen

    return xgrammar


def available() -> bool:
    """True when xgrammar is installed."""
    try:
        _xgr()
    except ImportError:
        return False
    return True


class XGrammarMatcher(GrammarMatcher):
    """An `xgrammar.GrammarMatcher` behind the matcher interface."""

    def __init__(self, m: Any, stop_ids: Sequence[int] = ()) -> None:
        self.m = m
        self._error = False
        self._stop = frozenset(int(t) for t in stop_ids)

    def accept_token(self, token: int) -> bool:
        if self._error:
            return False
        ok = bool(self.m.accept_token(int(token)))
        self._error = not ok
        return ok

    def validate_tokens(self, tokens: Sequence[int]) -> int:
        if self._error:
            return 0
        n = 0
        for t in tokens:  # up to, not including, an end token: a terminated matcher has no next mask
            if int(t) in self._stop or not self.m.accept_token(int(t)):
                break
            n += 1
        if n:
            self.m.rollback(n)
        return n

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self.m.rollback(num_tokens)

    def is_accepting(self) -> bool:
        return not self._error and bool(self.m.is_completed() or self.m.is_terminated())

    def is_error(self) -> bool:
        return self._error

    def forced_tokens(self) -> list[int]:
        if self._error or self.m.is_terminated():
            return []
        return [int(t) for t in self.m.find_jump_forward_tokens()]


class XGrammarGrammar(CompiledGrammar):
    def __init__(self, compiled: Any, stop_ids: list[int]) -> None:
        self.compiled = compiled
        self.stop_ids = stop_ids

    def matcher(self) -> XGrammarMatcher:
        return XGrammarMatcher(_xgr().GrammarMatcher(self.compiled, override_stop_tokens=self.stop_ids), self.stop_ids)


def _multi_branch_all_of(node: Any, path: str = "#") -> Any:
    """The JSON pointer of the first `allOf` with two or more branches in a schema, else None."""
    if isinstance(node, dict):
        branches = node.get("allOf")
        if isinstance(branches, list) and len(branches) > 1:
            return f"{path}/allOf"
        for key, value in node.items():
            found = _multi_branch_all_of(value, f"{path}/{key}")
            if found is not None:
                return found
    elif isinstance(node, list):
        for i, value in enumerate(node):
            found = _multi_branch_all_of(value, f"{path}/{i}")
            if found is not None:
                return found
    return None


class XGrammarBackend(GrammarBackend):
    """Args:
        tokenizer: the engine's `engine.tokenizer.Tokenizer` (a Hugging Face fast tokenizer); a
            matched output ends with its own EOS (`eos_token_id`), else any of `eos_token_ids`.
        max_threads: xgrammar's compile threads.
    Raises:
        ImportError: xgrammar is not installed (`pip install 'tokenmill[xgrammar]'`).
    """

    name = "xgrammar"

    def __init__(self, tokenizer: Any, max_threads: int = 2) -> None:
        xgr = _xgr()
        self.vocab_size = int(tokenizer.vocab_size)
        primary = tokenizer.eos_token_id
        self.stop_ids = [int(primary)] if primary is not None else sorted(tokenizer.eos_token_ids)
        info = xgr.TokenizerInfo.from_huggingface(tokenizer.hf, vocab_size=self.vocab_size, stop_token_ids=self.stop_ids)
        self.compiler = xgr.GrammarCompiler(info, max_threads=max_threads)

    def compile(self, params: StructuredOutputsParams) -> XGrammarGrammar:
        """Compile a constraint for this tokenizer.

        Raises:
            GrammarError: the constraint does not compile, or it is a JSON schema with an `allOf`
                of several branches (see the module's notes), naming the schema path.
        """
        kind, spec = params.kind, params.spec()
        c = self.compiler
        compact = params.disable_any_whitespace
        if kind == "json":
            where = _multi_branch_all_of(json.loads(spec) if isinstance(spec, str) else spec)
            if where is not None:
                raise GrammarError(f"structured_outputs.json: an allOf of several branches (at {where}) is not "
                                   f"enforced by the xgrammar backend; use structured_outputs_backend='llguidance' "
                                   f"(the default)")
        try:
            if kind in ("json", "json_object"):
                schema = spec if kind == "json" else {"type": "object"}
                text = schema if isinstance(schema, str) else json.dumps(schema)
                # strict_mode=False: the schema as written; objects are already closed by default
                # (StructuredOutputsParams.spec), the same for both backends
                g = c.compile_json_schema(text, any_whitespace=not compact,
                                          separators=(",", ":") if compact else None, strict_mode=False)
            elif kind == "regex":
                g = c.compile_regex(spec)
            elif kind == "choice":
                alts = " | ".join(json.dumps(s, ensure_ascii=False) for s in spec)
                g = c.compile_grammar(f"root ::= ({alts})")
            elif "::=" in spec:
                g = c.compile_grammar(spec)
            else:
                g = c.compile_lark(spec)
        except (RuntimeError, ValueError, TypeError) as exc:
            text = str(exc).strip()
            first = text.splitlines()[0] if text else type(exc).__name__
            first = re.sub(r"^\[[0-9:]+\] \S+:[0-9]+: ", "", first)  # xgrammar's C++ log prefix (time, file:line)
            raise GrammarError(f"structured_outputs.{kind}: {first}") from None
        return XGrammarGrammar(g, self.stop_ids)

    def fill_bitmasks(self, items: Sequence[tuple[GrammarMatcher, int, Sequence[int]]], bitmask: torch.Tensor) -> None:
        if not items:
            return
        if bitmask.dtype != torch.int32 or bitmask.device.type != "cpu" or not bitmask.is_contiguous():
            raise ValueError("bitmask must be a contiguous int32 CPU tensor")
        for matcher, row, draft in items:
            m = matcher.m
            done = 0
            for j in range(len(draft) + 1):
                m.fill_next_token_bitmask(bitmask, row + j)
                if j < len(draft):
                    if not m.accept_token(int(draft[j])):
                        raise ValueError(f"draft token {draft[j]} is not valid for the grammar (validate drafts first)")
                    done += 1
            if done:
                m.rollback(done)
