"""Adapter by body: the agent's ext_proc server in front of real Envoys.

Shard mode: the openai client, given only the listener's base_url and model="<adapter>",
reaches a worker that holds the adapter (streaming and not); base-model requests carry no
adapter header; the processor down, an unparsable body or a body past the limit all still
reach the shard (fail open). GIE mode: an Envoy set up as GIE documents (ext_proc in full
duplex, ORIGINAL_DST on x-gateway-destination-endpoint) sends each request to the endpoint the
picker chose, which scores residency, queue and KV cache from the workers' /metrics.
"""

from __future__ import annotations

import asyncio
import dataclasses
import http.client
import json
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import openai
import pytest

sys.path.insert(0, str(Path(__file__).parent))

from conftest import TEST_OPTIONS
from extproc_support import LOOPBACK, FakeWorker, gie_bootstrap, vllm_metrics
from mesh_support import free_port, wait_until

from adaptermesh.agent.extproc import ExtProcConfig, ExtProcServer, MetricsPoller
from adaptermesh.agent.picker import Decision, EndpointBook, EndpointLoad, decide, model_of
from adaptermesh.mesh.bootstrap import EnvoyProcess, build_bootstrap
from adaptermesh.mesh.cache import SnapshotCache
from adaptermesh.mesh.server import XdsServer
from adaptermesh.mesh.snapshot import ExtProcOptions, build_snapshot
from adaptermesh.proto import assignment_pb2 as ap

BASE = "base-7b"

# -- pure parts ---------------------------------------------------------------------------


def test_model_of_reads_only_a_top_level_string_model() -> None:
    assert model_of(b'{"model": "sql", "prompt": "x"}') == "sql"
    assert model_of(b'{"messages": [], "model": "chat"}') == "chat"
    for body in (
        b"",
        b"not json",
        b'["model"]',
        b'{"model": 3}',
        b'{"model": ""}',
        b'{"prompt": {"model": "x"}}',
        b'{"model": "sql"',
        b"\xff\xfe",
    ):
        assert model_of(body) is None, body


def _load(port: int, **kw: object) -> EndpointLoad:
    return EndpointLoad(LOOPBACK, port, **kw)  # type: ignore[arg-type]


def test_decide_prefers_residency_then_queue_then_kv() -> None:
    idle = _load(1, waiting=0.0, kv_cache_usage=0.1, max_lora=4)
    holder = _load(2, resident=frozenset({"sql"}), waiting=3.0, kv_cache_usage=0.5)
    running = _load(
        3,
        resident=frozenset({"sql"}),
        running_adapters=frozenset({"sql"}),
        waiting=3.0,
        kv_cache_usage=0.5,
    )
    assert decide("sql", BASE, [idle, holder, running]).endpoints == (running.key,)
    assert decide("sql", BASE, [idle, holder]).endpoints == (holder.key,)
    # Base model: residency is equal everywhere, so the idle worker wins.
    base = decide(BASE, BASE, [holder, idle])
    assert base.adapter is None
    assert base.endpoints == (idle.key,)
    busy_kv = _load(4, waiting=0.0, kv_cache_usage=0.9)
    assert decide(None, BASE, [busy_kv, idle]).endpoints == (idle.key,)


def test_decide_follows_gie_failure_semantics() -> None:
    a, b = _load(1), _load(2)
    assert decide("sql", BASE, [a, b], subset=[b.key]).endpoints == (b.key,)
    empty = decide("sql", BASE, [a, b], subset=[])
    assert empty.status == 503
    assert not empty.endpoints
    assert decide("sql", BASE, [a], subset=["10.0.0.9:8000"]).status == 503
    assert decide("sql", BASE, [], must_pick=True).status == 503
    # A shard listener without candidates forwards (fail open) with the adapter header.
    open_ = decide("sql", BASE, [])
    assert open_.status is None
    assert open_.adapter == "sql"
    assert not open_.endpoints
    assert decide("sql", BASE, [a, b], fallbacks=1).endpoints == (a.key, b.key)


def test_ties_rotate_and_pending_picks_spread_a_burst() -> None:
    book = EndpointBook()
    book.set_endpoints("s", [(LOOPBACK, 1), (LOOPBACK, 2), (LOOPBACK, 3)])
    picks = []
    for _ in range(6):
        d = decide("sql", BASE, book.candidates("s"), rotation=book.rotation)
        book.note_pick(d.endpoints[0])
        picks.append(d.endpoints[0])
    assert sorted(picks) == sorted([f"{LOOPBACK}:{p}" for p in (1, 2, 3)] * 2)


