"""OpenAI's sampling extras over HTTP with the fake engine: ``logit_bias`` (validation, passed
to the engine), ``echo``, ``suffix`` on a model without fill-in-the-middle tokens,
``best_of``; and errors the OpenAI way (400 ``invalid_request_error``, ``context_length_exceeded``)
through the real ``openai`` client."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from adaptermesh.worker.api import MAX_BEST_OF, CompletionRequest
from adaptermesh.worker.http_errors import ApiError
from adaptermesh.worker.types import MAX_LOGIT_BIAS

from .conftest import Server, StartServer
from .fakes import VOCAB, FakeEngine, expected_text, word_id
from .threaded import threaded_service


def ids(text: str) -> list[int]:
    return [word_id(w) for w in text.split()]


@pytest.fixture(scope="module")
def engine_url() -> Iterator[tuple[FakeEngine, str]]:
    engine = FakeEngine(max_batch=32)
    with threaded_service(lambda: engine) as url:
        yield engine, url


@pytest.fixture
def client(engine_url: tuple[FakeEngine, str]) -> openai.OpenAI:
    return openai.OpenAI(base_url=engine_url[1] + "/v1", api_key="k", max_retries=0)


# ------------------------------------------------------------------------------- logit_bias
async def test_logit_bias_is_passed_to_the_engine(server: Server) -> None:
    for path, extra in (
        ("/v1/completions", {"prompt": "hello"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ):
        server.engine.submitted.clear()
        r = await server.client.post(
            path, json={**extra, "max_tokens": 2, "logit_bias": {"7": 5, "3": -100, "12": 0.5}}
        )
        assert r.status_code == 200, r.text
        (request,) = server.engine.submitted
        assert request.sampling.logit_bias == ((3, -100.0), (7, 5.0), (12, 0.5))
    r = await server.client.post("/v1/completions", json={"prompt": "x", "logit_bias": None})
    assert r.status_code == 200
    assert server.engine.submitted[-1].sampling.logit_bias == ()


BIAS_KEYS = st.one_of(
    st.integers(0, VOCAB - 1).map(str),
    st.integers(VOCAB, 10**12).map(str),  # outside the vocabulary
    st.integers(-(10**6), -1).map(str),
    st.text(max_size=6),
    st.sampled_from(["1.5", "0x10", " 1", "1e3", "١"]),
)
BIAS_VALUES = st.one_of(
    st.integers(-100, 100),
    st.floats(-100, 100, allow_nan=False),
    st.integers(-(10**30), 10**30),
    st.floats(allow_nan=False, allow_infinity=False),
    st.booleans(),
    st.none(),
    st.text(max_size=4),
    st.lists(st.integers(), max_size=2),
)


def _valid_bias(value: Any) -> bool:
    if not isinstance(value, dict) or len(value) > MAX_LOGIT_BIAS:
        return False
    for key, bias in value.items():
        if not (key.isascii() and key.isdigit()) or len(key) > 10 or int(key) >= VOCAB:
            return False
        if type(bias) not in (int, float) or not -100 <= bias <= 100:
            return False
    return len({int(key) for key in value}) == len(value)


@settings(
    max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    bias=st.one_of(
        st.dictionaries(BIAS_KEYS, BIAS_VALUES, max_size=6),
        st.dictionaries(st.integers(0, VOCAB - 1).map(str), st.integers(-100, 100), max_size=6),
        st.integers(),
        st.lists(st.integers(), max_size=3),
        st.text(max_size=5),
    ),
    chat=st.booleans(),
)
def test_any_logit_bias_is_served_or_refused_naming_it(
    engine_url: tuple[FakeEngine, str], bias: Any, chat: bool
) -> None:
    engine, url = engine_url
    before = len(engine.submitted)
    body: dict[str, Any] = {"max_tokens": 2, "logit_bias": bias}
    if chat:
        path, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": "hi"}]
    else:
        path, body["prompt"] = "/v1/completions", "hello there"
    r = httpx.post(url + path, json=body, timeout=30)
    if _valid_bias(bias):
        assert r.status_code == 200, r.text
        sent = engine.submitted[-1].sampling.logit_bias
        assert sent == tuple(sorted((int(k), float(v)) for k, v in bias.items()))
        return
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", "logit_bias")
    assert error["message"].startswith("logit_bias: ")
    assert error["code"] in {"invalid_type", "invalid_value"}
    # Nothing reached the engine, nothing is left in flight, and the server keeps serving.
    assert len(engine.submitted) == before
    ok = httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 1}, timeout=30)
    assert ok.status_code == 200


def test_logit_bias_limits(engine_url: tuple[FakeEngine, str]) -> None:
    url = engine_url[1] + "/v1/completions"
    at_cap = {str(i): 1 for i in range(MAX_LOGIT_BIAS)}
    assert httpx.post(url, json={"prompt": "x", "max_tokens": 1, "logit_bias": at_cap}).is_success
    over = {str(i): 1 for i in range(MAX_LOGIT_BIAS + 1)}
    for bias, needle in (
        (over, f"at most {MAX_LOGIT_BIAS} tokens"),
        ({"5": 100.5}, "[-100, 100]"),
        ({"5": -1e308}, "[-100, 100]"),
        ({"5": 10**400}, "[-100, 100]"),
        ({"5": True}, "finite number"),
        ({"5": "1"}, "finite number"),
        ({"-5": 1}, "token ids"),
        ({"05": 1, "5": 2}, "named twice"),
        ({str(VOCAB): 1}, "outside the vocabulary"),
        ([1, 2], "object"),
    ):
        raw = json.dumps({"prompt": "x", "logit_bias": bias})
        r = httpx.post(url, content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 400, (bias, r.text)
        error = r.json()["error"]
        assert error["param"] == "logit_bias", error
        assert needle in error["message"], (needle, error)


def test_parsed_logit_bias_never_holds_a_non_finite_value() -> None:
    parsed = CompletionRequest.model_validate({"prompt": "x", "logit_bias": {"1": -100, "2": 100}})
    assert parsed.logit_bias == ((1, -100.0), (2, 100.0))
    assert all(math.isfinite(bias) for _, bias in parsed.logit_bias)


# ------------------------------------------------------------------------------------- echo
async def test_echo_prepends_the_prompt(server: Server) -> None:
    prompt = "tell me a story"
    body = {"prompt": prompt, "max_tokens": 3, "echo": True}
    r = await server.client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == prompt + expected_text(ids(prompt), None, 3)
    # Token-id prompts echo their text.
    r = await server.client.post("/v1/completions", json={**body, "prompt": [5, 9]})
    assert r.json()["choices"][0]["text"] == " w5 w9" + expected_text([5, 9], None, 3)
    # echo: false (and null) change nothing.
    for echo in (False, None):
        r = await server.client.post("/v1/completions", json={**body, "echo": echo})
        assert r.json()["choices"][0]["text"] == expected_text(ids(prompt), None, 3)
    # n choices each start with the prompt; usage counts no echoed token.
    r = await server.client.post("/v1/completions", json={**body, "n": 2})
    texts = [choice["text"] for choice in r.json()["choices"]]
    assert texts == [prompt + expected_text(ids(prompt), None, 3)] * 2
    assert r.json()["usage"]["completion_tokens"] == 6


async def test_streamed_echo_sends_the_prompt_first(server: Server) -> None:
    prompt = "once upon"
    for n in (1, 2):
        async with server.client.stream(
            "POST",
            "/v1/completions",
            json={"prompt": prompt, "max_tokens": 2, "echo": True, "stream": True, "n": n},
        ) as r:
            assert r.status_code == 200
            chunks = [
                json.loads(line[6:]) async for line in r.aiter_lines() if line.startswith("data: {")
            ]
        per_choice: dict[int, list[str]] = {}
        for chunk in chunks:
            for choice in chunk["choices"]:
                per_choice.setdefault(choice["index"], []).append(choice["text"])
        assert sorted(per_choice) == list(range(n))
        for texts in per_choice.values():
            assert texts[0] == prompt
            assert "".join(texts) == prompt + expected_text(ids(prompt), None, 2)


async def test_echo_is_a_completions_field_and_not_with_logprobs(server: Server) -> None:
    r = await server.client.post(
        "/v1/completions", json={"prompt": "x", "echo": True, "logprobs": 2}
    )
    assert r.status_code == 400
    error = r.json()["error"]
    assert (error["param"], error["code"]) == ("echo", "unsupported")
    assert "logprobs" in error["message"]
    r = await server.client.post("/v1/completions", json={"prompt": "x", "echo": "yes"})
    assert (r.status_code, r.json()["error"]["param"]) == (400, "echo")
    r = await server.client.post(
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "x"}], "echo": True},
    )
    assert (r.status_code, r.json()["error"]["param"]) == (400, "echo")


# ----------------------------------------------------------------------------------- suffix
async def test_suffix_without_fim_tokens_is_refused_naming_it(server: Server) -> None:
    before = len(server.engine.submitted)
    r = await server.client.post("/v1/completions", json={"prompt": "def f(", "suffix": "):"})
    assert r.status_code == 400
    error = r.json()["error"]
    assert (error["param"], error["code"]) == ("suffix", "unsupported")
    assert "fill-in-the-middle" in error["message"]
    assert len(server.engine.submitted) == before
    # An empty suffix is no suffix (OpenAI's default is null).
    r = await server.client.post("/v1/completions", json={"prompt": "x", "suffix": ""})
    assert r.status_code == 200
    r = await server.client.post("/v1/completions", json={"prompt": "x", "suffix": 3})
    assert (r.status_code, r.json()["error"]["param"]) == (400, "suffix")


# ---------------------------------------------------------------------------------- best_of
async def test_best_of_runs_every_candidate_and_answers_n(server: Server) -> None:
    server.engine.submitted.clear()
    r = await server.client.post(
        "/v1/completions", json={"prompt": "pick one", "max_tokens": 3, "n": 2, "best_of": 4}
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert [choice["index"] for choice in body["choices"]] == [0, 1]
    # The fake's candidates are equal; none carries logprobs the client did not ask for.
    assert all(choice["logprobs"] is None for choice in body["choices"])
    assert len(server.engine.submitted) == 4
    # Ranked by cumulative logprob: the engine reports the sampled tokens' logprobs.
    assert {request.sampling.logprobs for request in server.engine.submitted} == {0}
    # Usage counts every candidate's tokens.
    assert body["usage"]["completion_tokens"] == 12
    # best_of equal to n is plain n.
    server.engine.submitted.clear()
    r = await server.client.post(
        "/v1/completions", json={"prompt": "x", "max_tokens": 1, "n": 2, "best_of": 2}
    )
    assert r.status_code == 200
    assert len(server.engine.submitted) == 2
    assert {request.sampling.logprobs for request in server.engine.submitted} == {None}


@pytest.mark.parametrize(
    ("fields", "needle"),
    [
        ({"best_of": 2, "stream": True}, "cannot be streamed"),
        ({"best_of": 1, "n": 2}, "[n, 20]"),
        ({"best_of": MAX_BEST_OF + 1}, "[n, 20]"),
        ({"best_of": 0}, "[n, 20]"),
        ({"best_of": 2.0}, "integer"),
        ({"best_of": "3"}, "integer"),
    ],
)
async def test_bad_best_of_is_refused_naming_it(
    server: Server, fields: dict[str, Any], needle: str
) -> None:
    r = await server.client.post("/v1/completions", json={"prompt": "x", **fields})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "best_of"
    assert needle in error["message"]
    assert server.service.queue.num_running == 0


async def test_best_of_is_refused_on_the_websocket_route(start_server: StartServer) -> None:
    server = await start_server()
    job = await server.service.build_job(
        _request(), {"prompt": "x", "max_tokens": 1, "best_of": 3}, "completion"
    )
    events = server.service.job_events(job)
    with pytest.raises(ApiError) as caught:
        await anext(events)
    assert (caught.value.status, caught.value.param) == (400, "best_of")
    assert server.service.inflight == 0


def _request() -> Any:
    from aiohttp.test_utils import make_mocked_request

    return make_mocked_request("POST", "/v1/completions")


# --------------------------------------------------------------------------- OpenAI errors
def test_openai_client_raises_bad_request_naming_the_field(client: openai.OpenAI) -> None:
    for call, param, code in (
        (
            lambda: client.completions.create(model="tiny-base", prompt="x", logit_bias={"5": 101}),
            "logit_bias",
            "invalid_value",
        ),
        (
            lambda: client.completions.create(model="tiny-base", prompt="x", best_of=1, n=2),
            "best_of",
            "invalid_value",
        ),
        (
            lambda: client.completions.create(model="tiny-base", prompt="x", suffix="y"),
            "suffix",
            "unsupported",
        ),
        (
            lambda: client.completions.create(model="tiny-base", prompt="x", temperature=9),
            "temperature",
            "invalid_value",
        ),
        (
            lambda: client.chat.completions.create(
                model="tiny-base", messages=[{"role": "user", "content": "x"}], logit_bias={"x": 1}
            ),
            "logit_bias",
            "invalid_value",
        ),
    ):
        with pytest.raises(openai.BadRequestError) as info:
            call()
        assert info.value.status_code == 400
        assert (info.value.code, info.value.param, info.value.type) == (
            code,
            param,
            "invalid_request_error",
        )
        assert param in info.value.message


def test_openai_client_raises_context_length_exceeded(client: openai.OpenAI) -> None:
    # The fake's context is 128 tokens; one word is one token.
    long_prompt = " ".join(["w"] * 200)
    cases = [
        (lambda: client.completions.create(model="tiny-base", prompt=long_prompt), "prompt"),
        (
            lambda: client.completions.create(model="tiny-base", prompt="a b", max_tokens=127),
            "max_tokens",
        ),
        (
            lambda: client.chat.completions.create(
                model="tiny-base", messages=[{"role": "user", "content": long_prompt}]
            ),
            "messages",
        ),
        (
            lambda: client.chat.completions.create(
                model="tiny-base",
                messages=[{"role": "user", "content": "hi"}],
                max_completion_tokens=500,
            ),
            "max_completion_tokens",
        ),
    ]
    for call, param in cases:
        with pytest.raises(openai.BadRequestError) as info:
            call()
        assert (info.value.code, info.value.param) == ("context_length_exceeded", param)
        assert "maximum context length is 128 tokens" in info.value.message
    # Truncate and retry: the same client then succeeds.
    done = client.completions.create(model="tiny-base", prompt="a b", max_tokens=100)
    assert done.choices[0].finish_reason == "length"


def test_unknown_model_is_404_model_not_found(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="nope", prompt="x")
    assert (info.value.code, info.value.param) == ("model_not_found", "model")


ANY_VALUE = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 25),
    st.integers(),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=4),
    st.lists(st.integers(), max_size=2),
)


@settings(
    max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    fields=st.fixed_dictionaries(
        {},
        optional={
            "n": st.one_of(st.integers(1, 4), ANY_VALUE),
            "best_of": st.one_of(st.integers(1, 6), ANY_VALUE),
            "stream": st.one_of(st.booleans(), ANY_VALUE),
            "echo": st.one_of(st.booleans(), ANY_VALUE),
            "suffix": st.one_of(st.sampled_from(["", "tail"]), ANY_VALUE),
            "logprobs": st.one_of(st.integers(0, 3), ANY_VALUE),
        },
    )
)
def test_best_of_echo_suffix_combinations_are_served_or_refused_naming_a_field(
    engine_url: tuple[FakeEngine, str], fields: dict[str, Any]
) -> None:
    engine, url = engine_url
    before = len(engine.submitted)
    prompt = "tell me"
    r = httpx.post(
        url + "/v1/completions", json={"prompt": prompt, "max_tokens": 2, **fields}, timeout=30
    )
    if r.status_code != 200:
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["type"] == "invalid_request_error"
        assert error["param"] in fields, (error, fields)
        assert error["message"].startswith(error["param"] + ": ")
        assert len(engine.submitted) == before  # nothing reached the engine
        return
    n = fields.get("n", 1)
    best_of = fields.get("best_of") or n
    assert len(engine.submitted) == before + best_of
    if fields.get("stream") is True:
        texts: dict[int, str] = {}
        for line in r.text.splitlines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
        answered = [texts[i] for i in sorted(texts)]
    else:
        answered = [choice["text"] for choice in r.json()["choices"]]
    assert len(answered) == n
    generated = expected_text(ids(prompt), None, 2)
    echoed = prompt if fields.get("echo") is True else ""
    assert answered == [echoed + generated] * n
