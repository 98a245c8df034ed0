"""Every endpoint, random well-typed and ill-typed bodies (wrong types, huge numbers, deep
nesting, surrogates, NUL, long strings, missing and extra fields): 2xx or a 4xx naming the
field, never a 5xx, and /health still answers. Plus the bodies once found answering 500."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from .fakes import FakeEngine
from .strategies import FIELDS, HOSTILE, bodies, check_answer, encode
from .threaded import threaded_service

JSON = {"Content-Type": "application/json"}


@pytest.fixture(scope="module")
def client() -> Iterator[httpx.Client]:
    with threaded_service(FakeEngine) as url, httpx.Client(base_url=url, timeout=30) as c:
        yield c


def post(client: httpx.Client, path: str, body: bytes) -> httpx.Response:
    r = client.post(path, content=body, headers=JSON)
    check_answer(path, r)
    assert client.get("/health").status_code == 200
    return r


@pytest.mark.parametrize("path", sorted(FIELDS))
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_post_endpoints_never_answer_5xx(
    client: httpx.Client, path: str, data: st.DataObject
) -> None:
    post(client, path, data.draw(bodies(path)))


@pytest.mark.parametrize("path", ["/v1/models", "/health", "/metrics"])
@settings(max_examples=60, deadline=None)
@given(
    query=st.dictionaries(st.text(max_size=8), st.text(max_size=8), max_size=3),
    body=HOSTILE.map(encode),
    method=st.sampled_from(["GET", "POST", "PUT", "DELETE"]),
)
def test_get_endpoints_never_answer_5xx(
    client: httpx.Client, path: str, query: dict[str, str], body: bytes, method: str
) -> None:
    r = client.request(method, path, params=query, content=body, headers=JSON)
    assert r.status_code < 500, r.text
    if method == "GET":
        assert r.status_code == 200 if path != "/health" else r.status_code in (200, 503)
    else:
        assert r.status_code == 405
        assert r.json()["error"]["code"] == "method_not_allowed"
    assert client.get("/health").status_code == 200


# ----------------------------------------------------------------- bodies once answered 500
def error_of(r: httpx.Response) -> dict:
    assert 400 <= r.status_code < 500, (r.status_code, r.text)
    return r.json()["error"]


def test_lone_surrogate_prompt_is_400_naming_prompt(client: httpx.Client) -> None:
    r = client.post("/v1/completions", content=b'{"prompt": "hi \\ud800 there"}', headers=JSON)
    assert r.status_code == 400
    assert error_of(r)["param"] == "prompt"
    assert error_of(r)["code"] == "invalid_unicode"


def test_lone_surrogate_chat_content_is_400_naming_the_message(client: httpx.Client) -> None:
    r = client.post(
        "/v1/chat/completions",
        headers=JSON,
        content=b'{"messages": [{"role": "user", "content": "\\udfff"}]}',
    )
    assert r.status_code == 400
    assert error_of(r)["param"] == "messages[0].content"


def test_100000_deep_array_is_400_and_the_server_keeps_serving(client: httpx.Client) -> None:
    body = b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    r = client.post("/v1/completions", content=body, headers=JSON)
    assert r.status_code == 400
    assert error_of(r)["code"] == "json_too_deep"
    assert client.get("/health").status_code == 200


def test_nesting_past_the_cap_but_under_the_recursion_limit_is_400(client: httpx.Client) -> None:
    body = b'{"prompt": ' + b"[" * 40 + b"1" + b"]" * 40 + b"}"
    r = client.post("/v1/completions", content=body, headers=JSON)
    assert r.status_code == 400
    assert error_of(r)["code"] == "json_too_deep"


def test_seed_of_2_to_the_70_is_accepted(client: httpx.Client) -> None:
    r = client.post("/v1/completions", json={"prompt": "a b", "max_tokens": 2, "seed": 2**70})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(
    ("path", "why"),
    [
        ("a\x00b", "NUL"),
        ("x" * 300, "300 characters"),
        ("ok/" + "y" * 256, "a component over 255 bytes"),
    ],
)
def test_bad_lora_paths_are_400_naming_lora_path(client: httpx.Client, path: str, why: str) -> None:
    r = client.post("/v1/load_lora_adapter", json={"lora_name": "n1", "lora_path": path})
    assert r.status_code == 400, why
    assert error_of(r)["param"] == "lora_path"


def test_huge_numbers_are_400_naming_the_field(client: httpx.Client) -> None:
    for name, value in [
        ("temperature", 10**400),
        ("top_p", -(2**70)),
        ("top_k", 2**40),
        ("max_tokens", 2**70),
        ("presence_penalty", 1e308),
        ("repetition_penalty", 0),
    ]:
        r = client.post(
            "/v1/completions", content=encode({"prompt": "a", name: value}), headers=JSON
        )
        assert r.status_code == 400, (name, r.text)
        assert error_of(r)["param"] == name


def test_sampling_fields_reach_the_engine() -> None:
    engine = FakeEngine()
    with threaded_service(lambda: engine) as url, httpx.Client(base_url=url, timeout=30) as c:
        r = c.post(
            "/v1/completions",
            json={
                "prompt": "a b",
                "max_tokens": 2,
                "top_k": 5,
                "min_p": 0.1,
                "presence_penalty": 0.5,
                "frequency_penalty": -0.5,
                "repetition_penalty": 1.2,
            },
        )
        assert r.status_code == 200, r.text
        r = c.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "top_k": -1},
        )
        assert r.status_code == 200, r.text
    first, second = (req.sampling for req in engine.submitted)
    assert (
        first.top_k,
        first.min_p,
        first.presence_penalty,
        first.frequency_penalty,
        first.repetition_penalty,
    ) == (5, 0.1, 0.5, -0.5, 1.2)
    assert second.top_k == 0  # -1 means off, as in vLLM


def test_large_body_is_parsed_off_the_loop_with_the_same_answers(client: httpx.Client) -> None:
    # Over JSON_INLINE_BYTES: parsed in the child process.
    # (Padded with whitespace: an unknown field would be refused by name.)
    r = client.post(
        "/v1/completions",
        content=b'{"prompt": "a b", "max_tokens": 2' + b" " * (200 << 10) + b"}",
        headers=JSON,
    )
    assert r.status_code == 200, r.text
    r = client.post(
        "/v1/completions",
        content=b'{"prompt": "a", "pad": "'
        + b"z" * (200 << 10)
        + b'", "deep": '
        + b"[" * 50
        + b"]" * 50
        + b"}",
        headers=JSON,
    )
    assert error_of(r)["code"] == "json_too_deep"
    r = client.post(
        "/v1/completions", content=b'{"prompt": [' + b"1," * 300_000 + b"1]}", headers=JSON
    )
    assert r.status_code == 413
    assert error_of(r)["code"] == "too_many_values"
    r = client.post("/v1/completions", content=b'{"prompt": "' + b"z" * (200 << 10), headers=JSON)
    assert error_of(r)["code"] == "invalid_json"


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=5),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=3)
    ),
    max_leaves=30,
)


def depth_of(value) -> int:
    if isinstance(value, dict | list):
        items = value.values() if isinstance(value, dict) else value
        return 1 + max((depth_of(v) for v in items), default=0)
    return 0


@settings(max_examples=200, deadline=None)
@given(
    value=JSON_VALUES,
    wrap=st.integers(0, 40),
    max_depth=st.integers(1, 40),
    max_values=st.integers(1, 200),
)
def test_parse_json_bounded_returns_the_value_or_refuses_over_a_cap(
    value, wrap: int, max_depth: int, max_values: int
) -> None:
    import json as _json

    from adaptermesh.httpserve import JsonBodyError, parse_json_bounded

    for _ in range(wrap):
        value = [value]
    raw = _json.dumps(value).encode()
    count = 0
    stack = [value]
    while stack:
        v = stack.pop()
        count += 1
        if isinstance(v, dict | list):
            stack.extend(v.values() if isinstance(v, dict) else v)
    if depth_of(value) > max_depth or count > max_values:
        with pytest.raises(JsonBodyError) as caught:
            parse_json_bounded(raw, max_depth, max_values)
        assert (caught.value.status, caught.value.code) in {
            (400, "json_too_deep"),
            (413, "too_many_values"),
        }
    else:
        assert parse_json_bounded(raw, max_depth, max_values) == value
