"""Tool-call parsing per output format, whole and streamed in random chunkings; the request's
tools and tool_choice checked with a 400 naming the field; the grammar that enforces
``required`` and a named function; the parser each model family gets."""

from __future__ import annotations

import itertools
import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from adaptermesh.worker.http_errors import ApiError
from adaptermesh.worker.tool_calls import (
    ParsedCall,
    ToolCallStream,
    detect_tool_parser,
    parse_tool_calls,
    template_messages,
    tool_plan,
)

CALLS = [
    ("get_weather", {"city": "Paris", "unit": "c"}),
    ("get_time", {"tz": "UTC+1", "n": [1, 2]}),
]


def render(fmt: str, calls: list[tuple[str, dict[str, Any]]], content: str = "") -> str:
    """Text as a model of each family writes tool calls."""
    if fmt == "hermes":
        blocks = "".join(
            f'<tool_call>\n{{"name": "{n}", "arguments": {json.dumps(a)}}}\n</tool_call>\n'
            for n, a in calls
        )
        return content + blocks
    if fmt == "llama3_json":
        return "; ".join(json.dumps({"name": n, "parameters": a}) for n, a in calls)
    if fmt == "mistral":
        return "[TOOL_CALLS]" + json.dumps([{"name": n, "arguments": a} for n, a in calls])
    if fmt == "required":
        return json.dumps([{"name": n, "parameters": a} for n, a in calls])
    raise AssertionError(fmt)


def as_pairs(calls: list[ParsedCall]) -> list[tuple[str | None, Any]]:
    return [(c.name, json.loads(c.arguments)) for c in calls]


@pytest.mark.parametrize("fmt", ["hermes", "llama3_json", "mistral", "required"])
def test_whole_outputs_parse(fmt: str) -> None:
    content, calls = parse_tool_calls(fmt, render(fmt, CALLS))  # type: ignore[arg-type]
    assert content is None
    assert as_pairs(calls) == CALLS


def test_variants_of_each_format() -> None:
    # Llama 3 with its python tag; Mistral without its marker (a special token the detokeniser
    # skipped); Hermes after some text; arguments sent as a JSON string.
    text = '<|python_tag|>{"name": "f", "parameters": {"a": 1}}'
    assert as_pairs(parse_tool_calls("llama3_json", text)[1]) == [("f", {"a": 1})]
    text = '[{"name": "f", "arguments": {"a": 1}}]'
    assert as_pairs(parse_tool_calls("mistral", text)[1]) == [("f", {"a": 1})]
    content, calls = parse_tool_calls("hermes", render("hermes", CALLS[:1], "Let me look. "))
    assert content == "Let me look. "
    assert as_pairs(calls) == CALLS[:1]
    text = '{"name": "f", "arguments": "{\\"a\\": 1}"}'
    assert as_pairs(parse_tool_calls("llama3_json", text)[1]) == [("f", {"a": 1})]
    assert parse_tool_calls("llama3_json", '{"name": "f"}')[1][0].arguments == "{}"


@pytest.mark.parametrize("fmt", ["hermes", "llama3_json", "mistral"])
def test_plain_text_is_content(fmt: str) -> None:
    for text in ("Hello there", "[1, 2] is a list", '{"not": "a call"}', ""):
        assert parse_tool_calls(fmt, text) == (text, [])  # type: ignore[arg-type]


def stream_all(fmt: str, text: str, cuts: list[int], function: str | None = None) -> list[Any]:
    stream = ToolCallStream(fmt, function)  # type: ignore[arg-type]
    deltas: list[Any] = []
    bounds = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    for start, end in itertools.pairwise(bounds):
        deltas += stream.feed(text[start:end])
    return deltas + stream.finish()


