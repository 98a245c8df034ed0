"""Whether a rollout's target version can serve where the adapter's routes go.

A rollout to a version no worker can load would send its canary share to 404s until the
automatic rollback. Before one starts, the control plane asks the workers of every shard the
adapter's routes reach (the shards its AdapterInstance places it on, else every shard):

- a worker that reports the name resident (in the published Assignment or its latest scrape)
  finds it, without being asked;
- any other is asked ``GET /v1/models/{name}``: 200 means it finds it (loaded, under its
  adapter root, or in an adapter store), 404 ``model_not_found`` that it does not, anything
  else (no answer, an older worker without the endpoint) that it cannot tell.

:func:`refusing_shards` (pure) names the shards where some worker answered and none finds it;
a shard no worker could answer for is not held against the rollout.
"""

from __future__ import annotations

import asyncio
import urllib.parse
from collections.abc import Mapping, Sequence

import httpx

__all__ = ["Finds", "ask_worker", "refusing_shards"]

# True: the worker finds the name; False: it says it does not; None: it could not tell.
Finds = bool | None

ASK_TIMEOUT_S = 2.0


def refusing_shards(answers: Mapping[str, Sequence[Finds]]) -> list[str]:
    """Shards (sorted) where at least one worker answered and none finds the name."""
    return sorted(
        shard
        for shard, finds in answers.items()
        if any(f is not None for f in finds) and not any(f is True for f in finds)
    )


async def ask_worker(
    client: httpx.AsyncClient, address: str, port: int, name: str, timeout_s: float = ASK_TIMEOUT_S
) -> Finds:
    host = f"[{address}]" if ":" in address else address
    url = f"http://{host}:{port}/v1/models/{urllib.parse.quote(name, safe='@')}"
    try:
        r = await asyncio.wait_for(client.get(url), timeout_s)
    except (httpx.HTTPError, OSError, TimeoutError):
        return None
    if r.status_code == 200:
        return True
    if r.status_code == 404:
        try:
            code = r.json().get("error", {}).get("code")
        except ValueError:
            return None
        return False if code == "model_not_found" else None
    return None