def test_book_follows_the_assignment() -> None:
    book = EndpointBook()
    book.set_assignment(
        ap.Assignment(
            version=1,
            shards=[
                ap.Shard(
                    id="a",
                    endpoints=[
                        ap.Endpoint(address="10.0.0.1", port=8000, weight=1, adapters=["sql"]),
                        ap.Endpoint(address="10.0.0.2", port=8000, weight=1, draining=True),
                    ],
                ),
                ap.Shard(
                    id="b",
                    state=ap.SHARD_STATE_DRAINING,
                    endpoints=[ap.Endpoint(address="10.0.0.3", port=8000, weight=1)],
                ),
                ap.Shard(id="c", endpoints=[ap.Endpoint(address="fd00::1", port=80, weight=1)]),
            ],
        )
    )
    assert [c.key for c in book.candidates("a")] == ["10.0.0.1:8000"]
    assert book.candidates("a")[0].resident == {"sql"}
    assert book.candidates("b") == []
    assert [c.key for c in book.candidates(None)] == ["10.0.0.1:8000", "[fd00::1]:80"]


# -- shard mode: the listener's ext_proc filter ----------------------------------------------


@dataclasses.dataclass
class Mesh:
    workers: list[FakeWorker]
    processor: ExtProcServer
    envoy: EnvoyProcess
    port: int
    decisions: list[Decision]

    @property
    def base_url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}/v1"


def _shard_assignment(port: int, workers: list[FakeWorker]) -> ap.Assignment:
    adapters = [("sql",), ("chat",), ()]
    return ap.Assignment(
        version=1,
        reason="test",
        shards=[
            ap.Shard(
                id="s0",
                index=0,
                weight=10_000,
                state=ap.SHARD_STATE_ACTIVE,
                service_address=LOOPBACK,
                service_port=port,
                endpoints=[
                    ap.Endpoint(address=LOOPBACK, port=w.port, weight=1, adapters=list(a))
                    for w, a in zip(workers, adapters, strict=True)
                ],
            )
        ],
    )


@pytest.fixture(params=["ext_proc"])
def mesh(request: pytest.FixtureRequest) -> Iterator[Mesh]:
    native = request.param == "native"
    workers = [FakeWorker(f"w{i}") for i in range(3)]
    book = EndpointBook()
    decisions: list[Decision] = []
    processor = ExtProcServer(
        book, ExtProcConfig(base_model=BASE, max_body_bytes=64 * 1024), on_decision=decisions.append
    )
    ext_port = processor.start()
    options = dataclasses.replace(
        TEST_OPTIONS,
        route_by_body=native,
        ext_proc=None if native else ExtProcOptions(max_body_bytes=64 * 1024),
    )
    cache = SnapshotCache(options=options)
    xds = XdsServer(cache)
    xds_port = xds.start()
    port = free_port()
    assignment = _shard_assignment(port, workers)
    book.set_assignment(assignment)
    cache.set_assignment("node-x", assignment)
    envoy = EnvoyProcess(
        build_bootstrap(
            "node-x",
            xds_port,
            ext_proc_port=None if native else ext_port,
            initial_fetch_timeout_s=5.0,
        )
    )
    try:
        envoy.start(ready_timeout=20.0)
        state = Mesh(workers, processor, envoy, port, decisions)
        _wait_all_healthy(state)
        yield state
    finally:
        envoy.cleanup()
        xds.stop(grace=0.1)
        processor.stop()
        for w in workers:
            w.close()


def _post(port: int, body: bytes, headers: dict[str, str] | None = None) -> dict[str, str]:
    conn = http.client.HTTPConnection(LOOPBACK, port, timeout=10)
    try:
        conn.request(
            "POST",
            "/v1/completions",
            body=body,
            headers={"content-type": "application/json", **(headers or {})},
        )
        resp = conn.getresponse()
        data = resp.read()
        assert resp.status == 200, (resp.status, data[:300])
        text = json.loads(data)["choices"][0]["text"]
        worker, adapter = text.split("|")
        return {"worker": worker, "adapter": adapter}
    finally:
        conn.close()


def _wait_all_healthy(m: Mesh) -> None:
    names = {w.name for w in m.workers}

    def reached() -> bool:
        got = {_post(m.port, b'{"model": "' + BASE.encode() + b'"}')["worker"] for _ in range(12)}
        return got >= names

    wait_until(reached, 15, what="every worker routable", interval=0.1)


