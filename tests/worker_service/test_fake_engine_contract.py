"""One suite, two engines: the HTTP tests' FakeEngine and the real ``Engine`` (tiny CPU model).

Most service tests run against FakeEngine, so everything the service relies on must hold for
it exactly as it holds for the engine that serves: the same methods, the same event stream
(one finish reason, on the last event; token counts that grow by one), the same error types
and fields for bad input, with no state lost, and the same cancellation and deadline
semantics. The tokens themselves differ (the fake is not a model).
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from waiting import async_wait_until

from adaptermesh.worker.engine import Engine, EngineConfig
from adaptermesh.worker.types import (
    AdapterNotFoundError,
    EngineError,
    EngineProtocol,
    GenerationRequest,
    InvalidRequestError,
    SamplingParams,
    TokenEvent,
)
from adaptermesh_testkit.checkpoints import make_adapter, make_tiny_model

from .fakes import FakeEngine

ADAPTER = "alpha"  # on FakeEngine's disk, and written under the real engine's root


@pytest.fixture(scope="module")
def model_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    base = tmp_path_factory.mktemp("contract")
    model = make_tiny_model(base / "tiny", max_position_embeddings=256)
    root = base / "adapters"
    root.mkdir()
    make_adapter(root, model, ADAPTER, rank=4, target_modules=("q_proj", "v_proj"), seed=1)
    return model, root


@pytest.fixture(params=["fake", "engine"])
async def engine(
    request: pytest.FixtureRequest, model_files: tuple[Path, Path]
) -> AsyncIterator[EngineProtocol]:
    if request.param == "fake":
        eng: EngineProtocol = FakeEngine(max_batch=2)
    else:
        model, root = model_files
        eng = Engine(
            model,
            root,
            device="cpu",
            dtype="float32",
            config=EngineConfig(max_num_seqs=2),
            model_name="tiny",
        )
    yield eng
    await eng.shutdown()


def req(
    engine: EngineProtocol,
    rid: str,
    *,
    prompt: str = "hello world",
    max_tokens: int = 6,
    adapter: str | None = None,
    deadline: float | None = None,
    ids: tuple[int, ...] | None = None,
) -> GenerationRequest:
    prompt_ids = tuple(engine.tokenize(prompt)) if ids is None else ids
    return GenerationRequest(
        rid, prompt_ids, adapter, SamplingParams(max_tokens=max_tokens), deadline=deadline
    )


async def run(engine: EngineProtocol, request: GenerationRequest) -> list[TokenEvent]:
    return [event async for event in engine.submit(request)]


def check_stream(events: list[TokenEvent], request: GenerationRequest) -> None:
    """What the service's streaming and usage accounting rely on."""
    assert events, "a stream ends with an event that carries its finish reason"
    assert all(isinstance(e, TokenEvent) for e in events)
    assert [e.finish_reason is not None for e in events] == [False] * (len(events) - 1) + [True]
    assert all(e.prompt_tokens == len(request.prompt_token_ids) for e in events)
    counts = [e.completion_tokens for e in events if e.token_id is not None]
    assert counts == list(range(1, len(counts) + 1))
    last = events[-1]
    assert last.completion_tokens <= request.sampling.max_tokens
    if last.finish_reason == "length":
        assert last.completion_tokens == request.sampling.max_tokens


def test_the_same_api_surface(engine: EngineProtocol) -> None:
    assert isinstance(engine.model_name, str)
    assert isinstance(engine.max_model_len, int)
    for name in (
        "submit",
        "tokenize",
        "detokenize",
        "apply_chat_template",
        "list_adapters",
        "stats",
    ):
        assert callable(getattr(engine, name)), name
        assert not inspect.iscoroutinefunction(getattr(engine, name)), name
    for name in ("load_adapter", "unload_adapter", "shutdown"):
        assert inspect.iscoroutinefunction(getattr(engine, name)), name
    ids = engine.tokenize("hello world")
    assert ids
    assert all(isinstance(t, int) for t in ids)
    assert isinstance(engine.detokenize(ids), str)
    chat = engine.apply_chat_template([{"role": "user", "content": "hi"}])
    if chat is not None:
        assert chat
        assert all(isinstance(t, int) for t in chat)


