"""A stalled adapter store (a proxy in front of a real moto S3 server that accepts connections
and never answers): a request for an adapter only that store holds gets 503
``adapter_load_timeout`` with Retry-After after the worker's ``adapter_load_wait_s``, the load
goes on (not cancelled for the others), other adapters and the event loop are unaffected, and
the adapter loads once the store answers again."""

from __future__ import annotations

import asyncio
import math
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from moto.server import ThreadedMotoServer

from adaptermesh.worker.adapter_stores import AdapterStores
from adaptermesh.worker.cli import build_parser, build_stores
from adaptermesh.worker.engine_config import EngineConfig, validate_config
from adaptermesh.worker.http_errors import adapter_error
from adaptermesh.worker.service import ServiceConfig, WorkerService, serve
from adaptermesh.worker.types import AdapterLoadTimeoutError, InvalidRequestError
from adaptermesh_testkit.stallproxy import StallProxy

from .conftest import PROMPTS, Tiny, collect, request

CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}
LOAD_WAIT_S = 1.5
STORE_TIMEOUT_S = 2.0


@pytest.fixture(scope="module")
def moto_port() -> Iterator[int]:
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        yield int(server.get_host_and_port()[1])
    finally:
        server.stop()


@pytest.fixture
def proxy(moto_port: int) -> Iterator[StallProxy]:
    with StallProxy(("127.0.0.1", moto_port)) as p:
        yield p


@pytest.fixture
def bucket(moto_port: int, tiny: Tiny) -> str:
    s3 = boto3.client(
        "s3",
        endpoint_url=f"http://127.0.0.1:{moto_port}",
        region_name="us-east-1",
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
    )
    name = f"stall-{uuid.uuid4().hex[:12]}"
    s3.create_bucket(Bucket=name)
    for file in sorted((tiny.root / "alpha").iterdir()):
        s3.put_object(Bucket=name, Key=f"lib/remote/{file.name}", Body=file.read_bytes())
    return name