def test_snapshot_puts_ext_proc_before_the_router() -> None:
    options = dataclasses.replace(TEST_OPTIONS, ext_proc=ExtProcOptions(max_body_bytes=4096))
    worker_port = 9
    snap = build_snapshot(
        ap.Assignment(
            version=1,
            shards=[
                ap.Shard(
                    id="s0",
                    index=0,
                    weight=10_000,
                    state=ap.SHARD_STATE_ACTIVE,
                    service_address=LOOPBACK,
                    service_port=8080,  # built, never bound
                    endpoints=[
                        ap.Endpoint(address=LOOPBACK, port=worker_port, weight=1, adapters=["sql"])
                    ],
                )
            ],
        ),
        options=options,
    )
    from envoy.extensions.filters.network.http_connection_manager.v3 import (
        http_connection_manager_pb2 as hcm_pb2,
    )
    from google.protobuf import json_format

    listener = next(
        iter(snap.resources["type.googleapis.com/envoy.config.listener.v3.Listener"].values())
    )
    manager = hcm_pb2.HttpConnectionManager()
    listener.filter_chains[0].filters[0].typed_config.Unpack(manager)  # type: ignore[attr-defined]
    names = [f.name for f in manager.http_filters]
    assert names == ["envoy.filters.http.ext_proc", "envoy.filters.http.router"]
    assert listener.per_connection_buffer_limit_bytes.value == 4096  # type: ignore[attr-defined]
    dumped = json_format.MessageToDict(manager.http_filters[0])
    assert dumped["typedConfig"]["failureModeAllow"] is True


def _openai_reaches_holders(mesh: Mesh, header: bool) -> None:
    client = openai.OpenAI(base_url=mesh.base_url, api_key="unused", max_retries=0)
    holders = {"sql": "w0", "chat": "w1"}
    for adapter, holder in holders.items():
        # The ext_proc path also sets the adapter header; the native path only routes.
        want = f"{holder}|{adapter if header else None}"
        for _ in range(15):
            done = client.completions.create(model=adapter, prompt="hi", max_tokens=4)
            assert done.choices[0].text == want
            stream = client.completions.create(
                model=adapter, prompt="hi", max_tokens=4, stream=True
            )
            assert "".join(c.choices[0].text for c in stream) == want
            chat = client.chat.completions.create(
                model=adapter, messages=[{"role": "user", "content": "hi"}]
            )
            assert chat.choices[0].message.content == want
            chunks = client.chat.completions.create(
                model=adapter, messages=[{"role": "user", "content": "hi"}], stream=True
            )
            assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    # The base model spreads over the whole shard and carries no adapter header.
    seen = {client.completions.create(model=BASE, prompt="hi").choices[0].text for _ in range(12)}
    assert seen == {"w0|None", "w1|None", "w2|None"}


@pytest.mark.slow
def test_openai_client_reaches_a_holder_by_model_alone(mesh: Mesh) -> None:
    _openai_reaches_holders(mesh, header=True)
    assert all(d.status is None for d in mesh.decisions)


@pytest.mark.slow
@pytest.mark.parametrize("mesh", ["native"], indirect=True)
def test_native_body_routing_reaches_a_holder_without_a_processor(mesh: Mesh) -> None:
    mesh.processor.stop()  # not in the path at all
    _openai_reaches_holders(mesh, header=False)
    assert mesh.decisions == []


@pytest.mark.slow
def test_body_decides_over_a_clients_adapter_header(mesh: Mesh) -> None:
    got = _post(mesh.port, b'{"model": "sql"}', {"x-adapter-id": "chat"})
    assert got == {"worker": "w0", "adapter": "sql"}
    got = _post(mesh.port, json.dumps({"model": BASE}).encode(), {"x-adapter-id": "chat"})
    assert got["adapter"] == "None"


