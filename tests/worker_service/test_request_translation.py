"""The pure path from an OpenAI body to the engine's ``GenerationRequest``
(``worker/request_translation.py``): every valid body's fields reach the engine request as
sent, and every invalid value is refused naming its field."""

from __future__ import annotations

from typing import Any

import pytest
from aiohttp.test_utils import make_mocked_request
from hypothesis import given, settings
from hypothesis import strategies as st

from adaptermesh.worker.api import MAX_LOGPROBS, MAX_N, ChatCompletionRequest, CompletionRequest
from adaptermesh.worker.http_errors import ApiError
from adaptermesh.worker.request_translation import (
    ADAPTER_HEADER,
    VERSION_HEADER,
    chat_messages,
    checked_max_tokens,
    generation_job,
    generation_request,
    parse_generation_body,
    refuse_untokenised,
    request_timeout,
    resolve_model,
    tenant_of,
)

BASE = "tiny-base"
MAX_MODEL_LEN = 128
FINITE = {"allow_nan": False, "allow_infinity": False}

# Each sampling field a body may carry, with the values the API accepts.
VALID_SAMPLING: dict[str, st.SearchStrategy[Any]] = {
    "temperature": st.floats(0.0, 2.0, **FINITE),
    "top_p": st.floats(0.0, 1.0, exclude_min=True, **FINITE),
    "top_k": st.integers(-1, 1000),
    "min_p": st.floats(0.0, 1.0, **FINITE),
    "presence_penalty": st.floats(-2.0, 2.0, **FINITE),
    "frequency_penalty": st.floats(-2.0, 2.0, **FINITE),
    "repetition_penalty": st.floats(0.0, 10.0, exclude_min=True, **FINITE),
    "typical_p": st.floats(0.0, 1.0, exclude_min=True, **FINITE),
    "logit_bias": st.dictionaries(
        st.integers(0, 50).map(str), st.floats(-100.0, 100.0, **FINITE), max_size=3
    ),
    "seed": st.integers(-(2**70), 2**70),
    "stop": st.one_of(
        st.text("abc ", min_size=1, max_size=8),
        st.lists(st.text("abc ", min_size=1, max_size=8), max_size=4),
    ),
    "n": st.integers(1, MAX_N),
    "stream": st.booleans(),
    "model": st.sampled_from(["alpha", "beta", BASE]),
}
# Values each field refuses (wrong type or out of range).
INVALID_SAMPLING: dict[str, st.SearchStrategy[Any]] = {
    "temperature": st.one_of(
        st.floats(2.0, 1e6, exclude_min=True, **FINITE),
        st.floats(-1e6, 0.0, exclude_max=True, **FINITE),
        st.just("1"),
        st.just(True),
    ),
    "top_p": st.one_of(
        st.floats(-1e6, 0.0, **FINITE), st.floats(1.0, 1e6, exclude_min=True, **FINITE)
    ),
    "top_k": st.one_of(st.integers(max_value=-2), st.integers(min_value=2**31), st.just(1.5)),
    "min_p": st.floats(1.0, 1e6, exclude_min=True, **FINITE),
    "presence_penalty": st.floats(2.0, 1e6, exclude_min=True, **FINITE),
    "frequency_penalty": st.floats(-1e6, -2.0, exclude_max=True, **FINITE),
    "repetition_penalty": st.floats(-1e6, 0.0, **FINITE),
    "seed": st.one_of(st.just("7"), st.just(1.0), st.just(False)),
    "n": st.one_of(st.integers(max_value=0), st.integers(min_value=MAX_N + 1)),
    "max_tokens": st.one_of(st.just("8"), st.just(8.0)),
    "stream": st.one_of(st.just(1), st.just("yes")),
    "stop": st.one_of(st.just(""), st.just([1]), st.lists(st.just("x"), min_size=5, max_size=6)),
}


def translate(
    body: dict[str, Any],
    kind: str = "completion",
    *,
    prompt_ids: list[int] | None = None,
    index: int = 0,
) -> tuple[Any, Any]:
    """``body`` through every pure step, as ``WorkerService.build_job`` runs them."""
    parsed = parse_generation_body("completion" if kind == "completion" else "chat", body)
    model, adapter = resolve_model(parsed.model, {}, BASE)
    if prompt_ids is None:
        prompt_ids = list(parsed.prompt) if isinstance(parsed, CompletionRequest) else [1, 2]
    max_tokens = checked_max_tokens(parsed, len(prompt_ids), MAX_MODEL_LEN, 16)
    job = generation_job(
        parsed,
        model=model,
        adapter=adapter,
        prompt_ids=prompt_ids,
        max_tokens=max_tokens,
        tenant="id-acme",
        arrived=100.0,
        timeout_s=request_timeout(None, 600.0, 3600.0),
    )
    return job, generation_request(job, index)


