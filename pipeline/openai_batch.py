"""OpenAI Batch files: request lines in, result and error lines out (the format of OpenAI's Batch API and
of `vllm run-batch`).

A request line is `{"custom_id", "method": "POST", "url", "body"}`, one JSON object per line;
`parse_request_lines` turns each line into one job row (the columns of `REQUEST_COLUMNS`):

- `/v1/chat/completions`: `body.messages` (content a string or a list of text parts) -> `messages`;
- `/v1/completions`: `body.prompt`, a string or a list of token ids -> `prompt` / `prompt_token_ids`;
- the sampling fields of the body -> `sampling_params` (JSON of `engine.SamplingParams` fields):
  max_tokens (max_completion_tokens for chat), temperature, top_p, n, stop, seed, presence_penalty,
  frequency_penalty, logprobs / top_logprobs, response_format (json_object, json_schema), and vLLM's
  top_k, min_p, repetition_penalty, min_tokens, ignore_eos, stop_token_ids, structured_outputs and
  guided_choice / guided_regex / guided_json / guided_grammar. A field the body leaves out takes
  OpenAI's default (temperature 1, top_p 1, n 1), except max_tokens: the job's `max_tokens`.

A line that cannot run becomes a row whose `request_error` names the problem and the line (not JSON, no
`custom_id`, a repeated `custom_id`, another `model` than the job's, a field we do not support such as
`tools`); the job writes it as an error line, never fails. Unknown fields are ignored, as OpenAI does.

`result_line` / `error_line` turn a finished job row back into an output line: `{"id", "custom_id",
"response": {"status_code": 200, "request_id", "body": <chat.completion | text_completion>}, "error":
null}`, with `usage` (prompt_tokens, completion_tokens, prompt_tokens_details.cached_tokens), and for an
error `{"id", "custom_id", "response": {"status_code": 400, ...}, "error": {"code", "message"}}`.
"""
from __future__ import annotations

import hashlib
import json
import math
import re
from typing import Any, Iterable, Optional, Sequence

CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"
URLS = (CHAT_URL, COMPLETIONS_URL)

REQUEST_SUFFIXES = (".jsonl", ".jsonl.gz")
"""The file names a job reads as OpenAI Batch request files."""
BOM = "\ufeff"
"""The UTF-8 byte-order mark some tools (Windows' among them) write before a JSONL file's first line."""

# The job row of one request line: name -> Arrow type name (the staged Parquet's schema, `batch_files`).
# `custom_id` is the id column; `prompt` / `messages` / `prompt_token_ids` the prompt; `sampling_params`,
# `chat_template` (false for /v1/completions: the prompt as given) and `request_error` are read by
# `pipeline.schema.build_request`; `line`, `url`, `model` and `error_code`
# pass through to the output (the result and error lines are written from them).
REQUEST_COLUMNS = ("custom_id", "line", "url", "model", "prompt", "messages", "prompt_token_ids",
                   "sampling_params", "chat_template", "request_error", "error_code")

UNSUPPORTED_FIELDS = ("tools", "tool_choice", "functions", "function_call", "parallel_tool_calls", "audio",
                      "stream", "stream_options", "logit_bias", "prediction", "web_search_options", "suffix",
                      "echo", "best_of")
"""Body fields that change what a request means and that a job cannot honour: a line that sets one (to
anything but null, false, an empty list, or best_of 1) is an error line naming it."""

TEXT_PART_TYPES = ("text", "input_text")

# body field -> SamplingParams field, taken as given (SamplingParams.validate judges the values)
_DIRECT = {"temperature": "temperature", "top_p": "top_p", "n": "n", "seed": "seed",
           "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty",
           "top_k": "top_k", "min_p": "min_p", "repetition_penalty": "repetition_penalty",
           "min_tokens": "min_tokens", "ignore_eos": "ignore_eos", "stop_token_ids": "stop_token_ids"}

