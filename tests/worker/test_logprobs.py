"""Logprobs: the engine reports, for each sampled token, log_softmax of the raw model logits
(before penalties, temperature and filters) and the top k alternatives, checked against
transformers + peft on the tiny model; the HTTP service turns them into OpenAI's completions
and chat shapes (streaming and not, n choices, stop strings), refuses bad parameters by name,
and the real ``openai`` client parses the answers."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from worker_service.threaded import threaded_service

from adaptermesh.worker.engine import Engine, EngineConfig
from adaptermesh.worker.service import ServiceConfig, WorkerService, serve
from adaptermesh.worker.types import MAX_LOGPROBS, InvalidRequestError, TokenEvent, TokenLogprob

from .conftest import PROMPTS, Tiny, collect, request, tokens

TOL = 1e-4  # fp32 engine against fp32 transformers


# ---- helpers ---------------------------------------------------------------------------------


def entries_of(events: list[TokenEvent]) -> list[TokenLogprob]:
    return [e for ev in events for e in ev.logprobs]


def special_ids(tiny: Tiny) -> set[int]:
    """Tokens the output text skips (entries spell them out)."""
    added = tiny.tokenizer.added_tokens_decoder
    return set(tiny.tokenizer.all_special_ids) | {i for i, t in added.items() if t.special}


def ref_logprobs(
    tiny: Tiny, prompt: tuple[int, ...], adapter: str | None, out: list[int]
) -> torch.Tensor:
    """[len(out), V] float64 log_softmax of the reference logits each output token came from."""
    logits = tiny.ref.logits([*prompt, *out[:-1]], adapter)[len(prompt) - 1 :]
    return torch.log_softmax(logits.double(), dim=-1)


def check_entries(
    tiny: Tiny,
    prompt: tuple[int, ...],
    adapter: str | None,
    out: list[int],
    entries: list[TokenLogprob],
    k: int,
) -> torch.Tensor:
    """Every entry against the reference: the sampled token's logprob, the top k (a top-k set
    of the reference up to ties within TOL, most likely first). Returns the reference."""
    ref = ref_logprobs(tiny, prompt, adapter, out)
    assert [e.token_id for e in entries] == out
    for i, e in enumerate(entries):
        assert e.logprob == pytest.approx(float(ref[i, e.token_id]), abs=TOL), (i, e)
        assert len(e.top) == k
        vals = [t.logprob for t in e.top]
        assert vals == sorted(vals, reverse=True)
        assert len({t.token_id for t in e.top}) == k
        for t in e.top:
            assert t.logprob == pytest.approx(float(ref[i, t.token_id]), abs=TOL)
        if k:
            kth = float(ref[i].topk(k).values[-1])
            assert min(vals) >= kth - TOL
            assert e.logprob <= vals[0] + TOL  # nothing beats the reported most likely token
    return ref


# ---- engine ----------------------------------------------------------------------------------


@pytest.mark.parametrize("overlap", [False, True])
async def test_greedy_logprobs_match_the_reference_for_base_and_adapters(
    tiny: Tiny, make_engine: Any, overlap: bool
) -> None:
    eng = make_engine(async_scheduling=overlap)
    jobs = [
        (f"g{i}-{a}", tiny.encode(p), a, k)
        for i, p in enumerate(PROMPTS)
        for a, k in ((None, 5), ("alpha", 0), ("gamma", 3), ("beta", 20))
    ]
    outs = await asyncio.gather(
        *(
            collect(eng.submit(request(r, ids, a, max_tokens=6, logprobs=k)))
            for r, ids, a, k in jobs
        )
    )
    for (rid, ids, a, k), events in zip(jobs, outs, strict=True):
        out = tokens(events)
        assert out == tiny.ref.greedy(list(ids), a, 6), rid
        check_entries(tiny, ids, a, out, entries_of(events), k)
        # Greedy: the sampled token is the most likely one.
        for e in entries_of(events):
            if e.top:
                assert e.top[0].logprob == pytest.approx(e.logprob, abs=TOL)
        assert events[-1].completion_tokens == len(entries_of(events))


@pytest.mark.parametrize("overlap", [False, True])
async def test_mixed_batch_rows_that_do_not_ask_are_unchanged(
    tiny: Tiny, make_engine: Any, overlap: bool
) -> None:
    eng = make_engine(async_scheduling=overlap)
    base = [
        ("m0", 0, None, {"temperature": 0.0}),
        ("m1", 1, "alpha", {"temperature": 0.9, "seed": 7}),
        ("m2", 2, "delta", {"temperature": 0.7, "top_p": 0.8, "seed": 3}),
        ("m3", 0, "beta", {"temperature": 1.2, "top_k": 30, "seed": 11}),
        ("m4", 1, None, {"temperature": 0.0}),
        ("m5", 2, "gamma", {"temperature": 0.8, "min_p": 0.05, "seed": 5}),
    ]
    asks = {"m0": 2, "m2": 0, "m3": 7, "m5": MAX_LOGPROBS}

    def reqs(with_lp: bool) -> list[Any]:
        return [
            request(
                rid,
                tiny.encode(PROMPTS[p]),
                a,
                max_tokens=7,
                logprobs=asks.get(rid) if with_lp else None,
                **kw,
            )
            for rid, p, a, kw in base
        ]

    plain = await asyncio.gather(*(collect(eng.submit(r)) for r in reqs(False)))
    assert eng.launcher.logprob_steps == 0  # steps where no row asked run no logprob work
    mixed = await asyncio.gather(*(collect(eng.submit(r)) for r in reqs(True)))
    assert eng.launcher.logprob_steps > 0
    for (rid, p, a, _), before, after in zip(base, plain, mixed, strict=True):
        assert tokens(after) == tokens(before), rid  # asking changes no token, of any row
        if rid in asks:
            check_entries(
                tiny, tiny.encode(PROMPTS[p]), a, tokens(after), entries_of(after), asks[rid]
            )
            assert after[-1].completion_tokens == len(entries_of(after))
        else:
            assert entries_of(after) == []


async def test_sampled_logprobs_are_raw_not_tempered(tiny: Tiny, make_engine: Any) -> None:
    eng = make_engine()
    ids = tiny.encode(PROMPTS[1])
    temp = 1.7
    events = await collect(
        eng.submit(request("t", ids, "beta", max_tokens=8, temperature=temp, seed=21, logprobs=4))
    )
    out = tokens(events)
    ref = check_entries(tiny, ids, "beta", out, entries_of(events), 4)
    logits = tiny.ref.logits([*ids, *out[:-1]], "beta")[len(ids) - 1 :].double()
    tempered = torch.log_softmax(logits / temp, dim=-1)
    gaps = [abs(float(ref[i, t]) - float(tempered[i, t])) for i, t in enumerate(out)]
    assert max(gaps) > 1e-2  # the two definitions differ here, and the raw one was reported


async def test_penalised_rows_report_raw_logprobs(tiny: Tiny, make_engine: Any) -> None:
    eng = make_engine()
    ids = tiny.encode(PROMPTS[2])
    events = await collect(
        eng.submit(
            request(
                "p",
                ids,
                "alpha",
                max_tokens=8,
                repetition_penalty=1.8,
                frequency_penalty=1.0,
                logprobs=3,
            )
        )
    )
    out = tokens(events)
    entries = entries_of(events)
    check_entries(tiny, ids, "alpha", out, entries, 3)
    assert eng.launcher.eager_steps > 0


async def test_stop_string_cuts_its_tokens_out_of_the_logprobs(
    tiny: Tiny, make_engine: Any
) -> None:
    eng = make_engine(async_scheduling=True)
    ids = tiny.encode(PROMPTS[1])
    full = await collect(eng.submit(request("full", ids, "alpha", max_tokens=12, logprobs=1)))
    text = "".join(e.text for e in full)
    assert len(text) >= 6, text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    cut = await collect(
        eng.submit(request("cut", ids, "alpha", max_tokens=12, stop=(stop,), logprobs=1))
    )
    kept_text = "".join(e.text for e in cut)
    assert kept_text == text[: text.find(stop)]
    kept = entries_of(cut)
    everything = entries_of(full)
    # The same tokens, a prefix of them (values equal up to the prefix cache's rounding).
    assert [(e.token_id, e.text_offset) for e in kept] == [
        (e.token_id, e.text_offset) for e in everything[: len(kept)]
    ]
    assert [e.logprob for e in kept] == pytest.approx(
        [e.logprob for e in everything[: len(kept)]], abs=TOL
    )
    assert all(e.text_offset < len(kept_text) for e in kept)
    assert len(kept) < len(tokens(cut))  # the token that completed the stop string is gone
    assert everything[len(kept)].text_offset >= len(kept_text)
    special = special_ids(tiny)  # spelt out in entries, skipped in the text
    joined = b"".join(e.token_bytes for e in kept if e.token_id not in special).decode(
        "utf-8", errors="replace"
    )
    assert joined.startswith(kept_text)


async def test_text_offsets_and_bytes_follow_the_text(tiny: Tiny, make_engine: Any) -> None:
    eng = make_engine()
    ids = tiny.encode(PROMPTS[0])
    events = await collect(
        eng.submit(request("b", ids, "delta", max_tokens=10, logprobs=2, temperature=1.0, seed=9))
    )
    text = "".join(e.text for e in events)
    entries = entries_of(events)
    special = special_ids(tiny)
    raw = b"".join(e.token_bytes for e in entries if e.token_id not in special)
    assert raw.decode("utf-8", errors="replace") == text
    offsets = [e.text_offset for e in entries]
    assert offsets[0] == 0
    assert offsets == sorted(offsets)
    assert all(o <= len(text) for o in offsets)


@pytest.mark.parametrize("bad", [-1, MAX_LOGPROBS + 1, True, 2.0])
async def test_engine_refuses_bad_logprobs(tiny: Tiny, make_engine: Any, bad: Any) -> None:
    eng = make_engine()
    with pytest.raises(InvalidRequestError) as info:
        eng.submit(request("x", tiny.encode(PROMPTS[0]), None, logprobs=bad))
    assert info.value.field == "logprobs"
    # Nothing was queued; the engine keeps serving.
    assert (
        tokens(await collect(eng.submit(request("y", tiny.encode(PROMPTS[0]), None, max_tokens=2))))
        != []
    )


# ---- HTTP service ----------------------------------------------------------------------------


@pytest.fixture
async def http(make_engine: Any) -> AsyncIterator[tuple[Engine, httpx.AsyncClient, str]]:
    eng = make_engine()
    service = WorkerService(eng, ServiceConfig())
    runner, port = await serve(service, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{port}"
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        yield eng, client, url
    await runner.cleanup()


def sse_chunks(body: str) -> list[dict[str, Any]]:
    out = []
    for line in body.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            out.append(json.loads(line[len("data: ") :]))
    return out


async def test_completions_logprobs_shape_and_values(tiny: Tiny, http: Any) -> None:
    _, client, _ = http
    ids = list(tiny.encode(PROMPTS[1]))
    body = {"model": "alpha", "prompt": ids, "max_tokens": 6, "temperature": 0, "logprobs": 3}
    r = await client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    lp = choice["logprobs"]
    out = tiny.ref.greedy(ids, "alpha", 6)
    ref = ref_logprobs(tiny, tuple(ids), "alpha", out)
    assert (
        len(lp["tokens"])
        == len(lp["token_logprobs"])
        == len(lp["top_logprobs"])
        == len(lp["text_offset"])
        == 6
    )
    assert r.json()["usage"]["completion_tokens"] == 6
    for i, t in enumerate(out):
        assert lp["token_logprobs"][i] == pytest.approx(float(ref[i, t]), abs=TOL)
        top = lp["top_logprobs"][i]
        assert 1 <= len(top) <= 4
        assert top[lp["tokens"][i]] == pytest.approx(lp["token_logprobs"][i], abs=TOL)
    assert lp["text_offset"][0] == 0
    assert lp["text_offset"] == sorted(lp["text_offset"])

    # Streaming: the chunks' logprobs, concatenated, are the same.
    r2 = await client.post("/v1/completions", json={**body, "stream": True})
    chunks = [c for c in sse_chunks(r2.text) if c["choices"]]
    streamed: dict[str, list[Any]] = {
        "tokens": [],
        "token_logprobs": [],
        "top_logprobs": [],
        "text_offset": [],
    }
    for c in chunks:
        part = c["choices"][0]["logprobs"]
        if part is not None:
            for key in streamed:
                streamed[key].extend(part[key])
    assert streamed["tokens"] == lp["tokens"]
    assert streamed["text_offset"] == lp["text_offset"]
    assert streamed["token_logprobs"] == pytest.approx(lp["token_logprobs"], abs=1e-6)
    assert "".join(c["choices"][0]["text"] for c in chunks) == choice["text"]


async def test_chat_logprobs_n_choices_and_usage(tiny: Tiny, http: Any) -> None:
    _, client, _ = http
    body = {
        "model": "gamma",
        "messages": [{"role": "user", "content": "count: one two"}],
        "max_tokens": 5,
        "temperature": 1.0,
        "seed": 4,
        "n": 3,
        "logprobs": True,
        "top_logprobs": 2,
    }
    r = await client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    data = r.json()
    total = 0
    for choice in data["choices"]:
        content = choice["logprobs"]["content"]
        total += len(content)
        for entry in content:
            assert len(entry["top_logprobs"]) == 2
            assert bytes(entry["bytes"]).decode("utf-8", errors="replace") == entry["token"]
            assert entry["top_logprobs"][0]["logprob"] >= entry["top_logprobs"][1]["logprob"]
            assert entry["logprob"] <= entry["top_logprobs"][0]["logprob"] + TOL
    assert total == data["usage"]["completion_tokens"]

    # Streaming with usage: every token chunk carries its token's logprobs.
    r2 = await client.post(
        "/v1/chat/completions",
        json={**body, "stream": True, "stream_options": {"include_usage": True}},
    )
    chunks = sse_chunks(r2.text)
    per_choice: dict[int, list[Any]] = {}
    for c in chunks:
        for ch in c["choices"]:
            if ch["delta"].get("role"):
                assert ch["logprobs"] is None
            if ch["logprobs"] is not None:
                per_choice.setdefault(ch["index"], []).extend(ch["logprobs"]["content"])
    usage = chunks[-1]["usage"]
    assert sum(len(v) for v in per_choice.values()) == usage["completion_tokens"]
    # Seeded: the stream's logprobs are the non-streamed ones.
    for choice in data["choices"]:
        assert [e["token"] for e in per_choice[choice["index"]]] == [
            e["token"] for e in choice["logprobs"]["content"]
        ]


async def test_no_logprobs_asked_gives_null(http: Any) -> None:
    _, client, _ = http
    r = await client.post(
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "logprobs": False},
    )
    assert r.json()["choices"][0]["logprobs"] is None
    r = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert r.json()["choices"][0]["logprobs"] is None


BAD = [
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": MAX_LOGPROBS + 1}, "top_logprobs"),
    ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": False, "top_logprobs": 0}, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": "2"}, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": 3}, "logprobs"),
    ("/v1/completions", {"logprobs": -1}, "logprobs"),
    ("/v1/completions", {"logprobs": MAX_LOGPROBS + 1}, "logprobs"),
    ("/v1/completions", {"logprobs": True}, "logprobs"),
    ("/v1/completions", {"logprobs": 2, "top_logprobs": 2}, "top_logprobs"),
    ("/v1/completions", {"logprobs": 2, "echo": True}, "echo"),
]


@pytest.mark.parametrize(("path", "fields", "param"), BAD)
async def test_bad_logprob_parameters_name_the_field(
    http: Any, path: str, fields: dict[str, Any], param: str
) -> None:
    _, client, _ = http
    body: dict[str, Any] = {"max_tokens": 2, **fields}
    body |= (
        {"prompt": "hi"}
        if path == "/v1/completions"
        else {"messages": [{"role": "user", "content": "hi"}]}
    )
    r = await client.post(path, json=body)
    # The service answers every request-body validation error with 400 naming the field.
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param
    assert param in err["message"]
    ok = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1, "logprobs": 1})
    assert ok.status_code == 200


async def test_openai_client_parses_logprobs(tiny: Tiny, http: Any) -> None:
    _, _, url = http
    import openai  # here, so the GPU machine (no openai client) still collects the module

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="k", max_retries=0)
    try:
        chat = await client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "hello"}],
            max_tokens=4,
            temperature=0,
            logprobs=True,
            top_logprobs=3,
        )
        content = chat.choices[0].logprobs.content  # type: ignore[union-attr]
        assert content is not None
        assert len(content) == chat.usage.completion_tokens  # type: ignore[union-attr]
        assert all(len(c.top_logprobs) == 3 and c.bytes is not None for c in content)
        assert content[0].logprob == pytest.approx(content[0].top_logprobs[0].logprob, abs=TOL)

        stream = await client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "hello"}],
            max_tokens=4,
            temperature=0,
            logprobs=True,
            top_logprobs=3,
            stream=True,
        )
        streamed = [
            c.token
            async for ch in stream
            for choice in ch.choices
            if choice.logprobs and choice.logprobs.content
            for c in choice.logprobs.content
        ]
        assert streamed == [c.token for c in content]

        comp = await client.completions.create(
            model="tiny", prompt="hello", max_tokens=3, temperature=0, logprobs=2
        )
        lp = comp.choices[0].logprobs
        assert lp is not None
        assert lp.token_logprobs is not None
        assert len(lp.token_logprobs) == 3
    finally:
        await client.close()


# ---- request parameter combinations ----------------------------------------------------------


@pytest.fixture(scope="module")
def live(tiny: Tiny) -> Iterator[str]:
    def make() -> Engine:
        cfg = EngineConfig(max_num_seqs=8, max_loras=4, max_lora_rank=16, async_scheduling=True)
        return Engine(tiny.model_dir, tiny.root, config=cfg, model_name="tiny")

    with threaded_service(make) as url:
        yield url


LP_VALUES = st.one_of(
    st.none(), st.booleans(), st.integers(-2, MAX_LOGPROBS + 2), st.just("1"), st.just(1.5)
)


def expected_error(kind: str, body: dict[str, Any]) -> str | None:
    """The field a request must be refused for, or None when it must be served."""
    lp, top = body.get("logprobs"), body.get("top_logprobs")
    if kind == "completions":
        if not (lp is None or lp is False or (type(lp) is int and 0 <= lp <= MAX_LOGPROBS)):
            return "logprobs"
        return "top_logprobs" if top is not None else None
    if lp is not None and type(lp) is not bool:
        return "logprobs"
    if top is not None and not (type(top) is int and 0 <= top <= MAX_LOGPROBS):
        return "top_logprobs"
    if top is not None and lp is not True:
        return "top_logprobs"
    return None


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    kind=st.sampled_from(["completions", "chat"]),
    fields=st.fixed_dictionaries(
        {},
        optional={
            "logprobs": LP_VALUES,
            "top_logprobs": LP_VALUES,
            "n": st.integers(1, 2),
            "stream": st.booleans(),
            "max_tokens": st.integers(1, 4),
            "temperature": st.sampled_from([0.0, 0.8]),
            "seed": st.integers(0, 100),
            "model": st.sampled_from(["tiny", "alpha", "delta"]),
        },
    ),
)
def test_parameter_combinations_are_served_or_refused_by_name(
    live: str, kind: str, fields: dict[str, Any]
) -> None:
    body = dict(fields)
    path = "/v1/completions" if kind == "completions" else "/v1/chat/completions"
    body |= (
        {"prompt": "Hello"}
        if kind == "completions"
        else {"messages": [{"role": "user", "content": "Hello"}]}
    )
    if body.get("stream"):
        body["stream_options"] = {"include_usage": True}
    r = httpx.post(live + path, json=body, timeout=60)
    field = expected_error(kind, body)
    if field is not None:
        assert r.status_code == 400, (body, r.text)
        assert r.json()["error"]["param"] == field, (body, r.text)
        return
    assert r.status_code == 200, (body, r.text)
    lp, top = body.get("logprobs"), body.get("top_logprobs")
    asked = (type(lp) is int and lp is not False) if kind == "completions" else lp is True
    k = (lp if kind == "completions" else (top or 0)) if asked else 0
    n = body.get("n", 1)
    per_choice: dict[int, list[Any]] = {i: [] for i in range(n)}
    if body.get("stream"):
        chunks = sse_chunks(r.text)
        usage = chunks[-1]["usage"]
        for c in chunks:
            for ch in c["choices"]:
                part = ch["logprobs"]
                if part is None:
                    continue
                assert asked
                items = part["tokens"] if kind == "completions" else part["content"]
                tops = (
                    part["top_logprobs"]
                    if kind == "completions"
                    else [e["top_logprobs"] for e in items]
                )
                per_choice[ch["index"]].extend(zip(items, tops, strict=True))
    else:
        data = r.json()
        usage = data["usage"]
        for ch in data["choices"]:
            part = ch["logprobs"]
            if not asked:
                assert part is None
                continue
            items = part["tokens"] if kind == "completions" else part["content"]
            tops = (
                part["top_logprobs"]
                if kind == "completions"
                else [e["top_logprobs"] for e in items]
            )
            if kind == "completions":
                assert len(part["token_logprobs"]) == len(part["text_offset"]) == len(items)
            per_choice[ch["index"]].extend(zip(items, tops, strict=True))
    count = sum(len(v) for v in per_choice.values())
    assert count == (usage["completion_tokens"] if asked else 0), (body, usage)
    for entries in per_choice.values():
        for _, tops in entries:
            if kind == "chat":
                assert len(tops) == k
            else:
                assert 1 <= len(tops) <= k + 1


# ---- CUDA graphs -----------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["raw", "processed"])
def test_graph_steps_report_the_same_logprobs_as_eager_steps(tiny: Tiny, mode: str) -> None:
    async def run(graphs: bool) -> tuple[dict[str, list[TokenEvent]], dict[str, Any]]:
        cfg = EngineConfig(
            max_num_seqs=8,
            max_loras=4,
            max_lora_rank=16,
            use_cuda_graphs=graphs,
            logprobs_mode=mode,
        )
        eng = Engine(tiny.model_dir, tiny.root, device="cuda", config=cfg, model_name="tiny")
        reqs = [
            request(
                f"c{i}",
                tiny.encode(PROMPTS[i % 3]),
                [None, "alpha", "gamma"][i % 3],
                max_tokens=8,
                temperature=0.8 * (i % 2),
                top_k=[0, 4][i % 2],
                seed=i,
                logprobs=[None, 3, 0, 5][i % 4],
            )
            for i in range(6)
        ]
        outs = await asyncio.gather(*(collect(eng.submit(r)) for r in reqs))
        info = eng.describe()
        await eng.shutdown()
        return {r.request_id: o for r, o in zip(reqs, outs, strict=True)}, info

    graphed, info = asyncio.run(run(True))
    assert info["cuda_graphs"], info
    assert info["graph_steps"] > 0, info
    eager, _ = asyncio.run(run(False))
    for rid, events in graphed.items():
        assert tokens(events) == tokens(eager[rid]), rid
        a, b = entries_of(events), entries_of(eager[rid])
        assert [e.token_id for e in a] == [e.token_id for e in b]
        for x, y in zip(a, b, strict=True):
            assert x.logprob == pytest.approx(y.logprob, abs=1e-3)
            assert [t.logprob for t in x.top] == pytest.approx([t.logprob for t in y.top], abs=1e-3)


# ---- processed mode: the distribution the sampler draws from ------------------------------


def penalised(
    x: torch.Tensor, seen: set[int], counts: dict[int, int], rep: float, freq: float, pres: float
) -> torch.Tensor:
    """The sampler's penalty formula on one float64 logits row."""
    x = x.clone()
    for t in seen | set(counts):
        x[t] = x[t] / rep if x[t] > 0 else x[t] * rep
    for t, c in counts.items():
        x[t] -= freq * c + pres
    return x


