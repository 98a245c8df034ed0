"""Structured outputs and tool calls through the HTTP API, with the real ``openai`` client
against a worker around the real engine on CPU (the tiny random Llama, whose chat template
renders tools the way Qwen2.5's does).

``chat.completions.parse`` with a pydantic model returns a parsed object; JSON mode, regex,
choice and grammar constraints hold in chat and completions, streamed and not, with n > 1;
``tool_choice`` required and named force calls that come back as ``tool_calls`` (streamed as
OpenAI streams them) and a second turn with the calls and their results renders; malformed
constraints and tools are 400s naming the field.
"""

from __future__ import annotations

import datetime
import json
import re
import uuid
from collections.abc import Iterator
from typing import Any

import jsonschema
import openai
import pydantic
import pytest

from adaptermesh.worker.engine import Engine, EngineConfig
from adaptermesh_testkit.checkpoints import (
    TOOLS_CHAT_TEMPLATE,
    make_adapter,
    make_tiny_model,
    set_chat_template,
)

from .threaded import threaded_service

pytestmark = pytest.mark.slow

MESSAGES: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 8},
                "unit": {"enum": ["c", "f"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 12}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}


class Answer(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=8)
    degrees: int = pydantic.Field(ge=-50, le=50)
    sunny: bool


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    base = tmp_path_factory.mktemp("structured")
    model = make_tiny_model(base / "tiny", max_position_embeddings=1024)
    set_chat_template(model, TOOLS_CHAT_TEMPLATE)
    root = base / "adapters"
    root.mkdir()
    make_adapter(root, model, "a1", rank=4, target_modules=("q_proj", "v_proj"), seed=1)

    def engine() -> Engine:
        return Engine(model, root, config=EngineConfig(max_num_seqs=8), model_name="tiny")

    with threaded_service(engine) as served:
        yield served


@pytest.fixture
def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="k", max_retries=0)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_parse_with_a_pydantic_model(client: openai.OpenAI, temperature: float) -> None:
    completion = client.chat.completions.parse(
        model="tiny",
        messages=MESSAGES,
        response_format=Answer,
        max_tokens=300,
        temperature=temperature,
        seed=3,
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, Answer)


def test_json_schema_streamed_with_n_choices_and_an_adapter(client: openai.OpenAI) -> None:
    schema = Answer.model_json_schema()
    stream = client.chat.completions.create(
        model="a1",
        messages=MESSAGES,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "answer", "schema": schema, "strict": True},
        },
        n=3,
        temperature=1.0,
        seed=5,
        max_tokens=300,
        stream=True,
        logprobs=True,
        top_logprobs=2,
    )
    texts = ["", "", ""]
    reasons: list[Any] = [None] * 3
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            reasons[choice.index] = choice.finish_reason or reasons[choice.index]
    assert reasons == ["stop"] * 3
    for text in texts:
        jsonschema.validate(json.loads(text), schema)