def assemble(deltas: list[dict[str, Any]]) -> tuple[str, list[dict[str, Any]]]:
    """Join deltas as an OpenAI client does, checking the order OpenAI sends them in."""
    content = ""
    calls: list[dict[str, Any]] = []
    for delta in deltas:
        assert len(delta) == 1
        if "content" in delta:
            assert not calls, "content after a tool call"
            content += delta["content"]
            continue
        (part,) = delta["tool_calls"]
        if part["index"] == len(calls):
            # A call's first delta: id, type and name, with empty arguments.
            assert part["id"].startswith("call_")
            assert part["type"] == "function"
            assert part["function"]["name"]
            assert part["function"]["arguments"] == ""
            calls.append({"id": part["id"], "name": part["function"]["name"], "arguments": ""})
        else:
            assert part["index"] == len(calls) - 1, "fragments of an earlier call came late"
            assert set(part) == {"index", "function"}
            assert set(part["function"]) == {"arguments"}
            calls[-1]["arguments"] += part["function"]["arguments"]
    return content, calls


@settings(max_examples=150, deadline=None)
@given(
    fmt=st.sampled_from(["hermes", "llama3_json", "mistral", "required"]),
    count=st.integers(1, 2),
    content=st.sampled_from(["", "Sure. ", "<tool", "[x] "]),
    cuts=st.lists(st.integers(0, 400), max_size=30),
)
def test_streams_in_any_chunking_match_the_whole_parse(
    fmt: str, count: int, content: str, cuts: list[int]
) -> None:
    text = render(fmt, CALLS[:count], content if fmt == "hermes" else "")
    whole_content, whole = parse_tool_calls(fmt, text)  # type: ignore[arg-type]
    streamed_content, streamed = assemble(stream_all(fmt, text, cuts))
    assert streamed_content == (whole_content or "")
    assert [(c["name"], c["arguments"]) for c in streamed] == [(c.name, c.arguments) for c in whole]
    assert [(c["name"], json.loads(c["arguments"])) for c in streamed] == CALLS[:count]


@settings(max_examples=100, deadline=None)
@given(
    fmt=st.sampled_from(["hermes", "llama3_json", "mistral"]),
    text=st.text(alphabet="ab {}[]<>\"':,;_lTOCAS", max_size=40),
    cuts=st.lists(st.integers(0, 40), max_size=10),
)
def test_any_text_streams_to_what_the_whole_parse_gives(
    fmt: str, text: str, cuts: list[int]
) -> None:
    _whole_content, whole = parse_tool_calls(fmt, text)  # type: ignore[arg-type]
    streamed_content, streamed = assemble(stream_all(fmt, text, cuts))
    if not whole:
        assert streamed_content == text
        assert not streamed
    else:
        assert [c["name"] for c in streamed] == [c.name for c in whole]


@settings(max_examples=50, deadline=None)
@given(cuts=st.lists(st.integers(0, 60), max_size=20))
def test_named_function_streams_its_arguments(cuts: list[int]) -> None:
    text = json.dumps({"city": "Oslo", "days": [1, 2, 3]})
    content, calls = assemble(stream_all("named", text, cuts, "get_weather"))
    assert content == ""
    assert calls[0]["name"] == "get_weather"
    assert calls[0]["arguments"] == text


def test_detection_by_vocabulary_then_family() -> None:
    assert detect_tool_parser("qwen2", {"<tool_call>": 1}) == "hermes"
    assert detect_tool_parser("llama", {"[TOOL_CALLS]": 5}) == "mistral"
    assert detect_tool_parser("llama", {"<|python_tag|>": 5}) == "llama3_json"
    assert detect_tool_parser("qwen3", {}) == "hermes"
    assert detect_tool_parser("mistral", {}) == "mistral"
    assert detect_tool_parser("llama", {}) == "llama3_json"


TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 8}},
            "required": ["city"],
        },
    },
}


