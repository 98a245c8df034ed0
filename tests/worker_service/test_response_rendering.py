"""The answers of a generation request (``worker/response_rendering.py``): the SSE chunks, the
whole JSON body, usage and logprobs shapes; and the progress bookkeeping they read
(``worker/generation_job.py``)."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from adaptermesh.worker.generation_job import (
    ChoiceProgress,
    GenerationJob,
    record_event,
    request_outcome,
)
from adaptermesh.worker.response_rendering import (
    MIN_LOGPROB,
    SSE_DONE,
    chat_logprobs,
    choice_chunk,
    completion_logprobs,
    final_body,
    sse_event,
    usage_body,
    usage_chunk,
)
from adaptermesh.worker.types import (
    AdapterResolution,
    SamplingParams,
    TokenEvent,
    TokenLogprob,
    TopLogprob,
)


def job_of(kind: str = "completion", logprobs: int | None = None, n: int = 1) -> GenerationJob:
    return GenerationJob(
        kind="completion" if kind == "completion" else "chat",
        model="alpha",
        adapter="alpha",
        prompt_ids=[1, 2, 3],
        sampling=SamplingParams(max_tokens=4, logprobs=logprobs),
        stream=True,
        include_usage=False,
        tenant="id-acme",
        arrived=0.0,
        deadline=10.0,
        request_id="cmpl-1",
        n=n,
        created=1700000000,
    )


def decode(event: bytes) -> dict[str, Any]:
    assert event.startswith(b"data: ")
    assert event.endswith(b"\n\n")
    decoded: dict[str, Any] = json.loads(event[len(b"data: ") : -2])
    return decoded


LOGPROB = TokenLogprob(
    token_id=7,
    token="a",
    token_bytes=b"a",
    logprob=float("-inf"),
    text_offset=0,
    top=(TopLogprob(8, "b", b"b", -0.5), TopLogprob(9, "a", b"a", -0.7)),
)


def test_logprobs_clamp_minus_infinity_and_key_alternatives_by_text() -> None:
    legacy = completion_logprobs([LOGPROB])
    assert legacy == {
        "tokens": ["a"],
        "token_logprobs": [MIN_LOGPROB],
        # The first of equal texts wins: "a" is the alternative's -0.7.
        "top_logprobs": [{"b": -0.5, "a": -0.7}],
        "text_offset": [0],
    }
    chat = chat_logprobs((LOGPROB,))
    assert chat == {
        "content": [
            {
                "token": "a",
                "logprob": MIN_LOGPROB,
                "bytes": [97],
                "top_logprobs": [
                    {"token": "b", "logprob": -0.5, "bytes": [98]},
                    {"token": "a", "logprob": -0.7, "bytes": [97]},
                ],
            }
        ]
    }


TEXTS = st.one_of(st.none(), st.text(max_size=12))
REASONS = st.sampled_from([None, "stop", "length"])


@settings(max_examples=100, deadline=None)
@given(
    kind=st.sampled_from(["completion", "chat"]),
    texts=st.lists(TEXTS, min_size=1, max_size=4),
    reason=REASONS,
    index=st.integers(0, 15),
    role=st.booleans(),
)
def test_every_chunk_is_one_sse_event_of_the_request_head_and_its_choice(
    kind: str, texts: list[str | None], reason: str | None, index: int, role: bool
) -> None:
    job = job_of(kind)
    for text in texts:
        chunk = decode(choice_chunk(job, text, reason, role=role, index=index))
        assert chunk["id"] == "cmpl-1"
        assert chunk["model"] == "alpha"
        assert chunk["created"] == 1700000000
        (choice,) = chunk["choices"]
        assert choice["index"] == index
        assert choice["finish_reason"] == reason
        assert choice["logprobs"] is None
        if kind == "completion":
            assert chunk["object"] == "text_completion"
            assert choice["text"] == (text or "")
        else:
            assert chunk["object"] == "chat.completion.chunk"
            expected = {"role": "assistant"} if role else {}
            if text is not None:
                expected["content"] = text
            assert choice["delta"] == expected
    # The head is encoded once and reused.
    assert job.chunk_head.startswith(b"data: {")


def test_a_chunk_with_logprobs_carries_them_in_its_endpoint_shape() -> None:
    completion = decode(choice_chunk(job_of(), "a", None, logprobs=(LOGPROB,)))
    assert completion["choices"][0]["logprobs"]["tokens"] == ["a"]
    chat = decode(choice_chunk(job_of("chat"), "a", None, logprobs=(LOGPROB,)))
    assert chat["choices"][0]["logprobs"]["content"][0]["token"] == "a"


def test_usage_counts_the_prompt_once_and_every_choice() -> None:
    progresses = [
        ChoiceProgress(prompt_tokens=5, completion_tokens=3),
        ChoiceProgress(prompt_tokens=5, completion_tokens=4),
    ]
    assert usage_body(progresses) == {
        "prompt_tokens": 5,
        "completion_tokens": 7,
        "total_tokens": 12,
    }
    assert usage_body(progresses[0]) == {
        "prompt_tokens": 5,
        "completion_tokens": 3,
        "total_tokens": 8,
    }
    closing = decode(usage_chunk(job_of("chat"), progresses))
    assert closing["choices"] == []
    assert closing["object"] == "chat.completion.chunk"
    assert closing["usage"]["total_tokens"] == 12


def test_the_final_body_has_every_choice_and_the_usage() -> None:
    progresses = [
        ChoiceProgress(prompt_tokens=3, completion_tokens=2, finish_reason="stop"),
        ChoiceProgress(prompt_tokens=3, completion_tokens=4, finish_reason="length"),
    ]
    body = final_body(job_of("chat", n=2), [("hi", []), ("there", [])], progresses)
    assert body["object"] == "chat.completion"
    assert body["id"] == "cmpl-1"
    assert [c["message"] for c in body["choices"]] == [
        {"role": "assistant", "content": "hi"},
        {"role": "assistant", "content": "there"},
    ]
    assert [c["finish_reason"] for c in body["choices"]] == ["stop", "length"]
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 6, "total_tokens": 9}
    asked = final_body(job_of(logprobs=1), [("a", [LOGPROB])], progresses[:1])
    assert asked["object"] == "text_completion"
    assert asked["choices"][0]["logprobs"]["token_logprobs"] == [MIN_LOGPROB]
    assert (
        final_body(job_of(), [("a", [LOGPROB])], progresses[:1])["choices"][0]["logprobs"] is None
    )


def test_sse_framing() -> None:
    assert sse_event({"a": 1}) == b'data: {"a":1}\n\n'
    assert SSE_DONE == b"data: [DONE]\n\n"


def test_progress_records_token_times_counts_and_resolution() -> None:
    progress = ChoiceProgress()
    resolution = AdapterResolution(tier="gpu", started=1.0, resolved=1.0)
    record_event(progress, TokenEvent(None, "", resolution=resolution), 3, now=1.0)
    assert progress.first_token is None
    assert progress.prompt_tokens == 3
    assert progress.resolution is resolution
    record_event(progress, TokenEvent(5, "a", prompt_tokens=4, completion_tokens=1), 3, now=2.0)
    record_event(progress, TokenEvent(6, "b", completion_tokens=2), 3, now=3.0)
    assert (progress.first_token, progress.last_token) == (2.0, 3.0)
    assert (progress.prompt_tokens, progress.completion_tokens) == (3, 2)
    record_event(
        progress, TokenEvent(None, "", finish_reason="stop", completion_tokens=2), 3, now=4.0
    )
    assert progress.finish_reason == "stop"
    assert progress.last_token == 3.0


def test_a_finish_without_text_still_times_its_tokens() -> None:
    progress = ChoiceProgress()
    record_event(
        progress, TokenEvent(None, "", finish_reason="length", completion_tokens=2), 3, now=5.0
    )
    assert (progress.first_token, progress.last_token) == (5.0, 5.0)


def test_the_request_outcome() -> None:
    def of(*reasons: str | None) -> str:
        return request_outcome([ChoiceProgress(finish_reason=r) for r in reasons])

    assert of("stop", "stop") == "stop"
    assert of("stop", "length") == "length"
    assert of("stop", None) == "error"
    assert of("stop", "cancelled") == "error"
