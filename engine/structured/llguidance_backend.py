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
from .schema import locate_error


_POSITION = re.compile(r"^(?:at )?(\d+)\((\d+)\): ")  # llguidance's "at 2(6): " (line, column in its grammar)
_SHOWN_PATTERN_CHARS = 60


def one_line_error(kind: str, message: str, pattern: str | None = None, grammar: str | None = None) -> str:
    """llguidance's report of a constraint that does not compile, as one line that keeps the position.

    llguidance writes the position in the grammar it compiled (`at 1(8): `), the problem, then a
    snippet of that grammar with a caret under the spot; a bad regex adds the Rust `regex` crate's
    report (the pattern, carets under the bad part, `error: <reason>`): six lines for `(ab`. This
    keeps the reason and the position. For `kind` "regex", the offset (in characters, from 0) in
    the user's `pattern`, mapped back through llguidance's `\\d` -> `[0-9]` rewrite:
    `invalid regex "(ab": unclosed group at offset 0`. For "grammar", the line and column in the
    grammar text (and the offset in a regex token there); a message that quotes no text of the
    grammar (llguidance's bare "lexer error") gets the text at that position from `grammar`:
    `lexer error at line 1, column 12: unexpected '$'`, `lexer error at line 1, column 19:
    unclosed string '"no'`. Other kinds keep their first line.

    Args:
        kind: the constraint's kind ("regex", "grammar", "json", ...).
        message: llguidance's error text.
        pattern: the user's regex (kind "regex"), to report the offset in it.
        grammar: the grammar text llguidance compiled (kind "grammar"), to quote the problem text.

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
        if kind != "grammar" or not line_col:
            return first
        quoted = f": {_text_at(grammar, *line_col)}" if grammar is not None and not re.search(r"[\"']", first) else ""
        return f"{first} at line {line_col[0]}, column {line_col[1]}{quoted}"
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



def _text_at(grammar: str, line: int, column: int) -> str:
    """The grammar text at (1-based) `line` and `column`, for a message that names only the position:
    the run of non-blank characters there (the line's last one when the position is past its end,
    the grammar's last one past its last line), quoted, and called an unclosed string or regex when
    it opens a `"` or `/` that its line never closes (llguidance's Lark has no single-quoted
    strings: one is said to need double quotes)."""
    lines = grammar.splitlines() or [""]
    if line > len(lines):
        line, column = len(lines), len(lines[-1]) + 1
    text = lines[max(line, 1) - 1]
    at = min(max(column - 1, 0), len(text))
    while at > 0 and (at == len(text) or text[at].isspace()) and text[at - 1:at].strip():
        at -= 1  # past the end of a word (or of the line): that word
    if at == len(text) or text[at].isspace():
        return "at the end of the line" if not text[:at].strip() or at == len(text) else "unexpected blank"
    start = at
    while start > 0 and not text[start - 1].isspace():
        start -= 1
    end = at
    while end < len(text) and not text[end].isspace():
        end += 1
    word = text[start:end]
    mark = '"' if "'" in word and '"' not in word else "'"
    shown = mark + "".join(ch if ch.isprintable() else repr(ch)[1:-1] for ch in word[:_SHOWN_PATTERN_CHARS]) + mark
    quote = word[0]
    if quote == "'":
        return f"unexpected {shown} (strings take double quotes)"
    if quote in '"/' and not re.search(rf"(?<!\\)(?:\\\\)*{re.escape(quote)}", text[start + 1:]):
        return f"unclosed {'regex' if quote == '/' else 'string'} {shown}"
    return f"unexpected {shown}"


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
            return llg.LLMatcher.grammar_from_lark(_lark_of(spec))
        except GrammarError:  # GBNF that does not convert, already said in one line
            raise
        except (ValueError, TypeError) as exc:
            raise GrammarError(f"structured_outputs.{kind}: {describe_error(params, str(exc))}") from None

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
            raise GrammarError(f"structured_outputs.{params.kind}: {describe_error(params, m.get_error())}")
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
    return f"structured_outputs.{params.kind}: {describe_error(params, err)}" if err else None


def describe_error(params: StructuredOutputsParams, message: str) -> str:
    """llguidance's error for a validated constraint as one line that says what and where, without
    the `structured_outputs.<kind>: ` prefix (never raises):

    - regex: `one_line_error` (the offset in the pattern as written);
    - Lark grammar: `one_line_error` with the grammar's text, so that a bare "lexer error" names
      the text at its position;
    - GBNF grammar (text with no `start:` rule): the problem and the rule it lies in, with that
      rule's line in the text as written (llguidance's positions are in the Lark text it converted
      the grammar to, which the user never saw);
    - JSON Schema: the problem and where it lies in the schema (`schema.locate_error`):
      `Invalid type: integr (at properties.age.type)`.
    """
    kind = params.kind
    try:
        if kind == "json":
            spec = params.spec()
            path, text = locate_error(spec, lambda sub: _schema_error(sub, params.disable_any_whitespace), message)
            line = one_line_error(kind, text)
            return f"{line} (at {path})" if path else line
        if kind == "grammar" and not _is_lark(params.grammar):
            return _gbnf_compiled_error(params.grammar, message)
        if kind == "grammar":
            return one_line_error(kind, message, grammar=params.grammar)
    except Exception:  # noqa: BLE001 - locating is a courtesy; the plain one line is still right
        pass
    return one_line_error(kind, message, _regex_of(params))


def _schema_error(schema: Any, disable_any_whitespace: bool) -> str | None:
    """llguidance's error for a JSON Schema (its first compile step or validation), or None."""
    llg = _llg()
    try:
        text = llg.LLMatcher.grammar_from_json_schema(schema, overrides={"whitespace_flexible": not disable_any_whitespace})
    except (ValueError, TypeError) as exc:
        return str(exc)
    return llg.LLMatcher.validate_grammar(text, None) or None