@settings(max_examples=150, deadline=None)
@given(
    data=st.data(),
    prompt=st.lists(st.integers(0, 50_000), min_size=1, max_size=40),
    max_tokens=st.one_of(st.none(), st.integers(1, 80)),
    logprobs=st.one_of(st.none(), st.integers(0, MAX_LOGPROBS)),
)
def test_any_valid_completion_body_reaches_the_engine_as_sent(
    data: st.DataObject, prompt: list[int], max_tokens: int | None, logprobs: int | None
) -> None:
    fields = data.draw(st.sets(st.sampled_from(sorted(VALID_SAMPLING))))
    body: dict[str, Any] = {name: data.draw(VALID_SAMPLING[name]) for name in fields}
    body["prompt"] = prompt
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    if logprobs is not None:
        body["logprobs"] = logprobs
    index = data.draw(st.integers(0, body.get("n", 1) - 1))
    job, request = translate(body, index=index)

    sampling = request.sampling
    assert request.prompt_token_ids == tuple(prompt)
    assert request.deadline == 100.0 + 600.0
    model = body.get("model") or BASE
    assert request.adapter == (None if model == BASE else model)
    assert sampling.max_tokens == (max_tokens if max_tokens is not None else 16)
    assert sampling.temperature == body.get("temperature", 1.0)
    assert sampling.top_p == body.get("top_p", 1.0)
    assert sampling.top_k == max(body.get("top_k", 0), 0)
    assert sampling.min_p == body.get("min_p", 0.0)
    assert sampling.presence_penalty == body.get("presence_penalty", 0.0)
    assert sampling.frequency_penalty == body.get("frequency_penalty", 0.0)
    assert sampling.repetition_penalty == body.get("repetition_penalty", 1.0)
    assert sampling.typical_p == body.get("typical_p", 1.0)
    bias = body.get("logit_bias", {})
    assert sampling.logit_bias == tuple(sorted((int(k), float(v)) for k, v in bias.items()))
    stop = body.get("stop", ())
    assert sampling.stop == ((stop,) if isinstance(stop, str) else tuple(stop))
    assert sampling.logprobs == logprobs
    seed = body.get("seed")
    assert sampling.seed == (None if seed is None else seed + index)
    n = body.get("n", 1)
    assert job.n == n
    assert job.stream == body.get("stream", False)
    assert job.request_id.startswith("cmpl-")
    assert request.request_id == (job.request_id if n == 1 else f"{job.request_id}-{index}")


@settings(max_examples=60, deadline=None)
@given(
    messages=st.lists(
        st.fixed_dictionaries(
            {"role": st.sampled_from(["user", "system"]), "content": st.text(max_size=20)}
        ),
        min_size=1,
        max_size=4,
    ),
    max_tokens=st.one_of(st.none(), st.integers(1, 60)),
    max_completion_tokens=st.one_of(st.none(), st.integers(1, 60)),
    top_logprobs=st.one_of(st.none(), st.integers(0, MAX_LOGPROBS)),
)
def test_any_valid_chat_body_reaches_the_engine_as_sent(
    messages: list[dict[str, str]],
    max_tokens: int | None,
    max_completion_tokens: int | None,
    top_logprobs: int | None,
) -> None:
    body: dict[str, Any] = {"messages": messages}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    if max_completion_tokens is not None:
        body["max_completion_tokens"] = max_completion_tokens
    if top_logprobs is not None:
        body.update(logprobs=True, top_logprobs=top_logprobs)
    job, request = translate(body, "chat", prompt_ids=[5, 6, 7])
    parsed = parse_generation_body("chat", body)
    assert isinstance(parsed, ChatCompletionRequest)
    assert chat_messages(parsed) == messages
    room = MAX_MODEL_LEN - 3
    # The newer name wins; without either, a chat may fill the context.
    cap = max_completion_tokens if max_completion_tokens is not None else max_tokens
    assert request.sampling.max_tokens == (cap if cap is not None else room)
    assert request.sampling.logprobs == top_logprobs
    assert request.adapter is None
    assert job.model == BASE
    assert job.kind == "chat"
    assert job.request_id.startswith("chatcmpl-")


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_any_invalid_value_is_refused_naming_its_field(data: st.DataObject) -> None:
    field = data.draw(st.sampled_from(sorted(INVALID_SAMPLING)))
    value = data.draw(INVALID_SAMPLING[field])
    kind = data.draw(st.sampled_from(["completion", "chat"]))
    body: dict[str, Any] = (
        {"prompt": "hello"}
        if kind == "completion"
        else {"messages": [{"role": "user", "content": "hi"}]}
    )
    body[field] = value
    with pytest.raises(ApiError) as caught:
        parse_generation_body("completion" if kind == "completion" else "chat", body)
    assert caught.value.status == 400
    assert caught.value.param == field
    assert caught.value.message.startswith(f"{field}: ")
    assert caught.value.code in {"invalid_type", "invalid_value"}


