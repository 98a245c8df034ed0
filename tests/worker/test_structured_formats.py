"""What the grammar generates for a JSON schema, checked strictly: random schemas over every
enforced format and keyword, walked through the real grammar (llguidance with the worker's
key guard) on a byte-level BPE vocabulary, must parse without repeated keys, validate with
jsonschema's format checker and pass the hand-written RFC checks of ``strict_formats``. Values
the RFCs refuse (year 0000, 29 February of a common year, second 60) cannot be written at all;
formats the worker cannot enforce, schemas no output can satisfy and schemas past the depth
limit are 400s naming the schema path.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from adaptermesh.httpserve import JsonBodyError, parse_json_bounded
from adaptermesh.worker.grammar import GrammarCompiler, GrammarError, GrammarSpec, fill_masks
from adaptermesh.worker.http_errors import ApiError
from adaptermesh.worker.schema_formats import ENFORCED_FORMATS
from adaptermesh.worker.schema_rules import MAX_SCHEMA_DEPTH
from adaptermesh.worker.structured_request import SCHEMA_DOCUMENTS, schema_spec
from adaptermesh_testkit.checkpoints import make_tokenizer

from .strict_formats import CHECKS, duplicate_keys, strict_format_errors

PARAM = "response_format.json_schema.schema"
VALIDATOR = jsonschema.Draft202012Validator
FORMATS = VALIDATOR.FORMAT_CHECKER
# Tokens drawn per output before a walk counts as unfinished.
MAX_STEPS = 400


class Walker:
    """Random walks through a compiled grammar: at each step a drawn token among those the
    mask allows, preferring (3 draws in 4) tokens that close strings and containers, so
    outputs end within the step budget."""

    def __init__(self, directory: Path) -> None:
        import transformers

        make_tokenizer(directory)
        self.tokenizer = transformers.AutoTokenizer.from_pretrained(str(directory))
        self.vocab = len(self.tokenizer)
        self.stops = {self.tokenizer.eos_token_id}
        self.compiler = GrammarCompiler(self.tokenizer, self.vocab, sorted(self.stops))
        texts = [self.tokenizer.decode([i]) for i in range(self.vocab)]
        self.closing = np.array([any(c in t for c in '"}],') for t in texts])

    def allowed(self, mask: torch.Tensor) -> np.ndarray:
        words = mask[0].numpy().view(np.uint32)
        ids = np.arange(self.vocab)
        return ids[(words[ids >> 5] >> (ids & 31).astype(np.uint32)) & 1 == 1]

    def walk(self, schema: Any, draws: list[int]) -> str | None:
        spec = GrammarSpec("json_schema", json.dumps(schema), PARAM)
        matcher = self.compiler.compile(spec).matcher()
        mask = torch.zeros((1, self.compiler.words), dtype=torch.int32)
        out: list[int] = []
        for draw in draws:
            if matcher.only_stop_left:
                return self.tokenizer.decode(out)
            fill_masks([(matcher, 0)], mask)
            allowed = self.allowed(mask)
            assert allowed.size, f"no token allowed after {self.tokenizer.decode(out)!r}"
            closing = allowed[self.closing[allowed]]
            pool = closing if closing.size and draw % 4 else allowed
            token = int(pool[(draw >> 2) % pool.size])
            if token in self.stops:  # the engine ends the row before the matcher sees it
                return self.tokenizer.decode(out)
            assert matcher.advance(token)
            out.append(token)
        return None

    def accepts(self, schema: Any, text: str) -> bool:
        """Whether the grammar lets the output be exactly ``text``."""
        spec = GrammarSpec("json_schema", json.dumps(schema), PARAM)
        matcher = self.compiler.compile(spec).matcher()
        mask = torch.zeros((1, self.compiler.words), dtype=torch.int32)
        for token in self.tokenizer(text, add_special_tokens=False)["input_ids"]:
            fill_masks([(matcher, 0)], mask)
            if token not in set(self.allowed(mask).tolist()) or not matcher.advance(token):
                return False
        if matcher.only_stop_left:
            return True
        fill_masks([(matcher, 0)], mask)
        return bool(set(self.allowed(mask).tolist()) & self.stops)


@pytest.fixture(scope="module")
def walker(tmp_path_factory: pytest.TempPathFactory) -> Walker:
    return Walker(tmp_path_factory.mktemp("formats_tok"))


def check_output(schema: Any, text: str) -> None:
    assert duplicate_keys(text) == [], text
    instance = json.loads(text)
    VALIDATOR(schema, format_checker=FORMATS).validate(instance)
    assert strict_format_errors(schema, instance) == [], text


# ----------------------------------------------------------------------------- schemas
names = st.sampled_from(["a", "b", "id", "when", "x1", "x2"])


def leaves() -> st.SearchStrategy[dict[str, Any]]:
    formatted = st.sampled_from(ENFORCED_FORMATS).map(lambda f: {"type": "string", "format": f})
    nullable = st.sampled_from(ENFORCED_FORMATS).map(
        lambda f: {"type": ["string", "null"], "format": f}
    )
    bounded = st.tuples(st.integers(0, 3), st.integers(0, 4)).map(
        lambda t: {"type": "string", "minLength": t[0], "maxLength": t[0] + t[1]}
    )
    integers = st.tuples(st.integers(-50, 50), st.integers(0, 100)).map(
        lambda t: {"type": "integer", "minimum": t[0], "maximum": t[0] + t[1]}
    )
    fixed = st.sampled_from(
        [
            {"type": "boolean"},
            {"type": "null"},
            {"type": "number", "minimum": -1, "maximum": 1},
            {"enum": ["c", "f", 3, None]},
            {"type": "string", "pattern": "^[a-c]{1,4}$"},
            {"type": "string", "format": "date", "pattern": "^2"},
            {"type": "integer", "format": "int64"},
            {"const": "k"},
            {"type": "integer", "multipleOf": 3, "minimum": -9, "maximum": 30},
            {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1},
            {"oneOf": [{"type": "string", "format": "uuid"}, {"type": "integer"}]},
        ]
    )
    return st.one_of(formatted, formatted, nullable, bounded, integers, fixed)


def composites(children: st.SearchStrategy[dict[str, Any]]) -> st.SearchStrategy[dict[str, Any]]:
    def obj(props: dict[str, Any], required: list[str]) -> dict[str, Any]:
        return {
            "type": "object",
            "properties": props,
            "required": [k for k in required if k in props],
        }

    closed = st.builds(obj, st.dictionaries(names, children, max_size=3), st.lists(names))
    arrays = st.tuples(children, st.integers(0, 2), st.integers(0, 2)).map(
        lambda t: {"type": "array", "items": t[0], "minItems": t[1], "maxItems": t[1] + t[2]}
    )
    patterned = st.tuples(children, st.integers(0, 3), st.sampled_from(["^x[0-9]$", "^k"])).map(
        lambda t: {
            "type": "object",
            "patternProperties": {t[2]: t[0]},
            "additionalProperties": False,
            "minProperties": t[1],
            "maxProperties": t[1] + 1,
        }
    )
    mapping = st.tuples(children, st.integers(0, 2), st.integers(0, 2)).map(
        lambda t: {
            "type": "object",
            "additionalProperties": t[0],
            "minProperties": t[1],
            "maxProperties": t[1] + t[2],
        }
    )
    mixed = st.tuples(children, children).map(
        lambda t: {
            "type": "object",
            "properties": {"a": t[0]},
            "required": ["a"],
            "additionalProperties": t[1],
            "maxProperties": 3,
        }
    )
    either = st.tuples(children, children).map(lambda t: {"anyOf": [t[0], t[1]]})
    both = st.tuples(children, children).map(
        lambda t: {
            "allOf": [
                {"type": "object", "properties": {"a": t[0]}, "required": ["a"]},
                {"type": "object", "properties": {"b": t[1]}},
            ]
        }
    )
    tuples = st.tuples(children, children).map(
        lambda t: {"type": "array", "prefixItems": [t[0], t[1]], "items": False, "minItems": 2}
    )
    return st.one_of(closed, arrays, patterned, mapping, mixed, either, both, tuples)


trees = st.recursive(leaves(), composites, max_leaves=6)
# $defs live at the root (a "#/$defs/..." pointer starts there).
schemas = st.one_of(
    trees,
    st.tuples(trees, trees).map(
        lambda t: {
            "$defs": {"d": t[0]},
            "type": "object",
            "properties": {"r": {"$ref": "#/$defs/d"}, "s": t[1]},
            "required": ["r"],
        }
    ),
)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(schema=schemas, draws=st.lists(st.integers(0, 1 << 30), min_size=MAX_STEPS))
def test_random_schemas_generate_only_strictly_valid_json(
    walker: Walker, schema: dict[str, Any], draws: list[int]
) -> None:
    text = walker.walk(schema, draws)
    if text is not None:  # an output still open after MAX_STEPS tokens proves nothing
        check_output(schema, text)


@pytest.mark.parametrize("name", ENFORCED_FORMATS)
def test_every_enforced_format_walks_to_values_every_checker_accepts(
    walker: Walker, name: str
) -> None:
    schema = {
        "type": "object",
        "properties": {"v": {"type": "string", "format": name}},
        "required": ["v"],
    }
    rng = np.random.default_rng(len(name))
    finished = 0
    for _ in range(30):
        text = walker.walk(schema, rng.integers(0, 1 << 30, MAX_STEPS).tolist())
        if text is None:
            continue
        finished += 1
        check_output(schema, text)
        assert CHECKS[name](json.loads(text)["v"])
    assert finished >= 20


@pytest.mark.parametrize(
    ("name", "good", "bad"),
    [
        ("date", ["2024-02-29", "2000-02-29", "0001-01-01"], ["0000-01-01", "2023-02-29"]),
        ("date", ["1996-12-31", "2023-04-30"], ["1900-02-29", "2100-02-29", "2023-04-31"]),
        ("time", ["23:59:59Z", "00:00:00.5+23:59"], ["23:59:60Z", "24:00:00Z", "12:00:00"]),
        (
            "date-time",
            ["2016-12-31T23:59:59Z"],
            ["2016-12-31T23:59:60Z", "0000-01-01T00:00:00Z", "2016-12-31t23:59:59z"],
        ),
        ("ipv4", ["192.168.0.1"], ["192.168.00.1", "256.1.1.1"]),
        ("ipv6", ["::1", "1::2:3"], ["1::2::3", "fe80::1%eth0"]),
        ("uuid", ["123e4567-e89b-12d3-a456-426614174000"], ["123e4567e89b12d3a456426614174000"]),
        ("email", ["ada@example.org"], ["ada@example", "a..b@example.org"]),
        ("duration", ["P1Y2M3DT4H5M6S", "P2W"], ["P", "P1W2D", "PT"]),
        ("hostname", ["a-b.example"], ["-a.example", "a..b"]),
    ],
)
def test_the_grammar_refuses_what_the_rfc_refuses(
    walker: Walker, name: str, good: list[str], bad: list[str]
) -> None:
    schema = {"type": "string", "format": name}
    for value in good:
        assert walker.accepts(schema, json.dumps(value)), value
    for value in bad:
        assert not walker.accepts(schema, json.dumps(value)), value


@pytest.mark.parametrize(
    "name",
    [
        "iri",
        "iri-reference",
        "idn-email",
        "idn-hostname",
        "uri-template",
        "relative-json-pointer",
        "regex",
        "color",
    ],
)
def test_formats_the_worker_cannot_enforce_are_400s_naming_them(name: str) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "string", "format": name}}}
    with pytest.raises(ApiError) as info:
        schema_spec(schema, PARAM)
    assert info.value.param == f"{PARAM}.properties.a.format"
    assert repr(name) in str(info.value)
    # A format on a schema that admits no strings constrains nothing.
    schema_spec({"type": "integer", "format": name}, PARAM)


def test_the_compiler_refuses_what_the_request_check_refuses(walker: Walker) -> None:
    spec = GrammarSpec("json_schema", json.dumps({"type": "string", "format": "iri"}), PARAM)
    with pytest.raises(GrammarError) as info:
        walker.compiler.compile(spec)
    assert info.value.param == f"{PARAM}.format"


# ------------------------------------------------------------------------ duplicate keys
@pytest.mark.parametrize(
    "schema",
    [
        {  # the issue's case: pattern keys, at least 3 of them
            "type": "object",
            "patternProperties": {"^x[0-9]$": {"type": "boolean"}},
            "additionalProperties": False,
            "minProperties": 3,
        },
        {"type": "object", "additionalProperties": {"type": "integer"}, "minProperties": 3},
        {  # listed keys and pattern keys overlap
            "type": "object",
            "properties": {"x1": {"type": "boolean"}},
            "required": ["x1"],
            "patternProperties": {"^x[0-9]$": {"type": "boolean"}},
            "additionalProperties": False,
            "minProperties": 2,
        },
        {  # only two keys exist and both are needed
            "type": "object",
            "patternProperties": {"^x[12]$": {"type": "boolean"}},
            "additionalProperties": False,
            "minProperties": 2,
        },
        {
            "type": "array",
            "items": {"type": "object", "additionalProperties": {"type": "null"}},
            "minItems": 2,
            "maxItems": 2,
        },
    ],
)
def test_no_output_repeats_a_key(walker: Walker, schema: dict[str, Any]) -> None:
    rng = np.random.default_rng(7)
    finished = 0
    for _ in range(25):
        text = walker.walk(schema, rng.integers(0, 1 << 30, MAX_STEPS).tolist())
        if text is None:
            continue
        finished += 1
        check_output(schema, text)
    assert finished >= 15


def test_json_mode_never_repeats_a_key(walker: Walker) -> None:
    rng = np.random.default_rng(3)
    spec = GrammarSpec("json_object", "", "response_format")
    grammar = walker.compiler.compile(spec)
    assert grammar.guards_keys
    checked = 0
    for _ in range(25):
        matcher = grammar.matcher()
        mask = torch.zeros((1, walker.compiler.words), dtype=torch.int32)
        out: list[int] = []
        for draw in rng.integers(0, 1 << 30, MAX_STEPS).tolist():
            if matcher.only_stop_left:
                break
            fill_masks([(matcher, 0)], mask)
            allowed = walker.allowed(mask)
            closing = allowed[walker.closing[allowed]]
            pool = closing if closing.size and draw % 4 else allowed
            token = int(pool[(draw >> 2) % pool.size])
            assert matcher.advance(token)
            out.append(token)
        else:
            continue
        checked += 1
        assert duplicate_keys(walker.tokenizer.decode(out)) == []
    assert checked >= 15


def test_closed_schemas_carry_no_key_guard(walker: Walker) -> None:
    closed = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    spec = GrammarSpec("json_schema", json.dumps(closed), PARAM)
    assert not walker.compiler.compile(spec).guards_keys


def test_a_schema_wanting_more_keys_than_exist_ends_cut_without_repeating(
    walker: Walker,
) -> None:
    """Eleven keys wanted, ten admitted (a digit class the compile-time check does not
    count): the row ends at the dead end instead of repeating a key."""
    schema = {
        "type": "object",
        "patternProperties": {"^x\\d$": {"type": "null"}},
        "additionalProperties": False,
        "minProperties": 11,
    }
    rng = np.random.default_rng(11)
    for _ in range(5):
        text = walker.walk(schema, rng.integers(0, 1 << 30, MAX_STEPS).tolist())
        assert text is not None
        for digit in range(10):
            assert text.count(f'"x{digit}"') <= 1, text


# ---------------------------------------------------------------------- unsatisfiable
@pytest.mark.parametrize(
    ("schema", "at"),
    [
        (
            {"type": "object", "properties": {"a": {}}, "required": ["a", "b"]},
            ".required[1]",
        ),
        (
            {
                "type": "object",
                "properties": {"a": {}, "b": {}},
                "additionalProperties": False,
                "minProperties": 3,
            },
            ".minProperties",
        ),
        (
            {
                "type": "object",
                "properties": {"n": {"type": "array", "minItems": 3, "maxItems": 2}},
            },
            ".properties.n.minItems",
        ),
        ({"type": "string", "minLength": 5, "maxLength": 4}, ".minLength"),
        ({"type": "integer", "minimum": 3, "maximum": 2}, ".minimum"),
        ({"type": "number", "exclusiveMinimum": 2, "maximum": 2}, ".exclusiveMinimum"),
        ({"type": "object", "required": ["a", "b"], "maxProperties": 1}, ".maxProperties"),
        ({"minProperties": 2, "maxProperties": 1}, ".minProperties"),
        ({"anyOf": [{"type": "string"}, {"enum": []}]}, ".anyOf[1].enum"),
        ({"$defs": {"d": {"type": []}}, "$ref": "#/$defs/d"}, ".$defs.d.type"),
        (
            {"type": "object", "properties": {"a": False}, "required": ["a"]},
            ".required[0]",
        ),
        (  # the pattern admits 10 keys, the listed property is one of them
            {
                "type": "object",
                "properties": {"x1": {}},
                "patternProperties": {"^x[0-9]$": {}},
                "additionalProperties": False,
                "minProperties": 11,
            },
            ".minProperties",
        ),
        (
            {
                "type": "object",
                "patternProperties": {"^x[0-9]$": {}},
                "additionalProperties": False,
                "required": ["y"],
            },
            ".required[0]",
        ),
    ],
)
def test_unsatisfiable_schemas_are_400s_naming_the_path(schema: dict[str, Any], at: str) -> None:
    with pytest.raises(ApiError) as info:
        schema_spec(schema, PARAM)
    assert info.value.status == 400
    assert info.value.param == PARAM + at
    assert str(info.value).startswith(PARAM + at)


# ------------------------------------------------------------------------------ depth
def nested_objects(levels: int) -> dict[str, Any]:
    """``levels`` nested objects; JSON depth 2 * levels + 1."""
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(levels - 1):
        schema = {"type": "object", "properties": {"n": schema}, "required": ["n"]}
    return {"type": "object", "properties": {"n": schema}, "required": ["n"]}


def json_depth(value: Any) -> int:
    if isinstance(value, dict):
        return 1 + max((json_depth(v) for v in value.values()), default=0)
    if isinstance(value, list):
        return 1 + max((json_depth(v) for v in value), default=0)
    return 0


def test_schemas_as_deep_as_the_limit_compile_and_deeper_ones_are_400s(walker: Walker) -> None:
    deepest = nested_objects(MAX_SCHEMA_DEPTH // 2 - 1)
    assert json_depth(deepest) == MAX_SCHEMA_DEPTH - 1
    # OpenAI's strict mode allows 10 levels of nested objects; 31 compile here.
    walker.compiler.compile(schema_spec(deepest, PARAM))
    text = walker.walk(deepest, list(range(1, 4 * MAX_STEPS, 4)))
    assert text is not None
    check_output(deepest, text)
    over = {"type": "object", "properties": {"n": {"enum": [deepest]}}}
    assert json_depth(over) > MAX_SCHEMA_DEPTH
    with pytest.raises(ApiError) as info:
        schema_spec(over, PARAM)
    assert info.value.param == PARAM
    with pytest.raises(ApiError) as info:
        schema_spec(json.dumps(over), "guided_json")  # as JSON text too
    assert info.value.param == "guided_json"


def body(field: str, value: Any) -> bytes:
    path = {
        "response_format.json_schema.schema": lambda v: {
            "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": v}}
        },
        "tools[1].function.parameters": lambda v: {
            "tools": [
                {"type": "function", "function": {"name": "f"}},
                {"type": "function", "function": {"name": "g", "parameters": v}},
            ]
        },
        "guided_json": lambda v: {"guided_json": v},
        "structured_outputs.json": lambda v: {"structured_outputs": {"json": v}},
        "extra": lambda v: {"extra": v},
    }[field]
    return json.dumps({"messages": [], **path(value)}).encode()


@pytest.mark.parametrize(
    "field",
    [
        "response_format.json_schema.schema",
        "tools[1].function.parameters",
        "guided_json",
        "structured_outputs.json",
    ],
)
def test_the_body_bound_counts_a_schema_from_the_schema(field: str) -> None:
    deep = {"not": nested_objects(MAX_SCHEMA_DEPTH // 2 - 1)}  # 64: twice the body's 32
    assert json_depth(deep) == MAX_SCHEMA_DEPTH
    parse_json_bounded(body(field, deep), nested=SCHEMA_DOCUMENTS)
    with pytest.raises(JsonBodyError) as info:
        parse_json_bounded(body(field, {"not": deep}), nested=SCHEMA_DOCUMENTS)
    assert info.value.status == 400
    assert info.value.param == field
    assert info.value.message.startswith(field)


def test_the_body_bound_still_guards_every_other_field() -> None:
    with pytest.raises(JsonBodyError) as info:
        parse_json_bounded(body("extra", nested_objects(20)), nested=SCHEMA_DOCUMENTS)
    assert info.value.code == "json_too_deep"
    assert info.value.param is None
    hostile = b'{"guided_json": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    with pytest.raises(JsonBodyError) as info:
        parse_json_bounded(hostile, nested=SCHEMA_DOCUMENTS)
    assert info.value.code == "json_too_deep"
