"""Reading a request's JSON body, with every failure (too large, too slow, malformed, not an
object) as an ``ApiError``. Bodies over ``JSON_INLINE_BYTES`` are parsed in a child process
(``adaptermesh.httpserve.JsonBodyParser``) so a large one never stalls the event loop."""

from __future__ import annotations

from concurrent.futures.process import BrokenProcessPool
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from adaptermesh.httpserve import BodyTimeoutError, JsonBodyError, JsonBodyParser, read_body
from adaptermesh.worker.http_errors import ApiError, retry_after_headers

__all__ = ["decode_json_object", "read_json_object"]


async def read_json_object(
    request: web.Request,
    parser: JsonBodyParser,
    *,
    max_body_bytes: int,
    body_timeout_s: float,
    retry_after_s: int,
) -> dict[str, Any]:
    """The request's body, read within ``body_timeout_s``, as a JSON object."""
    try:
        raw = await read_body(request, body_timeout_s)
    except web.HTTPRequestEntityTooLarge:
        raise ApiError(
            413, f"request body is larger than {max_body_bytes} bytes", code="payload_too_large"
        ) from None
    except BodyTimeoutError as exc:
        raise ApiError(408, str(exc), code="body_timeout") from None
    except HttpProcessingError as exc:  # a broken chunked encoding or Content-Length
        raise ApiError(
            400, f"request body is malformed: {exc.message}", code="invalid_body"
        ) from None
    if not raw:
        raise ApiError(400, "request body is empty; send a JSON object", code="invalid_json")
    return await decode_json_object(raw, parser, retry_after_s=retry_after_s)


async def decode_json_object(
    raw: bytes, parser: JsonBodyParser, *, retry_after_s: int
) -> dict[str, Any]:
    """``raw`` as a JSON object, parsed off the loop when large; errors are ``ApiError``."""
    try:
        body = await parser.parse(raw)
    except JsonBodyError as exc:
        raise ApiError(exc.status, exc.message, param=exc.param, code=exc.code) from None
    except BrokenProcessPool:
        raise ApiError(
            503,
            "the JSON parser restarted; retry",
            type="service_unavailable",
            code="parser_restarted",
            headers=retry_after_headers(retry_after_s),
        ) from None
    if not isinstance(body, dict):
        raise ApiError(
            400,
            f"request body must be a JSON object, got {type(body).__name__}",
            code="invalid_json",
        )
    return body