async def test_processed_mode_reports_tempered_top_k_logprobs(tiny: Tiny, make_engine: Any) -> None:
    eng = make_engine(logprobs_mode="processed")
    ids = tiny.encode(PROMPTS[1])
    temp, top_k = 1.7, 6
    events = await collect(
        eng.submit(
            request(
                "t", ids, "beta", max_tokens=8, temperature=temp, top_k=top_k, seed=21, logprobs=8
            )
        )
    )
    out = tokens(events)
    entries = entries_of(events)
    assert [e.token_id for e in entries] == out
    logits = tiny.ref.logits([*ids, *out[:-1]], "beta")[len(ids) - 1 :].double()
    for i, e in enumerate(entries):
        x = logits[i]
        keep = x >= x.topk(top_k).values[-1]
        ref = torch.log_softmax(torch.where(keep, x / temp, -torch.inf), dim=-1)
        assert e.logprob == pytest.approx(float(ref[e.token_id]), abs=TOL), i
        vals = [t.logprob for t in e.top]
        assert vals == sorted(vals, reverse=True)
        # The 6 kept tokens renormalise; the other 2 alternatives are impossible.
        assert all(v > -torch.inf for v in vals[:top_k])
        assert all(v == -torch.inf for v in vals[top_k:])
        for t in e.top[:top_k]:
            assert t.logprob == pytest.approx(float(ref[t.token_id]), abs=TOL)


