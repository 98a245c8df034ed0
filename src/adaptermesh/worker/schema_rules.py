"""The rules a JSON schema must meet before the grammar enforces it, and the schema the grammar
is compiled from. This module owns them; ``structured_request`` (a 400 at parse time) and
``grammar`` (at compile time) both call ``enforceable_schema``.

* **Depth.** A schema nests at most ``MAX_SCHEMA_DEPTH`` JSON levels, counted from the schema
  itself (the schema object is level 1). OpenAI's strict mode allows 10 nested object levels
  and 5,000 properties (its Structured Outputs guide, "Supported schemas"); one object level
  is 2 JSON levels (``properties``, the name) and at most 4 when each is an array of
  ``anyOf`` branches, so 64 admits OpenAI's deepest schemas with room to spare and 32 levels
  of plain nested objects. The request body's own nesting bound (``httpserve``) counts the
  schema's levels from the schema, so this is the limit a schema meets, with a 400 naming the
  schema's field.
* **Formats.** Every ``format`` on a schema that admits strings is one of
  ``schema_formats.ENFORCED_FORMATS`` (replaced by its patterns) or a 400 naming it.
* **Satisfiable.** Bounds that contradict each other, a closed object that cannot hold its
  required keys or ``minProperties``, an empty ``enum`` or ``type`` list: a 400 naming the
  keyword's path, since no output can be valid.
* **Open objects.** ``open_keys`` says whether some object in the schema admits keys beyond
  a fixed list (``additionalProperties`` not false, ``patternProperties``): only such objects
  can repeat a key, and the grammar's matcher then refuses tokens that would.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from adaptermesh.worker.schema_formats import ENFORCED_FORMATS, format_patterns
from adaptermesh.worker.types import ParamError

__all__ = [
    "MAX_SCHEMA_DEPTH",
    "EnforceableSchema",
    "SchemaError",
    "closed_objects",
    "enforceable_schema",
    "json_depth",
]

MAX_SCHEMA_DEPTH = 64

_MAPS = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")
_VALUES = (
    "items",
    "additionalProperties",
    "unevaluatedProperties",
    "unevaluatedItems",
    "not",
    "contains",
    "propertyNames",
    "if",
    "then",
    "else",
    "additionalItems",
)
_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")


def closed_objects(schema: Any, close: bool = True) -> Any:
    """``schema`` with every object schema that lists ``properties`` and says nothing about
    ``additionalProperties`` closed to them (``additionalProperties: false``), as OpenAI's
    strict schemas are and vLLM's default engine treats them. Every output still validates
    against the original schema; a model just cannot add keys nobody asked for. The parts of
    an ``allOf`` stay open (each lists only some of the properties the whole allows)."""
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key in _MAPS and isinstance(value, dict):
            out[key] = {name: closed_objects(sub) for name, sub in value.items()}
        elif key in _VALUES:
            out[key] = closed_objects(value)
        elif key in _LISTS and isinstance(value, list):
            out[key] = [closed_objects(sub, key != "allOf") for sub in value]
        else:
            out[key] = value
    if close and "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


class SchemaError(ParamError):
    """A schema the grammar cannot enforce; ``param`` is the path of the offending part."""


@dataclass(frozen=True, slots=True)
class EnforceableSchema:
    schema: Any  # what the grammar compiles (closed objects, formats as patterns)
    open_keys: bool  # some object admits keys beyond a fixed list
    finite_keys: bool  # ... and they may come from a finite set (patterns, propertyNames)


def json_depth(value: Any) -> int:
    """Levels of nesting of a JSON value (a scalar is 0, ``{}`` is 1)."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict | list):
            deepest = max(deepest, depth)
            stack.extend(
                (child, depth + 1) for child in (item.values() if isinstance(item, dict) else item)
            )
    return deepest


def enforceable_schema(schema: Any, param: str) -> EnforceableSchema:
    """``schema`` checked (``SchemaError`` naming the path under ``param``) and rewritten for
    the grammar: objects closed (``closed_objects``), each ``format`` replaced by its exact
    patterns."""
    if json_depth(schema) > MAX_SCHEMA_DEPTH:
        raise SchemaError(
            param, f"nests deeper than {MAX_SCHEMA_DEPTH} levels (counted from the schema)"
        )
    walker = _Walker()
    prepared = walker.schema(closed_objects(schema), param)
    return EnforceableSchema(prepared, walker.open_keys, walker.finite_keys)


def _maybe_finite(pattern: Any) -> bool:
    """Whether a key pattern may match only finitely many keys (anchored at both ends, with
    no unbounded repetition); False only when the language is surely infinite."""
    if not isinstance(pattern, str):
        return True
    anchored = pattern.startswith("^") and pattern.endswith("$")
    return anchored and not _UNBOUNDED.search(pattern)


