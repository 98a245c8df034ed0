"""The adapter the edge routed a request for (``x-adapter-id``, set by an AdapterInstance's
path route, mesh/edge.py): the worker serves it when the body names no model, and its gRPC
and WebSocket services refuse a message that names another one (the edge checks the header,
not those bodies). gRPC's side is tested through Envoy in
tests/mesh/test_adapter_protocols_envoy.py."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
from websockets.asyncio.client import connect
from worker_service.fakes import FakeEngine, expected_text

from adaptermesh.worker.service import ServiceConfig, WorkerService, serve
from adaptermesh.worker.ws import WS_PATH, mount_websocket

TIMEOUT = 20.0


async def _final(ws: Any, cid: str) -> dict[str, Any]:
    while True:
        msg = json.loads(await asyncio.wait_for(ws.recv(), TIMEOUT))
        assert msg["id"] == cid, msg
        if msg["type"] != "token":
            return msg


async def test_the_routed_adapter_names_the_model_and_cannot_be_swapped() -> None:
    engine = FakeEngine()
    service = WorkerService(engine, ServiceConfig())
    mount_websocket(service)
    runner, port = await serve(service, "127.0.0.1", 0)
    try:
        async with httpx.AsyncClient(timeout=TIMEOUT) as client:
            r = await client.post(
                f"http://127.0.0.1:{port}/v1/completions",
                headers={"x-adapter-id": "alpha"},
                json={"prompt": "one two", "max_tokens": 3},
            )
            assert r.status_code == 200, r.text
            assert r.json()["model"] == "alpha"
            assert r.json()["choices"][0]["text"] == expected_text(
                engine.tokenize("one two"), "alpha", 3
            )
        async with connect(
            f"ws://127.0.0.1:{port}{WS_PATH}", additional_headers={"x-adapter-id": "alpha"}
        ) as ws:
            base = {"type": "completion", "prompt": "one two", "max_tokens": 3}
            await ws.send(json.dumps({**base, "id": "a"}))
            assert (await _final(ws, "a"))["model"] == "alpha"
            await ws.send(json.dumps({**base, "id": "b", "model": "beta"}))
            refused = await _final(ws, "b")
            assert refused["type"] == "error", refused
            assert refused["error"]["code"] == "adapter_mismatch", refused
            assert [r.adapter for r in engine.submitted] == ["alpha", "alpha"]
    finally:
        await runner.cleanup()
