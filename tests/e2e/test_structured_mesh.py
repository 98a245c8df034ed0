"""Structured outputs and tool calls through the local mesh: the ``openai`` client in a tenant's
namespace -> eBPF classifier -> Envoy -> CPU worker. ``chat.completions.parse`` with a pydantic
model returns a parsed object; a forced tool call comes back whole and streamed."""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import openai
import pydantic
import pytest

from adaptermesh_testkit.localmesh import SERVICE_PORT, LocalMesh, MeshConfig

pytestmark = [pytest.mark.e2e, pytest.mark.root, pytest.mark.slow]

PARAMETERS = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS: list[Any] = [
    {"type": "function", "function": {"name": "get_weather", "parameters": PARAMETERS}}
]


class Answer(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=8)
    degrees: int = pydantic.Field(ge=-50, le=50)


@pytest.fixture(scope="module")
def mesh() -> Iterator[LocalMesh]:
    m = LocalMesh(
        MeshConfig(
            prefix=f"ams{secrets.token_hex(2)}",
            shards=1,
            workers_per_shard=1,
            tenants=1,
            interval_s=2.0,
            report_interval_s=0.5,
        )
    )
    try:
        m.start()
        yield m
    finally:
        m.stop()


def _round_trips(source: str, base: str, adapter: str) -> dict[str, Any]:
    """In the tenant's namespace: the client bound to the tenant's address."""
    http = httpx.Client(transport=httpx.HTTPTransport(local_address=source), timeout=60)
    client = openai.OpenAI(
        base_url=base + "/v1",
        api_key="tenant",
        max_retries=0,
        http_client=http,
        default_headers={"x-adapter-id": adapter},
    )
    messages: list[Any] = [{"role": "user", "content": "Weather in Paris?"}]
    parsed = client.chat.completions.parse(
        model=adapter, messages=messages, response_format=Answer, max_tokens=120
    )
    named = client.chat.completions.create(
        model=adapter,
        messages=messages,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=120,
    )
    streamed: list[dict[str, Any]] = []
    finish = None
    for chunk in client.chat.completions.create(
        model=adapter,
        messages=messages,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=120,
        stream=True,
    ):
        for part in chunk.choices[0].delta.tool_calls or []:
            if part.index == len(streamed):
                assert part.function is not None
                streamed.append({"name": part.function.name, "arguments": ""})
            else:
                assert part.function is not None
                streamed[part.index]["arguments"] += part.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    http.close()
    return {"parsed": parsed, "named": named, "streamed": streamed, "finish": finish}


def test_parse_and_tool_calls_through_envoy(mesh: LocalMesh) -> None:
    adapter = next(iter(mesh.config.adapters))
    source = mesh.tenants[0]
    out = mesh.ns.run(
        mesh.tenant_ns, _round_trips, source, f"http://{mesh.vip}:{SERVICE_PORT}", adapter
    )
    parsed = out["parsed"].choices[0]
    assert parsed.finish_reason == "stop"
    assert isinstance(parsed.message.parsed, Answer)
    named = out["named"].choices[0]
    assert named.finish_reason == "stop"  # a named function ends "stop", as OpenAI answers
    assert named.message.tool_calls is not None
    call = named.message.tool_calls[0]
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), PARAMETERS)
    assert out["finish"] == "stop"
    assert [c["name"] for c in out["streamed"]] == ["get_weather"]
    jsonschema.validate(json.loads(out["streamed"][0]["arguments"]), PARAMETERS)