async def test_processed_mode_greedy_rows_report_the_penalised_distribution(
    tiny: Tiny, make_engine: Any
) -> None:
    eng = make_engine(logprobs_mode="processed")
    ids = tiny.encode(PROMPTS[2])
    rep, freq, pres = 1.8, 1.0, 0.5
    events = await collect(
        eng.submit(
            request(
                "p",
                ids,
                "alpha",
                max_tokens=8,
                repetition_penalty=rep,
                frequency_penalty=freq,
                presence_penalty=pres,
                logprobs=3,
            )
        )
    )
    out = tokens(events)
    logits = tiny.ref.logits([*ids, *out[:-1]], "alpha")[len(ids) - 1 :].double()
    for i, e in enumerate(entries_of(events)):
        counts: dict[int, int] = {}
        for t in out[:i]:
            counts[t] = counts.get(t, 0) + 1
        ref = torch.log_softmax(penalised(logits[i], set(ids), counts, rep, freq, pres), dim=-1)
        assert e.token_id == int(ref.argmax())  # greedy on the penalised logits
        assert e.logprob == pytest.approx(float(ref[e.token_id]), abs=TOL), i
        assert e.top[0].logprob == pytest.approx(e.logprob, abs=TOL)
        for t in e.top:
            assert t.logprob == pytest.approx(float(ref[t.token_id]), abs=TOL)


