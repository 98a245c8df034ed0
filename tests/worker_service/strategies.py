"""Hypothesis strategies for request bodies, well-typed and hostile, per worker endpoint, and
the check every answer must pass: 2xx, or 4xx with a JSON error naming the field."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import httpx
from hypothesis import strategies as st


@dataclass(frozen=True)
class Deep:
    """A value sent as ``depth`` nested arrays (too deep for ``json.dumps`` to build)."""

    depth: int


NASTY_TEXT = st.one_of(
    st.text(max_size=12),
    st.sampled_from(
        [
            "\ud800",
            "a\udfffb",
            "\x00",
            "a\x00b",
            "x" * 300,
            "y" * 5000,
            "../..",
            "/etc/passwd",
            "ok-path",
            "alpha",
            "tiny-base",
            "",
            " ",
            "\u202e",
            "☃",
        ]
    ),
)
HUGE_INTS = st.one_of(
    st.integers(min_value=2**63 - 2, max_value=2**80),
    st.integers(min_value=-(2**80), max_value=-(2**63)),
    st.just(2**70),
    st.just(10**400),
)
SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-5, 300),
    HUGE_INTS,
    st.floats(allow_nan=True, allow_infinity=True),
    NASTY_TEXT,
)
HOSTILE = st.one_of(
    st.recursive(
        SCALARS,
        lambda inner: (
            st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4)
        ),
        max_leaves=10,
    ),
    st.integers(min_value=33, max_value=100_000).map(Deep),
)
WORDS = st.lists(
    st.sampled_from(["hello", "world", "a", "b", "x", "z"]), min_size=1, max_size=6
).map(" ".join)
MODELS = st.sampled_from(["tiny-base", "alpha", "beta", "nope"])
MESSAGES = st.lists(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "system"]), "content": WORDS}),
    min_size=1,
    max_size=3,
)

SAMPLING: dict[str, st.SearchStrategy[Any]] = {
    "model": MODELS,
    "max_tokens": st.integers(1, 8),
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.01, 1),
    "top_k": st.integers(-1, 50),
    "min_p": st.floats(0, 1),
    "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.1, 10),
    "seed": st.integers(0, 2**70),
    "stop": st.one_of(WORDS, st.lists(WORDS, max_size=4)),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "n": st.integers(1, 3),
    "logprobs": st.sampled_from([False, None]),
    "user": WORDS,
}
FIELDS: dict[str, dict[str, st.SearchStrategy[Any]]] = {
    "/v1/completions": {
        **SAMPLING,
        "prompt": st.one_of(WORDS, st.lists(st.integers(0, 999), min_size=1, max_size=20)),
    },
    "/v1/chat/completions": {
        **SAMPLING,
        "messages": MESSAGES,
        "max_completion_tokens": st.integers(1, 8),
    },
    "/v1/load_lora_adapter": {
        "lora_name": st.sampled_from(["alpha", "delta", "x1"]),
        "lora_path": st.sampled_from(["ok-a", "ok/b", "missing"]),
    },
    "/v1/unload_lora_adapter": {"lora_name": st.sampled_from(["alpha", "delta", "x1"])},
}
# Errors about the body as a whole name no field.
BODY_LEVEL_CODES = {
    "invalid_json",
    "json_too_deep",
    "too_many_values",
    "payload_too_large",
    "invalid_body",
    "queue_full",
    "engine_overloaded",
    "not_found",
    "method_not_allowed",
}


def encode(body: Any) -> bytes:
    deep: list[int] = []

    def default(obj: Any) -> str:
        assert isinstance(obj, Deep)
        deep.append(obj.depth)
        return f"__deep{len(deep) - 1}__"

    text = json.dumps(body, default=default, allow_nan=True)
    for i, depth in enumerate(deep):
        text = text.replace(f'"__deep{i}__"', "[" * depth + "]" * depth)
    return text.encode()


@st.composite
def bodies(draw: st.DrawFn, path: str) -> bytes:
    """A request body for ``path``: mostly JSON objects mixing good and hostile fields."""
    kind = draw(st.sampled_from(["object"] * 8 + ["not_object", "broken"]))
    if kind == "not_object":
        return encode(draw(HOSTILE))
    if kind == "broken":
        return draw(
            st.sampled_from(
                [b"", b"{", b'{"prompt": ', b"\xff\xfe", b"nul\x00l", b"[" * 5000, b'{"a":' * 5000]
            )
        )
    fields = FIELDS[path]
    body: dict[str, Any] = {}
    for name in draw(st.lists(st.sampled_from(sorted(fields)), unique=True)):
        body[name] = draw(fields[name]) if draw(st.booleans()) else draw(HOSTILE)
    for name in draw(st.lists(st.text(max_size=8), max_size=2)):  # extra fields
        body[name] = draw(HOSTILE)
    return encode(body)


def check_answer(path: str, r: httpx.Response) -> None:
    """2xx, or a 4xx whose JSON error names a field of ``path`` (or is about the whole body)."""
    assert r.status_code < 500, (r.status_code, r.text[:500])
    if r.status_code < 400:
        return
    error = r.json()["error"]
    assert error["code"], error
    if error["code"] in BODY_LEVEL_CODES:
        return
    param = error["param"]
    assert param, error
    assert param in error["message"], error
    if error["code"] == "unknown_field":
        # A field the endpoint does not know, named as the client spelt it.
        assert r.status_code == 400, error
        return
    root = param.split("[", 1)[0].split(".", 1)[0]
    # The field named is one of this endpoint's, or an API field the client sent where this
    # endpoint does not take it (e.g. completions' ``suffix`` on chat: refused as unsupported).
    known = set(FIELDS.get(path, {})).union(*FIELDS.values())
    assert root in known or root in ("x-request-timeout", "prompt", "messages", "max_tokens"), error
