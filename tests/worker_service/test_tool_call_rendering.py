"""How a chat choice with tools is answered: the whole body's ``message.tool_calls`` and
``finish_reason``, and the SSE chunks of a streamed choice, for the model's own format
(``tool_choice: auto``) fed token by token as the engine's events come."""

from __future__ import annotations

import itertools
import json
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from adaptermesh.worker.generation_job import ChoiceProgress, GenerationJob
from adaptermesh.worker.generation_responses import _ChoiceChunks
from adaptermesh.worker.response_rendering import final_body
from adaptermesh.worker.tool_calls import tool_plan
from adaptermesh.worker.types import SamplingParams, TokenEvent

TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
OUTPUT = (
    'Checking. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
)


def job(choice: Any = None) -> GenerationJob:
    return GenerationJob(
        kind="chat",
        model="tiny",
        adapter=None,
        prompt_ids=[1, 2],
        sampling=SamplingParams(max_tokens=64),
        stream=True,
        include_usage=False,
        tenant="t",
        arrived=0.0,
        deadline=10.0,
        request_id="chatcmpl-1",
        created=1,
        tool_plan=tool_plan([TOOL], choice, None, "hermes"),
    )


def progress(reason: str) -> ChoiceProgress:
    return ChoiceProgress(prompt_tokens=2, completion_tokens=9, finish_reason=reason)


def test_whole_answer_has_tool_calls() -> None:
    body = final_body(job(), [(OUTPUT, [])], [progress("stop")])
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    message = choice["message"]
    assert message["content"] == "Checking. "
    (call,) = message["tool_calls"]
    assert call["type"] == "function"
    assert call["id"].startswith("call_")
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    # Cut by max_tokens: the reason stays length.
    assert (
        final_body(job(), [(OUTPUT, [])], [progress("length")])["choices"][0]["finish_reason"]
        == "length"
    )
    # tool_choice none: the text is the content.
    plain = final_body(job("none"), [(OUTPUT, [])], [progress("stop")])["choices"][0]
    assert plain["message"] == {"role": "assistant", "content": OUTPUT}
    assert plain["finish_reason"] == "stop"


def chunks_of(payloads: list[bytes]) -> list[dict[str, Any]]:
    out = []
    for raw in payloads:
        assert raw.startswith(b"data: ")
        out.append(json.loads(raw[len(b"data: ") :])["choices"][0])
    return out


@settings(max_examples=60, deadline=None)
@given(cuts=st.lists(st.integers(0, len(OUTPUT)), max_size=25))
def test_streamed_chunks_in_any_chunking(cuts: list[int]) -> None:
    writer = _ChoiceChunks(job(), 0)
    bounds = sorted({0, len(OUTPUT), *cuts})
    payloads: list[bytes] = []
    for start, end in itertools.pairwise(bounds):
        payloads += writer.of(TokenEvent(7, OUTPUT[start:end]))
    payloads += writer.of(TokenEvent(None, "", "stop"))
    chunks = chunks_of(payloads)
    assert chunks[-1]["finish_reason"] == "tool_calls"
    assert all(c["finish_reason"] is None for c in chunks[:-1])
    content = "".join(c["delta"].get("content", "") for c in chunks)
    parts = [p for c in chunks for p in c["delta"].get("tool_calls", [])]
    assert content == "Checking. "
    assert parts[0]["function"] == {"name": "get_weather", "arguments": ""}
    assert parts[0]["id"].startswith("call_")
    assert "".join(p["function"].get("arguments", "") for p in parts) == '{"city": "Oslo"}'
    assert {p["index"] for p in parts} == {0}
