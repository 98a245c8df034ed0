"""The service's error translations (``worker/http_errors.py``) and admin checks
(``worker/admin_endpoints.py``), without a server."""

from __future__ import annotations

import time
from typing import Any

import pytest

from adaptermesh.worker.admin_endpoints import check_admin_token, set_fault_rate
from adaptermesh.worker.faults import FaultTable
from adaptermesh.worker.http_errors import (
    ApiError,
    adapter_error,
    engine_error_as_api_error,
    finish_reason_error,
)
from adaptermesh.worker.types import (
    AdapterNotFoundError,
    EngineError,
    EngineOverloadedError,
    InvalidRequestError,
)


def test_the_error_body_has_openais_shape() -> None:
    error = ApiError(400, "n: bad", param="n", code="invalid_value")
    assert error.body() == {
        "error": {
            "message": "n: bad",
            "type": "invalid_request_error",
            "param": "n",
            "code": "invalid_value",
        }
    }
    response = error.response()
    assert response.status == 400
    assert response.content_type == "application/json"


def test_a_missing_adapter_is_404_and_an_unusable_one_400() -> None:
    missing = adapter_error(AdapterNotFoundError("alpha"), "model")
    assert (missing.status, missing.param, missing.code) == (404, "model", "model_not_found")
    assert adapter_error(AdapterNotFoundError("alpha"), "lora_path").code == "adapter_not_found"
    unusable = AdapterNotFoundError("alpha", "bad name")
    unusable.field = "name"  # type: ignore[attr-defined]
    named = adapter_error(unusable, "lora_path")
    assert (named.status, named.param, named.code) == (400, "lora_name", "invalid_adapter")
    assert adapter_error(unusable, "model").param == "model"


@pytest.mark.parametrize(
    ("exc", "status", "param", "code"),
    [
        (AdapterNotFoundError("alpha"), 404, "model", "model_not_found"),
        (InvalidRequestError("prompt_token_ids", "too long"), 400, "prompt", "invalid_value"),
        (InvalidRequestError("top_k", "too big"), 400, "top_k", "invalid_value"),
        (EngineOverloadedError("full"), 429, None, "engine_overloaded"),
        (EngineError("boom"), 500, None, "engine_error"),
    ],
)
def test_engine_errors_as_answers(
    exc: Exception, status: int, param: str | None, code: str
) -> None:
    error = engine_error_as_api_error(exc, retry_after_s=3)
    assert (error.status, error.param, error.code) == (status, param, code)
    if status == 429:
        assert error.headers == {"Retry-After": "3"}


def test_failed_finish_reasons() -> None:
    now = time.monotonic()
    assert finish_reason_error("cancelled", now - 1, 1).status == 504
    cancelled = finish_reason_error("cancelled", now + 100, 2)
    assert (cancelled.status, cancelled.code, cancelled.headers) == (
        503,
        "cancelled",
        {"Retry-After": "2"},
    )
    assert finish_reason_error("error", now + 100, 1).status == 500


@pytest.mark.parametrize(
    ("headers", "status"),
    [
        ({}, 401),
        ({"Authorization": "Basic s3cret"}, 401),
        ({"x-admin-token": "wrong"}, 403),
        ({"Authorization": "Bearer wrong"}, 403),
    ],
)
def test_the_admin_token_is_required(headers: dict[str, str], status: int) -> None:
    with pytest.raises(ApiError) as caught:
        check_admin_token(headers, "s3cret")
    assert caught.value.status == status


def test_the_admin_token_passes() -> None:
    check_admin_token({"x-admin-token": "s3cret"}, "s3cret")
    check_admin_token({"Authorization": "bearer s3cret "}, "s3cret")
    check_admin_token({}, None)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"error_rate": 0.5}, "adapter"),
        ({"adapter": "", "error_rate": 0.5}, "adapter"),
        ({"adapter": "a\x00", "error_rate": 0.5}, "adapter"),
        ({"adapter": "alpha"}, "error_rate"),
        ({"adapter": "alpha", "error_rate": True}, "error_rate"),
        ({"adapter": "alpha", "error_rate": 1.5}, "error_rate"),
    ],
)
def test_a_bad_fault_setting_names_its_field(body: dict[str, Any], param: str) -> None:
    with pytest.raises(ApiError) as caught:
        set_fault_rate(FaultTable(), body)
    assert (caught.value.status, caught.value.param) == (400, param)


def test_a_fault_setting_applies() -> None:
    faults = FaultTable()
    set_fault_rate(faults, {"adapter": "alpha", "error_rate": 1})
    assert faults.rates() == {"alpha": 1.0}
    set_fault_rate(faults, {"adapter": "alpha", "error_rate": 0})
    assert faults.rates() == {}