async def test_processed_logprobs_do_not_depend_on_the_batch(tiny: Tiny, make_engine: Any) -> None:
    eng = make_engine(logprobs_mode="processed")
    ids = tiny.encode(PROMPTS[0])
    asked = request("x", ids, "gamma", max_tokens=7, temperature=0.9, top_p=0.8, seed=5, logprobs=5)
    alone = await collect(eng.submit(asked))
    others = [
        request(
            f"o{i}", tiny.encode(PROMPTS[i % 3]), a, max_tokens=9, temperature=t, seed=i, logprobs=k
        )
        for i, (a, t, k) in enumerate([(None, 0.0, 2), ("alpha", 1.3, None), ("beta", 0.6, 20)])
    ]
    together = await asyncio.gather(*(collect(eng.submit(r)) for r in [*others, asked]))
    a, b = entries_of(alone), entries_of(together[-1])
    assert [e.token_id for e in a] == [e.token_id for e in b]
    for x, y in zip(a, b, strict=True):
        assert x.logprob == pytest.approx(y.logprob, abs=1e-5)
        assert [t.token_id for t in x.top] == [t.token_id for t in y.top]
        assert [t.logprob for t in x.top] == pytest.approx([t.logprob for t in y.top], abs=1e-5)


async def test_logprobs_mode_is_checked_and_reaches_the_engine_from_the_cli(
    tiny: Tiny, capsys: pytest.CaptureFixture[str]
) -> None:
    from adaptermesh.worker.cli import _build_engine, build_parser

    with pytest.raises(InvalidRequestError, match="logprobs_mode"):
        Engine(tiny.model_dir, tiny.root, config=EngineConfig(logprobs_mode="logits"))
    base = ["--model", str(tiny.model_dir), "--adapter-root", str(tiny.root), "--device", "cpu"]
    with pytest.raises(SystemExit):
        build_parser().parse_args([*base, "--logprobs-mode", "logits"])
    assert "--logprobs-mode" in capsys.readouterr().err
    assert build_parser().parse_args(base).logprobs_mode is None  # EngineConfig's "raw"
    eng = _build_engine(build_parser().parse_args([*base, "--logprobs-mode", "processed"]))
    try:
        assert isinstance(eng, Engine)
        assert eng.config.logprobs_mode == "processed"
    finally:
        await eng.shutdown()
