"""The admin side of the worker service: the admin token check, loading and unloading adapters
in the engine (with the engine's errors as ``ApiError`` naming ``lora_name`` or ``lora_path``),
and the injected-fault table's settings."""

from __future__ import annotations

import hmac
from collections.abc import Mapping
from typing import Any

from adaptermesh.assignment_rules import quote
from adaptermesh.worker.api import MAX_NAME_CHARS
from adaptermesh.worker.faults import FaultTable
from adaptermesh.worker.http_errors import (
    ENGINE_FIELD_TO_PARAM,
    ApiError,
    adapter_error,
    invalid_field,
    retry_after_headers,
)
from adaptermesh.worker.types import (
    AdapterNotFoundError,
    EngineOverloadedError,
    EngineProtocol,
    InvalidRequestError,
)

__all__ = [
    "check_admin_token",
    "load_adapter_into_engine",
    "loaded_message",
    "set_fault_rate",
    "unload_adapter_from_engine",
    "unloaded_message",
]


def admin_token_verdict(x_admin_token: str | None, authorization: str, expected: str | None) -> str:
    """ "ok", "missing" or "wrong": the one rule for the admin token over HTTP and gRPC.

    The token comes in ``x-admin-token`` or as ``Authorization: Bearer``; anything passes when
    ``expected`` is None.
    """
    if expected is None:
        return "ok"
    given = x_admin_token
    if given is None:
        scheme, _, token = authorization.partition(" ")
        given = token.strip() if scheme.lower() == "bearer" else None
    if not given:
        return "missing"
    return "ok" if hmac.compare_digest(given.encode(), expected.encode()) else "wrong"


def check_admin_token(headers: Mapping[str, str], expected: str | None) -> None:
    """401 without a token, 403 with a wrong one; anything passes when ``expected`` is None."""
    verdict = admin_token_verdict(
        headers.get("x-admin-token"), headers.get("Authorization", ""), expected
    )
    if verdict == "missing":
        raise ApiError(
            401,
            "this endpoint needs the admin token (Authorization: Bearer or x-admin-token)",
            type="authentication_error",
            code="missing_token",
            headers={"WWW-Authenticate": "Bearer"},
        )
    if verdict == "wrong":
        raise ApiError(
            403, "the admin token is wrong", type="permission_error", code="invalid_token"
        )


async def load_adapter_into_engine(
    engine: EngineProtocol, name: str, path: str, *, pinned: bool, retry_after_s: int = 1
) -> None:
    """Load (or reload) adapter ``name`` from ``path`` (a directory under the adapter root, or
    an ``s3://`` or ``hf://`` store URI: ``adapter_stores.py``); engine errors become
    ``ApiError`` naming ``lora_name`` or ``lora_path`` (a failing store: 502 or 503; every GPU
    slot pinned or in use until the load's wait ran out: 503 with ``Retry-After``)."""
    try:
        await engine.load_adapter(name, path, pinned=pinned)
    except EngineOverloadedError as exc:
        raise ApiError(
            503,
            f"lora_name: {quote(name)} cannot be placed now: {exc}",
            type="server_error",
            param="lora_name",
            code="engine_overloaded",
            headers=retry_after_headers(retry_after_s),
        ) from None
    except AdapterNotFoundError as exc:
        raise adapter_error(exc, "lora_path") from None
    except InvalidRequestError as exc:
        param = ENGINE_FIELD_TO_PARAM.get(exc.field, exc.field)
        raise ApiError(400, str(exc), param=param, code="invalid_adapter") from None
    except (OSError, ValueError, RuntimeError) as exc:
        # What the filesystem says about the path (a name too long, a permission, a
        # symlink loop, which pathlib reports as RuntimeError on Python 3.11) is about the
        # client's lora_path, not a server fault. Other RuntimeErrors (CUDA) are.
        if isinstance(exc, RuntimeError) and "Symlink loop" not in str(exc):
            raise
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise invalid_field(
            "lora_path", f"cannot be read: {reason}", code="invalid_adapter"
        ) from None


async def unload_adapter_from_engine(engine: EngineProtocol, name: str) -> None:
    """Unload adapter ``name``; errors as ``ApiError``."""
    try:
        await engine.unload_adapter(name)
    except AdapterNotFoundError as exc:
        raise adapter_error(exc, "lora_name") from None
    except InvalidRequestError as exc:
        param = ENGINE_FIELD_TO_PARAM.get(exc.field, exc.field)
        raise ApiError(400, str(exc), param=param, code="invalid_value") from None


def loaded_message(name: str) -> str:
    """vLLM's answer to a load."""
    return f"Success: LoRA adapter '{name}' added successfully."


def unloaded_message(name: str) -> str:
    """vLLM's answer to an unload."""
    return f"Success: LoRA adapter '{name}' removed successfully."


def set_fault_rate(faults: FaultTable, body: dict[str, Any]) -> None:
    """Apply ``{"adapter": name, "error_rate": 0-1}`` to ``faults`` (rate 0 clears); a bad
    value is refused naming its field."""
    adapter = body.get("adapter")
    if not isinstance(adapter, str) or not adapter:
        raise invalid_field("adapter", "must be a non-empty string")
    if len(adapter) > MAX_NAME_CHARS or not adapter.isprintable():
        raise invalid_field("adapter", f"must be 1-{MAX_NAME_CHARS} printable characters")
    rate = body.get("error_rate")
    if isinstance(rate, bool) or not isinstance(rate, int | float):
        raise invalid_field("error_rate", "must be a number in 0-1")
    try:
        faults.set(adapter, float(rate))
    except ValueError as exc:
        field, _, message = str(exc).partition(": ")
        raise invalid_field(field, message) from None
