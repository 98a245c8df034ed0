"""A request's output constraint (``GrammarSpec``) from the OpenAI and vLLM fields that name
one, each checked with a 400 naming the field when it is malformed:

* ``response_format``: ``{"type": "text"}`` (none), ``{"type": "json_object"}``, or
  ``{"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}}``;
* vLLM's ``structured_outputs``: an object with exactly one of ``json`` (a schema, as an
  object or JSON text), ``regex``, ``choice`` (a list of strings), ``grammar`` (EBNF) or
  ``json_object: true``;
* vLLM's older ``guided_json``, ``guided_regex``, ``guided_choice`` and ``guided_grammar``.

At most one of them may constrain a request. A JSON schema meets ``schema_rules`` here (its
depth, its formats, satisfiable bounds: a 400 naming the schema path, such as
``response_format.json_schema.schema.properties.when.format``); whether the constraint
compiles is the grammar compiler's to say (``worker/grammar.py``), also as a 400 naming the
field.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from adaptermesh.httpserve import NestedDocument
from adaptermesh.worker.grammar import GrammarError, GrammarSpec
from adaptermesh.worker.http_errors import ApiError
from adaptermesh.worker.schema_rules import MAX_SCHEMA_DEPTH, SchemaError, enforceable_schema

__all__ = [
    "MAX_CHOICES",
    "MAX_CONSTRAINT_CHARS",
    "SCHEMA_DOCUMENTS",
    "bad_field",
    "grammar_error",
    "grammar_spec",
    "schema_spec",
]

# The longest schema, regex or grammar one request may send (as JSON text), and the most
# choices: a grammar compiles on the worker's CPU.
MAX_CONSTRAINT_CHARS = 64 << 10
MAX_CHOICES = 1024
_SCHEMA_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_STRUCTURED_KEYS = ("json", "regex", "choice", "grammar", "json_object")
# The body fields that hold a JSON schema: the body's nesting bound counts their levels from
# the field, against the schema's own limit (schema_rules.MAX_SCHEMA_DEPTH).
SCHEMA_DOCUMENTS = tuple(
    NestedDocument(path, MAX_SCHEMA_DEPTH)
    for path in (
        ("response_format", "json_schema", "schema"),
        ("structured_outputs", "json"),
        ("guided_json",),
        ("tools", "*", "function", "parameters"),
    )
)


def bad_field(param: str, message: str, code: str = "invalid_value") -> ApiError:
    """A 400 ``invalid_request_error`` naming ``param``."""
    return ApiError(400, f"{param}: {message}", param=param, code=code)


def grammar_error(exc: GrammarError) -> ApiError:
    return bad_field(exc.param, exc.message)


def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _sized(text: str, param: str) -> str:
    if len(text) > MAX_CONSTRAINT_CHARS:
        raise bad_field(param, f"must have at most {MAX_CONSTRAINT_CHARS} characters")
    return text


def schema_spec(schema: Any, param: str) -> GrammarSpec:
    """A JSON-schema constraint from ``schema`` (an object, or JSON text of one)."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as exc:
            raise bad_field(param, f"is not valid JSON: {exc}") from None
        except RecursionError:
            raise bad_field(param, f"nests deeper than {MAX_SCHEMA_DEPTH} levels") from None
    if not isinstance(schema, dict | bool):
        raise bad_field(param, f"must be a JSON schema object, got {_type_name(schema)}")
    if schema is False:
        raise bad_field(param, "false admits no output")
    text = _sized(json.dumps({} if schema is True else schema, separators=(",", ":")), param)
    try:
        enforceable_schema(schema, param)
    except SchemaError as exc:
        raise bad_field(exc.param, exc.message) from None
    return GrammarSpec("json_schema", text, param)


def _regex_spec(value: Any, param: str) -> GrammarSpec:
    if not isinstance(value, str) or not value:
        raise bad_field(param, f"must be a non-empty string, got {_type_name(value)}")
    return GrammarSpec("regex", _sized(value, param), param)


def _choice_spec(value: Any, param: str) -> GrammarSpec:
    if not isinstance(value, list) or not value:
        raise bad_field(param, "must be a non-empty list of strings")
    if len(value) > MAX_CHOICES:
        raise bad_field(param, f"must have at most {MAX_CHOICES} choices, got {len(value)}")
    for index, choice in enumerate(value):
        if not isinstance(choice, str):
            raise bad_field(f"{param}[{index}]", f"must be a string, got {_type_name(choice)}")
    return GrammarSpec("choice", _sized(json.dumps(value), param), param)