@pytest.mark.parametrize(
    ("tools", "choice", "param"),
    [
        ("x", None, "tools"),
        ([1], None, "tools[0]"),
        ([{"type": "code", "function": {}}], None, "tools[0].type"),
        ([{"type": "function"}], None, "tools[0].function"),
        ([{"type": "function", "function": {"name": "bad name"}}], None, "tools[0].function.name"),
        (
            [{"type": "function", "function": {"name": "f", "parameters": []}}],
            None,
            "tools[0].function.parameters",
        ),
        (
            [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}],
            None,
            "tools[0].function.parameters.type",
        ),
        ([{"type": "function", "function": {"name": "f", "x": 1}}], None, "tools[0].function.x"),
        ([TOOL, TOOL], None, "tools[1].function.name"),
        ([TOOL], "sometimes", "tool_choice"),
        ([TOOL], {"type": "function", "function": {"name": "nope"}}, "tool_choice.function.name"),
        ([TOOL], {"type": "tool"}, "tool_choice.type"),
        (None, "required", "tool_choice"),
    ],
)
def test_bad_tools_are_400s_naming_the_field(tools: Any, choice: Any, param: str) -> None:
    with pytest.raises(ApiError) as info:
        tool_plan(tools, choice, None, "hermes")
    assert info.value.status == 400
    assert info.value.param == param
    assert info.value.type == "invalid_request_error"
    assert info.value.message.startswith(param + ": ")


def test_forced_choices_have_grammars() -> None:
    named = tool_plan([TOOL], {"type": "function", "function": {"name": "get_weather"}}, None, "x")
    assert named is not None
    spec = named.grammar_spec()
    assert spec is not None
    assert json.loads(spec.source) == TOOL["function"]["parameters"]
    required = tool_plan([TOOL], "required", False, "x")
    assert required is not None
    spec = required.grammar_spec()
    assert spec is not None
    schema = json.loads(spec.source)
    assert (schema["type"], schema["minItems"], schema["maxItems"]) == ("array", 1, 1)
    auto = tool_plan([TOOL], None, None, "mistral")
    assert auto is not None
    assert auto.grammar_spec() is None
    assert auto.format == "mistral"
    none = tool_plan([TOOL], "none", None, "mistral")
    assert none is not None
    assert none.format is None
    assert none.parse("[TOOL_CALLS][]") == ("[TOOL_CALLS][]", [])


def test_the_worker_flag_names_every_parser() -> None:
    from adaptermesh.worker.cli import build_parser

    parser = build_parser()
    base = ["--model", "m", "--adapter-root", "a"]
    assert parser.parse_args(base).tool_call_parser == "auto"
    assert parser.parse_args([*base, "--tool-call-parser", "hermes"]).tool_call_parser == "hermes"
    with pytest.raises(SystemExit):
        parser.parse_args([*base, "--tool-call-parser", "xml"])
    text = " ".join(parser.format_help().split())
    for name in ("llama3_json", "hermes", "mistral", "auto picks"):
        assert name in text


# ------------------------------------------------------------- as vLLM and OpenAI answer
def parameters(*keys: str) -> dict[str, Any]:
    return {"type": "object", "properties": {k: {} for k in keys}}


TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": parameters("city")}},
    {"type": "function", "function": {"name": "get_time", "parameters": parameters("tz", "n")}},
]
AUTO_FORMATS = ["hermes", "llama3_json", "mistral"]


def plan_for(fmt: str, parallel: bool | None = None, choice: Any = None) -> Any:
    plan = tool_plan(TOOLS, choice, parallel, fmt)
    assert plan is not None
    return plan


def stream_plan(plan: Any, text: str, cuts: list[int]) -> tuple[str, list[dict[str, Any]]]:
    stream = plan.stream()
    deltas: list[Any] = []
    bounds = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    for start, end in itertools.pairwise(bounds):
        deltas += stream.feed(text[start:end])
    return assemble(deltas + stream.finish())


@settings(max_examples=60, deadline=None)
@given(fmt=st.sampled_from(AUTO_FORMATS), cuts=st.lists(st.integers(0, 200), max_size=12))
def test_parallel_tool_calls_false_keeps_the_first_call(fmt: str, cuts: list[int]) -> None:
    text = render(fmt, CALLS)
    _, calls = plan_for(fmt, parallel=False).parse(text)
    assert as_pairs(calls) == CALLS[:1]
    _, streamed = stream_plan(plan_for(fmt, parallel=False), text, cuts)
    assert [(c["name"], json.loads(c["arguments"])) for c in streamed] == CALLS[:1]
    _, calls = plan_for(fmt).parse(text)
    assert as_pairs(calls) == CALLS