def _is_lark(text: str) -> bool:
    """True for grammar text llguidance takes as Lark (a `start:` rule or `%llguidance`); else it is GBNF."""
    from llguidance.gbnf_to_lark import is_lark_syntax

    return is_lark_syntax(text)


def _lark_of(text: str) -> str:
    """Lark text of a grammar given as Lark or GBNF.

    Raises:
        GrammarError: GBNF that does not convert: the problem, its line and column and the text
            there (`read as GBNF (no start: rule): Expected ::= at line 1, column 7: unexpected '"a"'`);
            a rule that is used but never defined, at its first use.
    """
    if _is_lark(text):
        return text
    from llguidance.gbnf_to_lark import GbnfToLarkError, gbnf_to_lark

    head = "structured_outputs.grammar: read as GBNF (no start: rule): "
    try:
        return gbnf_to_lark(text)
    except GbnfToLarkError as exc:
        reason = str(exc).removesuffix(f" at {exc.pos}")
        line, column = _line_column(text, exc.pos.pos)
        raise GrammarError(f"{head}{reason} at line {line}, column {column}: {_text_at(text, line, column)}") from None
    except Exception as exc:  # noqa: BLE001 - its rule checks raise plain Exceptions
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        missing = re.fullmatch(r"Rule '(.+)' not found", reason)
        offset = _first_use(text, missing.group(1)) if missing else None
        if offset is not None:
            line, column = _line_column(text, offset)
            reason = f"unknown rule '{missing.group(1)}' at line {line}, column {column}"
        raise GrammarError(head + reason) from None


def _line_column(text: str, offset: int) -> tuple[int, int]:
    """1-based line and column of a character offset in `text`."""
    line = text.count("\n", 0, offset) + 1
    return line, offset - (text.rfind("\n", 0, offset) + 1) + 1


def _first_use(gbnf: str, name: str) -> int | None:
    """Offset of the first use of rule `name` in GBNF text (a whole name, outside double quotes, not
    its definition), or None."""
    for m in re.finditer(rf"(?<![\w-]){re.escape(name)}(?![\w-])", gbnf):
        before = gbnf[gbnf.rfind("\n", 0, m.start()) + 1:m.start()]
        if len(re.findall(r'(?<!\\)"', before)) % 2 == 0 and not re.match(r"\s*::=", gbnf[m.end():]):
            return m.start()
    return None


def _gbnf_compiled_error(gbnf: str, message: str) -> str:
    """The error of GBNF that converted to Lark but does not compile: the problem, and the GBNF rule
    (with its line as written) that the Lark line llguidance named came from."""
    text = message.strip()
    where = _POSITION.match(text)
    problem = one_line_error("grammar", text[where.end():] if where else text)
    out = f"read as GBNF (no start: rule): {problem}"
    if where is None:
        return out
    from llguidance.gbnf_to_lark import gbnf_to_lark

    lark_lines = gbnf_to_lark(gbnf).splitlines()
    rule = None
    for ln in reversed(lark_lines[:int(where.group(1))]):
        if m := re.match(r"([A-Za-z_]\w*)\s*:", ln):
            rule = m.group(1)
            break
    for m in re.finditer(r"^[ \t]*([\w-]+)[ \t]*::=", gbnf, re.MULTILINE):
        name = m.group(1)
        lark_name = "start" if name == "root" else re.sub(r"([a-z])([A-Z])", r"\1_\2", name.replace("-", "_"))
        if rule is not None and lark_name.lower() == rule.lower():
            return f"{out} in rule {name} (line {_line_column(gbnf, m.start(1))[0]})"
    return out