OPENAI_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "n": 1}
"""What a body that leaves these fields out gets (OpenAI's defaults), whatever the job's defaults."""


class LineError(ValueError):
    """A request line that cannot run: `code` (OpenAI-style: invalid_json, missing_custom_id,
    duplicate_custom_id, model_not_found, unsupported_field, invalid_request) and the message."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def model_names(model: str, served: Optional[Sequence[str]] = None) -> set[str]:
    """The `model` values a line may give for a job of `model` (lowercase): the job's model, its file or
    folder name (without .gguf), and `served` (the job's `served_model_name`); a Hugging Face style
    "org/name" matches on its name."""
    names = {model.lower()}
    base = model.rstrip("/").rsplit("/", 1)[-1].lower()
    names |= {base, base.removesuffix(".gguf")}
    names |= {s.lower() for s in served or ()}
    return names


def model_matches(value: str, names: set[str]) -> bool:
    """Whether a line's `model` names the job's model (`model_names`)."""
    v = value.lower()
    return v in names or v.rsplit("/", 1)[-1] in names


def _set(value: Any) -> bool:
    return value is not None and value is not False and value != [] and value != {}


def _text_of(content: Any, where: str) -> str:
    """A message's content as text: a string, or a list of text parts joined with newlines."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in TEXT_PART_TYPES:
                shown = repr(kind) if kind is not None else f"{type(part).__name__} {part!r}"[:60]
                raise LineError("unsupported_field", f"{where}.content[{j}] is a {shown} part; only text parts "
                                                     f"are supported")
            text = part.get("text")
            if not isinstance(text, str):
                raise LineError("invalid_request", f"{where}.content[{j}].text must be a string")
            texts.append(text)
        return "\n".join(texts)
    raise LineError("invalid_request", f"{where}.content must be a string or a list of text parts, got "
                                       f"{type(content).__name__}")


def chat_messages(messages: Any) -> list[dict[str, str]]:
    """A chat body's `messages` as [{role, content}] with text content ("developer" is "system").

    Raises:
        LineError: not a list of messages, a tool call or a part that is not text (unsupported_field).
    """
    if not isinstance(messages, list) or not messages:
        raise LineError("invalid_request", "body.messages must be a non-empty list of messages")
    out = []
    for i, m in enumerate(messages):
        where = f"body.messages[{i}]"
        if not isinstance(m, dict):
            raise LineError("invalid_request", f"{where} must be an object with role and content")
        for key in ("tool_calls", "function_call", "audio"):
            if _set(m.get(key)):
                raise LineError("unsupported_field", f"{where}.{key} is not supported")
        role = m.get("role")
        if role == "developer":
            role = "system"
        if role in ("tool", "function"):
            raise LineError("unsupported_field", f"{where}.role {role!r} (tool results) is not supported")
        out.append({"role": role, "content": _text_of(m.get("content"), where)})
    return out


def _prompt(body: dict) -> tuple[Optional[str], Optional[list[int]]]:
    """A completions body's prompt: (text, None) or (None, token ids)."""
    p = body.get("prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]  # a batch of one prompt
    if isinstance(p, str):
        return p, None
    if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
        return None, list(p)
    if isinstance(p, list) and len(p) > 1:
        raise LineError("unsupported_field", "body.prompt holds several prompts; give one prompt per line")
    raise LineError("invalid_request", "body.prompt must be a string or a list of token ids")


def _response_format(rf: Any) -> Optional[dict]:
    """`response_format` as StructuredOutputsParams fields (None for text)."""
    if rf is None:
        return None
    kind = rf.get("type") if isinstance(rf, dict) else None
    if kind in (None, "text") and isinstance(rf, dict):
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        js = rf.get("json_schema")
        schema = js.get("schema") if isinstance(js, dict) else None
        if not isinstance(schema, dict):
            raise LineError("invalid_request", "body.response_format.json_schema.schema must be a JSON Schema "
                                               "object")
        return {"json": schema}
    raise LineError("invalid_request", f"body.response_format.type must be text, json_object or json_schema, "
                                       f"got {kind!r}")


def sampling_fields(body: dict, chat: bool) -> dict[str, Any]:
    """The SamplingParams fields a body sets (OpenAI's defaults for temperature, top_p and n).

    Raises:
        LineError: a response_format or guided field that is malformed, or two constraints at once.
    """
    out: dict[str, Any] = dict(OPENAI_DEFAULTS)
    for key, name in _DIRECT.items():
        if body.get(key) is not None:
            out[name] = body[key]
    mt = body.get("max_completion_tokens") if chat else None
    mt = mt if mt is not None else body.get("max_tokens")
    if mt is not None:
        out["max_tokens"] = mt
    if body.get("stop") is not None:
        out["stop"] = [body["stop"]] if isinstance(body["stop"], str) else body["stop"]
    if chat:
        if body.get("logprobs"):
            out["logprobs"] = body.get("top_logprobs") or 0
    elif body.get("logprobs") is not None:
        out["logprobs"] = body["logprobs"]
    constraints = []
    if (so := _response_format(body.get("response_format"))) is not None:
        constraints.append(("response_format", so))
    if isinstance(body.get("structured_outputs"), dict):
        constraints.append(("structured_outputs", dict(body["structured_outputs"])))
    for key, name in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                      ("guided_grammar", "grammar")):
        if body.get(key) is not None:
            value = body[key]
            if key == "guided_json" and isinstance(value, str):
                try:
                    value = json.loads(value)
                except json.JSONDecodeError as exc:
                    raise LineError("invalid_request", f"body.guided_json is not valid JSON: {exc.msg}") from None
            constraints.append((key, {name: value}))
    if len(constraints) > 1:
        raise LineError("invalid_request", f"set at most one output constraint, got {[k for k, _ in constraints]}")
    if constraints:
        out["structured_outputs"] = constraints[0][1]
    return out


_BODY_ONLY = ("prompt_logprobs", "skip_special_tokens", "score_choices")  # SamplingParams fields no body field sets


def body_fields(fields: dict[str, Any], chat: bool) -> dict[str, Any]:
    """SamplingParams fields as the body fields that `sampling_fields` maps back to them (its inverse):
    `max_tokens`, `logprobs` (chat: `logprobs` true and `top_logprobs`), a structured output as
    `response_format` (json_object; json_schema, strict) or vLLM's `structured_outputs`, the rest by name.

    Raises:
        LineError: a field no request body can carry (`prompt_logprobs`, `score_choices`, a
            `skip_special_tokens` other than true, a name SamplingParams does not have), named.
    """
    inverse = {v: k for k, v in _DIRECT.items()}
    body: dict[str, Any] = {}
    for name, value in fields.items():
        if value is None or (name == "skip_special_tokens" and value is True):
            continue
        if name in inverse:
            body[inverse[name]] = value
        elif name in ("max_tokens", "stop"):
            body[name] = value
        elif name == "logprobs":
            if chat:
                body["logprobs"] = True
                if value:
                    body["top_logprobs"] = value
            else:
                body["logprobs"] = value
        elif name == "structured_outputs":
            if not isinstance(value, dict):
                raise LineError("invalid_request", f"structured_outputs must be an object, got {value!r}"[:200])
            so = dict(value)
            if so == {"json_object": True}:
                body["response_format"] = {"type": "json_object"}
            elif set(so) == {"json"} and isinstance(so["json"], dict):
                body["response_format"] = {"type": "json_schema", "json_schema": {
                    "name": "output", "schema": so["json"], "strict": True}}
            else:
                body["structured_outputs"] = so
        else:
            why = "has no OpenAI Batch body field" if name in _BODY_ONLY else "is not a SamplingParams field"
            raise LineError("unsupported_field", f"sampling field {name} {why}")
    return body


def parse_request(obj: Any, models: Optional[set[str]] = None) -> dict[str, Any]:
    """One request object -> its row's prompt and sampling columns (`REQUEST_COLUMNS` less the bookkeeping).

    Args:
        obj: the line's JSON value.
        models: the `model` values this job answers (`model_names`); None accepts any.

    Raises:
        LineError: why the line cannot run (its `code` and message, without the line number).
    """
    _require_object(obj)
    url = obj.get("url")
    if url not in URLS:
        raise LineError("invalid_url", f"url {url!r} is not supported; use {CHAT_URL} or {COMPLETIONS_URL}")
    method = obj.get("method", "POST")
    if str(method).upper() != "POST":
        raise LineError("invalid_request", f"method must be POST, got {method!r}")
    body = obj.get("body")
    if not isinstance(body, dict):
        raise LineError("invalid_request", "body must be a JSON object")
    model = body.get("model")
    if model is not None and models is not None and not (isinstance(model, str) and model_matches(model, models)):
        raise LineError("model_not_found", f"model {model!r} is not this job's model ({sorted(models)[0]}); "
                                           f"name it, or give the job --served-model-name {model}")
    unsupported = [k for k in UNSUPPORTED_FIELDS if _set(body.get(k)) and not (k == "best_of" and body[k] == 1)]
    if unsupported:
        raise LineError("unsupported_field", f"body.{unsupported[0]} is not supported by tokenmill")
    modalities = body.get("modalities")
    if modalities is not None and modalities != ["text"]:
        raise LineError("unsupported_field", f"body.modalities {modalities!r}: only text output is supported")
    chat = url == CHAT_URL
    row: dict[str, Any] = {"url": url, "model": model if isinstance(model, str) else None}
    if chat:
        row["messages"] = json.dumps(chat_messages(body.get("messages")), ensure_ascii=False)
    else:
        row["prompt"], row["prompt_token_ids"] = _prompt(body)
        row["chat_template"] = False  # a completions prompt is the text the model continues
    row["sampling_params"] = json.dumps(sampling_fields(body, chat), ensure_ascii=False, sort_keys=True)
    return row


def _empty_row(line: int) -> dict[str, Any]:
    return {c: None for c in REQUEST_COLUMNS} | {"line": line}


def parse_request_lines(lines: Iterable[bytes | str], models: Optional[set[str]] = None,
                        seen: Optional[dict[str, str]] = None, source: str = "") -> list[dict[str, Any]]:
    """Every non-blank line of a request file -> one row (`REQUEST_COLUMNS`), in file order.

    Args:
        lines: the file's lines (bytes or text), numbered from 1.
        models: the `model` values the job answers (`model_names`); None accepts any.
        seen: custom_id -> where it was first seen ("line 3", "a.jsonl line 3"), shared across the files
            of one input, so that a repeat in a later file is found too; updated.
        source: the file's name for messages ("" for one file: messages say `line 7`).

    A UTF-8 byte-order mark (`BOM`, as Windows tools write) that starts a line is not part of it.
    A bad line's row has `request_error` ("line 7: custom_id 'a' repeats line 3's; ...") and
    `error_code`; a repeated custom_id's row has no custom_id (the first line's result keeps it,
    so an id names one output line).
    """
    seen = {} if seen is None else seen
    rows = []
    where_prefix = f"{source} line" if source else "line"
    for number, raw in enumerate(lines, start=1):
        row = _empty_row(number)
        where = f"{where_prefix} {number}"
        obj = None
        try:
            obj = json_line(raw)
            if obj is BLANK:
                continue
            _require_object(obj)  # (before its custom_id is read; parse_request checks it for its own callers)
            cid = obj.get("custom_id")
            if cid is not None and not isinstance(cid, str):  # 42 and "42" would be one id, so neither is made up
                raise LineError("invalid_request", f"custom_id must be a string, got {_json_kind(cid)} "
                                                   f"{json.dumps(cid)[:40]}")
            if not cid:
                raise LineError("missing_custom_id", "no custom_id (each request line needs a custom_id string)")
            if cid in seen:
                raise LineError("duplicate_custom_id", f"custom_id {cid!r} repeats {seen[cid]}'s; each request "
                                                       f"needs its own custom_id")
            seen[cid] = where
            row["custom_id"] = cid
            row.update(parse_request(obj, models))
        except LineError as exc:
            row["request_error"] = f"{where}: {exc}"
            row["error_code"] = exc.code
            if isinstance(obj, dict):
                row["url"] = obj.get("url") if isinstance(obj.get("url"), str) else None
        rows.append(row)
    return rows


def _require_object(obj: Any) -> None:
    """Raise the LineError of a request line that is not a JSON object (naming the JSON type it is)."""
    if not isinstance(obj, dict):
        raise LineError("invalid_request", f"a request line must be a JSON object, got {_json_kind(obj)}")


def _json_kind(value: Any) -> str:
    """The JSON type of a parsed value, in JSON's words (object, array, string, number, boolean, null)."""
    if isinstance(value, dict):
        return "object"
    if isinstance(value, list):
        return "array"
    if isinstance(value, str):
        return "string"
    if isinstance(value, bool):
        return "boolean"
    return "null" if value is None else "number"


BLANK = object()
"""What `json_line` gives for a blank line (JSON's null is None)."""


def json_line(raw: bytes | str) -> Any:
    """One JSONL line (bytes: UTF-8, bad bytes replaced) -> its JSON value, or `BLANK` for a blank line.
    A byte-order mark (`BOM`) that starts the line is skipped: before line 1 as Windows tools write it,
    before a later one where two such files were joined end to end (U+FEFF cannot start a JSON text).

    Raises:
        LineError: invalid_json, with JSON's reason and column.
    """
    text = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else raw
    text = text.removeprefix(BOM)
    if not text.strip():
        return BLANK
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise LineError("invalid_json", f"not valid JSON ({exc.msg} at column {exc.colno})") from None


# ---------------------------------------------------------------- output lines

def request_id(job_id: str, custom_id: Optional[str], line: Any) -> str:
    """A stable id for one request of a job (the same in a rerun): 24 hex digits."""
    return hashlib.blake2b(f"{job_id}:{custom_id}:{line}".encode(), digest_size=12).hexdigest()


def choices_cell(out: Any, tokenizer: Any, top_n: int = 0) -> str:
    """An engine RequestOutput's completions as the JSON text of a job row's `choices` column:
    [{"text", "finish_reason", "logprobs": [{"token", "logprob", "top": [[token, logprob], ...]}] | null}],
    tokens as text (`tokenizer.decode` of the one token), `top` the `top_n` most likely (the request's
    `SamplingParams.logprobs`)."""
    def tok(i: int) -> str:
        return tokenizer.decode([i], skip_special_tokens=False)

    choices = []
    for c in out.outputs or []:
        lps = None
        if c.logprobs is not None:
            lps = []
            for t, top in zip(c.token_ids, c.logprobs):
                ranked = sorted(top.items(), key=lambda kv: -kv[1])
                lps.append({"token": tok(t), "logprob": _finite(top.get(t, -9999.0)),
                            "top": [[tok(k), _finite(v)] for k, v in ranked[:top_n]]})
        choices.append({"text": c.text, "finish_reason": c.finish_reason, "logprobs": lps})
    return json.dumps(choices, ensure_ascii=False)


def _finite(v: float) -> float:
    return float(v) if math.isfinite(v) else -9999.0  # OpenAI's floor for an impossible token


def _chat_logprobs(lps: Optional[list]) -> Optional[dict]:
    if lps is None:
        return None
    return {"content": [{"token": e["token"], "logprob": e["logprob"], "bytes": list(e["token"].encode()),
                         "top_logprobs": [{"token": t, "logprob": v, "bytes": list(t.encode())}
                                          for t, v in e["top"]]} for e in lps],
            "refusal": None}


def _text_logprobs(lps: Optional[list]) -> Optional[dict]:
    if lps is None:
        return None
    offsets, at = [], 0
    for e in lps:
        offsets.append(at)
        at += len(e["token"])
    return {"tokens": [e["token"] for e in lps], "token_logprobs": [e["logprob"] for e in lps],
            "top_logprobs": [dict(e["top"]) for e in lps], "text_offset": offsets}


def usage(row: dict) -> dict[str, Any]:
    """A job row's token counts as OpenAI's `usage` (cached_tokens: prompt tokens the prefix cache served)."""
    p, c = int(row.get("prompt_tokens") or 0), int(row.get("completion_tokens") or 0)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
            "prompt_tokens_details": {"cached_tokens": int(row.get("cached_tokens") or 0)}}


