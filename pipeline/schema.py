"""Input and output schemas of a job, and row validation.

Input (one Parquet file or a folder of them):
    - an id column (default ``id``; the row index when there is none);
    - ``prompt`` (string) and/or ``messages`` (a list of {role, content}, as a
      Parquet list of structs or as a JSON string); a row uses ``messages``
      when it is not null, else ``prompt``;
    - optional per-row overrides: ``system``, ``max_tokens``, ``temperature``,
      ``top_p``, ``seed``, ``stop``, and one output constraint per row, ``json_schema``
      (JSON Schema text or a struct), ``regex``, ``choice`` (a list, a JSON list, or
      comma-separated text) or ``grammar`` (Lark / GBNF text); ``sampling_params`` (JSON
      text of any `engine.SamplingParams` fields, applied after the others);
      ``prompt_token_ids`` (a list of token ids: the prompt as given, no template); ``chat_template``
      (false: this row's prompt is given as is, as OpenAI's /v1/completions takes it); null means
      the job's default;
    - ``request_error``: when not null, the row is an error row with this message (a reader's
      verdict on the line it came from, `pipeline.openai_batch`);
    - every other column passes through to the output unchanged.

A bad row never fails the job: `build_request` returns a `RowRequest` whose
``error`` names the problem, and the job writes it as an error row. A null id
makes a bad row (its output could not be told apart); repeated ids do not (the
job warns, and each row is processed).
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import polars as pl
import pyarrow as pa

from engine.config import (
    SamplingParams, prompt_length_error, prompt_text_error, prompt_type_error, stop_strings_error,
)
from engine.structured.params import StructuredOutputsParams
from engine.tokenizer import CHAT_ROLES, TOOL_ROLE, validate_messages
from pipeline.io import INVALID_UTF8_COLUMN

PROMPT_COLUMN = "prompt"
MESSAGES_COLUMN = "messages"
CONSTRAINT_COLUMNS = ("json_schema", "regex", "choice", "grammar")  # -> StructuredOutputsParams json/regex/...
OVERRIDE_COLUMNS = ("system", "max_tokens", "temperature", "top_p", "seed", "stop", *CONSTRAINT_COLUMNS,
                    "sampling_params", "prompt_token_ids", "chat_template", "request_error")
MESSAGE_ROLES = (*CHAT_ROLES, TOOL_ROLE)  # a tokenizer's `chat_roles` narrows them to what its template handles

# Output columns added after the id and pass-through columns, in this order.
GENERATION_COLUMNS: dict[str, pl.DataType] = {
    "generation": pl.Utf8(),
    "finish_reason": pl.Utf8(),
    "prompt_tokens": pl.Int64(),
    "completion_tokens": pl.Int64(),
    "cached_tokens": pl.Int64(),
    "spec_draft_tokens": pl.Int64(),
    "spec_accepted_tokens": pl.Int64(),
    "ttft_s": pl.Float64(),
    "latency_s": pl.Float64(),
    "error": pl.Utf8(),
}
GENERATIONS_LIST_COLUMN = "generations"  # only when n > 1
# after the others in jobs that write OpenAI Batch result lines: each completion's text, finish reason and
# logprobs, as JSON text (`pipeline.openai_batch.choices_cell`)
CHOICES_COLUMN = "choices"
# after `generation` in jobs that constrain outputs (a default constraint or a constraint column)
STRUCTURED_COLUMNS: dict[str, pl.DataType] = {"valid": pl.Boolean(), "parsed": pl.Utf8()}
# after those in scoring jobs (`score_choices`)
SCORE_COLUMNS: dict[str, pl.DataType] = {
    "label": pl.Utf8(),
    "label_logprobs": pl.List(pl.Struct({"choice": pl.Utf8(), "logprob": pl.Float64()})),
}


@dataclass(frozen=True)
class InputLayout:
    """Which input columns play which role, for one input file's schema.

    Attributes:
        id_column: name of the id column in the output.
        id_in_input: False when the input has no such column (ids are row indexes).
        has_prompt / has_messages: which prompt columns exist.
        overrides: per-row override columns present in the input.
        passthrough: all other input columns, in input order.
    """

    id_column: str
    id_in_input: bool
    has_prompt: bool
    has_messages: bool
    overrides: tuple[str, ...]
    passthrough: tuple[str, ...]

    @classmethod
    def from_schema(cls, columns: Sequence[str], id_column: str = "id") -> "InputLayout":
        """Classify columns. Raises ValueError when a column name appears more than once, or when there is
        neither `prompt` nor `messages`."""
        cols = list(columns)
        dups = sorted({c for c in cols if cols.count(c) > 1}, key=cols.index)
        if dups:  # a column is read by its name: which of two would be the id, the prompt, a pass-through?
            listed = ", ".join(f"{c!r} ({cols.count(c)} times)" for c in dups)
            raise ValueError(f"input has duplicate column names: {listed}; rename the columns so that each name "
                             f"appears once")
        has_prompt = PROMPT_COLUMN in cols
        has_messages = MESSAGES_COLUMN in cols
        if not (has_prompt or has_messages):
            import difflib

            near = difflib.get_close_matches(PROMPT_COLUMN, [str(c) for c in cols], n=1, cutoff=0.6) or \
                difflib.get_close_matches(MESSAGES_COLUMN, [str(c) for c in cols], n=1, cutoff=0.6)
            hint = f" (is {near[0]!r} meant to be one of them?)" if near else ""
            raise ValueError(
                f"input needs a {PROMPT_COLUMN!r} column (string) or a {MESSAGES_COLUMN!r} column "
                f"(list of {{role, content}}); found columns {cols}{hint}"
            )
        def is_output(c: str) -> bool:
            return (c in GENERATION_COLUMNS or c in (GENERATIONS_LIST_COLUMN, CHOICES_COLUMN) or c in STRUCTURED_COLUMNS
                    or c in SCORE_COLUMNS)

        role = ("the prompt" if id_column in (PROMPT_COLUMN, MESSAGES_COLUMN)
                else "a per-row sampling option" if id_column in OVERRIDE_COLUMNS
                else "an output" if is_output(id_column) else None)
        if role is not None:  # one column cannot be both: the output would hold it twice
            raise ValueError(f"id_column {id_column!r} is {role} column; name the column that holds each row's "
                             f"id, or leave id_column unset to use the row index")
        reserved = {id_column, PROMPT_COLUMN, MESSAGES_COLUMN, *OVERRIDE_COLUMNS}
        clash = [c for c in cols if is_output(c)]
        if clash:
            raise ValueError(f"input columns {clash} collide with output columns; rename them")
        return cls(
            id_column=id_column,
            id_in_input=id_column in cols,
            has_prompt=has_prompt,
            has_messages=has_messages,
            overrides=tuple(c for c in OVERRIDE_COLUMNS if c in cols),
            passthrough=tuple(c for c in cols if c not in reserved),
        )


@dataclass
class RowRequest:
    """One row turned into an engine request, or into an error.

    Attributes:
        prompt_token_ids: the tokenized prompt (after the chat template), or None on error.
        params: the row's SamplingParams, or None on error.
        error: why the row cannot run, or None.
    """

    prompt_token_ids: Optional[list[int]] = None
    params: Optional[SamplingParams] = None
    error: Optional[str] = None


def _json_object(value: Any, name: str, what: str) -> dict:
    """A cell that holds a JSON object, given as a dict or as JSON text.

    Raises:
        ValueError: text that is not JSON, or a value that is not an object (the message names `name`).
    """
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{name} is not valid JSON: {exc.msg} at position {exc.pos}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be {what}, got {type(value).__name__}")
    return value


def _override(name: str, value: Any) -> Any:
    """One per-row override value, as the row's SamplingParams takes it; raise ValueError for a bad one.

    The sampling parameters (`max_tokens`, `seed`, `temperature`, `top_p`) are only normalised here:
    a whole float is an integer count or seed (a Parquet float column). Whether the value is valid is
    `SamplingParams.validate`'s rule, which the API applies too, so both refuse the same values in the
    same words (a NaN temperature: `temperature must be a finite number >= 0, got nan`).
    """
    if name == "max_tokens" or name == "seed":
        return int(value) if isinstance(value, float) and value.is_integer() else value
    if name in ("temperature", "top_p"):
        return value
    if name == "stop":
        value = [value] if isinstance(value, str) else value
        problem = stop_strings_error(value)  # the engine's rule, in its words
        if problem is not None:
            raise ValueError(problem)
        return list(value)
    if name == "system":
        if not isinstance(value, str):
            raise ValueError(f"system must be a string, got {type(value).__name__} {value!r}")
        if not value.strip():  # it was reported as the chat template's `messages[0].content is empty`
            raise ValueError(f"system is empty ({value!r}): leave it null for the job's system prompt, if any")
        return value
    if name == "json_schema":
        return _json_object(value, "json_schema", "a JSON Schema object")
    if name in ("regex", "grammar"):
        if not isinstance(value, str) or not value:
            raise ValueError(f"{name} must be a non-empty string, got {value!r}")
        return value
    if name == "choice":
        return parse_choices(value, "choice")
    if name == "sampling_params":
        return _sampling_cell(value)
    if name == "chat_template":
        if not isinstance(value, bool):
            raise ValueError(f"chat_template must be true or false, got {value!r}")
        return value
    if name == "prompt_token_ids":
        if not isinstance(value, (list, tuple)) or not value or not all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value):
            raise ValueError(f"prompt_token_ids must be a non-empty list of token ids, got {value!r}"[:200])
        return list(value)
    raise ValueError(f"unknown override column {name!r}")


def row_overrides(row: dict[str, Any], columns: Sequence[str]) -> dict[str, Any]:
    """A row's non-null cells of the override `columns` (of `OVERRIDE_COLUMNS`), each as the row's
    request takes it (`sampling_params` a dict of SamplingParams fields, `stop` a list, ...).

    Raises:
        ValueError: a cell that is not a valid value for its column (named).
    """
    out: dict[str, Any] = {}
    for name in columns:
        value = row.get(name)
        if value is not None:
            out[name] = _override(name, _text_cell(name, value))
    return out


def _sampling_cell(value: Any) -> dict[str, Any]:
    """A `sampling_params` cell (JSON text or a struct) as SamplingParams fields.

    Raises:
        ValueError: not a JSON object, or a key SamplingParams does not have (named).
    """
    value = _json_object(value, "sampling_params", "an object of SamplingParams fields")
    known = {f.name for f in dataclasses.fields(SamplingParams)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise ValueError(f"sampling_params: unknown field(s) {unknown}")
    return dict(value)


def parse_choices(value: Any, name: str = "choice") -> list:
    """A choice list from a list, a JSON list text, or comma-separated text ("a,b,c").

    Entries are returned as given (their validity, non-empty and distinct, is checked by
    `StructuredOutputsParams.validate`, which names the problem).

    Raises:
        ValueError: a value that is none of those.
    """
    if isinstance(value, str):
        text = value.strip()
        if text.startswith("["):
            try:
                value = json.loads(text)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{name} is not a valid JSON list: {exc.msg} at position {exc.pos}") from None
        else:
            value = [c.strip() for c in text.split(",")] if text else []
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"{name} must be a list of strings or comma-separated text, got {type(value).__name__}")
    return list(value)


def row_constraint(overrides: dict[str, Any], defaults: SamplingParams) -> Optional[StructuredOutputsParams]:
    """The StructuredOutputsParams of a row's constraint columns (popped from `overrides`), or
    None when the row sets none (the job's default then applies).

    Raises:
        ValueError: the row sets more than one constraint column.
    """
    given = [c for c in CONSTRAINT_COLUMNS if c in overrides]
    if not given:
        return None
    if len(given) > 1:
        raise ValueError(f"set at most one constraint column per row, got {given}")
    name = given[0]
    value = overrides.pop(name)
    base = defaults.structured_outputs
    compact = base.disable_any_whitespace if base is not None else True
    field_name = "json" if name == "json_schema" else name
    return StructuredOutputsParams(**{field_name: value}, disable_any_whitespace=compact)


def parse_messages(value: Any, roles: Sequence[str] = MESSAGE_ROLES) -> list[dict[str, str]]:
    """Normalise a `messages` cell to a list of {role, content} dicts.

    Accepts a list of dicts (Parquet list<struct>) or a JSON string of one. The conversation rule is
    the engine's (`engine.tokenizer.validate_messages`, as `LLM.chat` applies it): each role one of
    `roles`, each content a non-blank string.

    Args:
        roles: the roles accepted (the model tokenizer's `chat_roles`; default: system, user,
            assistant, tool).

    Raises:
        ValueError: with a message saying what is wrong with the value (the message's index, the
            field and the bad value).
    """
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"messages is not valid JSON: {exc.msg} at position {exc.pos}") from None
    validate_messages(value, roles)
    return [{"role": m["role"], "content": m["content"]} for m in value]


def _text_cell(name: str, value: Any) -> Any:
    """A cell of text column `name` with bytes (a Parquet BINARY or LARGE_BINARY column, which some
    writers use for text) decoded as UTF-8; any other value as it is.

    Raises:
        ValueError: bytes that are not valid UTF-8, naming the column and the first bad byte.
    """
    if not isinstance(value, bytes):
        return value
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{name} is not valid UTF-8 text (a binary column; byte {value[exc.start]:#04x} at "
                         f"position {exc.start})") from None


def build_request(
    row: dict[str, Any],
    layout: InputLayout,
    tokenizer: Any,
    defaults: SamplingParams,
    *,
    system_prompt: Optional[str] = None,
    use_chat_template: bool = True,
    max_model_len: Optional[int] = None,
    vocab_size: Optional[int] = None,
    truncate: bool = False,
    context_bound: Optional[str] = None,
) -> RowRequest:
    """Validate one input row and build its prompt token ids and SamplingParams.

    Args:
        row: the row as a dict (column -> Python value); when it holds the id column, a null id is an error.
        layout: the input's column roles.
        tokenizer: has `encode(str) -> list[int]` and
            `apply_chat_template(messages, add_generation_prompt=True) -> str`.
        defaults: the job's default sampling parameters; overrides replace fields.
        system_prompt: the job's system prompt; a row's `system` replaces it.
        use_chat_template: wrap prompts in the chat template; without it a
            system prompt is prepended as text and `messages` rows are errors.
        max_model_len: context length in tokens; longer prompts are errors, and so is a
            max_tokens that does not fit after the prompt unless `truncate` (`length_rule`).
        truncate: cut max_tokens to what the context leaves instead of refusing the row.
        context_bound: what sets max_model_len, in words (`engine.loader.context_bound`: the loaded
            engine's `context_bound`), named by the error of a too-long prompt.

    Returns:
        A RowRequest; never raises for a bad row (any exception becomes `error`).
    """
    try:
        return _build_request(row, layout, tokenizer, defaults, system_prompt, use_chat_template,
                              max_model_len, vocab_size, truncate, context_bound)
    except Exception as exc:  # noqa: BLE001 - one row's failure must not fail the job
        return RowRequest(error=f"{type(exc).__name__}: {exc}" if not isinstance(exc, ValueError) else str(exc))


def _build_request(row, layout, tokenizer, defaults, system_prompt, use_chat_template, max_model_len, vocab_size,
                   truncate=False, context_bound=None):
    if row.get("request_error") is not None:
        raise ValueError(row["request_error"])
    bad_text = row.get(INVALID_UTF8_COLUMN)
    if bad_text:
        raise ValueError(f"{bad_text} {'is' if ',' not in bad_text else 'are'} not valid UTF-8 text (the Parquet "
                         f"file holds other bytes in a string column)")
    if layout.id_in_input and layout.id_column in row:
        rid = row[layout.id_column]
        if rid is None:
            raise ValueError(f"{layout.id_column} is null")
        if isinstance(rid, float) and rid != rid:  # pandas writes a missing value of an int column as NaN
            raise ValueError(f"{layout.id_column} is NaN (a missing value)")
    overrides = row_overrides(row, layout.overrides)
    system = overrides.pop("system", system_prompt)
    token_ids = overrides.pop("prompt_token_ids", None)
    use_chat_template = overrides.pop("chat_template", use_chat_template)
    constraint = row_constraint(overrides, defaults)
    if constraint is not None:
        overrides["structured_outputs"] = constraint
    overrides.update(overrides.pop("sampling_params", {}))

    messages_value = _text_cell(MESSAGES_COLUMN, row.get(MESSAGES_COLUMN)) if layout.has_messages else None
    if token_ids is not None:  # the prompt as token ids: no template, no system prompt
        text = None
    elif messages_value is not None or (layout.has_messages and not layout.has_prompt):  # (None: `messages is null`)
        messages = parse_messages(messages_value, getattr(tokenizer, "chat_roles", MESSAGE_ROLES))
        if not use_chat_template:
            raise ValueError("messages rows need the chat template (chat_template is off or the model has none)")
        if system is not None and messages[0]["role"] != "system":
            messages = [{"role": "system", "content": system}, *messages]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    else:
        prompt = _text_cell(PROMPT_COLUMN, row.get(PROMPT_COLUMN)) if layout.has_prompt else None
        if prompt is None and layout.has_messages:  # a row needs one of them
            raise ValueError("prompt and messages are both null")
        problem = prompt_type_error(prompt)  # the engine's rules: LLM.generate refuses the same prompts
        if problem is not None:
            raise ValueError(problem)
        problem = prompt_text_error(prompt)
        if problem is not None:
            raise ValueError(problem)
        if use_chat_template:
            messages = [{"role": "user", "content": prompt}]
            if system is not None:
                messages.insert(0, {"role": "system", "content": system})
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        else:
            text = prompt if system is None else f"{system}\n\n{prompt}"

    params = dataclasses.replace(defaults, **overrides)
    problem = params.validate(vocab_size)
    if problem is not None:
        raise ValueError(problem)
    ids = list(tokenizer.encode(text)) if token_ids is None else token_ids
    if token_ids is not None and vocab_size is not None and max(ids) >= vocab_size:
        raise ValueError(f"prompt_token_ids holds token id {max(ids)}, past the vocabulary ({vocab_size} tokens)")
    if not ids:
        raise ValueError("prompt is empty after tokenization")
    problem, max_tokens = length_rule(len(ids), params.max_tokens, max_model_len, truncate, context_bound)
    if problem is not None:
        raise ValueError(problem)
    if max_tokens != params.max_tokens:
        params = dataclasses.replace(params, max_tokens=max_tokens)
    return RowRequest(prompt_token_ids=ids, params=params)


def length_rule(n_prompt: int, max_tokens: Optional[int], max_model_len: Optional[int],
                truncate: bool = False, context_bound: Optional[str] = None) -> tuple[Optional[str], Optional[int]]:
    """The context-length rule for one row: (error or None, the max_tokens to run with).

    A prompt must leave room for output (`n_prompt < max_model_len`). Without
    `truncate`, prompt + max_tokens above the context is an error, as the
    OpenAI API answers; with it, max_tokens is cut to what the context leaves.
    """
    if max_model_len is None:
        return None, max_tokens
    problem = prompt_length_error(n_prompt, max_model_len, context_bound)  # the engine's rule, in its words
    if problem is not None:
        return problem, max_tokens
    room = max_model_len - n_prompt
    if max_tokens is not None and max_tokens > room:
        if truncate:
            return None, room
        why = f", set by {context_bound}" if context_bound else ""
        return (f"max_tokens {max_tokens} does not fit the engine's context: the prompt has {n_prompt} tokens and "
                f"the context (max_model_len) is {max_model_len}{why}, which leaves {room}; lower max_tokens, or "
                f"pass --truncate to stop at the end of the context"), max_tokens
    return None, max_tokens


@dataclass(frozen=True)
class UnifiedColumns:
    """The output-shaping input columns (id and pass-through) of a multi-file input, with one type each.

    Attributes:
        types: column -> the polars dtype every part file gets (each file's values are cast to it).
        notes: human-readable lines for the types that were widened (empty when every file agrees).
    """

    types: dict[str, pl.DataType]
    notes: tuple[str, ...] = ()


def unify_input_columns(files: Sequence[Any], id_column: str = "id") -> UnifiedColumns:
    """Check that the input files agree on the columns that reach the output (the id and the
    pass-through columns), and give each one type, so that the part files read together.

    Column roles (`prompt`, `messages`, per-row overrides) may differ between files: they do
    not reach the output, and each row is validated on its own. Types are unified the way
    `pyarrow.unify_schemas(promote_options="permissive")` does (int32 + int64 -> int64, null
    -> anything, float + double -> double, int + double -> double, ...).

    Args:
        files: `io.InputFile`s with their Arrow `schema` (files without one are skipped).

    Raises:
        ValueError: a file lacks (or adds) an output column that another file has, or a column's
            types cannot be unified (e.g. Int64 and String); the message names both files and the column.
    """
    first: Optional[Any] = None
    first_cols: tuple[str, ...] = ()
    fields: dict[str, tuple[pa.Field, str]] = {}  # column -> (unified field, first file)
    widened: dict[str, list[str]] = {}
    for f in files:
        if f.schema is None:
            continue
        layout = InputLayout.from_schema(f.columns, id_column)
        cols = ((id_column,) if layout.id_in_input else ()) + layout.passthrough
        if first is None:
            first, first_cols = f, cols
        elif set(cols) != set(first_cols):
            extra = sorted(set(cols) - set(first_cols))
            missing = sorted(set(first_cols) - set(cols))
            what = (f"has column {extra[0]!r}, which {first.path} lacks" if extra
                    else f"lacks column {missing[0]!r}, which {first.path} has")
            raise ValueError(
                f"{f.path} {what}: every input file must have the same id and pass-through columns, or the "
                f"output's part files would not read together as one table. Add or drop the column, or run the "
                f"files as separate jobs.")
        for c in cols:
            fld = f.schema.field(c)
            if c not in fields:
                fields[c] = (fld, f.path)
                continue
            have, origin = fields[c]
            if have.type == fld.type:
                continue
            try:
                merged = pa.unify_schemas([pa.schema([have]), pa.schema([fld])], promote_options="permissive").field(c)
            except (pa.ArrowTypeError, pa.ArrowInvalid):
                raise ValueError(
                    f"{f.path}: column {c!r} is {_type_name(fld.type)} here but {_type_name(have.type)} in {origin}; "
                    f"these types cannot be unified, so the output's part files would not read together as one "
                    f"table. Cast the column to one type in every input file.") from None
            widened.setdefault(c, [f"{_type_name(have.type)} in {origin}"])
            widened[c].append(f"{_type_name(fld.type)} in {f.path}")
            fields[c] = (merged, origin)
    if not fields:
        return UnifiedColumns({})
    unified = pa.schema([fields[c][0] for c in fields])
    types = dict(pl.from_arrow(unified.empty_table()).schema)
    notes = tuple(f"column {c!r} is {', '.join(where)}: unified to {types[c]} in the output"
                  for c, where in widened.items())
    return UnifiedColumns(types, notes)


def _type_name(t: pa.DataType) -> str:
    try:
        return str(pl.from_arrow(pa.schema([pa.field("x", t)]).empty_table()).schema["x"])
    except Exception:  # noqa: BLE001 - a type polars does not know: Arrow's name
        return str(t)


def output_schema(
    id_column: str, id_dtype: pl.DataType, passthrough: dict[str, pl.DataType], n: int,
    structured: bool = False, scored: bool = False, choices: bool = False,
) -> dict[str, pl.DataType]:
    """The output part schema: id, pass-through columns, then the generation columns.

    `generations` (list of strings, one per completion) follows `generation` when n > 1;
    then `valid` and `parsed` when the job is `structured`, and `label` and
    `label_logprobs` when it is `scored`; `choices` last when asked (OpenAI Batch output).
    """
    out: dict[str, pl.DataType] = {id_column: id_dtype, **passthrough}
    for name, dtype in GENERATION_COLUMNS.items():
        out[name] = dtype
        if name == "generation":
            if n > 1:
                out[GENERATIONS_LIST_COLUMN] = pl.List(pl.Utf8())
            if structured or scored:
                out.update(STRUCTURED_COLUMNS)
            if scored:
                out.update(SCORE_COLUMNS)
    if choices:
        out[CHOICES_COLUMN] = pl.Utf8()
    return out