async def test_stalled_store_gives_503_with_retry_after_and_recovers(
    tiny: Tiny,
    make_engine: Any,
    proxy: StallProxy,
    bucket: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for key, value in CREDENTIALS.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    eng = make_engine(adapter_load_wait_s=LOAD_WAIT_S)
    # The worker's own client (its timeouts), not a test double.
    eng.adapters.stores = AdapterStores(
        tmp_path / "cache",
        endpoint_url=proxy.url,
        resolvers=[f"s3://{bucket}/lib"],
        timeout_s=STORE_TIMEOUT_S,
    )
    proxy.stall()
    # One admission slot: a request waiting on the stalled load must not hold it.
    service = WorkerService(eng, ServiceConfig(retry_after_s=3, max_running=1))
    runner, port = await serve(service, "127.0.0.1", 0)
    body = {"prompt": PROMPTS[1], "max_tokens": 6, "temperature": 0}
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:

            async def timed(model: str) -> tuple[httpx.Response, float]:
                t0 = time.monotonic()
                r = await client.post("/v1/completions", json={**body, "model": model})
                return r, time.monotonic() - t0

            stalled_task = asyncio.create_task(timed("remote"))
            await asyncio.sleep(0.3)
            # While the load hangs: the event loop answers at once, other adapters serve.
            t0 = time.monotonic()
            health = await client.get("/health")
            health_s = time.monotonic() - t0
            other, other_s = await timed("alpha")
            stalled, stalled_s = await stalled_task
            assert health.status_code == 200
            assert health_s < 0.5
            assert other.status_code == 200, other.text
            assert other_s < LOAD_WAIT_S
            assert stalled.status_code == 503, stalled.text
            error = stalled.json()["error"]
            assert error["code"] == "adapter_load_timeout"
            assert "remote" in error["message"]
            assert "stalled" in error["message"]
            assert stalled.headers["retry-after"] == "3"
            assert LOAD_WAIT_S <= stalled_s < LOAD_WAIT_S + 1.0
            assert proxy.held >= 1
            # The load was not cancelled with the request that gave up on it.
            assert "remote" in eng.adapters.inflight
            assert eng.scheduler.load_wait_timeouts == 1

            # The store answers again: the adapter loads (the frozen attempt times out after
            # STORE_TIMEOUT_S and boto3 retries on a new connection, which is forwarded).
            proxy.forward()
            deadline = time.monotonic() + 30
            statuses = []
            while time.monotonic() < deadline:
                r, _ = await timed("remote")
                statuses.append(r.status_code)
                if r.status_code == 200:
                    break
                assert r.status_code == 503, r.text
                await asyncio.sleep(0.5)
            assert statuses[-1] == 200, statuses
            assert eng.adapters.is_resident("remote")
            assert proxy.forwarded >= 1
    finally:
        await runner.cleanup()


async def test_load_wait_unbounded_waits_for_the_load(
    tiny: Tiny, make_engine: Any, proxy: StallProxy, bucket: str, tmp_path: Path, monkeypatch: Any
) -> None:
    """Without the bound (None) a request waits on the load as long as it runs: the bound is
    what answers 503, not the store timeout."""
    for key, value in CREDENTIALS.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    eng = make_engine(adapter_load_wait_s=None)
    eng.adapters.stores = AdapterStores(
        tmp_path / "cache", endpoint_url=proxy.url, resolvers=[f"s3://{bucket}/lib"], timeout_s=1
    )
    proxy.stall()
    task = asyncio.create_task(
        collect(eng.submit(request("u", tiny.encode(PROMPTS[1]), "remote", max_tokens=2)))
    )
    await asyncio.sleep(LOAD_WAIT_S + 0.5)
    assert not task.done()  # still waiting
    proxy.forward()
    events = await asyncio.wait_for(task, 30)
    assert events
    assert events[-1].finish_reason is not None


async def test_submitted_request_waiting_on_a_stalled_load_fails_after_the_bound(
    tiny: Tiny, make_engine: Any, proxy: StallProxy, bucket: str, tmp_path: Path, monkeypatch: Any
) -> None:
    """A request submitted to the engine directly (no HTTP pre-wait) waiting on the load:
    the scheduler fails it with AdapterLoadTimeoutError after the bound; the load goes on."""
    for key, value in CREDENTIALS.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    eng = make_engine(adapter_load_wait_s=LOAD_WAIT_S)
    eng.adapters.stores = AdapterStores(
        tmp_path / "cache", endpoint_url=proxy.url, resolvers=[f"s3://{bucket}/lib"], timeout_s=5
    )
    proxy.stall()
    t0 = time.monotonic()
    with pytest.raises(AdapterLoadTimeoutError):
        await asyncio.wait_for(
            collect(eng.submit(request("s", tiny.encode(PROMPTS[1]), "remote", max_tokens=2))),
            LOAD_WAIT_S + 5,
        )
    assert LOAD_WAIT_S <= time.monotonic() - t0 < LOAD_WAIT_S + 1.0
    assert "remote" in eng.adapters.inflight
    proxy.forward()


def test_adapter_error_of_a_load_timeout_is_503_with_retry_after() -> None:
    api = adapter_error(AdapterLoadTimeoutError("x", 2.0), "model", 7)
    assert api.status == 503
    assert api.code == "adapter_load_timeout"
    assert api.headers is not None
    assert api.headers["Retry-After"] == "7"


def test_store_and_load_wait_flags() -> None:
    base = ["--model", "m", "--adapter-root", "r"]
    args = build_parser().parse_args(base)
    assert args.adapter_load_wait == 30.0
    assert args.adapter_store_timeout == 10.0
    args = build_parser().parse_args(
        [*base, "--adapter-load-wait", "4", "--adapter-store-timeout", "2.5"]
    )
    assert args.adapter_load_wait == 4.0
    assert build_stores(args).timeout_s == 2.5
    assert build_stores(args)._default_client().meta.config.read_timeout == 2.5
    helptext = build_parser().format_help()
    assert "--adapter-load-wait" in helptext
    assert "--adapter-store-timeout" in helptext


@settings(max_examples=60, deadline=None)
@given(
    st.one_of(
        st.floats(max_value=0.0),
        st.just(math.inf),
        st.just(math.nan),
        st.text(max_size=8).filter(lambda t: _not_positive_number(t)),
    )
)
def test_load_wait_and_store_timeout_refuse_non_positive_values(value: Any) -> None:
    base = ["--model", "m", "--adapter-root", "r"]
    for flag in ("--adapter-load-wait", "--adapter-store-timeout"):
        with pytest.raises(SystemExit):
            build_parser().parse_args([*base, flag, str(value)])
    if isinstance(value, float):
        with pytest.raises(InvalidRequestError) as info:
            validate_config(EngineConfig(adapter_load_wait_s=value))
        assert info.value.field == "adapter_load_wait_s"


def _not_positive_number(text: str) -> bool:
    try:
        number = float(text)
    except ValueError:
        return True
    return not (math.isfinite(number) and number > 0)