def test_completions_take_json_object_regex_choice_and_grammar(client: openai.OpenAI) -> None:
    out = client.completions.create(
        model="tiny",
        prompt="JSON:",
        max_tokens=120,
        extra_body={"structured_outputs": {"regex": "[a-c]{2,5}-[0-9]{2}"}},
    )
    assert re.fullmatch("[a-c]{2,5}-[0-9]{2}", out.choices[0].text)
    assert out.choices[0].finish_reason == "stop"
    out = client.completions.create(
        model="tiny", prompt="Pick:", max_tokens=20, extra_body={"guided_choice": ["yes", "no"]}
    )
    assert out.choices[0].text in ("yes", "no")
    grammar = 'root ::= "(" num ("+" num)* ")"\nnum ::= [1-9]'
    out = client.completions.create(
        model="tiny", prompt="Sum:", max_tokens=60, extra_body={"guided_grammar": grammar}
    )
    if out.choices[0].finish_reason == "stop":
        assert re.fullmatch(r"\([1-9](\+[1-9])*\)", out.choices[0].text)
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    out = client.completions.create(
        model="tiny",
        prompt="JSON:",
        max_tokens=200,
        extra_body={"guided_json": schema, "response_format": None},
    )
    if out.choices[0].finish_reason == "stop":
        jsonschema.validate(json.loads(out.choices[0].text), schema)
    chat = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=200, response_format={"type": "json_object"}
    )
    if chat.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(chat.choices[0].message.content or ""), dict)


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "(("}},
                }
            },
            "response_format.json_schema.schema",
        ),
        ({"response_format": {"type": "yaml"}}, "response_format.type"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        ({"guided_regex": "(("}, "guided_regex"),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_choice": ["a", 1]}, "guided_choice[1]"),
        ({"guided_grammar": "root ::= ("}, "guided_grammar"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs.choice"),
        ({"structured_outputs": {"json_schema": {}}}, "structured_outputs.json_schema"),
        ({"guided_json": {"type": "object"}, "guided_regex": "a"}, "guided_regex"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "tool_choice.function.name",
        ),
        (
            {
                "tools": [WEATHER],
                "tool_choice": "required",
                "response_format": {"type": "json_object"},
            },
            "response_format",
        ),
        (
            {
                "messages": [
                    {
                        "role": "assistant",
                        "tool_calls": [
                            {
                                "id": "c",
                                "type": "function",
                                "function": {"name": "f", "arguments": "{"},
                            }
                        ],
                    }
                ]
            },
            "messages[0].tool_calls[0].function.arguments",
        ),
    ],
)
def test_bad_constraints_and_tools_are_400s_naming_the_field(
    client: openai.OpenAI, extra: dict[str, Any], param: str
) -> None:
    rest = dict(extra)
    messages = rest.pop("messages", MESSAGES)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=4, extra_body=rest
        )
    error = info.value.body
    assert isinstance(error, dict)
    assert error["param"] == param
    assert error["type"] == "invalid_request_error"
    assert param in error["message"]


def check_call(name: str, arguments: str) -> None:
    tool = {"get_weather": WEATHER, "get_time": TIME}[name]
    jsonschema.validate(json.loads(arguments), tool["function"]["parameters"])  # type: ignore[index]


def test_named_and_required_tool_choices_force_calls(client: openai.OpenAI) -> None:
    named = client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        tools=[WEATHER, TIME],  # type: ignore[list-item]
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        max_tokens=200,
    )
    choice = named.choices[0]
    # A forced call ends "stop", as OpenAI and vLLM answer a named function.
    assert choice.finish_reason == "stop"
    calls = choice.message.tool_calls
    assert calls is not None
    assert len(calls) == 1
    assert calls[0].function.name == "get_time"  # type: ignore[union-attr]
    assert calls[0].id.startswith("call_")
    check_call("get_time", calls[0].function.arguments)  # type: ignore[union-attr]
    required = client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        tools=[WEATHER, TIME],  # type: ignore[list-item]
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=200,
        temperature=1.0,
        seed=1,
    )
    choice = required.choices[0]
    assert choice.finish_reason == "stop"  # as vLLM answers tool_choice "required"
    assert choice.message.tool_calls is not None
    assert len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    check_call(call.function.name, call.function.arguments)  # type: ignore[union-attr]

    # The second turn: the assistant's call and the tool's result go through the template.
    follow = client.chat.completions.create(
        model="tiny",
        messages=[
            *MESSAGES,
            {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
            {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 21}'},
        ],
        tools=[WEATHER, TIME],  # type: ignore[list-item]
        max_tokens=5,
    )
    assert follow.choices[0].message.role == "assistant"
    assert follow.usage is not None
    assert follow.usage.prompt_tokens > named.usage.prompt_tokens  # type: ignore[union-attr]


@pytest.mark.parametrize("choice", ["required", "named"])
def test_streamed_tool_calls_come_as_openai_sends_them(client: openai.OpenAI, choice: str) -> None:
    tool_choice: Any = (
        "required"
        if choice == "required"
        else {"type": "function", "function": {"name": "get_weather"}}
    )
    stream = client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        tools=[WEATHER, TIME],  # type: ignore[list-item]
        tool_choice=tool_choice,
        parallel_tool_calls=False,
        max_tokens=200,
        stream=True,
    )
    calls: list[dict[str, Any]] = []
    finish = None
    for chunk in stream:
        delta = chunk.choices[0].delta
        assert not delta.content
        for part in delta.tool_calls or []:
            if part.index == len(calls):
                assert part.id
                assert part.type == "function"
                assert part.function
                assert part.function.name
                assert part.function.arguments == ""
                calls.append({"name": part.function.name, "arguments": ""})
            else:
                assert part.id is None
                assert part.function
                assert part.function.name is None
                calls[part.index]["arguments"] += part.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "stop"
    assert len(calls) == 1
    check_call(calls[0]["name"], calls[0]["arguments"])
    if choice == "named":
        assert calls[0]["name"] == "get_weather"


