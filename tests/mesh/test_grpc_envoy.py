"""KServe v2 gRPC through a real Envoy: the worker's gRPC listener behind a shard listener
built by ``mesh/snapshot.py`` (HTTP/2 cluster ``shard-<id>-grpc``), with and without the
agent's ext_proc filter, driven by the real tritonclient gRPC client.

Tokens through Envoy equal the HTTP API's through the same Envoy, unary and streaming; an
error status crosses Envoy unchanged; HTTP keeps working beside gRPC on the same listener.
"""

from __future__ import annotations

import asyncio
import dataclasses
import queue
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import tritonclient.grpc as tc
from tritonclient.utils import InferenceServerException

sys.path.insert(0, str(Path(__file__).parent))

from conftest import TEST_OPTIONS
from mesh_support import LOOPBACK, free_port, wait_until
from worker_service.fakes import FakeEngine, expected_ids, expected_text

from adaptermesh.agent.extproc import ExtProcConfig, ExtProcServer
from adaptermesh.agent.picker import EndpointBook
from adaptermesh.mesh.bootstrap import EnvoyProcess, build_bootstrap
from adaptermesh.mesh.cache import SnapshotCache
from adaptermesh.mesh.server import XdsServer
from adaptermesh.mesh.snapshot import ExtProcOptions
from adaptermesh.proto import assignment_pb2 as ap
from adaptermesh.worker.grpc_v2 import GrpcV2Server
from adaptermesh.worker.service import ServiceConfig, WorkerService, serve

TIMEOUT = 20.0


class Worker:
    """A worker service with its gRPC listener around the fake engine, on a loop in a thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="worker", daemon=True)
        self.thread.start()

        async def start() -> tuple[FakeEngine, Any, GrpcV2Server, int, int]:
            engine = FakeEngine(token_delay=0.005)
            service = WorkerService(engine, ServiceConfig())
            runner, port = await serve(service, LOOPBACK, 0)
            grpc_server = GrpcV2Server(service)
            gport = await grpc_server.start(LOOPBACK, 0)
            return engine, runner, grpc_server, port, gport

        self.engine, self._runner, self._grpc, self.port, self.grpc_port = self.call(start())

    def call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(30)

    def close(self) -> None:
        self.call(self._grpc.stop())
        self.call(self._runner.cleanup())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@dataclasses.dataclass
class Mesh:
    worker: Worker
    envoy: EnvoyProcess
    port: int

    def grpc_requests(self) -> int:
        """Requests Envoy sent to the shard's gRPC cluster."""
        stats = httpx.get(
            f"{self.envoy.admin_url}/stats", params={"filter": "grpc"}, timeout=5
        ).text
        for line in stats.splitlines():
            if line.startswith("cluster.shard-s0-grpc.upstream_rq_total:"):
                return int(line.split(":")[1])
        return 0

    @property
    def grpc_url(self) -> str:
        return f"{LOOPBACK}:{self.port}"

    @property
    def http_url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"


@pytest.fixture(params=["plain", "ext_proc"])
def mesh(request: pytest.FixtureRequest) -> Iterator[Mesh]:
    worker = Worker()
    processor = None
    ext_port = None
    # The gRPC listener's port relative to the HTTP one (8001 - 8000 in a pod).
    options = dataclasses.replace(TEST_OPTIONS, grpc_port_offset=worker.grpc_port - worker.port)
    port = free_port()
    assignment = ap.Assignment(
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
                endpoints=[ap.Endpoint(address=LOOPBACK, port=worker.port, weight=1)],
            )
        ],
    )
    if request.param == "ext_proc":
        book = EndpointBook()
        book.set_assignment(assignment)
        processor = ExtProcServer(book, ExtProcConfig(base_model=FakeEngine.model_name))
        ext_port = processor.start()
        options = dataclasses.replace(options, ext_proc=ExtProcOptions())
    cache = SnapshotCache(options=options)
    xds = XdsServer(cache)
    xds_port = xds.start()
    cache.set_assignment("node-grpc", assignment)
    envoy = EnvoyProcess(
        build_bootstrap("node-grpc", xds_port, ext_proc_port=ext_port, initial_fetch_timeout_s=5.0)
    )
    try:
        envoy.start(ready_timeout=20.0)
        state = Mesh(worker, envoy, port)

        def routable() -> bool:
            try:
                client = tc.InferenceServerClient(state.grpc_url)
                try:
                    return bool(client.is_server_ready(client_timeout=2))
                finally:
                    client.close()
            except InferenceServerException:
                return False

        wait_until(routable, 15, what="the gRPC listener routable through Envoy", interval=0.1)
        yield state
    finally:
        envoy.cleanup()
        xds.stop(grace=0.1)
        if processor is not None:
            processor.stop()
        worker.close()


def text_inputs(prompt: str) -> list[tc.InferInput]:
    tensor = tc.InferInput("text_input", [1], "BYTES")
    tensor.set_data_from_numpy(np.array([prompt.encode()], dtype=np.object_))
    return [tensor]


