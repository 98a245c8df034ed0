"""The worker service's errors: ``ApiError`` (an OpenAI-shaped JSON error with its HTTP status)
and the translations of engine errors and engine finish reasons into it.

Errors use OpenAI's shape ``{"error": {"message", "type", "param", "code"}}`` with ``param``
naming the offending field. A message quotes client input through ``assignment_rules.quote``
(a bounded prefix and the length), and ``ApiError`` cuts any message to MAX_MESSAGE_JSON and
any ``param`` to MAX_PARAM_JSON bytes of JSON, so an error body stays under 1 KB whatever the
request held.
"""

from __future__ import annotations

import json
import time
from typing import Any

from aiohttp import web

from adaptermesh.assignment_rules import bounded_message
from adaptermesh.worker.types import (
    AdapterLoadTimeoutError,
    AdapterNotFoundError,
    EngineOverloadedError,
    InvalidRequestError,
)

__all__ = [
    "ENGINE_FIELD_TO_PARAM",
    "IMMEDIATE_HEALTH_CHECK_FAIL",
    "ApiError",
    "QueuedPastDeadlineError",
    "adapter_error",
    "draining_error",
    "engine_error_as_api_error",
    "finish_reason_error",
    "generation_deadline_error",
    "invalid_field",
    "retry_after_headers",
]

# Engine field names that differ from the API's.
ENGINE_FIELD_TO_PARAM = {
    "name": "lora_name",
    "path": "lora_path",
    "adapter": "model",
    "prompt_token_ids": "prompt",
}


# Bytes of JSON (escapes included) an error's message and param may take in its body.
MAX_MESSAGE_JSON = 600
MAX_PARAM_JSON = 160


def _json_size(text: str) -> int:
    return len(json.dumps(text))


class ApiError(Exception):
    """An error answered as OpenAI-shaped JSON with ``status``."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",  # the wire field is named "type"
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        message = bounded_message(message, MAX_MESSAGE_JSON, _json_size)
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        # A param can be a client's own key (an unknown field of the body).
        self.param = None if param is None else bounded_message(param, MAX_PARAM_JSON, _json_size)
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> web.Response:
        return web.json_response(self.body(), status=self.status, headers=self.headers)


class QueuedPastDeadlineError(ApiError):
    """The request's deadline passed while it waited in the tenant queue."""

    def __init__(self, headers: dict[str, str]) -> None:
        super().__init__(
            504,
            "the request's deadline passed while it waited in the queue",
            type="timeout_error",
            code="deadline_exceeded",
            headers=headers,
        )


def retry_after_headers(retry_after_s: int) -> dict[str, str]:
    """The headers of a 429 or 503 that tells the client when to come back."""
    return {"Retry-After": str(retry_after_s)}


# On a draining worker's answers: an Envoy that health-checks this worker takes it out of load
# balancing on the first answer carrying it, without waiting for its unhealthy threshold.
IMMEDIATE_HEALTH_CHECK_FAIL = {"x-envoy-immediate-health-check-fail": "true"}


def invalid_field(
    param: str, message: str, status: int = 400, code: str = "invalid_value"
) -> ApiError:
    """A refusal naming field ``param``: ``"<param>: <message>"``."""
    return ApiError(status, f"{param}: {message}", param=param, code=code)


def draining_error(retry_after_s: int) -> ApiError:
    """503 for a generation request that reaches a draining worker."""
    return ApiError(
        503,
        "the worker is draining; send the request to another worker",
        type="service_unavailable",
        code="draining",
        headers={**retry_after_headers(retry_after_s), **IMMEDIATE_HEALTH_CHECK_FAIL},
    )


def adapter_error(
    exc: AdapterNotFoundError, param: str, retry_after_s: int | None = None
) -> ApiError:
    """404 for an adapter that does not exist; 400 for one that exists but is unusable.

    The engine marks the second kind with a ``field`` attribute (a bad name, a path outside
    the adapter root, a rank or target-module mismatch, a corrupt weights file). An adapter
    store's failure (``adapter_stores.AdapterStoreError``, which carries a 5xx ``status``) is
    the server's: 503 for a store that cannot be reached, 502 for one that refused access or
    sent bytes that failed their checksum. A request that waited its worker's
    ``--adapter-load-wait`` for the adapter's load (``AdapterLoadTimeoutError``) gets 503
    ``adapter_load_timeout``. A 503 carries ``Retry-After`` when ``retry_after_s`` is given.
    """
    store_status = getattr(exc, "status", None)
    if isinstance(store_status, int) and 500 <= store_status <= 599:
        if isinstance(exc, AdapterLoadTimeoutError):
            code = "adapter_load_timeout"
        elif store_status == 503:
            code = "adapter_store_unavailable"
        else:
            code = "adapter_store_error"
        headers = (
            retry_after_headers(retry_after_s)
            if store_status == 503 and retry_after_s is not None
            else None
        )
        return ApiError(
            store_status,
            f"{param}: {exc}",
            type="server_error",
            param=param,
            code=code,
            headers=headers,
        )
    field_name = getattr(exc, "field", None)
    if field_name is None:
        code = "model_not_found" if param == "model" else "adapter_not_found"
        return ApiError(404, f"{param}: {exc}", param=param, code=code)
    if field_name == "name" and param != "model":
        param = "lora_name"
    return ApiError(400, f"{param}: {exc}", param=param, code="invalid_adapter")


def engine_error_as_api_error(exc: Exception, retry_after_s: int) -> ApiError:
    """What a generation request answers when the engine refuses or fails it."""
    if isinstance(exc, AdapterNotFoundError):
        return adapter_error(exc, "model", retry_after_s)
    if isinstance(exc, InvalidRequestError):
        param = ENGINE_FIELD_TO_PARAM.get(exc.field, exc.field)
        return ApiError(400, str(exc), param=param, code="invalid_value")
    if isinstance(exc, EngineOverloadedError):
        return ApiError(
            429,
            f"the engine is overloaded: {exc}",
            type="rate_limit_error",
            code="engine_overloaded",
            headers=retry_after_headers(retry_after_s),
        )
    return ApiError(500, f"engine error: {exc}", type="server_error", code="engine_error")


def generation_deadline_error() -> ApiError:
    """504 for a request whose deadline passed while the engine generated it."""
    return ApiError(
        504,
        "the request's deadline passed during generation",
        type="timeout_error",
        code="deadline_exceeded",
    )


def finish_reason_error(reason: str, deadline: float, retry_after_s: int) -> ApiError:
    """The error of a choice that finished ``cancelled`` or ``error``: 504 when the request's
    deadline (monotonic seconds) has passed, else 503 (the engine is shutting down) or 500."""
    if reason == "cancelled" and time.monotonic() >= deadline - 0.05:
        return generation_deadline_error()
    if reason == "cancelled":
        return ApiError(
            503,
            "the engine cancelled the request (it is shutting down)",
            type="service_unavailable",
            code="cancelled",
            headers=retry_after_headers(retry_after_s),
        )
    return ApiError(
        500, "the engine failed while generating", type="server_error", code="engine_error"
    )