@settings(max_examples=60, deadline=None)
@given(fmt=st.sampled_from(AUTO_FORMATS), cuts=st.lists(st.integers(0, 200), max_size=12))
def test_a_call_to_an_unknown_function_is_content(fmt: str, cuts: list[int]) -> None:
    text = render(fmt, [("launch", {"city": "Oslo"})], "Sure. " if fmt == "hermes" else "")
    plan = plan_for(fmt)
    assert plan.parse(text) == (text, [])
    content, streamed = stream_plan(plan_for(fmt), text, cuts)
    assert (content, streamed) == (text, [])
    # After a known call, the whole answer is content; a stream is too unless it had sent
    # the known call before the unknown name came, and then drops the unknown one.
    text = render(fmt, [CALLS[0], ("launch", {})])
    assert plan.parse(text) == (text, [])
    content, streamed = stream_plan(plan_for(fmt), text, cuts)
    assert (content, streamed) == (text, []) or [c["name"] for c in streamed] == ["get_weather"]


@pytest.mark.parametrize("fmt", AUTO_FORMATS)
def test_a_cut_off_call_is_content(fmt: str) -> None:
    whole = render(fmt, CALLS[:1])
    cut = whole[: whole.index("Paris") + 2]
    assert plan_for(fmt).parse(cut) == (cut, [])
    bad_arguments = whole.replace('{"city": "Paris", "unit": "c"}', "[1, 2]")
    assert plan_for(fmt).parse(bad_arguments) == (bad_arguments, [])
    # Without its closing tag, a whole call still counts (the model stopped right after).
    if fmt == "hermes":
        unclosed = whole[: whole.index("</tool_call>")]
        assert as_pairs(plan_for(fmt).parse(unclosed)[1]) == CALLS[:1]


def test_finish_reason_is_tool_calls_only_for_calls_the_model_chose() -> None:
    auto = plan_for("hermes")
    required = plan_for("hermes", choice="required")
    named = plan_for("hermes", choice={"type": "function", "function": {"name": "get_time"}})
    assert auto.finish_reason("stop", True) == "tool_calls"
    assert auto.finish_reason("stop", False) == "stop"
    assert auto.finish_reason("length", True) == "length"
    assert required.finish_reason("stop", True) == "stop"
    assert named.finish_reason("stop", True) == "stop"


def test_every_tool_definition_is_checked_whatever_the_choice() -> None:
    bad = {
        "type": "function",
        "function": {
            "name": "f",
            "parameters": {
                "type": "object",
                "properties": {"d": {"type": "string", "format": "iri"}},
            },
        },
    }
    for choice in (None, "auto", "none", "required"):
        with pytest.raises(ApiError) as info:
            tool_plan([TOOLS[0], bad], choice, None, "hermes")
        assert info.value.param == "tools[1].function.parameters.properties.d.format"
    plan = plan_for("hermes")
    specs = plan.tool_specs()
    assert [s.param for s in specs] == [
        "tools[0].function.parameters",
        "tools[1].function.parameters",
    ]


def test_a_tool_message_needs_its_tool_call_id() -> None:
    from adaptermesh.worker.api import ChatMessage

    messages = [
        ChatMessage(role="user", content="hi"),
        ChatMessage(role="tool", content='{"t": 1}'),
    ]
    with pytest.raises(ApiError) as info:
        template_messages(messages)
    assert info.value.param == "messages[1].tool_call_id"
    assert info.value.status == 400
    ok = [messages[0], ChatMessage(role="tool", content="1", tool_call_id="call_1")]
    assert template_messages(ok)[1]["tool_call_id"] == "call_1"
