"""One HTTP client kept across the control plane's scrape rounds.

Building an ``httpx.AsyncClient`` loads the default certificate store into a new TLS context:
about 40 ms of CPU and over half a megabyte of short-lived C heap on each construction. The
rebalancer scrapes every interval and a running rollout every tick, so a client per round
churned the heap (its high-water mark rose with each rollout and stayed there) and opened a
new connection to every worker each time. :class:`KeptClient` builds the client once, on the
event loop that first asks for it, and hands the same one out until :meth:`aclose`; a caller
on another loop (a test's second ``asyncio.run``) gets a fresh one instead of a client bound
to a loop that has gone.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx

__all__ = ["KeptClient", "plain_http_client_options"]


def plain_http_client_options(concurrency: int, keepalive_s: float = 10.0) -> dict[str, Any]:
    """Options for a client that only speaks plain HTTP to workers: no proxy from the
    environment, no certificate store (``verify=False``: no TLS is ever negotiated), and a
    pool as wide as the scrape's concurrency. Idle connections close after ``keepalive_s``,
    below the workers' own keep-alive timeout (15 s by default), so the client rarely reuses
    one the worker is closing."""
    return {
        "trust_env": False,
        "verify": False,
        "limits": httpx.Limits(
            max_connections=concurrency,
            max_keepalive_connections=concurrency,
            keepalive_expiry=keepalive_s,
        ),
    }


class KeptClient:
    def __init__(self, **options: Any) -> None:
        self._options = options
        self._client: httpx.AsyncClient | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.built = 0  # clients constructed so far (one per event loop in practice)

    def get(self) -> httpx.AsyncClient:
        """The kept client, built on first use on the running loop."""
        loop = asyncio.get_running_loop()
        if self._client is None or self._client.is_closed or self._loop is not loop:
            self._client = httpx.AsyncClient(**self._options)
            self._loop = loop
            self.built += 1
        return self._client

    async def aclose(self) -> None:
        """Close the kept client if it belongs to the running loop; forget it either way."""
        client, loop = self._client, self._loop
        self._client = self._loop = None
        if client is not None and loop is asyncio.get_running_loop():
            await client.aclose()
