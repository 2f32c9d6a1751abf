"""JSON objects are closed by default: a schema's `properties` are the keys an object may have.

JSON Schema lets an object carry keys its `properties` do not list unless the schema says
`additionalProperties: false`; a grammar engine that reads a schema that way (llguidance
does) lets a model add keys of its own, so a `Label` with `topic` and `confidence` comes
back with a `reason` too. vLLM's default backend (xgrammar in its default strict mode)
closes objects instead, and so does this module, before either backend sees a schema.
`additionalProperties: true` (or a schema for the extra values) keeps an object open.
"""
from __future__ import annotations

import copy
from typing import Any, Optional

#: Keywords that already say what an object does with keys outside `properties`.
_OPENING_KEYWORDS = ("additionalProperties", "patternProperties", "unevaluatedProperties")
#: Keywords whose value is a {name: sub-schema} map.
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
#: Keywords whose value is a list of sub-schemas (`items` may also be one, as `additionalItems` is).
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
_SCHEMA_ONE = ("items", "additionalItems", "additionalProperties")


def close_objects(schema: Any) -> Any:
    """A copy of `schema` in which every object that lists `properties` allows no other keys.

    An object schema with a `properties` map and none of `additionalProperties`,
    `patternProperties`, `unevaluatedProperties` gets `additionalProperties: false`; one that
    sets any of them keeps its own rule. Sub-schemas are closed too, wherever they sit:
    `properties`, `patternProperties`, `additionalProperties` (a schema), `items`,
    `prefixItems`, `additionalItems`, `$defs` / `definitions`, `anyOf`, `oneOf`, `allOf`.
    Objects that only make sense as part of an intersection stay open, since closing them
    would forbid the keys the other parts declare: a direct branch of `allOf`, a schema
    that has an `allOf`, and a `$defs` entry that an `allOf` branch names by `$ref`. Their
    own sub-schemas are closed as usual. `not`, `if` / `then` / `else` and `dependentSchemas`
    are copied unchanged.

    The argument is never modified; anything that is not a dict (a boolean schema, None) is
    returned as a copy, unchanged.
    """
    return _close(schema, "", _refs_in_all_of(schema), in_all_of=False)


def _close(node: Any, pointer: str, keep_open: set[str], in_all_of: bool) -> Any:
    """`close_objects` of the sub-schema at JSON pointer `pointer` (no exceptions raised)."""
    if not isinstance(node, dict):
        return copy.deepcopy(node)
    out: dict = {}
    for key, value in node.items():
        where = f"{pointer}/{_escape(key)}"
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: _close(sub, f"{where}/{_escape(name)}", keep_open, False) for name, sub in value.items()}
        elif key in _SCHEMA_LISTS and isinstance(value, list):
            out[key] = [_close(sub, f"{where}/{i}", keep_open, key == "allOf") for i, sub in enumerate(value)]
        elif key in _SCHEMA_ONE and isinstance(value, dict):
            out[key] = _close(value, where, keep_open, False)
        else:
            out[key] = copy.deepcopy(value)
    closable = (isinstance(node.get("properties"), dict)
                and not any(k in node for k in _OPENING_KEYWORDS)
                and not in_all_of and "allOf" not in node and pointer not in keep_open)
    if closable:
        out["additionalProperties"] = False
    return out


def _refs_in_all_of(node: Any, found: Optional[set[str]] = None) -> set[str]:
    """JSON pointers (without the leading '#') of the local `$ref`s that are direct `allOf` branches."""
    found = set() if found is None else found
    if isinstance(node, dict):
        branches = node.get("allOf")
        if isinstance(branches, list):
            for b in branches:
                ref = b.get("$ref") if isinstance(b, dict) else None
                if isinstance(ref, str) and ref.startswith("#"):
                    found.add(ref[1:])
        for value in node.values():
            _refs_in_all_of(value, found)
    elif isinstance(node, list):
        for value in node:
            _refs_in_all_of(value, found)
    return found


def _escape(name: Any) -> str:
    """One JSON pointer token (RFC 6901: '~' as '~0', '/' as '~1')."""
    return str(name).replace("~", "~0").replace("/", "~1")
