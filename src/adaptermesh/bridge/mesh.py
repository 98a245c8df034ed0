"""One request to the mesh's OpenAI-compatible HTTP entry, with bounded retries.

The mesh is an Envoy listener or a worker URL. Its answers split three ways:

- 2xx with a JSON body: the answer;
- 429, 502, 503, 504 and connection errors or timeouts: the mesh is busy or a hop is down,
  so the request is tried again after ``Backoff``'s delay (at least the mesh's ``Retry-After``,
  capped by the backoff maximum), ``max_attempts`` times in all;
- any other status: final, passed to the requester as an error with the mesh's own body.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import httpx

from adaptermesh.backoff import Backoff
from adaptermesh.bridge.protocol import ENDPOINTS

__all__ = ["RETRYABLE", "MeshClient", "MeshResult"]

log = logging.getLogger(__name__)

RETRYABLE = frozenset({429, 502, 503, 504})


@dataclass(frozen=True)
class MeshResult:
    """``status`` is the mesh's HTTP status, or 503 when every attempt failed to get one (then
    ``unavailable`` is set and ``error`` says why)."""

    status: int
    body: Any
    attempts: int
    unavailable: bool = False
    error: str = ""

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 300 and not self.unavailable


class MeshClient:
    def __init__(
        self,
        base_url: str,
        *,
        timeout: float = 300.0,
        max_attempts: int = 6,
        backoff: Callable[[], Backoff] = Backoff,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        max_connections: int = 64,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        if max_attempts < 1:
            raise ValueError("max_attempts must be at least 1")
        self.base_url = base_url.rstrip("/")
        self.max_attempts = max_attempts
        self._backoff = backoff
        self._sleep = sleep
        self._http = httpx.AsyncClient(
            timeout=timeout,
            limits=httpx.Limits(max_connections=max_connections),
            transport=transport,
        )

    async def aclose(self) -> None:
        await self._http.aclose()

    async def submit(self, endpoint: str, body: dict[str, Any]) -> MeshResult:
        url = self.base_url + ENDPOINTS[endpoint]
        backoff = self._backoff()
        why = ""
        for attempt in range(1, self.max_attempts + 1):
            retry_after = 0.0
            try:
                resp = await self._http.post(url, json=body)
            except httpx.TransportError as exc:  # connect, read, timeouts
                why = f"{type(exc).__name__}: {exc}"
            except httpx.HTTPError as exc:  # a broken answer: trying again would not mend it
                return MeshResult(502, None, attempt, error=f"{type(exc).__name__}: {exc}")
            else:
                if resp.status_code not in RETRYABLE:
                    return _result(resp, attempt)
                why = f"HTTP {resp.status_code}"
                retry_after = _retry_after(resp.headers.get("retry-after"))
            if attempt == self.max_attempts:
                break
            delay = min(max(backoff.next(), retry_after), backoff.maximum)
            log.info(
                "mesh %s (attempt %d/%d); retrying in %.2fs", why, attempt, self.max_attempts, delay
            )
            await self._sleep(delay)
        return MeshResult(
            503,
            None,
            self.max_attempts,
            unavailable=True,
            error=f"no answer after {self.max_attempts} attempts (last: {why})",
        )


def _retry_after(value: str | None) -> float:
    try:
        return max(0.0, float(value)) if value else 0.0
    except ValueError:  # an HTTP date: fall back to the backoff alone
        return 0.0


def _result(resp: httpx.Response, attempt: int) -> MeshResult:
    try:
        body: Any = resp.json()
    except ValueError:
        body = None
    if 200 <= resp.status_code < 300 and body is None:
        return MeshResult(502, None, attempt, error="the mesh answered without a JSON body")
    return MeshResult(resp.status_code, body if body is not None else resp.text[:2000], attempt)