def test_unary_tokens_through_envoy_equal_http(mesh: Mesh) -> None:
    client = tc.InferenceServerClient(mesh.grpc_url)
    try:
        assert client.is_server_live()
        assert client.get_model_metadata("tiny-base", as_json=True)["platform"] == "adaptermesh"
        for model, adapter in (("tiny-base", None), ("alpha", "alpha")):
            result = client.infer(
                model, text_inputs("one two"), parameters={"max_tokens": 6, "temperature": 0.0}
            )
            ids = [int(t) for t in result.as_numpy("token_ids")]
            text = result.as_numpy("text_output")[0].decode()
            prompt = FakeEngine().tokenize("one two")
            assert ids == expected_ids(prompt, adapter, 6)
            http = httpx.post(
                f"{mesh.http_url}/v1/completions",
                timeout=TIMEOUT,
                json={"model": model, "prompt": "one two", "max_tokens": 6, "temperature": 0},
            ).json()
            assert text == http["choices"][0]["text"] == expected_text(prompt, adapter, 6)
        with pytest.raises(InferenceServerException) as exc:
            client.infer("tiny-base", text_inputs("x"), parameters={"max_tokens": "lots"})
        assert exc.value.status() == "StatusCode.INVALID_ARGUMENT"
        assert "parameters[max_tokens]" in exc.value.message()
        with pytest.raises(InferenceServerException) as exc:
            client.get_model_metadata("nobody")
        assert exc.value.status() == "StatusCode.NOT_FOUND"
    finally:
        client.close()
    assert mesh.grpc_requests() >= 4  # the calls above went through the gRPC cluster


def test_streaming_through_envoy(mesh: Mesh) -> None:
    got: queue.Queue[tuple[Any, Any]] = queue.Queue()
    client = tc.InferenceServerClient(mesh.grpc_url)
    try:
        client.start_stream(callback=lambda result, error: got.put((result, error)))
        client.async_stream_infer(
            "alpha", text_inputs("a b"), request_id="s", parameters={"max_tokens": 5}
        )
        chunks = []
        while True:
            result, error = got.get(timeout=TIMEOUT)
            assert error is None, error
            chunks.append(result)
            if result.get_response().parameters["triton_final_response"].bool_param:
                break
        client.stop_stream()
    finally:
        client.close()
    prompt = FakeEngine().tokenize("a b")
    assert len(chunks) == 5
    assert [int(c.as_numpy("token_ids")[0]) for c in chunks] == expected_ids(prompt, "alpha", 5)
    assert "".join(c.as_numpy("text_output")[0].decode() for c in chunks) == expected_text(
        prompt, "alpha", 5
    )


def _assignment(port: int) -> ap.Assignment:
    return ap.Assignment(
        version=1,
        shards=[
            ap.Shard(
                id="s0",
                index=0,
                weight=10_000,
                state=ap.SHARD_STATE_ACTIVE,
                service_address=LOOPBACK,
                service_port=9000,
                endpoints=[ap.Endpoint(address=LOOPBACK, port=port, weight=1, adapters=["alpha"])],
            )
        ],
    )


def test_snapshot_grpc_cluster_and_routes() -> None:
    from adaptermesh.mesh.snapshot import (
        CLUSTER_TYPE,
        ENDPOINT_TYPE,
        GRPC_V2_PREFIX,
        ROUTE_TYPE,
        AssignmentError,
        BuildOptions,
        build_snapshot,
    )

    plain = build_snapshot(_assignment(8000))
    assert set(plain.resources[CLUSTER_TYPE]) == {"shard-s0"}
    snap = build_snapshot(_assignment(8000), options=BuildOptions(grpc_port_offset=1))
    assert set(snap.resources[CLUSTER_TYPE]) == {"shard-s0", "shard-s0-grpc"}
    cluster: Any = snap.resources[CLUSTER_TYPE]["shard-s0-grpc"]
    assert cluster.health_checks[0].HasField("grpc_health_check")
    eds: Any = snap.resources[ENDPOINT_TYPE]["shard-s0-grpc"]
    assert eds.endpoints[0].lb_endpoints[0].endpoint.address.socket_address.port_value == 8001
    routes: Any = snap.resources[ROUTE_TYPE]["shard-s0"]
    first = routes.virtual_hosts[0].routes
    assert [r.name for r in first[:2]] == ["grpc:alpha", "grpc"]
    assert all(r.match.prefix == GRPC_V2_PREFIX for r in first[:2])
    assert {r.route.cluster for r in first[:2]} == {"shard-s0-grpc"}
    with pytest.raises(AssignmentError) as exc:
        build_snapshot(_assignment(65535), options=BuildOptions(grpc_port_offset=1))
    assert exc.value.field == "shards[0].endpoints[0].port"
    with pytest.raises(ValueError, match="grpc_port_offset"):
        build_snapshot(_assignment(8000), options=BuildOptions(grpc_port_offset=0))