# ------------------------------------------------- what OpenAI and vLLM users rely on
class Event(pydantic.BaseModel):
    when: datetime.datetime
    day: datetime.date
    at: datetime.time
    ref: uuid.UUID
    host: pydantic.IPvAnyAddress


class Times(pydantic.BaseModel):
    when: datetime.datetime
    day: datetime.date
    at: datetime.time
    until: datetime.datetime


@pytest.mark.parametrize(("model", "seed"), [(Event, 0), (Event, 1), (Times, 2), (Times, 3)])
def test_parse_with_date_time_fields_never_raises_in_the_client(
    client: openai.OpenAI, model: type[pydantic.BaseModel], seed: int
) -> None:
    """Year 0000, 31 April or second 60 made pydantic raise inside ``parse``: no longer
    generated; pydantic's address and UUID formats are enforced."""
    completion = client.chat.completions.parse(
        model="tiny",
        messages=MESSAGES,
        response_format=model,
        max_tokens=300,
        temperature=1.0,
        seed=seed,
        n=3,
    )
    for choice in completion.choices:
        assert choice.finish_reason == "stop"
        assert isinstance(choice.message.parsed, model)


def test_pattern_keys_never_repeat(client: openai.OpenAI) -> None:
    schema = {
        "type": "object",
        "patternProperties": {"^x[0-9]$": {"type": "boolean"}},
        "additionalProperties": False,
        "minProperties": 3,
        "maxProperties": 6,
    }
    out = client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        response_format={"type": "json_schema", "json_schema": {"name": "k", "schema": schema}},
        max_tokens=200,
        temperature=1.0,
        seed=2,
        n=4,
    )
    for choice in out.choices:
        assert choice.finish_reason == "stop"
        text = choice.message.content or ""
        keys = [k for k, _ in json.loads(text, object_pairs_hook=lambda pairs: pairs)]
        assert len(keys) == len(set(keys)), text
        jsonschema.validate(json.loads(text), schema)


def nested(levels: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "boolean"}
    for _ in range(levels):
        schema = {
            "type": "object",
            "properties": {"n": schema},
            "required": ["n"],
            "additionalProperties": False,
        }
    return schema


