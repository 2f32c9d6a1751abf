"""The llguidance grammar backend (guidance-ai/llguidance; vLLM's fallback backend).

llguidance compiles JSON Schema, regex and Lark grammars into a lazily built lexer plus an
Earley parser and computes token masks over the tokenizer's trie; it reports grammar
problems as matcher state (`is_error` / `get_error`), never as exceptions. Compiling is
building an `LLMatcher` from the grammar; each sequence then gets `deep_copy()` of that
start-state matcher, so a constraint compiles once however many rows use it.
"""
from __future__ import annotations

import re
from typing import Any, Sequence

import torch

from .backend import CompiledGrammar, GrammarBackend, GrammarError, GrammarMatcher
from .params import StructuredOutputsParams


_POSITION = re.compile(r"^(?:at )?(\d+)\((\d+)\): ")  # llguidance's "at 2(6): " (line, column in its grammar)
_SHOWN_PATTERN_CHARS = 60


def one_line_error(kind: str, message: str, pattern: str | None = None) -> str:
    """llguidance's report of a constraint that does not compile, as one line that keeps the position.

    llguidance writes the position in the grammar it compiled (`at 1(8): `), the problem, then a
    snippet of that grammar with a caret under the spot; a bad regex adds the Rust `regex` crate's
    report (the pattern, carets under the bad part, `error: <reason>`): six lines for `(ab`. This
    keeps the reason and the position. For `kind` "regex", the offset (in characters, from 0) in
    the user's `pattern`, mapped back through llguidance's `\\d` -> `[0-9]` rewrite:
    `invalid regex "(ab": unclosed group at offset 0`. For "grammar", the line and column in the
    grammar text (and the offset in a regex token there). Other kinds keep their first line.

    Args:
        kind: the constraint's kind ("regex", "grammar", "json", ...).
        message: llguidance's error text.
        pattern: the user's regex (kind "regex"), to report the offset in it.

    Returns:
        One line without the `structured_outputs.<kind>: ` prefix (never raises).
    """
    text = message.strip()
    where = _POSITION.match(text)
    line_col = (int(where.group(1)), int(where.group(2))) if where else None
    if where:
        text = text[where.end():]
    lines = text.splitlines() or ["does not compile"]
    head = lines[0]
    if "regex parse error:" not in head:
        first = head.strip()
        return f"{first} at line {line_col[0]}, column {line_col[1]}" if kind == "grammar" and line_col else first
    reason = next((ln[len("error: "):].strip() for ln in lines[1:] if ln.startswith("error: ")), "regex parse error")
    compiled, offset = _regex_report_position(lines[1:])
    if kind == "regex" and pattern is not None:
        shown, offset, grammar_at = pattern, _user_offset(pattern, compiled, offset), ""
    else:
        shown = compiled
        grammar_at = f" (line {line_col[0]}, column {line_col[1]} of the grammar)" if line_col else ""
    at = f" at offset {offset}" if offset is not None else ""
    return f"invalid regex{' ' + _shown(shown) if shown is not None else ''}: {reason}{at}{grammar_at}"


def _regex_report_position(report: list[str]) -> tuple[str | None, int | None]:
    """(pattern, character offset of the first caret) from the lines of a Rust regex report that follow
    "regex parse error:", for a one-line pattern (indented 4 spaces, the carets below it); Nones when
    the report has another shape (a pattern of several lines numbers them)."""
    if len(report) < 2 or not report[0].startswith("    ") or not set(report[1].strip()) <= {"^", " "} \
            or "^" not in report[1]:
        return None, None
    return report[0][4:], report[1].index("^") - 4


def _user_offset(pattern: str, compiled: str | None, offset: int | None) -> int | None:
    """The offset in the user's `pattern` of `offset` in `compiled` (`pattern` after llguidance's
    rewrite for Lark: `\\d` -> `[0-9]`, `/` -> `\\/`): the longest prefix of the pattern whose
    rewrite ends at or before it. None when the report named no offset or is not this pattern's."""
    if offset is None or compiled is None:
        return None
    if compiled == pattern:
        return offset
    rewrite = lambda text: _llg().regex_to_lark(text, "d")  # noqa: E731
    try:
        if rewrite(pattern) != compiled:
            return None
        lo, hi = 0, len(pattern)  # rewritten prefix lengths grow with the prefix: bisect
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if len(rewrite(pattern[:mid])) <= offset:
                lo = mid
            else:
                hi = mid - 1
        return lo
    except Exception:  # noqa: BLE001 - a rewrite that fails on a prefix: no offset rather than a wrong one
        return None


def _shown(pattern: str) -> str:
    """A pattern in double quotes for a message, backslashes as written and characters that are not
    printable (a newline) as escapes, so it stays on one line; cut past `_SHOWN_PATTERN_CHARS`."""
    text = "".join(ch if ch.isprintable() else repr(ch)[1:-1] for ch in pattern[:_SHOWN_PATTERN_CHARS])
    more = f"... ({len(pattern)} characters)" if len(pattern) > _SHOWN_PATTERN_CHARS else ""
    return f'"{text}"{more}'



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
            GrammarError: text that cannot even be converted (e.g. malformed GBNF); its message is
                one line (`one_line_error`).
        """
        llg = _llg()
        kind, spec = params.kind, params.spec()
        if kind == "regex" and (len(spec) - len(spec.rstrip("\\"))) % 2:
            # an odd run of backslashes at the end leaves the last one escaping nothing; llguidance's
            # rewrite below drops it, which compiled a pattern "abc" + backslash as "abc" (Rust's regex,
            # Python's re and xgrammar all refuse such a pattern)
            raise GrammarError(f"structured_outputs.regex: invalid regex {_shown(spec)}: incomplete escape at offset "
                               f"{len(spec) - 1}")
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
            raise GrammarError(f"structured_outputs.{kind}: {one_line_error(kind, str(exc), _regex_of(params))}") \
                from None

    def compile(self, params: StructuredOutputsParams) -> LLGuidanceGrammar:
        """Compile a validated constraint.

        Raises:
            GrammarError: the regex, schema or grammar is invalid; one line naming the problem and
                where it is (`one_line_error`: `structured_outputs.regex: invalid regex "(ab": unclosed group at
                offset 0`).
        """
        llg = _llg()
        m = llg.LLMatcher(self.tokenizer, self.grammar_text(params), log_level=0)
        if m.is_error():
            problem = one_line_error(params.kind, m.get_error(), _regex_of(params))
            raise GrammarError(f"structured_outputs.{params.kind}: {problem}")
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


def _regex_of(params: StructuredOutputsParams) -> str | None:
    """The user's pattern of a regex constraint, else None."""
    return params.regex if params.kind == "regex" else None


def check_constraint(params: StructuredOutputsParams) -> str | None:
    """None if a constraint is well-formed and compiles, else the message, one line (no tokenizer
    needed; for refusing a job's default constraint before anything runs)."""
    problem = params.validate()
    if problem is not None:
        return problem
    llg = _llg()
    try:
        text = LLGuidanceBackend.grammar_text(params)
    except GrammarError as exc:
        return str(exc)
    err = llg.LLMatcher.validate_grammar(text, None)
    return f"structured_outputs.{params.kind}: {one_line_error(params.kind, err, _regex_of(params))}" if err else None
