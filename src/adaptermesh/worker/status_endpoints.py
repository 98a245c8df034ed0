"""The worker's read-only answers: ``/health``, ``/metrics`` and ``/v1/models``."""

from __future__ import annotations

import time
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from adaptermesh.worker.http_errors import IMMEDIATE_HEALTH_CHECK_FAIL, retry_after_headers
from adaptermesh.worker.types import EngineProtocol

__all__ = ["health_response", "metrics_response", "model_body", "models_body"]


def health_response(
    draining: bool, retry_after_s: int, ranks_up: tuple[bool, ...] = ()
) -> web.Response:
    """200 ``{"status": "ok"}``, or 503 ``{"status": "draining"}`` with ``Retry-After`` and
    Envoy's immediate-fail header (the worker leaves load balancing on this answer).

    ``ranks_up``: a tensor-parallel worker's ranks (rank 0 first), listed as ``"ranks"``; any
    rank down answers 503 ``{"status": "rank_down"}``, without ``Retry-After`` (the worker
    is stopping)."""
    extra: dict[str, Any] = {"ranks": ["up" if u else "down" for u in ranks_up]} if ranks_up else {}
    if ranks_up and not all(ranks_up):
        return web.json_response(
            {"status": "rank_down", **extra}, status=503, headers=IMMEDIATE_HEALTH_CHECK_FAIL
        )
    if draining:
        return web.json_response(
            {"status": "draining", **extra},
            status=503,
            headers={**retry_after_headers(retry_after_s), **IMMEDIATE_HEALTH_CHECK_FAIL},
        )
    return web.json_response({"status": "ok", **extra})


def metrics_response(registry: CollectorRegistry) -> web.Response:
    """``registry`` in Prometheus' text format."""
    payload = generate_latest(registry)
    return web.Response(body=payload, headers={"Content-Type": CONTENT_TYPE_LATEST})


def model_body(
    engine: EngineProtocol, name: str, parent: str | None, location: str
) -> dict[str, Any]:
    """``GET /v1/models/{name}``: one model card, with where the worker finds it."""
    return {
        "id": name,
        "object": "model",
        "created": int(time.time()),
        "owned_by": "adaptermesh",
        "root": name if parent is None else None,
        "parent": parent,
        "max_model_len": engine.max_model_len,
        "location": location,
    }


def models_body(engine: EngineProtocol) -> dict[str, Any]:
    """The base model (``parent: null``) and the adapters the engine knows, by name."""
    created = int(time.time())
    base = engine.model_name
    data: list[dict[str, Any]] = [
        {
            "id": base,
            "object": "model",
            "created": created,
            "owned_by": "adaptermesh",
            "root": base,
            "parent": None,
            "max_model_len": engine.max_model_len,
        }
    ]
    for info in sorted(engine.list_adapters(), key=lambda a: a.name):
        data.append(
            {
                "id": info.name,
                "object": "model",
                "created": created,
                "owned_by": "adaptermesh",
                "root": info.path,
                "parent": base,
                "max_model_len": engine.max_model_len,
                "rank": info.rank,
                # In a slot of the adapter pool; on a CPU worker that pool is host memory.
                "resident": info.resident_on_gpu,
                "resident_on_gpu": info.resident_on_gpu and engine.on_gpu,
                "pinned": info.pinned,
            }
        )
    return {"object": "list", "data": data}