def _grammar_spec(value: Any, param: str) -> GrammarSpec:
    if not isinstance(value, str) or not value.strip():
        raise bad_field(param, f"must be a non-empty EBNF grammar, got {_type_name(value)}")
    return GrammarSpec("grammar", _sized(value, param), param)


def _object(value: Any, param: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise bad_field(param, f"must be an object, got {_type_name(value)}")
    return value


def _response_format(value: Any, param: str) -> GrammarSpec | None:
    value = _object(value, param)
    kind = value.get("type")
    extra = sorted(set(value) - {"type", "json_schema"})
    if extra:
        raise bad_field(f"{param}.{extra[0]}", "is not a field of response_format", "unknown_field")
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec("json_object", "", param)
    if kind != "json_schema":
        raise bad_field(
            f"{param}.type", f"must be 'text', 'json_object' or 'json_schema', got {kind!r}"
        )
    at = f"{param}.json_schema"
    body = _object(value.get("json_schema"), at)
    unknown = sorted(set(body) - {"name", "schema", "strict", "description"})
    if unknown:
        raise bad_field(f"{at}.{unknown[0]}", "is not a field of json_schema", "unknown_field")
    name = body.get("name")
    if not isinstance(name, str) or not _SCHEMA_NAME.match(name):
        raise bad_field(
            f"{at}.name", "must be 1 to 64 letters, digits, underscores or dashes", "invalid_value"
        )
    if "strict" in body and body["strict"] is not None and not isinstance(body["strict"], bool):
        raise bad_field(f"{at}.strict", f"must be a boolean, got {_type_name(body['strict'])}")
    if "description" in body and not isinstance(body["description"], str | None):
        raise bad_field(f"{at}.description", "must be a string")
    if "schema" not in body or body["schema"] is None:
        return GrammarSpec("json_object", "", at)
    return schema_spec(body["schema"], f"{at}.schema")


def _structured_outputs(value: Any, param: str) -> GrammarSpec | None:
    value = _object(value, param)
    unknown = sorted(set(value) - set(_STRUCTURED_KEYS))
    if unknown:
        raise bad_field(
            f"{param}.{unknown[0]}",
            f"is not supported; use one of {', '.join(_STRUCTURED_KEYS)}",
            "unknown_field",
        )
    given = [key for key in _STRUCTURED_KEYS if value.get(key) not in (None, False)]
    if len(given) > 1:
        raise bad_field(f"{param}.{given[1]}", f"cannot be combined with {param}.{given[0]}")
    if not given:
        return None
    key = given[0]
    at = f"{param}.{key}"
    if key == "json":
        return schema_spec(value[key], at)
    if key == "regex":
        return _regex_spec(value[key], at)
    if key == "choice":
        return _choice_spec(value[key], at)
    if key == "grammar":
        return _grammar_spec(value[key], at)
    if value[key] is not True:
        raise bad_field(at, f"must be true, got {_type_name(value[key])}")
    return GrammarSpec("json_object", "", at)


# The request fields that carry an output constraint, in the order they are read, and the
# parser of each (value, field name); a field that is absent or null sets none.
_CONSTRAINT_FIELDS: dict[str, Callable[[Any, str], GrammarSpec | None]] = {
    "response_format": _response_format,
    "structured_outputs": _structured_outputs,
    "guided_json": schema_spec,
    "guided_regex": _regex_spec,
    "guided_choice": _choice_spec,
    "guided_grammar": _grammar_spec,
}


def grammar_spec(parsed: Any) -> GrammarSpec | None:
    """The constraint a validated request body names, or None; a 400 naming the field when
    one is malformed or a second one is given."""
    found: list[GrammarSpec] = []
    for name, parse in _CONSTRAINT_FIELDS.items():
        value = getattr(parsed, name, None)
        spec = None if value is None else parse(value, name)
        if spec is not None:
            found.append(spec)
    if len(found) > 1:
        first, second = found[0].param.split(".")[0], found[1].param.split(".")[0]
        raise bad_field(second, f"cannot be combined with {first}: send one output constraint")
    return found[0] if found else None