def _number(value: Any) -> float | None:
    """``value`` when it is a finite JSON number, else None."""
    if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None


def _types(schema: dict[str, Any]) -> set[str] | None:
    kind = schema.get("type")
    if isinstance(kind, str):
        return {kind}
    if isinstance(kind, list) and all(isinstance(k, str) for k in kind):
        return set(kind)
    return None


_UNBOUNDED = re.compile(r"(?<!\\)[*+]|\{[0-9]*,\}")


class _Walker:
    def __init__(self) -> None:
        self.open_keys = False
        self.finite_keys = False

    def schema(self, schema: Any, at: str) -> Any:
        if not isinstance(schema, dict):
            if schema is True:
                self.open_keys = True  # any value, objects with any keys included
            return schema
        out: dict[str, Any] = {}
        for key, value in schema.items():
            here = f"{at}.{key}"
            if key in _MAPS and isinstance(value, dict):
                out[key] = {name: self.schema(sub, f"{here}.{name}") for name, sub in value.items()}
            elif key in _VALUES:
                out[key] = self.schema(value, here)
            elif key in _LISTS and isinstance(value, list):
                out[key] = [self.schema(sub, f"{here}[{i}]") for i, sub in enumerate(value)]
            else:
                out[key] = value
        self._check(out, at)
        self._note_open(out)
        return self._formats(out, at)

    def _note_open(self, schema: dict[str, Any]) -> None:
        if "enum" in schema or "const" in schema or "$ref" in schema:
            return
        types = _types(schema)
        if types is not None and "object" not in types:
            return
        patterns = schema.get("patternProperties")
        if patterns or schema.get("additionalProperties", True) is not False:
            self.open_keys = True
        if "propertyNames" in schema or (
            schema.get("additionalProperties") is False
            and isinstance(patterns, dict)
            and any(_maybe_finite(p) for p in patterns)
        ):
            self.finite_keys = True

    def _formats(self, schema: dict[str, Any], at: str) -> dict[str, Any]:
        if "format" not in schema:
            return schema
        name = schema["format"]
        rest = {key: value for key, value in schema.items() if key != "format"}
        types = _types(schema)
        if types is not None and "string" not in types:
            return rest  # a format constrains strings only
        patterns = format_patterns(name) if isinstance(name, str) else None
        if patterns is None:
            raise SchemaError(
                f"{at}.format",
                f"{name!r} is not a string format this server can enforce; it enforces "
                f"{', '.join(ENFORCED_FORMATS)}",
            )
        parts: list[Any] = [rest] if rest else []
        parts.extend({"type": "string", "pattern": pattern} for pattern in patterns)
        if types is not None and types != {"string"}:
            # Other types stay allowed: the patterns bind only the string branch.
            others = {k: v for k, v in rest.items() if k != "type"}
            others["type"] = sorted(types - {"string"})
            return {"anyOf": [others, {"allOf": [{**rest, "type": "string"}, *parts[1:]]}]}
        return {"allOf": parts} if len(parts) > 1 else parts[0]

    def _check(self, schema: dict[str, Any], at: str) -> None:
        if schema.get("enum") == []:
            raise SchemaError(f"{at}.enum", "is empty: no value can match")
        if schema.get("type") == []:
            raise SchemaError(f"{at}.type", "is empty: no value can match")
        _bounds(schema, at, "minLength", "maxLength")
        _bounds(schema, at, "minItems", "maxItems")
        _bounds(schema, at, "minProperties", "maxProperties")
        _bounds(schema, at, "minContains", "maxContains")
        low, high = _number(schema.get("minimum")), _number(schema.get("maximum"))
        if low is not None and high is not None and low > high:
            raise SchemaError(f"{at}.minimum", f"{low:g} is above maximum {high:g}")
        xlow = _number(schema.get("exclusiveMinimum"))
        xhigh = _number(schema.get("exclusiveMaximum"))
        for lower, strict_low in ((low, False), (xlow, True)):
            for upper, strict_high in ((high, False), (xhigh, True)):
                if lower is None or upper is None or not (strict_low or strict_high):
                    continue
                if lower >= upper:
                    name = "exclusiveMinimum" if strict_low else "minimum"
                    raise SchemaError(f"{at}.{name}", f"leaves no number below {upper:g}")
        self._check_object(schema, at)

    def _check_object(self, schema: dict[str, Any], at: str) -> None:
        properties = schema.get("properties")
        properties = properties if isinstance(properties, dict) else {}
        required = schema.get("required")
        required = (
            list(dict.fromkeys(k for k in required if isinstance(k, str)))
            if isinstance(required, list)
            else []
        )
        maximum = schema.get("maxProperties")
        if isinstance(maximum, int) and not isinstance(maximum, bool) and len(required) > maximum:
            raise SchemaError(
                f"{at}.maxProperties", f"is {maximum}, below the {len(required)} required keys"
            )
        for index, key in enumerate(required):
            if properties.get(key) is False:
                raise SchemaError(
                    f"{at}.required[{index}]", f"{key!r} is required but its schema is false"
                )
        if schema.get("additionalProperties") is not False:
            return
        patterns = schema.get("patternProperties")
        patterns = patterns if isinstance(patterns, dict) else {}
        for index, key in enumerate(required):
            if key not in properties and not any(_matches(p, key) for p in patterns):
                admitted = f"its properties ({', '.join(map(repr, properties)) or 'none'})"
                if patterns:
                    admitted += " and keys matching its patternProperties"
                raise SchemaError(
                    f"{at}.required[{index}]",
                    f"{key!r} is required but the object admits only {admitted} (objects "
                    "that list properties are closed unless additionalProperties says otherwise)",
                )
        minimum = schema.get("minProperties")
        if not isinstance(minimum, int) or isinstance(minimum, bool):
            return
        keys: set[str] | None = {k for k, sub in properties.items() if sub is not False}
        for pattern in patterns:
            found = _finite_language(pattern)
            if found is None or keys is None:
                keys = None
                break
            keys |= found
        if keys is not None and minimum > len(keys):
            raise SchemaError(
                f"{at}.minProperties",
                f"is {minimum}, above the {len(keys)} distinct keys the object admits",
            )