def test_unknown_fields_and_missing_prompts_are_named() -> None:
    with pytest.raises(ApiError) as caught:
        parse_generation_body("completion", {"prompt": "x", "max_token": 3})
    assert (caught.value.param, caught.value.code) == ("max_token", "unknown_field")
    with pytest.raises(ApiError) as caught:
        parse_generation_body("completion", {})
    assert (caught.value.param, caught.value.code) == ("prompt", "missing_field")


def test_the_model_comes_from_the_body_then_the_edge_header_then_the_base() -> None:
    assert resolve_model("alpha", {ADAPTER_HEADER: "beta"}, BASE) == ("alpha", "alpha")
    assert resolve_model(None, {ADAPTER_HEADER: " beta "}, BASE) == ("beta", "beta")
    assert resolve_model("", {}, BASE) == (BASE, None)
    assert resolve_model(BASE, {VERSION_HEADER: "2.0.0"}, BASE) == (BASE, None)


def test_a_mesh_chosen_version_names_the_versioned_adapter() -> None:
    assert resolve_model("alpha", {VERSION_HEADER: "2.0.0"}, BASE) == ("alpha@2.0.0", "alpha@2.0.0")
    # A model that already names its version keeps it.
    assert resolve_model("alpha@1.0.0", {VERSION_HEADER: "2.0.0"}, BASE)[0] == "alpha@1.0.0"
    with pytest.raises(ApiError) as caught:
        resolve_model("alpha", {VERSION_HEADER: "bad version!"}, BASE)
    assert (caught.value.status, caught.value.param, caught.value.code) == (
        400,
        VERSION_HEADER,
        "invalid_header",
    )


def test_max_tokens_defaults_and_limits() -> None:
    completion = parse_generation_body("completion", {"prompt": [1]})
    chat = parse_generation_body("chat", {"messages": [{"role": "user", "content": "x"}]})
    assert checked_max_tokens(completion, 10, 128, 16) == 16
    assert checked_max_tokens(completion, 120, 128, 16) == 8
    assert checked_max_tokens(chat, 10, 128, 16) == 118
    with pytest.raises(ApiError) as caught:
        checked_max_tokens(chat, 128, 128, 16)
    assert (caught.value.status, caught.value.param, caught.value.code) == (
        400,
        "messages",
        "context_length_exceeded",
    )
    assert caught.value.message == (
        "messages: this model's maximum context length is 128 tokens. However, the prompt "
        "has 128 tokens, so a prompt may have at most 127"
    )
    too_many = parse_generation_body(
        "chat", {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 50}
    )
    with pytest.raises(ApiError) as caught:
        checked_max_tokens(too_many, 100, 128, 16)
    assert (caught.value.status, caught.value.param, caught.value.code) == (
        400,
        "max_completion_tokens",
        "context_length_exceeded",
    )
    assert "maximum context length is 128 tokens" in caught.value.message
    assert "150 tokens (100 in the prompt, 50 in max_completion_tokens)" in caught.value.message
    zero = parse_generation_body("completion", {"prompt": [1], "max_tokens": 0})
    with pytest.raises(ApiError) as caught:
        checked_max_tokens(zero, 1, 128, 16)
    assert caught.value.message == "max_tokens: must be at least 1, got 0"


@pytest.mark.parametrize("header", ["abc", "0", "-1", "inf", "nan", "1e400", ""])
def test_a_bad_request_timeout_header_is_refused(header: str) -> None:
    with pytest.raises(ApiError) as caught:
        request_timeout(header, 600.0, 3600.0)
    assert (caught.value.status, caught.value.param, caught.value.code) == (
        400,
        "x-request-timeout",
        "invalid_header",
    )


def test_the_request_timeout_defaults_and_is_capped() -> None:
    assert request_timeout(None, 600.0, 3600.0) == 600.0
    assert request_timeout("2.5", 600.0, 3600.0) == 2.5
    assert request_timeout("1e9", 600.0, 3600.0) == 3600.0


def test_a_text_longer_than_any_tokenisation_is_refused_untokenised() -> None:
    refuse_untokenised(100, 10, 10, "prompt")  # fits: 10 tokens of 10 characters
    refuse_untokenised(10**9, 10, 0, "prompt")  # the engine says nothing: no check
    with pytest.raises(ApiError) as caught:
        refuse_untokenised(101, 10, 10, "messages")
    assert (caught.value.status, caught.value.param, caught.value.code) == (
        400,
        "messages",
        "context_length_exceeded",
    )


def test_tenants_are_keys_hashed_then_ids_then_addresses() -> None:
    keyed = tenant_of(make_mocked_request("POST", "/", headers={"Authorization": "Bearer s3"}))
    assert keyed.startswith("key-")
    assert "s3" not in keyed
    assert len(keyed) == 4 + 16
    assert tenant_of(make_mocked_request("POST", "/", headers={"x-tenant-id": "acme"})) == (
        "id-acme"
    )
    odd = tenant_of(make_mocked_request("POST", "/", headers={"x-tenant-id": "a b"}))
    assert odd.startswith("id-sha-")
    assert tenant_of(make_mocked_request("POST", "/")).startswith("ip-")