def test_schemas_deeper_than_the_body_bound_are_served(client: openai.OpenAI) -> None:
    """20 nested objects (41 JSON levels, past the body's 32; OpenAI allows 10)."""
    schema = nested(20)
    out = client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        response_format={"type": "json_schema", "json_schema": {"name": "d", "schema": schema}},
        max_tokens=300,
    )
    assert out.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(out.choices[0].message.content or ""), schema)


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "d", "schema": nested(40)},
                }
            },
            "response_format.json_schema.schema",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {
                        "name": "d",
                        "schema": {
                            "type": "object",
                            "properties": {"when": {"type": "string", "format": "iri"}},
                        },
                    },
                }
            },
            "response_format.json_schema.schema.properties.when.format",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {
                        "name": "d",
                        "schema": {
                            "type": "object",
                            "properties": {"a": {}, "b": {}},
                            "required": ["a", "c"],
                        },
                    },
                }
            },
            "response_format.json_schema.schema.required[1]",
        ),
        (
            {"guided_json": {"type": "array", "items": {}, "minItems": 3, "maxItems": 1}},
            "guided_json.minItems",
        ),
        (  # more keys wanted than the closed key set holds (it used to repeat keys)
            {
                "structured_outputs": {
                    "json": {
                        "type": "object",
                        "patternProperties": {"^x[0-9]$": {"type": "boolean"}},
                        "additionalProperties": False,
                        "minProperties": 11,
                    }
                }
            },
            "structured_outputs.json.minProperties",
        ),
        (
            {
                "tools": [
                    WEATHER,
                    {
                        "type": "function",
                        "function": {
                            "name": "bad",
                            "parameters": {
                                "type": "object",
                                "properties": {"p": {"type": "string", "pattern": "(("}},
                            },
                        },
                    },
                ]
            },
            "tools[1].function.parameters",
        ),
        (
            {
                "tools": [
                    {"type": "function", "function": {"name": "deep", "parameters": nested(40)}}
                ],
                "tool_choice": "none",
            },
            "tools[0].function.parameters",
        ),
        (
            {
                "messages": [
                    *MESSAGES,
                    {"role": "assistant", "content": "ok"},
                    {"role": "tool", "content": '{"temp": 21}'},
                ]
            },
            "messages[2].tool_call_id",
        ),
    ],
)
def test_what_openai_refuses_is_a_400_naming_the_field(
    client: openai.OpenAI, extra: dict[str, Any], param: str
) -> None:
    rest = dict(extra)
    messages = rest.pop("messages", MESSAGES)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=4, extra_body=rest
        )
    error = info.value.body
    assert isinstance(error, dict)
    assert error["param"] == param
    assert error["type"] == "invalid_request_error"
    assert error["message"].startswith(param)
    assert client.models.list().data  # still serving


def forced_output(
    client: openai.OpenAI, text: str, stream: bool = False, **extra: Any
) -> tuple[str | None, list[tuple[str, str]], str | None]:
    """A chat with tools under ``auto`` whose output is exactly ``text`` (a one-choice
    constraint): (content, calls, finish_reason), whole or assembled from the stream."""
    kwargs: dict[str, Any] = {
        "model": "tiny",
        "messages": MESSAGES,
        "tools": [WEATHER, TIME],
        "max_tokens": 300,
        "extra_body": {"guided_choice": [text]},
        **extra,
    }
    if not stream:
        choice = client.chat.completions.create(**kwargs).choices[0]
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]  # type: ignore[union-attr]
        return choice.message.content, calls, choice.finish_reason
    content, parts, finish = "", [], None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for part in delta.tool_calls or []:
            if part.index == len(parts):
                parts.append([part.function.name, ""])  # type: ignore[union-attr]
            parts[part.index][1] += part.function.arguments or ""  # type: ignore[union-attr]
        finish = chunk.choices[0].finish_reason or finish
    return content or None, [(n, a) for n, a in parts], finish


WEATHER_CALL = '{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "c"}}'
TIME_CALL = '{"name": "get_time", "parameters": {"zone": 1}}'


@pytest.mark.parametrize("stream", [False, True])
def test_auto_tool_calls_as_vllm_answers_them(client: openai.OpenAI, stream: bool) -> None:
    both = f"{WEATHER_CALL}; {TIME_CALL}"
    _, calls, finish = forced_output(client, both, stream)
    assert [name for name, _ in calls] == ["get_weather", "get_time"]
    assert finish == "tool_calls"
    _, calls, finish = forced_output(client, both, stream, parallel_tool_calls=False)
    assert [name for name, _ in calls] == ["get_weather"]  # the first, as vLLM keeps
    assert json.loads(calls[0][1]) == {"city": "Oslo", "unit": "c"}
    assert finish == "tool_calls"
    unknown = '{"name": "launch", "parameters": {}}'
    assert forced_output(client, unknown, stream) == (unknown, [], "stop")
    if not stream:  # streamed, a call's fragments are sent as the model writes them
        cut = WEATHER_CALL[:30]
        assert forced_output(client, cut, stream) == (cut, [], "stop")