def result_line(row: dict, job_id: str, model: str, created: int) -> dict[str, Any]:
    """A finished, good job row (the `REQUEST_COLUMNS` that pass through, the generation columns and
    `choices`) as an OpenAI Batch output line with a chat.completion or text_completion body.

    Args:
        job_id: the job's id (ids in the line are derived from it and the row's custom_id).
        model: the model named in the body when the line named none.
        created: Unix seconds for the body's `created`.
    """
    rid = request_id(job_id, row.get("custom_id"), row.get("line"))
    chat = row.get("url") == CHAT_URL
    cells = json.loads(row["choices"]) if row.get("choices") else [
        {"text": row.get("generation") or "", "finish_reason": row.get("finish_reason"), "logprobs": None}]
    choices = []
    for i, c in enumerate(cells):
        if chat:
            choices.append({"index": i, "message": {"role": "assistant", "content": c["text"], "refusal": None},
                            "finish_reason": c["finish_reason"], "logprobs": _chat_logprobs(c["logprobs"])})
        else:
            choices.append({"index": i, "text": c["text"], "finish_reason": c["finish_reason"],
                            "logprobs": _text_logprobs(c["logprobs"])})
    body = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{rid}", "object": "chat.completion" if chat else "text_completion",
            "created": int(created), "model": row.get("model") or model, "choices": choices, "usage": usage(row),
            "system_fingerprint": f"tokenmill-{job_id}"}
    return {"id": f"batch_req_{rid}", "custom_id": row.get("custom_id"),
            "response": {"status_code": 200, "request_id": rid, "body": body}, "error": None}


