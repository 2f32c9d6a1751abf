"""`StructuredOutputsParams`: what a request's output must match (vLLM's names).

Exactly one kind is set per request:

- `json`: a JSON Schema (a dict, its JSON text, or a pydantic model class);
- `regex`: a regular expression the whole output matches (Rust `regex` syntax);
- `choice`: a list of strings, the output is exactly one of them;
- `grammar`: a Lark grammar (or GBNF / EBNF text, converted to Lark);
- `json_object`: True for any JSON object.

Objects in a JSON Schema are closed by default, as in vLLM's default (xgrammar's strict
mode): an object schema that lists `properties` and says nothing of other keys is read as
`additionalProperties: false` (`schema.close_objects`); `additionalProperties: true` keeps
it open.

JSON is compact by default (`disable_any_whitespace=True`): no whitespace between
tokens of the JSON text, so a model cannot loop on blanks until `max_tokens`. This is
the opposite of vLLM's default; set it False for JSON with free whitespace.

`validate` returns a message naming the bad field instead of raising, so that one bad
constraint becomes that request's error. Whether a regex, schema or grammar compiles is
the grammar backend's question (`engine.structured.backend`), asked once per distinct
constraint (`key`).
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any, Optional, Union

from .schema import close_objects

KINDS = ("json", "regex", "choice", "grammar", "json_object")


def _schema_of(value: Any) -> Any:
    """A pydantic model class -> its JSON Schema dict; anything else unchanged."""
    if isinstance(value, type) and hasattr(value, "model_json_schema"):
        return value.model_json_schema()
    return value


@dataclass
class StructuredOutputsParams:
    """One request's output constraint (vLLM's `StructuredOutputsParams` fields).

    Attributes:
        json: JSON Schema as a dict or JSON text (a pydantic `BaseModel` subclass is turned
            into its `model_json_schema()` at construction). Objects are closed by default:
            one that lists `properties` without `additionalProperties` (or
            `patternProperties` / `unevaluatedProperties`) allows no other keys; set
            `"additionalProperties": true` to allow them. The given dict is never modified.
        regex: regular expression the whole output must match.
        choice: the allowed outputs (non-empty, distinct, non-empty strings).
        grammar: Lark grammar text (GBNF / EBNF accepted and converted).
        json_object: True for any JSON object (`{"type": "object"}`).
        disable_any_whitespace: compact JSON (no whitespace between JSON tokens); default True.
    """

    json: Optional[Union[dict, str, Any]] = None
    regex: Optional[str] = None
    choice: Optional[list] = None
    grammar: Optional[str] = None
    json_object: Optional[bool] = None
    disable_any_whitespace: bool = True

    def __post_init__(self) -> None:
        self.json = _schema_of(self.json)
        if isinstance(self.choice, tuple):
            self.choice = list(self.choice)

    @property
    def kind(self) -> Optional[str]:
        """The one kind set ("json", "regex", "choice", "grammar", "json_object"), or None."""
        set_kinds = self._set_kinds()
        return set_kinds[0] if len(set_kinds) == 1 else None

    @property
    def is_json(self) -> bool:
        """True for `json` and `json_object` constraints (outputs parse as JSON)."""
        return self.kind in ("json", "json_object")

    def _set_kinds(self) -> list[str]:
        return [k for k in KINDS if getattr(self, k) not in (None, False)]

    def validate(self) -> Optional[str]:
        """None if the fields are well-formed, else a message naming the field (never raises)."""
        set_kinds = self._set_kinds()
        if len(set_kinds) != 1:
            return (f"structured_outputs: set exactly one of {list(KINDS)}, got "
                    f"{set_kinds if set_kinds else 'none'}")
        kind = set_kinds[0]
        v = getattr(self, kind)
        if kind == "json":
            if isinstance(v, str):
                try:
                    v = json.loads(v)
                except json.JSONDecodeError as exc:
                    return f"structured_outputs.json: not valid JSON: {exc.msg} at position {exc.pos}"
            if not isinstance(v, (dict, bool)):
                return f"structured_outputs.json: a JSON Schema must be an object, got {type(v).__name__}"
        elif kind in ("regex", "grammar"):
            if not isinstance(v, str) or not v:
                return f"structured_outputs.{kind}: must be a non-empty string, got {v!r}"
        elif kind == "choice":
            if not isinstance(v, list) or not v:
                return f"structured_outputs.choice: must be a non-empty list of strings, got {v!r}"
            for c in v:
                if not isinstance(c, str) or not c:
                    return f"structured_outputs.choice: every choice must be a non-empty string, got {c!r}"
            dup = sorted({c for c in v if v.count(c) > 1})
            if dup:
                return f"structured_outputs.choice: duplicate choice(s) {dup}"
        elif kind == "json_object" and v is not True:
            return f"structured_outputs.json_object: must be True, got {v!r}"
        if not isinstance(self.disable_any_whitespace, bool):
            return f"structured_outputs.disable_any_whitespace: must be a bool, got {self.disable_any_whitespace!r}"
        return None

    def spec(self) -> Any:
        """The constraint's content in canonical form (a schema dict, the text, the list).

        A JSON Schema comes back as a new dict with its objects closed (`close_objects`:
        `additionalProperties: false` wherever an object lists `properties` and says nothing
        of other keys), so both grammar backends, and `key()`, see the same closed schema.

        Raises:
            json.JSONDecodeError: `json` is text that does not parse (`validate()` says so first).
        """
        kind = self.kind
        v = getattr(self, kind) if kind else None
        if kind == "json":
            v = close_objects(json.loads(v) if isinstance(v, str) else v)
        if kind == "json_object":
            v = {"type": "object"}
        return v

    def key(self) -> str:
        """A content hash (sha256 hex) of the constraint: equal constraints compile once.

        Schemas are hashed as canonical JSON (sorted keys), so key order does not matter.
        Call only after `validate()` returned None.
        """
        doc = json.dumps([self.kind, self.spec(), self.disable_any_whitespace if self.is_json else None],
                         sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(doc.encode()).hexdigest()
