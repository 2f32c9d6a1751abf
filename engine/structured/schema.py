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
import json
import re
from typing import Any, Callable, Optional

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

    An intersection is closed as a whole: closing each part of an `allOf` would forbid the
    keys its sibling parts declare, so the parts stay open (a direct branch of `allOf`, and a
    `$defs` entry that such a branch names by `$ref`) and the schema holding the `allOf`
    lists every key any part declares (`{}` for those it does not declare itself) with
    `additionalProperties: false`: an object valid under every part is accepted, a key no
    part declares is not. The keys are gathered through the parts' `properties`, local
    `$ref`s, nested `allOf` / `anyOf` / `oneOf` and `then` / `else`; an intersection with a
    part that opens objects itself (`additionalProperties` other than false,
    `patternProperties`, `unevaluatedProperties`) or names a schema outside this one stays
    open. The parts' own sub-schemas are closed as usual. `not`, `if` / `then` / `else` and
    `dependentSchemas` are copied unchanged.

    The argument is never modified; anything that is not a dict (a boolean schema, None) is
    returned as a copy, unchanged.
    """
    return _close(schema, "", _refs_in_all_of(schema), in_all_of=False, root=schema)


def _close(node: Any, pointer: str, keep_open: set[str], in_all_of: bool, root: Any = None) -> Any:
    """`close_objects` of the sub-schema at JSON pointer `pointer` (no exceptions raised)."""
    if not isinstance(node, dict):
        return copy.deepcopy(node)
    out: dict = {}
    for key, value in node.items():
        where = f"{pointer}/{_escape(key)}"
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: _close(sub, f"{where}/{_escape(name)}", keep_open, False, root) for name, sub in value.items()}
        elif key in _SCHEMA_LISTS and isinstance(value, list):
            out[key] = [_close(sub, f"{where}/{i}", keep_open, key == "allOf", root) for i, sub in enumerate(value)]
        elif key in _SCHEMA_ONE and isinstance(value, dict):
            out[key] = _close(value, where, keep_open, False, root)
        else:
            out[key] = copy.deepcopy(value)
    closable = (isinstance(node.get("properties"), dict)
                and not any(k in node for k in _OPENING_KEYWORDS)
                and not in_all_of and "allOf" not in node and pointer not in keep_open)
    if closable:
        out["additionalProperties"] = False
    elif (isinstance(node.get("allOf"), list) and not any(k in node for k in _OPENING_KEYWORDS)
          and not in_all_of and pointer not in keep_open):
        names = _declared_keys(node, root, set())
        if names:  # None: a part opens objects or is unknown; empty: no part is an object with properties
            own = out.get("properties") if isinstance(out.get("properties"), dict) else {}
            out["properties"] = {**own, **{name: {} for name in sorted(names) if name not in own}}
            out["additionalProperties"] = False
    return out


def _declared_keys(node: Any, root: Any, seen: set[str]) -> Optional[set[str]]:
    """The object keys a schema declares (its `properties`, and those of its `allOf` / `anyOf` /
    `oneOf` parts, `then` / `else` and the local `$ref`s it names), or None when it allows keys
    it does not declare (`additionalProperties` other than false, `patternProperties`,
    `unevaluatedProperties`) or names a schema outside this one."""
    if not isinstance(node, dict):
        return set()
    if any(k in node for k in _OPENING_KEYWORDS) and node.get("additionalProperties", False) is not False:
        return None
    if "patternProperties" in node or "unevaluatedProperties" in node:
        return None
    names = set(node["properties"]) if isinstance(node.get("properties"), dict) else set()
    parts: list[Any] = [sub for key in ("allOf", "anyOf", "oneOf") if isinstance(node.get(key), list)
                        for sub in node[key]]
    parts += [node[key] for key in ("then", "else") if isinstance(node.get(key), dict)]
    ref = node.get("$ref")
    if isinstance(ref, str):
        if not ref.startswith("#"):
            return None
        if ref not in seen:
            target = _resolve(root, ref[1:])
            if target is None:
                return None
            seen.add(ref)
            parts.append(target)
    for part in parts:
        more = _declared_keys(part, root, seen)
        if more is None:
            return None
        names |= more
    return names


def _resolve(root: Any, pointer: str) -> Any:
    """The sub-schema of `root` at a JSON pointer (`/$defs/Base`), or None."""
    node = root
    for token in pointer.split("/")[1:] if pointer else []:
        token = token.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and token in node:
            node = node[token]
        elif isinstance(node, list) and token.isdigit() and int(token) < len(node):
            node = node[int(token)]
        else:
            return None
    return node


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


#: Keywords whose value is a {name: sub-schema} map, or a list of sub-schemas, or one sub-schema
#: (for finding where in a schema an error lies; `close_objects` leaves `not`, `if`, ... as they are).
_LOCATE_MAPS = _SCHEMA_MAPS + ("dependentSchemas",)
_LOCATE_ONE = _SCHEMA_ONE + ("not", "if", "then", "else", "contains", "propertyNames", "unevaluatedProperties",
                             "unevaluatedItems")
_DEFS = ("$defs", "definitions")
_MAX_LOCATE_CHECKS = 200  # compiles one search may spend (a schema with thousands of properties is cut short)


def locate_error(schema: Any, error_of: Callable[[Any], Optional[str]], message: str) -> tuple[str, str]:
    """Where in `schema` the problem `message` (what `error_of(schema)` said) lies, and what to say.

    The grammar engines name the problem (`Invalid type: integr`) but not where it is in the
    schema. This compiles sub-schemas on their own (`error_of`: the message for a schema that
    does not compile, else None), each with the root's `$defs` / `definitions` beside it so
    that `#/$defs/...` references resolve, and descends into one that fails: first one that
    fails with the same first line, else one without `$ref` that fails otherwise (an
    unsatisfiable property behind "required property 'a' is unsatisfiable"), `$defs` entries
    before the rest. Where no part fails alone, the keyword of that sub-schema the message
    names (its name, or its text value: `type` for `Invalid type: integr`) ends the path.

    Args:
        schema: the schema that failed (already closed, as the backend compiled it).
        error_of: compiles a schema; returns its error message or None.
        message: `error_of(schema)`.

    Returns:
        (path, message): the path as dotted keys and [indexes], e.g. `properties.age.type`,
        `anyOf[1].type` ("" for the schema itself), and the message of the deepest sub-schema
        that fails (`message` itself when that is the schema). Never raises.
    """
    defs = {k: schema[k] for k in _DEFS if isinstance(schema, dict) and isinstance(schema.get(k), dict)}
    budget = [_MAX_LOCATE_CHECKS]

    def fails(sub: Any) -> Optional[str]:
        if budget[0] <= 0 or not isinstance(sub, (dict, bool)):
            return None
        budget[0] -= 1
        if isinstance(sub, dict) and defs and _has_ref(sub):
            sub = {**defs, **sub}
        try:
            return error_of(sub) or None
        except Exception:  # noqa: BLE001 - a sub-schema the engine cannot even take: not the answer
            return None

    path: list[Any] = []
    node, text = schema, message
    while isinstance(node, dict):
        first = _first_line(text)
        same = other = None
        for step, sub in _children(node, top=node is schema):
            err = fails(sub)
            if err is None:
                continue
            if _first_line(err) == first:
                same = (step, sub, err)
                break
            if other is None and not _has_ref(sub):
                other = (step, sub, err)
        found = same or other
        if found is None:
            key = _named_keyword(node, text)
            if key is not None:
                path.append(key)
            break
        step, node, text = found
        path.extend(step)
    return _dotted(path), text


def _children(node: dict, top: bool) -> list[tuple[tuple[Any, ...], Any]]:
    """(path steps, sub-schema) of a schema's direct sub-schemas, `$defs` entries first (only the
    root's: the others' references cannot be resolved on their own)."""
    first, rest = [], []
    for key, value in node.items():
        if key in _LOCATE_MAPS and isinstance(value, dict):
            into = first if key in _DEFS else rest
            if key in _DEFS and not top:
                continue
            into += [((key, name), sub) for name, sub in value.items()]
        elif key in _SCHEMA_LISTS and isinstance(value, list):
            rest += [((key, i), sub) for i, sub in enumerate(value)]
        elif key in _LOCATE_ONE and isinstance(value, dict):
            rest.append(((key,), value))
    return first + rest


def _named_keyword(node: dict, message: str) -> Optional[str]:
    """The key of `node` that `message` names: the key itself as a word (`minimum` in "Expected f64
    for 'minimum'"), else a text value it quotes (`integr` of `type` in "Invalid type: integr", a
    `$ref` target without its "#"). None when it names none."""
    for key in node:
        if re.search(rf"(?<![\w$]){re.escape(str(key))}(?![\w$])", message):
            return key
    for key, value in node.items():
        if isinstance(value, str) and len(value.lstrip("#")) >= 2 and value.lstrip("#") in message:
            return key
    return None


def _has_ref(node: Any) -> bool:
    if isinstance(node, dict):
        return "$ref" in node or any(_has_ref(v) for v in node.values())
    if isinstance(node, list):
        return any(_has_ref(v) for v in node)
    return False


def _first_line(text: str) -> str:
    lines = str(text).strip().splitlines()
    return lines[0] if lines else ""


def _dotted(path: list[Any]) -> str:
    """`["properties", "age", "type"]` -> `properties.age.type`; indexes as `[1]`, keys that are not
    plain words as `["a.b"]`."""
    out = ""
    for step in path:
        if isinstance(step, int):
            out += f"[{step}]"
        elif re.fullmatch(r"[A-Za-z_$][\w$-]*", str(step)):
            out += f".{step}" if out else str(step)
        else:
            out += f"[{json.dumps(str(step))}]"
    return out