@pytest.mark.slow
def test_fail_open_unparsable_oversized_and_processor_down(mesh: Mesh) -> None:
    names = {w.name for w in mesh.workers}
    # Not JSON: forwarded without the header, to the whole shard.
    seen = {_post(mesh.port, b"{not json")["worker"] for _ in range(12)}
    assert seen == names
    # Past max_body_bytes (64 KiB here): Envoy refuses it before the processor sees it.
    big = json.dumps({"prompt": "x" * (200 * 1024), "model": "sql"}).encode()
    status, _ = _raw_post(mesh.port, big)
    assert status == 413
    # Just under the limit: read, routed by its model.
    fits = json.dumps({"prompt": "x" * (60 * 1024), "model": "sql"}).encode()
    assert _post(mesh.port, fits) == {"worker": "w0", "adapter": "sql"}
    # Processor down: failure_mode_allow lets requests through unchanged.
    mesh.processor.stop()
    seen = {_post(mesh.port, b'{"model": "sql"}')["worker"] for _ in range(12)}
    assert seen == names
    assert mesh.envoy.stats("ext_proc").get("http.shard_s0.ext_proc.failure_mode_allowed", 0) > 0


# -- GIE mode: the endpoint-picker protocol --------------------------------------------------


@dataclasses.dataclass
class Gateway:
    workers: list[FakeWorker]
    book: EndpointBook
    processor: ExtProcServer
    decisions: list[Decision]
    start: Callable[..., tuple[EnvoyProcess, int, Path]]


@pytest.fixture
def gateway(tmp_path: Path) -> Iterator[Gateway]:
    workers = [
        # Busy, and without the adapter.
        FakeWorker("w0", vllm_metrics(waiting=6, kv=0.9)),
        # Idle-ish and running the adapter "sql".
        FakeWorker("w1", vllm_metrics(waiting=1, kv=0.3, running_adapters="sql")),
        # Idle, no adapter.
        FakeWorker("w2", vllm_metrics(waiting=0, kv=0.1)),
    ]
    book = EndpointBook()
    book.set_endpoints("pool", [(LOOPBACK, w.port) for w in workers])
    decisions: list[Decision] = []
    processor = ExtProcServer(book, ExtProcConfig(base_model=BASE), on_decision=decisions.append)
    ext_port = processor.start()
    envoys: list[EnvoyProcess] = []

    def start(subset: list[str] | None = None) -> tuple[EnvoyProcess, int, Path]:
        port = free_port()
        log = tmp_path / f"access-{len(envoys)}.log"
        envoy = EnvoyProcess(gie_bootstrap(port, ext_port, str(log), subset=subset))
        envoys.append(envoy)
        envoy.start(ready_timeout=20.0)
        return envoy, port, log

    try:
        yield Gateway(workers, book, processor, decisions, start)
    finally:
        for e in envoys:
            e.cleanup()
        processor.stop()
        for w in workers:
            w.close()


async def _scrape(book: EndpointBook) -> None:
    async with httpx.AsyncClient() as client:
        await MetricsPoller(book).step(client)


def _log_lines(log: Path, n: int) -> list[dict[str, str]]:
    wait_until(
        lambda: log.exists() and len(log.read_text().splitlines()) >= n, 10, what="access log lines"
    )
    return [json.loads(line) for line in log.read_text().splitlines()]


@pytest.mark.slow
def test_gie_request_reaches_the_endpoint_the_picker_chose(gateway: Gateway) -> None:
    asyncio.run(_scrape(gateway.book))
    _, port, log = gateway.start()
    client = openai.OpenAI(base_url=f"http://{LOOPBACK}:{port}/v1", api_key="unused", max_retries=0)
    by_key = {w.key: w for w in gateway.workers}
    # The adapter's running worker wins despite a queue of one.
    assert client.completions.create(model="sql", prompt="hi").choices[0].text == "w1|sql"
    stream = client.completions.create(model="sql", prompt="hi", stream=True)
    assert "".join(c.choices[0].text for c in stream) == "w1|sql"
    # The base model goes to the idlest worker.
    assert client.completions.create(model=BASE, prompt="hi").choices[0].text == "w2|None"
    picks = [d.endpoints[0] for d in gateway.decisions]
    assert picks == [gateway.workers[1].key, gateway.workers[1].key, gateway.workers[2].key]
    # Header and dynamic metadata carry the same pick, and Envoy went there.
    lines = _log_lines(log, 3)
    assert [(line["code"], line["upstream"], line["picked"]) for line in lines] == [
        (200, pick, pick) for pick in picks
    ]
    for pick in picks:
        assert any(s["destination"] == pick for s in by_key[pick].seen)


