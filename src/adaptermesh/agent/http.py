"""The agent's own HTTP endpoints.

- ``/metrics``: Prometheus text format.
- ``/healthz``: 200 while the datapath is attached and the xDS server runs. A control-plane
  outage does NOT make the agent unhealthy: restarting it would not help, and the node keeps
  serving its last Assignment.
- ``/readyz``: 200 once an Assignment has been applied (from the control plane or the cache).
- ``/status``: JSON with the applied version, the connection and per-shard weights and loads.
- ``/flows[?source=IP]``: which shard each active source address was steered to, from the
  classifier's new-flow events (troubleshooting "where does tenant X go?"); for one source
  whose flow is older than the window, the datapath's sticky flow entry (``age_s`` null).

The app carries ``adaptermesh.httpserve``'s header caps and keep-alive timeout as handler
arguments, so any runner that serves it gets them (aiohttp 3.14 also closes a connection whose
request has not arrived within the keep-alive timeout of connecting). Serve it with
``httpserve.serve_app`` for the header deadline, the JSON 408/431 answers and the connection
cap.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from adaptermesh.agent.metrics import AgentMetrics
from adaptermesh.httpserve import ListenerLimits

__all__ = ["build_app"]


def build_app(
    metrics: AgentMetrics,
    health: Callable[[], tuple[bool, dict[str, Any]]],
    ready: Callable[[], bool],
    status: Callable[[], dict[str, Any]],
    flows: Callable[[str | None], dict[str, Any]],
    limits: ListenerLimits | None = None,
) -> web.Application:
    async def get_metrics(_: web.Request) -> web.Response:
        body = generate_latest(metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def get_healthz(_: web.Request) -> web.Response:
        ok, detail = health()
        return web.json_response({"ok": ok, **detail}, status=200 if ok else 503)

    async def get_readyz(_: web.Request) -> web.Response:
        ok = ready()
        return web.json_response({"ready": ok}, status=200 if ok else 503)

    async def get_status(_: web.Request) -> web.Response:
        return web.json_response(status())

    async def get_flows(request: web.Request) -> web.Response:
        return web.json_response(flows(request.query.get("source")))

    app = web.Application(handler_args=(limits or ListenerLimits()).handler_args())
    app.router.add_get("/metrics", get_metrics)
    app.router.add_get("/healthz", get_healthz)
    app.router.add_get("/readyz", get_readyz)
    app.router.add_get("/status", get_status)
    app.router.add_get("/flows", get_flows)
    return app