_NAMES_ITS_LINE = re.compile(r"(\S+ )?line \d+: ")  # the parser's "line 3: ..." / "a.jsonl line 3: ..."


def error_line(row: dict, job_id: str) -> dict[str, Any]:
    """A failed job row as an OpenAI Batch error line: `error` {code, message} (the row's `error_code`, else
    invalid_request), and a `response` with status 400 whose body holds the same error. A message the engine
    wrote (a value it refuses) is prefixed with the request's line, as the parser's messages are."""
    rid = request_id(job_id, row.get("custom_id"), row.get("line"))
    code = row.get("error_code") or "invalid_request"
    message = row.get("error") or "request failed"
    if row.get("line") is not None and not _NAMES_ITS_LINE.match(message):
        message = f"line {row['line']}: {message}"
    return {"id": f"batch_req_{rid}", "custom_id": row.get("custom_id"),
            "response": {"status_code": 400, "request_id": rid,
                         "body": {"error": {"message": message, "type": "invalid_request_error", "param": None,
                                            "code": code}}},
            "error": {"code": code, "message": message}}


def request_counts(total: int, completed: int, failed: int) -> dict[str, int]:
    """OpenAI's `request_counts` of a batch: requests in it, those that completed, those that failed."""
    return {"total": total, "completed": completed, "failed": failed}


