"""The OpenAI request surface through the real ``openai`` client and raw bodies: n, seed, stop,
penalties, max_completion_tokens, stream_options.include_usage, user, response_format, unknown
and unsupported fields; plus properties of the pydantic request models."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from adaptermesh.worker.api import ChatCompletionRequest, CompletionRequest, request_error

from .fakes import FakeEngine, expected_text, word_id
from .strategies import HOSTILE, SAMPLING, check_answer, encode
from .threaded import threaded_service


@pytest.fixture(scope="module")
def engine_url() -> Iterator[tuple[FakeEngine, str]]:
    # Slots for every choice the tests ask for (n up to 20): the fake generates a choice only
    # while its stream is read, so a request with more choices than slots would wait on
    # itself (the engine generates whether or not its streams are read).
    engine = FakeEngine(max_batch=32)
    with threaded_service(lambda: engine) as url:
        yield engine, url


@pytest.fixture
def client(engine_url: tuple[FakeEngine, str]) -> openai.OpenAI:
    return openai.OpenAI(base_url=engine_url[1] + "/v1", api_key="k", max_retries=0)


def ids(text: str) -> list[int]:
    return [word_id(w) for w in text.split()]


def test_n_choices_non_streaming(client: openai.OpenAI, engine_url: tuple[FakeEngine, str]) -> None:
    engine = engine_url[0]
    engine.submitted.clear()
    done = client.completions.create(model="alpha", prompt="a b", max_tokens=3, n=3, seed=7)
    assert [c.index for c in done.choices] == [0, 1, 2]
    assert all(c.finish_reason == "length" for c in done.choices)
    assert done.choices[0].text == expected_text(ids("a b"), "alpha", 3)
    assert done.usage is not None
    assert (done.usage.prompt_tokens, done.usage.completion_tokens, done.usage.total_tokens) == (
        2,
        9,
        11,
    )
    seeds = [r.sampling.seed for r in engine.submitted]
    assert seeds == [7, 8, 9]
    assert len({r.request_id for r in engine.submitted}) == 3


def test_n_choices_streaming_with_usage(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model="tiny-base",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=4,
        n=2,
        stream=True,
        stream_options={"include_usage": True},
    )
    texts = {0: "", 1: ""}
    finish: dict[int, str | None] = {}
    usage = None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
            assert chunk.choices == []
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finish[choice.index] = choice.finish_reason
    assert finish == {0: "length", 1: "length"}
    assert texts[0]
    assert texts[0] == texts[1]
    assert usage is not None
    assert usage.completion_tokens == 8


def test_stop_string_or_list_finishes_with_stop(client: openai.OpenAI) -> None:
    full = expected_text(ids("q"), None, 6)
    word = full.split()[2]
    for stop in (word, [word, "never-there"]):
        done = client.completions.create(model="tiny-base", prompt="q", max_tokens=6, stop=stop)
        assert done.choices[0].finish_reason == "stop"


def test_sampling_fields_reach_the_engine(
    client: openai.OpenAI, engine_url: tuple[FakeEngine, str]
) -> None:
    engine = engine_url[0]
    engine.submitted.clear()
    client.chat.completions.create(
        model="tiny-base",
        messages=[{"role": "user", "content": "hi"}],
        max_completion_tokens=2,
        max_tokens=5,
        seed=3,
        presence_penalty=0.5,
        frequency_penalty=-1.0,
        temperature=0.0,
        top_p=0.5,
        user="u-1",
        response_format={"type": "text"},
        logprobs=False,
        extra_body={"repetition_penalty": 1.3, "top_k": 4},
    )
    (req,) = engine.submitted
    s = req.sampling
    assert (
        s.max_tokens,
        s.seed,
        s.presence_penalty,
        s.frequency_penalty,
        s.temperature,
        s.top_p,
        s.repetition_penalty,
        s.top_k,
    ) == (2, 3, 0.5, -1.0, 0.0, 0.5, 1.3, 4)


@pytest.mark.parametrize(
    ("kwargs", "param", "code"),
    [
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "invalid_value"),
        ({"top_logprobs": 2}, "top_logprobs", "invalid_value"),
        ({"n": 0}, "n", "invalid_value"),
        ({"extra_body": {"max_token": 3}}, "max_token", "unknown_field"),
        (
            {"extra_body": {"stream_options": {"include_usage": True, "x": 1}}},
            "stream_options.x",
            "unknown_field",
        ),
        ({"presence_penalty": 3}, "presence_penalty", "invalid_value"),
        ({"extra_body": {"seed": "1"}}, "seed", "invalid_type"),
    ],
)
def test_refusals_name_the_field(
    client: openai.OpenAI, kwargs: dict[str, Any], param: str, code: str
) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model="tiny-base", max_tokens=2, messages=[{"role": "user", "content": "hi"}], **kwargs
        )
    error = info.value.body
    assert isinstance(error, dict)
    assert (error["param"], error["code"]) == (param, code)
    assert param in error["message"]


def test_completions_refuse_chat_only_fields(engine_url: tuple[FakeEngine, str]) -> None:
    r = httpx.post(
        engine_url[1] + "/v1/completions",
        json={"prompt": "a", "messages": [{"role": "user", "content": "x"}]},
    )
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "messages"


# ------------------------------------------------------------------------------- properties
VALID = st.fixed_dictionaries({}, optional={k: v for k, v in SAMPLING.items() if k != "model"})


@settings(max_examples=100, deadline=None)
@given(
    fields=VALID,
    prompt=st.one_of(
        st.text(min_size=1, max_size=20).filter(
            lambda t: not any(0xD800 <= ord(c) <= 0xDFFF for c in t)
        ),
        st.lists(st.integers(0, 999), min_size=1, max_size=8),
    ),
)
def test_well_typed_bodies_parse(fields: dict[str, Any], prompt: Any) -> None:
    parsed = CompletionRequest.model_validate({**fields, "prompt": prompt})
    assert parsed.n == fields.get("n", 1)
    stop = fields.get("stop")
    assert parsed.stop == (
        () if stop is None else (stop,) if isinstance(stop, str) else tuple(stop)
    )


@settings(max_examples=150, deadline=None)
@given(
    body=st.dictionaries(
        st.sampled_from(
            sorted(
                {
                    *SAMPLING,
                    "prompt",
                    "messages",
                    "echo",
                    "suffix",
                    "tools",
                    "response_format",
                    "max_completion_tokens",
                    "top_logprobs",
                    "x",
                    "",
                }
            )
        ),
        HOSTILE,
        max_size=6,
    ),
    model=st.sampled_from([CompletionRequest, ChatCompletionRequest]),
)
def test_any_body_parses_or_names_a_field(body: dict[str, Any], model: Any) -> None:
    try:
        json.loads(encode(body))
    except (RecursionError, ValueError):
        return
    try:
        model.model_validate(json.loads(encode(body)))
    except ValidationError as exc:
        param, code, message = request_error(exc)
        assert param
        assert message.startswith(param + ": ")
        root = param.split("[", 1)[0].split(".", 1)[0]
        assert root in body or code == "missing_field", (param, body)
        assert code in {
            "missing_field",
            "invalid_type",
            "invalid_value",
            "invalid_unicode",
            "unknown_field",
            "unsupported",
        }


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@settings(max_examples=25, deadline=None)
@given(n=st.integers(-2, 20), stream=st.booleans(), extra=HOSTILE)
def test_n_and_stream_over_http_never_5xx(
    engine_url: tuple[FakeEngine, str], path: str, n: int, stream: bool, extra: Any
) -> None:
    body: dict[str, Any] = {
        "n": n,
        "stream": stream,
        "max_tokens": 2,
        "stream_options": {"include_usage": extra},
    }
    if path == "/v1/completions":
        body["prompt"] = "a b"
    else:
        body["messages"] = [{"role": "user", "content": "hi"}]
    r = httpx.post(
        engine_url[1] + path,
        content=encode(body),
        headers={"Content-Type": "application/json"},
        timeout=30,
    )
    check_answer(path, r)
    if r.status_code == 200 and not stream:
        assert len(r.json()["choices"]) == n