async def test_a_completion_streams_counted_tokens_and_one_finish_reason(
    engine: EngineProtocol,
) -> None:
    before = engine.stats().generated_tokens
    for adapter in (None, ADAPTER):
        request = req(engine, f"r-{adapter}", adapter=adapter)
        events = await run(engine, request)
        check_stream(events, request)
        assert events[-1].finish_reason in ("length", "stop")
        # Greedy decoding is a function of the request.
        again = await run(engine, req(engine, f"again-{adapter}", adapter=adapter))
        assert [e.token_id for e in again] == [e.token_id for e in events]
    stats = await async_wait_until(lambda: (s := engine.stats()).num_running == 0 and s)
    assert stats.num_waiting == 0
    assert stats.generated_tokens > before
    assert [a.name for a in engine.list_adapters()] == [ADAPTER]


@pytest.mark.parametrize(
    ("field", "make"),
    [
        ("prompt", lambda e: req(e, "empty", ids=())),
        ("prompt", lambda e: req(e, "vocab", ids=(1, 10**6))),
        ("prompt", lambda e: req(e, "long", ids=(1,) * e.max_model_len)),
        ("max_tokens", lambda e: req(e, "zero", max_tokens=0)),
    ],
)
async def test_bad_input_is_refused_at_submit_naming_the_field(
    engine: EngineProtocol, field: str, make
) -> None:
    with pytest.raises(InvalidRequestError) as refused:
        engine.submit(make(engine))
    assert refused.value.field == field
    # Nothing was queued: the next request is served as if the bad one never came.
    assert engine.stats().num_waiting == 0
    events = await run(engine, req(engine, "after"))
    assert events[-1].finish_reason in ("length", "stop")


@settings(
    max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    max_tokens=st.integers(1, 12),
    words=st.lists(st.sampled_from(["a", "b", "hello", "7"]), min_size=1, max_size=6),
)
async def test_any_small_request_keeps_the_stream_contract(
    engine: EngineProtocol, max_tokens: int, words: list[str]
) -> None:
    request = req(engine, "h", prompt=" ".join(words), max_tokens=max_tokens)
    check_stream(await run(engine, request), request)


async def test_an_unknown_adapter_is_an_adapter_not_found_before_any_token(
    engine: EngineProtocol,
) -> None:
    # The engine may refuse at submit or from the iteration (a load that fails later); the
    # service handles both, and neither yields a token first.
    events: list[TokenEvent] = []

    async def drain() -> None:
        async for event in engine.submit(req(engine, "nosuch", adapter="nosuch")):
            events.append(event)  # one by one: a token before the error must be seen

    with pytest.raises(AdapterNotFoundError):
        await drain()
    assert events == []
    with pytest.raises(AdapterNotFoundError):
        await engine.unload_adapter("nosuch")
    with pytest.raises(AdapterNotFoundError):
        await engine.load_adapter("nosuch", "not/there")


async def test_cancel_ends_the_stream_with_cancelled_and_frees_the_slot(
    engine: EngineProtocol,
) -> None:
    request = req(engine, "walk-away", max_tokens=200, prompt="a b a b")
    stream = engine.submit(request)
    events: list[TokenEvent] = []
    async for event in stream:
        events.append(event)
        if len(events) == 1:
            stream.cancel()
    check_stream(events, request)
    # A request may finish on its own before the cancel lands; otherwise it says cancelled.
    assert events[-1].finish_reason in ("cancelled", "stop", "length")
    if events[-1].finish_reason == "cancelled":
        assert events[-1].completion_tokens < 200
    await async_wait_until(lambda: engine.stats().num_running == 0)
    stream.cancel()  # cancelling a finished stream is a no-op
    assert (await run(engine, req(engine, "next")))[-1].finish_reason in ("length", "stop")


async def test_a_passed_deadline_cancels_without_tokens(engine: EngineProtocol) -> None:
    request = req(engine, "late", deadline=time.monotonic() - 1)
    events = await run(engine, request)
    check_stream(events, request)
    assert events[-1].finish_reason == "cancelled"
    assert [e for e in events if e.token_id is not None] == []


async def test_requests_beyond_the_batch_wait_and_are_all_served(engine: EngineProtocol) -> None:
    requests = [req(engine, f"b{i}", max_tokens=4) for i in range(5)]
    results = await asyncio.gather(*(run(engine, r) for r in requests))
    for request, events in zip(requests, results, strict=True):
        check_stream(events, request)
        assert events[-1].finish_reason in ("length", "stop")


async def test_after_shutdown_submit_is_refused(engine: EngineProtocol) -> None:
    await engine.shutdown()
    with pytest.raises(EngineError):
        engine.submit(req(engine, "too-late"))