# ---------------------------------------------------------------- reading output lines back

RESULT_FIELDS = ("custom_id", "id", "request_id", "status_code", "object", "model", "created", "content",
                 "finish_reason", "choices", "prompt_tokens", "completion_tokens", "total_tokens", "cached_tokens",
                 "error_code", "error_message")
"""The fields `parse_result_line` reads from one output or error line (`content` / `finish_reason`: the
first choice's; `choices`: every choice as {content, finish_reason})."""


def _int_field(value: Any, where: str) -> Optional[int]:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value):
        raise LineError("invalid_result", f"{where} must be an integer, got {value!r}"[:200])
    return int(value)


def _str_field(value: Any, where: str) -> Optional[str]:
    if value is None or isinstance(value, str):
        return value
    raise LineError("invalid_result", f"{where} must be a string, got {value!r}"[:200])


def parse_result_line(obj: Any) -> dict[str, Any]:
    """One OpenAI Batch output or error line (ours, OpenAI's, `vllm run-batch`'s) -> `RESULT_FIELDS`.

    A chat choice's text is its `message.content`, a completion's its `text`. The error is the line's
    `error`, else (a status other than 200) the body's `error`.

    Raises:
        LineError: not an object, neither `response` nor `error`, or a field of the wrong type (named).
    """
    if not isinstance(obj, dict):
        raise LineError("invalid_result", f"an output line must be a JSON object, got {type(obj).__name__}")
    response, error = obj.get("response"), obj.get("error")
    if not isinstance(response, dict) and not isinstance(error, dict):
        raise LineError("invalid_result", "neither a response nor an error object")
    response = response if isinstance(response, dict) else {}
    body = response.get("body") if isinstance(response.get("body"), dict) else {}
    status = _int_field(response.get("status_code"), "response.status_code")
    if not isinstance(error, dict) and status not in (None, 200) and isinstance(body.get("error"), dict):
        error = body["error"]
    choices = []
    for i, c in enumerate(body.get("choices") or []):
        if not isinstance(c, dict):
            raise LineError("invalid_result", f"response.body.choices[{i}] must be an object")
        message = c.get("message")
        text = message.get("content") if isinstance(message, dict) else c.get("text")
        choices.append({"content": _str_field(text, f"response.body.choices[{i}] text"),
                        "finish_reason": _str_field(c.get("finish_reason"), f"response.body.choices[{i}].finish_reason")})
    use = body.get("usage") if isinstance(body.get("usage"), dict) else {}
    details = use.get("prompt_tokens_details") if isinstance(use.get("prompt_tokens_details"), dict) else {}
    err = error if isinstance(error, dict) else {}
    cid = obj.get("custom_id")
    return {
        "custom_id": str(cid) if isinstance(cid, (int, float)) and not isinstance(cid, bool) else
        _str_field(cid, "custom_id"),
        "id": _str_field(obj.get("id"), "id"),
        "request_id": _str_field(response.get("request_id"), "response.request_id"),
        "status_code": status,
        "object": _str_field(body.get("object"), "response.body.object"),
        "model": _str_field(body.get("model"), "response.body.model"),
        "created": _int_field(body.get("created"), "response.body.created"),
        "content": choices[0]["content"] if choices else None,
        "finish_reason": choices[0]["finish_reason"] if choices else None,
        "choices": choices or None,
        "prompt_tokens": _int_field(use.get("prompt_tokens"), "usage.prompt_tokens"),
        "completion_tokens": _int_field(use.get("completion_tokens"), "usage.completion_tokens"),
        "total_tokens": _int_field(use.get("total_tokens"), "usage.total_tokens"),
        "cached_tokens": _int_field(details.get("cached_tokens"), "usage.prompt_tokens_details.cached_tokens"),
        "error_code": None if err.get("code") is None else str(err.get("code")),
        "error_message": None if err.get("message") is None else str(err.get("message")),
    }
