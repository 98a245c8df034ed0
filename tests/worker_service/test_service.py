"""HTTP layer against a deterministic fake engine: API shapes, streaming, errors, backpressure,
disconnects, deadlines, admin auth and draining."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from waiting import async_wait_until as wait_until

from adaptermesh.worker.types import EngineOverloadedError

from .conftest import Server, StartServer
from .fakes import FakeEngine, expected_text, word_id


def sse_events(body: str) -> list[str]:
    return [line[len("data: ") :] for line in body.split("\n") if line.startswith("data: ")]


# ---------------------------------------------------------------------------------- happy paths
async def test_completion_matches_engine_output(server: Server) -> None:
    r = await server.client.post(
        "/v1/completions",
        json={"model": "tiny-base", "prompt": "hello world", "max_tokens": 5, "temperature": 0},
    )
    assert r.status_code == 200, r.text
    body = r.json()
    ids = [word_id("hello"), word_id("world")]
    assert body["object"] == "text_completion"
    assert body["model"] == "tiny-base"
    assert body["choices"][0]["text"] == expected_text(ids, None, 5)
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": 2, "completion_tokens": 5, "total_tokens": 7}
    req = server.engine.submitted[-1]
    assert req.adapter is None
    assert req.sampling.temperature == 0.0
    assert req.deadline is not None


async def test_adapter_is_named_by_model_and_token_prompts_work(server: Server) -> None:
    r = await server.client.post(
        "/v1/completions",
        json={"model": "alpha", "prompt": [5, 6, 7], "max_tokens": 3, "seed": 4, "stop": ["zz"]},
    )
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == expected_text([5, 6, 7], "alpha", 3)
    req = server.engine.submitted[-1]
    assert req.adapter == "alpha"
    assert req.sampling.seed == 4
    assert req.sampling.stop == ("zz",)
    assert req.sampling.temperature == 1.0  # OpenAI's default


async def test_stream_concatenates_to_the_same_text(server: Server) -> None:
    payload = {
        "model": "beta",
        "prompt": "a b c",
        "max_tokens": 6,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    r = await server.client.post("/v1/completions", json=payload)
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    ids = [word_id(w) for w in ["a", "b", "c"]]
    assert text == expected_text(ids, "beta", 6)
    finals = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert [c["choices"][0]["finish_reason"] for c in finals] == ["length"]
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"]["completion_tokens"] == 6


async def test_stop_sequence_finishes_with_stop(server: Server) -> None:
    ids = [word_id("x")]
    second = expected_text(ids, None, 2).split()[1]
    r = await server.client.post(
        "/v1/completions", json={"prompt": "x", "max_tokens": 8, "stop": second}
    )
    assert r.json()["choices"][0]["finish_reason"] == "stop"
    assert r.json()["usage"]["completion_tokens"] == 2


async def test_chat_completion_and_stream(server: Server) -> None:
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "hi"}]},
    ]
    r = await server.client.post(
        "/v1/chat/completions",
        json={"model": "tiny-base", "messages": messages, "max_completion_tokens": 4},
    )
    assert r.status_code == 200, r.text
    body = r.json()
    ids = server.engine.apply_chat_template(
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    )
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {
        "role": "assistant",
        "content": expected_text(ids, None, 4),
    }
    r = await server.client.post(
        "/v1/chat/completions",
        json={"model": "tiny-base", "messages": messages, "max_tokens": 4, "stream": True},
    )
    chunks = [json.loads(e) for e in sse_events(r.text)[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == expected_text(ids, None, 4)


async def test_chat_without_template_is_refused(start_server: StartServer) -> None:
    s = await start_server(FakeEngine(chat=False))
    r = await s.client.post(
        "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}
    )
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "messages"


async def test_models_lists_base_and_adapters(server: Server) -> None:
    await server.client.post("/v1/completions", json={"model": "gamma", "prompt": "q"})
    r = await server.client.get("/v1/models")
    data = r.json()["data"]
    assert [m["id"] for m in data] == ["tiny-base", "gamma"]
    assert data[1]["parent"] == "tiny-base"
    assert data[0]["max_model_len"] == 128


async def test_health(server: Server) -> None:
    r = await server.client.get("/health")
    assert r.status_code == 200
    assert r.json() == {"status": "ok"}


# ------------------------------------------------------------------------------------ bad input
BAD = [
    (b"{not json", 400, None),
    (b"[1, 2]", 400, None),
    (b"", 400, None),
    (b"\xff\xfe", 400, None),
    ({"model": 7, "prompt": "x"}, 400, "model"),
    ({"prompt": "x", "max_tokens": "5"}, 400, "max_tokens"),
    ({"prompt": "x", "max_tokens": 2.5}, 400, "max_tokens"),
    ({"prompt": "x", "max_tokens": True}, 400, "max_tokens"),
    ({"prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
    ({"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": "x", "max_tokens": 10**12}, 400, "max_tokens"),
    ({"prompt": "x", "max_tokens": 128}, 400, "max_tokens"),
    ({"max_tokens": 3}, 400, "prompt"),
    ({"prompt": 5}, 400, "prompt"),
    ({"prompt": ""}, 400, "prompt"),
    ({"prompt": []}, 400, "prompt"),
    ({"prompt": [1, "a"]}, 400, "prompt"),
    ({"prompt": [1, -2]}, 400, "prompt"),
    ({"prompt": [1, 5000]}, 400, "prompt"),
    ({"prompt": ["a", "b"]}, 400, "prompt"),
    ({"prompt": "x", "temperature": 5}, 400, "temperature"),
    ({"prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ({"prompt": "x", "top_p": 0}, 400, "top_p"),
    ({"prompt": "x", "seed": 1.5}, 400, "seed"),
    ({"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ({"prompt": "x", "stop": [1]}, 400, "stop"),
    ({"prompt": "x", "stream": "yes"}, 400, "stream"),
    ({"prompt": "x", "stream_options": 3}, 400, "stream_options"),
    ({"prompt": "x", "n": 0}, 400, "n"),
    ({"prompt": "x", "n": 17}, 400, "n"),
    ({"prompt": "x", "logprobs": 21}, 400, "logprobs"),
    ({"prompt": "x", "max_token": 2}, 400, "max_token"),
    ({"prompt": "x", "suffix": "y"}, 400, "suffix"),
    ({"prompt": "x", "echo": True, "logprobs": 1}, 400, "echo"),
    ({"prompt": "x", "best_of": 2, "stream": True}, 400, "best_of"),
    ({"prompt": "x", "n": 3, "best_of": 2}, 400, "best_of"),
    ({"prompt": "x", "logit_bias": {"1": 101}}, 400, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"9999": 1}}, 400, "logit_bias"),
    ({"model": "nope", "prompt": "x"}, 404, "model"),
    ({"prompt": " ".join(["w"] * 128)}, 400, "prompt"),
]


@pytest.mark.parametrize(("payload", "status", "param"), BAD)
async def test_bad_input_names_the_field_and_server_keeps_serving(
    server: Server, payload, status, param
) -> None:
    if isinstance(payload, bytes):
        r = await server.client.post(
            "/v1/completions", content=payload, headers={"content-type": "application/json"}
        )
    else:
        r = await server.client.post("/v1/completions", json=payload)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param
    if param is not None:
        assert param in error["message"]
    assert server.service.queue.num_running == 0
    ok = await server.client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
    assert ok.status_code == 200


@pytest.mark.parametrize(
    ("messages", "param"),
    [
        (None, "messages"),
        ([], "messages"),
        (["hi"], "messages[0]"),
        ([{"content": "hi"}], "messages[0].role"),
        ([{"role": "user", "content": 3}], "messages[0].content"),
        ([{"role": "user", "content": [{"type": "image_url"}]}], "messages[0].content[0]"),
    ],
)
async def test_bad_chat_messages(server: Server, messages, param) -> None:
    r = await server.client.post("/v1/chat/completions", json={"messages": messages})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == param


async def test_oversized_body_gets_413(start_server: StartServer) -> None:
    s = await start_server(max_body_bytes=1024)
    r = await s.client.post("/v1/completions", json={"prompt": "x" * 5000})
    assert r.status_code == 413
    assert r.json()["error"]["code"] == "payload_too_large"


async def test_unknown_route_and_method_get_json_errors(server: Server) -> None:
    r = await server.client.get("/v1/nothing")
    assert r.status_code == 404
    assert r.json()["error"]["code"] == "not_found"
    r = await server.client.get("/v1/completions")
    assert r.status_code == 405
    assert "POST" in r.headers["allow"]


async def test_bad_timeout_header(server: Server) -> None:
    r = await server.client.post(
        "/v1/completions", json={"prompt": "x"}, headers={"x-request-timeout": "-1"}
    )
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "x-request-timeout"


# ------------------------------------------------------------------------------- engine errors
async def test_engine_overload_gives_429(server: Server) -> None:
    server.engine.fail_on_submit = EngineOverloadedError("batch full")
    r = await server.client.post("/v1/completions", json={"prompt": "x"})
    assert r.status_code == 429
    assert r.headers["retry-after"] == "1"
    server.engine.fail_on_submit = None
    assert server.service.queue.num_running == 0


async def test_engine_crash_gives_500_and_server_keeps_serving(server: Server) -> None:
    server.engine.fail_in_stream = RuntimeError("boom")
    r = await server.client.post("/v1/completions", json={"prompt": "x"})
    assert r.status_code == 500
    assert r.json()["error"]["type"] == "server_error"
    server.engine.fail_in_stream = None
    r = await server.client.post("/v1/completions", json={"prompt": "x"})
    assert r.status_code == 200


async def test_engine_error_mid_stream_is_reported_in_band(server: Server) -> None:
    server.engine.fail_after = 2
    r = await server.client.post(
        "/v1/completions", json={"prompt": "x", "max_tokens": 5, "stream": True}
    )
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["code"] == "engine_error"
    texts = [json.loads(e)["choices"][0]["text"] for e in events[:-2]]
    assert len(texts) == 2
    r = await server.client.post("/v1/completions", json={"prompt": "x", "max_tokens": 5})
    assert r.status_code == 500


# --------------------------------------------------------------------------- queueing and 429s
async def test_flooding_tenant_gets_429_while_quiet_tenant_is_served(
    start_server: StartServer,
) -> None:
    s = await start_server(
        FakeEngine(token_delay=0.01), max_running=1, max_waiting_per_tenant=2, max_waiting_total=10
    )

    async def ask(tenant: str) -> httpx.Response:
        return await s.client.post(
            "/v1/completions",
            json={"prompt": "x", "max_tokens": 5},
            headers={"x-tenant-id": tenant},
        )

    flood = [asyncio.create_task(ask("flood")) for _ in range(8)]
    await wait_until(lambda: s.service.queue.num_waiting == 2)
    quiet = await ask("quiet")
    results = await asyncio.gather(*flood)
    codes = sorted(r.status_code for r in results)
    assert codes == [200] * 3 + [429] * 5
    rejected = next(r for r in results if r.status_code == 429)
    assert rejected.headers["retry-after"] == "1"
    assert rejected.json()["error"]["code"] == "queue_full"
    assert quiet.status_code == 200
    # The quiet request ran right after the one that was running: before the two queued floods.
    order = [r.request_id for r in s.engine.submitted]
    quiet_id = quiet.json()["id"]
    assert order.index(quiet_id) == 1


async def test_global_bound_gives_429(start_server: StartServer) -> None:
    s = await start_server(
        FakeEngine(token_delay=0.01), max_running=1, max_waiting_per_tenant=5, max_waiting_total=2
    )
    tasks = [
        asyncio.create_task(
            s.client.post(
                "/v1/completions",
                json={"prompt": "x", "max_tokens": 3},
                headers={"x-tenant-id": f"t{i}"},
            )
        )
        for i in range(5)
    ]
    codes = sorted(r.status_code for r in await asyncio.gather(*tasks))
    assert codes == [200, 200, 200, 429, 429]


async def test_tenant_identity_api_key_header_and_address(start_server: StartServer) -> None:
    s = await start_server(
        FakeEngine(token_delay=0.02), max_running=1, max_waiting_per_tenant=1, max_waiting_total=10
    )
    body = {"prompt": "x", "max_tokens": 3}
    blocker = asyncio.create_task(s.client.post("/v1/completions", json=body))
    await wait_until(lambda: s.service.queue.num_running == 1)
    heads = [
        {"Authorization": "Bearer sk-one"},
        {"Authorization": "Bearer sk-two"},
        {"x-tenant-id": "team-a"},
    ]
    waits = [
        asyncio.create_task(s.client.post("/v1/completions", json=body, headers=h)) for h in heads
    ]
    await wait_until(lambda: s.service.queue.num_waiting == 3)
    tenants = set(s.service.queue.snapshot())
    assert "ip-127.0.0.1" in tenants
    assert "id-team-a" in tenants
    keys = [t for t in tenants if t.startswith("key-")]
    assert len(keys) == 2
    assert not any("sk-" in t for t in keys)
    await asyncio.gather(blocker, *waits)


# ----------------------------------------------------------------------- disconnects, deadlines
async def test_disconnect_mid_stream_cancels_and_frees_the_slot(start_server: StartServer) -> None:
    s = await start_server(FakeEngine(token_delay=0.02), max_running=1)
    async with (
        httpx.AsyncClient(base_url=s.url) as c,
        c.stream(
            "POST",
            "/v1/completions",
            json={"prompt": "x", "max_tokens": 100, "stream": True},
        ) as r,
    ):
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                break
    await wait_until(lambda: s.service.queue.num_running == 0)
    await wait_until(lambda: len(s.engine.cancelled) == 1)
    await wait_until(lambda: not s.engine.running)
    assert s.engine.generated < 100
    r = await s.client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
    assert r.status_code == 200
    metrics = (await s.client.get("/metrics")).text
    assert 'adaptermesh_requests_total{outcome="disconnected"} 1.0' in metrics


async def test_disconnect_while_queued_withdraws(start_server: StartServer) -> None:
    s = await start_server(FakeEngine(token_delay=0.05), max_running=1)
    blocker = asyncio.create_task(
        s.client.post("/v1/completions", json={"prompt": "x", "max_tokens": 10})
    )
    await wait_until(lambda: s.service.queue.num_running == 1)
    async with httpx.AsyncClient(base_url=s.url, timeout=0.2) as c:
        with pytest.raises(httpx.ReadTimeout):
            await c.post("/v1/completions", json={"prompt": "y", "max_tokens": 2})
    await wait_until(lambda: s.service.queue.num_waiting == 0)
    assert len(s.engine.submitted) == 1  # the abandoned request never reached the engine
    assert (await blocker).status_code == 200


async def test_deadline_during_generation_gives_504(start_server: StartServer) -> None:
    s = await start_server(FakeEngine(token_delay=0.05))
    r = await s.client.post(
        "/v1/completions",
        json={"prompt": "x", "max_tokens": 50},
        headers={"x-request-timeout": "0.2"},
    )
    assert r.status_code == 504
    assert r.json()["error"]["code"] == "deadline_exceeded"
    await wait_until(lambda: s.service.queue.num_running == 0 and not s.engine.running)


async def test_deadline_while_queued_gives_504(start_server: StartServer) -> None:
    s = await start_server(FakeEngine(token_delay=0.05), max_running=1)
    blocker = asyncio.create_task(
        s.client.post("/v1/completions", json={"prompt": "x", "max_tokens": 10})
    )
    await wait_until(lambda: s.service.queue.num_running == 1)
    r = await s.client.post(
        "/v1/completions", json={"prompt": "y"}, headers={"x-request-timeout": "0.1"}
    )
    assert r.status_code == 504
    assert "queue" in r.json()["error"]["message"]
    assert s.service.queue.num_waiting == 0
    await blocker
    metrics = (await s.client.get("/metrics")).text
    # Recorded as a queue deadline, apart from deadlines that pass during generation.
    assert 'adaptermesh_requests_total{outcome="deadline_queued"} 1.0' in metrics
    assert 'outcome="deadline_exceeded"' not in metrics


async def test_server_default_deadline_applies(start_server: StartServer) -> None:
    s = await start_server(FakeEngine(token_delay=0.05), request_timeout_s=0.15)
    r = await s.client.post(
        "/v1/completions", json={"prompt": "x", "max_tokens": 50, "stream": True}
    )
    events = sse_events(r.text)
    assert json.loads(events[-2])["error"]["code"] == "deadline_exceeded"


# --------------------------------------------------------------------------------------- admin
async def test_admin_endpoints_need_the_token(start_server: StartServer) -> None:
    s = await start_server(admin_token="s3cret")
    body = {"lora_name": "new", "lora_path": "ok/new"}
    r = await s.client.post("/v1/load_lora_adapter", json=body)
    assert r.status_code == 401
    r = await s.client.post(
        "/v1/load_lora_adapter", json=body, headers={"Authorization": "Bearer wrong"}
    )
    assert r.status_code == 403
    assert "new" not in s.engine.adapters
    r = await s.client.post(
        "/v1/load_lora_adapter", json=body, headers={"Authorization": "Bearer s3cret"}
    )
    assert r.status_code == 200
    assert "new" in r.text
    r = await s.client.post(
        "/v1/unload_lora_adapter", json={"lora_name": "new"}, headers={"x-admin-token": "s3cret"}
    )
    assert r.status_code == 200
    assert "new" not in s.engine.adapters


async def test_load_can_pin_and_models_say_so(server: Server) -> None:
    r = await server.client.post(
        "/v1/load_lora_adapter", json={"lora_name": "p", "lora_path": "ok/p", "pinned": True}
    )
    assert r.status_code == 200, r.text
    assert server.engine.adapters["p"].pinned
    pinned = {
        m["id"]: m["pinned"]
        for m in (await server.client.get("/v1/models")).json()["data"]
        if m["parent"]
    }
    assert pinned == {"p": True}
    r = await server.client.post(
        "/v1/load_lora_adapter", json={"lora_name": "p", "lora_path": "ok/p"}
    )
    assert r.status_code == 200
    assert not server.engine.adapters["p"].pinned


async def test_a_load_that_finds_every_slot_taken_is_a_503_to_retry(server: Server) -> None:
    """Every GPU slot pinned or in use until the load's wait ran out: the admin gets 503 with
    Retry-After naming lora_name (not a 500), nothing is registered, and the worker serves on."""
    server.engine.fail_on_load = EngineOverloadedError(
        "adapter slots: every GPU slot is pinned or in use; retry later"
    )
    r = await server.client.post(
        "/v1/load_lora_adapter", json={"lora_name": "p", "lora_path": "ok/p", "pinned": True}
    )
    assert r.status_code == 503, r.text
    assert r.headers["Retry-After"] == "1"
    err = r.json()["error"]
    assert err["param"] == "lora_name"
    assert err["code"] == "engine_overloaded"
    assert "every GPU slot" in err["message"]
    assert "p" not in server.engine.adapters
    server.engine.fail_on_load = None
    r = await server.client.post(
        "/v1/load_lora_adapter", json={"lora_name": "p", "lora_path": "ok/p", "pinned": True}
    )
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        (
            "/v1/load_lora_adapter",
            {"lora_name": "x", "lora_path": "ok/x", "pinned": "yes"},
            400,
            "pinned",
        ),
        ("/v1/load_lora_adapter", {"lora_path": "ok/x"}, 400, "lora_name"),
        ("/v1/load_lora_adapter", {"lora_name": 3, "lora_path": "ok/x"}, 400, "lora_name"),
        ("/v1/load_lora_adapter", {"lora_name": "x"}, 400, "lora_path"),
        ("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "missing"}, 404, "lora_path"),
        (
            "/v1/load_lora_adapter",
            {"lora_name": "x", "lora_path": "ok/../../etc"},
            400,
            "lora_path",
        ),
        (
            "/v1/load_lora_adapter",
            {"lora_name": "tiny-base", "lora_path": "ok/x"},
            400,
            "lora_name",
        ),
        ("/v1/unload_lora_adapter", {"lora_name": "never-loaded"}, 404, "lora_name"),
        ("/v1/unload_lora_adapter", {}, 400, "lora_name"),
    ],
)
async def test_admin_bad_input(server: Server, path, body, status, param) -> None:
    r = await server.client.post(path, json=body)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param
    assert server.engine.adapters == {}


# ------------------------------------------------------------------------------------- drain
async def test_drain_refuses_new_work_and_waits_for_inflight(start_server: StartServer) -> None:
    s = await start_server(FakeEngine(token_delay=0.02))
    inflight = asyncio.create_task(
        s.client.post("/v1/completions", json={"prompt": "x", "max_tokens": 10})
    )
    await wait_until(lambda: s.service.inflight == 1)
    drain = asyncio.create_task(s.service.drain(5))
    await asyncio.sleep(0.02)
    r = await s.client.post("/v1/completions", json={"prompt": "x"})
    assert r.status_code == 503
    assert r.json()["error"]["code"] == "draining"
    assert (await s.client.get("/health")).status_code == 503
    assert not drain.done()
    assert (await inflight).status_code == 200
    assert await drain is True


async def test_drain_grace_fails_health_first_and_serves_on(start_server: StartServer) -> None:
    s = await start_server(FakeEngine(token_delay=0.01), drain_grace_s=0.5, drain_timeout_s=5.0)
    drain = asyncio.create_task(s.service.drain())
    await wait_until(lambda: s.service.unready)
    health = await s.client.get("/health")
    assert health.status_code == 503
    assert health.headers["x-envoy-immediate-health-check-fail"] == "true"
    # Within the grace a load balancer that has not yet seen the failed check still gets
    # answers; after it, requests are refused.
    served = await s.client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
    assert served.status_code == 200
    assert await drain is True
    refused = await s.client.post("/v1/completions", json={"prompt": "x"})
    assert refused.status_code == 503
    assert refused.json()["error"]["code"] == "draining"


async def test_drain_grace_counts_against_the_drain_timeout(start_server: StartServer) -> None:
    s = await start_server(FakeEngine(token_delay=0.05), drain_grace_s=30.0)
    inflight = asyncio.create_task(
        s.client.post("/v1/completions", json={"prompt": "x", "max_tokens": 8})
    )
    await wait_until(lambda: s.service.inflight == 1)
    started = asyncio.get_running_loop().time()
    assert await s.service.drain(0.2) is False
    assert asyncio.get_running_loop().time() - started < 5.0
    await inflight


async def test_drain_times_out(start_server: StartServer) -> None:
    s = await start_server(FakeEngine(token_delay=0.05))
    inflight = asyncio.create_task(
        s.client.post("/v1/completions", json={"prompt": "x", "max_tokens": 8})
    )
    await wait_until(lambda: s.service.inflight == 1)
    assert await s.service.drain(0.1) is False
    await inflight
