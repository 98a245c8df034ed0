"""The bridge's request store and its HTTP client, without a broker."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from adaptermesh.backoff import Backoff
from adaptermesh.bridge.mesh import MeshClient
from adaptermesh.bridge.protocol import Request
from adaptermesh.bridge.store import SCHEMA_VERSION, Store


def _req(i: str, prompt: str = "p") -> Request:
    return Request(
        i,
        "replies/t",
        "completions",
        {"model": "m", "prompt": prompt},
        correlation={"c": i},
        correlation_data=b"\x00" + i.encode(),
    )


def test_store_moves_accepted_done_published_and_survives_reopen(tmp_path: Path) -> None:
    path = tmp_path / "s.sqlite3"
    store = Store(path)
    first = store.accept(_req("a"), 1.0)
    assert first.state == "accepted"
    assert store.accept(_req("a", prompt="other"), 2.0).digest == first.digest  # first one kept
    assert store.complete("a", b"answer", 3.0)
    assert not store.complete("a", b"second answer", 4.0)  # the first answer stays
    store.close()
    store = Store(path)
    (row,) = store.unpublished()
    assert row.answer == b"answer"
    assert row.request == _req("a")
    store.mark_published("a", 5.0)
    assert store.unpublished() == []
    assert store.counts() == {"accepted": 0, "done_unpublished": 0, "published": 1}
    assert store.prune(before=3.5) == 1
    assert store.get("a") is None
    store.close()


def test_store_refuses_a_newer_schema(tmp_path: Path) -> None:
    path = tmp_path / "s.sqlite3"
    Store(path).close()
    db = sqlite3.connect(path)
    db.execute(f"PRAGMA user_version={SCHEMA_VERSION + 1}")
    db.close()
    with pytest.raises(RuntimeError, match="newer"):
        Store(path)


@settings(deadline=None)  # each example creates and fsyncs a database
@given(ids=st.lists(st.text(min_size=1, max_size=5), min_size=1, max_size=20))
def test_unfinished_holds_each_accepted_id_once(tmp_path_factory: Any, ids: list[str]) -> None:
    store = Store(tmp_path_factory.mktemp("s") / "s.sqlite3", synchronous="NORMAL")
    for n, i in enumerate(ids):
        store.accept(_req(i), float(n))
    assert sorted(r.request.id for r in store.unfinished()) == sorted(set(ids))
    store.close()


class _Sleeps:
    def __init__(self) -> None:
        self.delays: list[float] = []

    async def __call__(self, delay: float) -> None:
        self.delays.append(delay)


async def test_mesh_client_retries_busy_answers_then_gives_up() -> None:
    statuses = iter([503, 429, 200])
    seen: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.url.path)
        status = next(statuses)
        if status == 200:
            return httpx.Response(200, json={"choices": []})
        return httpx.Response(status, headers={"Retry-After": "3"}, json={"error": {}})

    sleeps = _Sleeps()
    mesh = MeshClient(
        "http://mesh/",
        max_attempts=5,
        sleep=sleeps,
        backoff=lambda: Backoff(initial=0.1, maximum=2.0, jitter=0),
        transport=httpx.MockTransport(handler),
    )
    result = await mesh.submit("chat.completions", {"model": "m"})
    assert result.ok
    assert result.attempts == 3
    assert seen == ["/v1/chat/completions"] * 3
    assert sleeps.delays == [2.0, 2.0]  # Retry-After 3 s, capped at the backoff maximum
    await mesh.aclose()

    def down(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    mesh = MeshClient(
        "http://mesh", max_attempts=3, sleep=_Sleeps(), transport=httpx.MockTransport(down)
    )
    result = await mesh.submit("completions", {})
    assert result.unavailable
    assert result.status == 503
    assert result.attempts == 3
    assert "ConnectError" in result.error
    await mesh.aclose()


async def test_mesh_client_passes_final_errors_through() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        if b"bad" in request.content:
            return httpx.Response(400, json={"error": {"param": "prompt"}})
        return httpx.Response(200, text="not json")

    mesh = MeshClient("http://mesh", sleep=_Sleeps(), transport=httpx.MockTransport(handler))
    bad = await mesh.submit("completions", {"prompt": "bad"})
    assert (bad.status, bad.attempts, bad.body) == (400, 1, {"error": {"param": "prompt"}})
    odd = await mesh.submit("completions", {"prompt": "ok"})
    assert odd.status == 502
    assert not odd.ok
    await mesh.aclose()
