"""Sampling, stop rules, cancellation, deadlines, request validation and detokenisation."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from adaptermesh.worker.scheduler import Detokenizer, _held_back
from adaptermesh.worker.types import (
    EngineOverloadedError,
    GenerationRequest,
    InvalidRequestError,
    SamplingParams,
)

from .conftest import PROMPTS, Tiny, collect, request, tokens


async def test_seeded_sampling_is_reproducible(tiny: Tiny, make_engine: Any) -> None:
    eng = make_engine()
    ids = tiny.encode(PROMPTS[1])
    kw = {"temperature": 1.5, "top_p": 0.9, "max_tokens": 12}
    a, b, c = await asyncio.gather(
        collect(eng.submit(request("a", ids, "alpha", seed=5, **kw))),
        collect(eng.submit(request("b", ids, "alpha", seed=5, **kw))),
        collect(eng.submit(request("c", ids, "alpha", seed=6, **kw))),
    )
    assert tokens(a) == tokens(b)
    assert tokens(a) != tokens(c)
    assert tokens(a) != tiny.ref.greedy(list(ids), "alpha", 12)


async def test_top_p_tiny_is_greedy(tiny: Tiny, make_engine: Any) -> None:
    eng = make_engine()
    ids = tiny.encode(PROMPTS[0])
    got = tokens(
        await collect(
            eng.submit(request("t", ids, "beta", temperature=1.0, top_p=1e-6, seed=1, max_tokens=6))
        )
    )
    assert got == tiny.ref.greedy(list(ids), "beta", 6)


async def test_stop_sequence_truncates_text(tiny: Tiny, make_engine: Any) -> None:
    eng = make_engine()
    # Random weights emit many partial UTF-8 bytes; pick a run whose text has a clean 2-char
    # stop string after its first character.
    for prompt in PROMPTS:
        for name in (None, "alpha", "beta", "gamma"):
            ids = tiny.encode(prompt)
            full = await collect(eng.submit(request("f", ids, name, max_tokens=20)))
            text = "".join(e.text for e in full)
            cands = [
                i
                for i in range(1, len(text) - 2)
                if "\ufffd" not in text[i : i + 2] and text.find(text[i : i + 2]) == i
            ]
            if cands:
                break
        if cands:
            break
    assert cands, "no usable output text"
    cut = cands[0]
    stop = text[cut : cut + 2]
    stopped = await collect(
        eng.submit(request("s", ids, name, max_tokens=20, stop=(stop, "never-there")))
    )
    assert stopped[-1].finish_reason == "stop"
    assert "".join(e.text for e in stopped) == text[:cut]
    assert len(stopped) < len(full)


async def test_cancel_frees_the_slot(tiny: Tiny, make_engine: Any) -> None:
    eng = make_engine(max_num_seqs=1)
    ids = tiny.encode(PROMPTS[0])
    stream = eng.submit(request("long", ids, "alpha", max_tokens=200))
    it = stream.__aiter__()
    first = await it.__anext__()
    assert first.token_id is not None
    stream.cancel()
    rest = [e async for e in it]
    assert rest[-1].finish_reason == "cancelled"
    # The single KV slot is free again: the next request runs.
    nxt = await collect(eng.submit(request("next", ids, "alpha", max_tokens=3)))
    assert nxt[-1].finish_reason == "length"
    assert eng.stats().num_running == 0
    assert eng.adapters.slots[eng.adapters.published["alpha"].slot].refcount == 0


async def test_abandoned_iteration_cancels(tiny: Tiny, make_engine: Any) -> None:
    eng = make_engine(max_num_seqs=1)
    ids = tiny.encode(PROMPTS[0])
    stream = eng.submit(request("gone", ids, None, max_tokens=200))
    async for _ in stream:
        break  # closing the async generator cancels the request
    nxt = await asyncio.wait_for(collect(eng.submit(request("next", ids, None, max_tokens=3))), 30)
    assert nxt[-1].finish_reason == "length"


async def test_deadline_cancels(tiny: Tiny, make_engine: Any) -> None:
    eng = make_engine()
    ids = tiny.encode(PROMPTS[0])
    req = GenerationRequest(
        "d", ids, None, SamplingParams(max_tokens=200), deadline=time.monotonic() - 1
    )
    events = await collect(eng.submit(req))
    assert events[-1].finish_reason == "cancelled"


async def test_max_model_len_ends_with_length(tiny: Tiny, make_engine: Any) -> None:
    eng = make_engine(max_model_len=24)
    ids = tiny.encode(PROMPTS[0])
    events = await collect(eng.submit(request("m", ids, None, max_tokens=100)))
    assert events[-1].finish_reason == "length"
    assert len(ids) + events[-1].completion_tokens == 24


@pytest.mark.parametrize(
    ("field", "kw", "ids"),
    [
        ("prompt", {}, ()),
        ("prompt", {}, (1, 10_000)),
        ("prompt", {}, tuple(range(5)) * 100),
        ("max_tokens", {"max_tokens": 0}, (1, 2)),
        ("temperature", {"temperature": -1.0}, (1, 2)),
        ("temperature", {"temperature": float("nan")}, (1, 2)),
        ("top_p", {"top_p": 0.0}, (1, 2)),
        ("top_p", {"top_p": 1.5}, (1, 2)),
        ("seed", {"seed": -3}, (1, 2)),
        ("stop", {"stop": ("",)}, (1, 2)),
    ],
)
async def test_invalid_requests_name_the_field(
    make_engine: Any, field: str, kw: dict[str, Any], ids: tuple[int, ...]
) -> None:
    eng = make_engine()
    with pytest.raises(InvalidRequestError) as err:
        eng.submit(request("bad", ids, None, **kw))
    assert err.value.field == field
    assert eng.stats().num_waiting == 0


async def test_overload_is_reported(tiny: Tiny, make_engine: Any) -> None:
    eng = make_engine(max_waiting=2, max_num_seqs=1)
    ids = tiny.encode(PROMPTS[0])
    streams = [eng.submit(request(f"o{i}", ids, None, max_tokens=2)) for i in range(2)]
    with pytest.raises(EngineOverloadedError):
        eng.submit(request("o-extra", ids, None, max_tokens=2))
    for s in streams:
        await collect(s)


async def test_chat_template_and_tokenizer(tiny: Tiny, make_engine: Any) -> None:
    eng = make_engine()
    ids = eng.apply_chat_template([{"role": "user", "content": "hi there"}])
    assert ids is not None
    assert tiny.tokenizer.decode(ids).endswith("<|assistant|>\n")
    assert "hi there" in eng.detokenize(ids)
    assert eng.detokenize(eng.tokenize("Hello world")) == "Hello world"


async def test_shutdown_fails_running_requests(tiny: Tiny, make_engine: Any) -> None:
    eng = make_engine()
    stream = eng.submit(request("s", tiny.encode(PROMPTS[0]), None, max_tokens=500))
    await eng.shutdown()
    with pytest.raises(Exception, match="shutting down"):
        await collect(stream)


def test_detokenizer_holds_incomplete_characters(tiny: Tiny) -> None:
    text = "héllo wörld ✓ done"
    ids = tiny.tokenizer(text, add_special_tokens=False)["input_ids"]
    d = Detokenizer(lambda t: tiny.tokenizer.decode(t, skip_special_tokens=True))
    pieces = [d.step(ids[: i + 1]) for i in range(len(ids))]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == text


def test_held_back() -> None:
    assert _held_back("abc", ("cd",)) == 1
    assert _held_back("abc", ("xyz",)) == 0
    assert _held_back("abcd", ("bcdef", "d")) == 3