def _matches(pattern: str, key: str) -> bool:
    try:
        return re.search(pattern, key) is not None
    except re.error:
        return True  # not Python's syntax: the grammar compiler judges it


# Strings a key pattern's language may hold before it counts as "many" (undecided).
_LANGUAGE_CAP = 4096


def _finite_language(pattern: Any) -> set[str] | None:
    """Every string an anchored key pattern matches, when that is a small finite set of
    plain literals, classes, alternatives and bounded repeats; None when undecided."""
    if not isinstance(pattern, str) or not (pattern.startswith("^") and pattern.endswith("$")):
        return None
    try:
        tree = list(re._parser.parse(pattern))  # type: ignore[attr-defined]
    except (re.error, AttributeError, RecursionError):
        return None
    if len(tree) < 2 or tree[0] != (_AT, _AT_BEGINNING) or tree[-1] != (_AT, _AT_END):
        return None
    return _strings(tree[1:-1])


_constants: Any = getattr(re, "_constants", None)
_AT = getattr(_constants, "AT", None)
_AT_BEGINNING = getattr(_constants, "AT_BEGINNING", None)
_AT_END = getattr(_constants, "AT_END", None)


def _strings(items: Any) -> set[str] | None:
    """The strings of a parsed sequence (``re._parser`` items), or None past the cap."""
    out = {""}
    for op, arg in items:
        name = str(op)
        if name == "LITERAL":
            options: set[str] | None = {chr(arg)}
        elif name == "IN":
            options = _class(arg)
        elif name == "SUBPATTERN":
            options = _strings(arg[-1])
        elif name == "BRANCH":
            options = set()
            for branch in arg[1]:
                found = _strings(branch)
                if found is None:
                    return None
                options |= found
        elif name in ("MAX_REPEAT", "MIN_REPEAT"):
            low, high, body = arg
            unit = _strings(body)
            if unit is None or high > _LANGUAGE_CAP:
                return None
            options, layer = set(), {""}
            for count in range(high + 1):
                if count >= low:
                    options |= layer
                if count < high:
                    layer = {a + b for a in layer for b in unit}
                    if len(layer) > _LANGUAGE_CAP:
                        return None
        else:
            return None
        if options is None:
            return None
        out = {a + b for a in out for b in options}
        if len(out) > _LANGUAGE_CAP:
            return None
    return out


def _class(items: Any) -> set[str] | None:
    chars: set[str] = set()
    for op, arg in items:
        name = str(op)
        if name == "LITERAL":
            chars.add(chr(arg))
        elif name == "RANGE":
            low, high = arg
            if high - low > _LANGUAGE_CAP:
                return None
            chars.update(chr(c) for c in range(low, high + 1))
        else:
            return None  # a negation or a category: many characters
    return chars


def _bounds(schema: dict[str, Any], at: str, low_key: str, high_key: str) -> None:
    low, high = _number(schema.get(low_key)), _number(schema.get(high_key))
    if low is not None and high is not None and low > high:
        raise SchemaError(f"{at}.{low_key}", f"{low:g} is above {high_key} {high:g}")