@pytest.mark.slow
def test_gie_burst_between_scrapes_spreads_by_pending_picks(gateway: Gateway) -> None:
    asyncio.run(_scrape(gateway.book))
    _, port, _ = gateway.start()
    got = [_post(port, json.dumps({"model": BASE}).encode())["worker"] for _ in range(8)]
    # w2 (idle) first, but the picks it has taken since the scrape push later ones elsewhere.
    assert got[0] == "w2"
    assert len(set(got)) >= 2


@pytest.mark.slow
def test_gie_subset_hint_and_503s(gateway: Gateway) -> None:
    asyncio.run(_scrape(gateway.book))
    only_w0 = gateway.workers[0].key
    _, port, _ = gateway.start(subset=[only_w0])
    # The hint wins over the scores: only w0 is allowed.
    assert _post(port, b'{"model": "sql"}')["worker"] == "w0"
    _, bad_port, _ = gateway.start(subset=["10.255.0.1:8000"])
    status, body = _raw_post(bad_port, b'{"model": "sql"}')
    assert status == 503
    assert b"subset" in body
    gateway.book.set_endpoints("pool", [])
    _, empty_port, _ = gateway.start()
    assert _raw_post(empty_port, b'{"model": "sql"}')[0] == 503


@pytest.mark.slow
def test_gie_full_duplex_chunked_body_reaches_the_gpu_holder(gateway: Gateway) -> None:
    # w0 is busy but holds "code" in a GPU slot: the residency series make it beat the idle
    # w2, which would have to load it. The client sends the body in pieces with pauses, so
    # Envoy streams it to the processor in several chunks, each answered with its own streamed
    # body response.
    busy = gateway.workers[0]
    busy.metrics += (
        "# TYPE vllm:lora_adapter_loaded gauge\n"
        'vllm:lora_adapter_loaded{adapter_name="code",level="gpu",pinned="false",'
        'rank="8"} 1\n'
    )
    asyncio.run(_scrape(gateway.book))
    _, port, log = gateway.start()
    body = json.dumps({"prompt": "x" * 3000, "model": "code", "max_tokens": 4}).encode()
    pieces = [body[:7], body[7:1500], body[1500:2900], body[2900:]]
    conn = http.client.HTTPConnection(LOOPBACK, port, timeout=10)
    try:
        conn.putrequest("POST", "/v1/completions")
        conn.putheader("content-type", "application/json")
        conn.putheader("transfer-encoding", "chunked")
        conn.endheaders()
        for piece in pieces:
            conn.send(b"%x\r\n%s\r\n" % (len(piece), piece))
            time.sleep(0.05)
        conn.send(b"0\r\n\r\n")
        resp = conn.getresponse()
        assert resp.status == 200
        assert json.loads(resp.read())["choices"][0]["text"] == "w0|code"
    finally:
        conn.close()
    assert gateway.decisions[-1].endpoints == (busy.key,)
    seen = busy.seen[-1]
    # The worker got the whole body back from the processor's streamed answers, in order.
    assert (seen["model"], seen["body_bytes"], seen["adapter"]) == ("code", len(body), "code")
    assert _log_lines(log, 1)[-1]["picked"] == busy.key


def _raw_post(port: int, body: bytes) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection(LOOPBACK, port, timeout=10)
    try:
        conn.request(
            "POST", "/v1/completions", body=body, headers={"content-type": "application/json"}
        )
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def test_grpc_health_answers_the_picker_services() -> None:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    processor = ExtProcServer(EndpointBook())
    port = processor.start()
    try:
        with grpc.insecure_channel(f"{LOOPBACK}:{port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            for service in (
                "",
                "liveness",
                "readiness",
                "envoy.service.ext_proc.v3.ExternalProcessor",
            ):
                reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
                assert reply.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        processor.stop()


def test_readiness_waits_for_the_workers() -> None:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    processor = ExtProcServer(EndpointBook(), ready=False)
    port = processor.start()
    serving = health_pb2.HealthCheckResponse.SERVING

    def status(channel: grpc.Channel, service: str) -> int:
        stub = health_pb2_grpc.HealthStub(channel)
        return int(stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status)

    try:
        with grpc.insecure_channel(f"{LOOPBACK}:{port}") as channel:
            assert status(channel, "liveness") == serving
            assert status(channel, "readiness") == health_pb2.HealthCheckResponse.NOT_SERVING
            processor.set_ready(True)
            wait_until(lambda: status(channel, "readiness") == serving, 5, what="readiness")
            assert status(channel, "envoy.service.ext_proc.v3.ExternalProcessor") == serving
    finally:
        processor.stop()
