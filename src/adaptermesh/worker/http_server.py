"""The worker service's server wiring: the middleware that answers every failure as
OpenAI-shaped JSON, and ``serve``, which puts the app behind ``adaptermesh.httpserve``'s
listener guards (header and body deadlines, header caps, a connection cap) with
``handler_cancellation=True``, so a client that disconnects cancels its handler, which cancels
the engine request and frees its slot even while it is queued."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Protocol

from aiohttp import web
from prometheus_client import Counter

from adaptermesh.httpserve import ListenerLimits, serve_app
from adaptermesh.worker.http_errors import ApiError

__all__ = ["Servable", "error_middleware", "serve"]


class _ListenerConfig(Protocol):
    @property
    def listener(self) -> ListenerLimits: ...


class _RefusalMetrics(Protocol):
    @property
    def listener_refused(self) -> Counter: ...


class Servable(Protocol):
    """What ``serve`` needs of a service (``WorkerService``): its app, its listener limits
    and the counter of refused connections."""

    @property
    def app(self) -> web.Application: ...

    @property
    def config(self) -> _ListenerConfig: ...

    @property
    def metrics(self) -> _RefusalMetrics: ...


# The service's log, under the name it has always had.
log = logging.getLogger("adaptermesh.worker.service")

# Codes of aiohttp's own refusals (an unknown route, a wrong method, a body over the cap).
_HTTP_EXCEPTION_CODES = {404: "not_found", 405: "method_not_allowed", 413: "payload_too_large"}


@web.middleware
async def error_middleware(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """``ApiError`` as its JSON answer, aiohttp's 4xx and 5xx in the same shape, and anything
    unexpected as a logged 500 ``internal_error``."""
    try:
        return await handler(request)
    except ApiError as exc:
        return exc.response()
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        error_type = "invalid_request_error" if exc.status < 500 else "server_error"
        code = _HTTP_EXCEPTION_CODES.get(exc.status)
        headers = {k: v for k, v in exc.headers.items() if k.lower() == "allow"}
        return ApiError(
            exc.status,
            exc.reason if exc.status != 413 else exc.text or exc.reason,
            type=error_type,
            code=code,
            headers=headers,
        ).response()
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception:
        log.exception("unhandled error in %s %s", request.method, request.path)
        return ApiError(
            500, "internal server error", type="server_error", code="internal_error"
        ).response()


async def serve(
    service: Servable, host: str, port: int, *, shutdown_timeout: float = 2.0
) -> tuple[web.AppRunner, int]:
    """Start serving ``service`` on ``host:port`` (0 picks a free port); returns the port.

    The listener has ``service.config.listener``'s limits. ``runner.cleanup()`` waits
    ``shutdown_timeout`` seconds for handlers still running, then cancels them;
    ``WorkerService.drain`` is the place for a long, orderly wait.
    """
    refused = service.metrics.listener_refused
    return await serve_app(
        service.app,
        host,
        port,
        service.config.listener,
        handler_cancellation=True,
        shutdown_timeout=shutdown_timeout,
        on_refusal=lambda reason: refused.labels(reason=reason).inc(),
    )
