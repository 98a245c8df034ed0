"""AdapterInstance protocols through a real Envoy to a worker (fake engine, real HTTP and
KServe v2 gRPC services): ``http-json`` by path, ``grpc`` by a service prefix of the client's
own, and ``grpc-json`` (JSON through Envoy's gRPC-JSON transcoder). Each answers the tokens
the HTTP API gives for the same greedy request; refused calls never reach the engine.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import json
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest

sys.path.insert(0, str(Path(__file__).parent))

from conftest import TEST_OPTIONS
from edge_tokens import ISSUER, JWKS, bearer, token
from mesh_support import LOOPBACK, free_port, wait_until
from worker_service.fakes import FakeEngine, expected_text

from adaptermesh.mesh.bootstrap import EnvoyProcess, build_bootstrap
from adaptermesh.mesh.cache import SnapshotCache
from adaptermesh.mesh.edge import EdgeAuthOptions
from adaptermesh.mesh.server import XdsServer
from adaptermesh.proto import assignment_pb2 as ap
from adaptermesh.proto.adaptermesh.v1 import open_inference_pb2 as pb
from adaptermesh.worker.grpc_v2 import GrpcV2Server
from adaptermesh.worker.service import ServiceConfig, WorkerService, serve

TIMEOUT = 20.0
PROMPT = "one two"
SCOPE = "risk:evaluate"


class Worker:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="worker", daemon=True)
        self.thread.start()

        async def start() -> tuple[FakeEngine, Any, GrpcV2Server, int, int]:
            engine = FakeEngine()
            engine.on_disk.update(e.name for e in EDGES)
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
    port: int

    def url(self, path: str) -> str:
        return f"http://{LOOPBACK}:{self.port}{path}"


EDGES = [
    ap.AdapterEdge(
        name="credit-risk-v2", protocol="http-json", paths=["/v1/evaluate"], scopes=[SCOPE]
    ),
    ap.AdapterEdge(name="risk-grpc", protocol="grpc", paths=["/credit.risk.v2.Inference/"]),
    ap.AdapterEdge(
        name="risk-json", protocol="grpc-json", paths=["/v1/score", "/v1/score2"], scopes=[SCOPE]
    ),
]


@pytest.fixture(scope="module")
def mesh() -> Iterator[Mesh]:
    worker = Worker()
    options = dataclasses.replace(
        TEST_OPTIONS,
        grpc_port_offset=worker.grpc_port - worker.port,
        edge_auth=EdgeAuthOptions(ISSUER, JWKS),
    )
    port = free_port()
    assignment = ap.Assignment(
        version=1,
        reason="test",
        adapters=EDGES,
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
    cache = SnapshotCache(options=options)
    xds = XdsServer(cache)
    xds_port = xds.start()
    cache.set_assignment("node-proto", assignment)
    envoy = EnvoyProcess(build_bootstrap("node-proto", xds_port, initial_fetch_timeout_s=5.0))
    try:
        envoy.start(ready_timeout=20.0)
        state = Mesh(worker, port)

        def routable() -> bool:
            try:
                return httpx.get(state.url("/health"), timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(routable, 15, what="the worker routable through Envoy", interval=0.1)
        yield state
    finally:
        envoy.cleanup()
        xds.stop(grace=0.1)
        worker.close()


def _http_text(mesh: Mesh, model: str) -> str:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 6, "temperature": 0}
    r = httpx.post(
        mesh.url("/v1/completions"), json=body, timeout=TIMEOUT, headers=bearer(token(SCOPE))
    )
    assert r.status_code == 200, r.text
    text = r.json()["choices"][0]["text"]
    assert text == expected_text(FakeEngine().tokenize(PROMPT), model, 6)
    return str(text)


def test_http_json_path_equals_the_http_api(mesh: Mesh) -> None:
    r = httpx.post(
        mesh.url("/v1/evaluate"),
        timeout=TIMEOUT,
        headers=bearer(token(SCOPE)),
        json={"prompt": PROMPT, "max_tokens": 6, "temperature": 0},
    )
    assert r.status_code == 200, r.text
    assert r.json()["model"] == "credit-risk-v2"
    assert r.json()["choices"][0]["text"] == _http_text(mesh, "credit-risk-v2")


def _infer_request(model: str = "") -> pb.ModelInferRequest:
    req = pb.ModelInferRequest(model_name=model)
    tensor = req.inputs.add(name="text_input", datatype="BYTES", shape=[1])
    tensor.contents.bytes_contents.append(PROMPT.encode())
    req.parameters["max_tokens"].int64_param = 6
    req.parameters["temperature"].double_param = 0.0
    return req


def _text(resp: pb.ModelInferResponse) -> str:
    (out,) = [o for o in resp.outputs if o.name == "text_output"]
    if out.contents.bytes_contents:
        return out.contents.bytes_contents[0].decode()
    index = list(resp.outputs).index(out)
    raw = resp.raw_output_contents[index]
    return raw[4:].decode()


def test_grpc_by_the_clients_own_service_prefix(mesh: Mesh) -> None:
    with grpc.insecure_channel(f"{LOOPBACK}:{mesh.port}") as channel:
        call = channel.unary_unary(
            "/credit.risk.v2.Inference/ModelInfer",
            request_serializer=pb.ModelInferRequest.SerializeToString,
            response_deserializer=pb.ModelInferResponse.FromString,
        )
        # No model_name: the route names the adapter.
        resp = call(_infer_request(), timeout=TIMEOUT)
        assert resp.model_name == "risk-grpc"
        assert _text(resp) == _http_text(mesh, "risk-grpc")
        # A message that names another adapter than its route is refused by the worker.
        with pytest.raises(grpc.RpcError) as exc:
            call(_infer_request("credit-risk-v2"), timeout=TIMEOUT)
        assert exc.value.code() == grpc.StatusCode.PERMISSION_DENIED


def _json_request() -> dict[str, Any]:
    return {
        "inputs": [
            {
                "name": "text_input",
                "datatype": "BYTES",
                "shape": [1],
                "contents": {"bytes_contents": [base64.b64encode(PROMPT.encode()).decode()]},
            }
        ],
        "parameters": {"max_tokens": {"int64_param": 6}, "temperature": {"double_param": 0.0}},
    }


def test_grpc_json_through_the_transcoder_equals_the_http_api(mesh: Mesh) -> None:
    for path in ("/v1/score", "/v1/score2"):
        r = httpx.post(
            mesh.url(path), json=_json_request(), timeout=TIMEOUT, headers=bearer(token(SCOPE))
        )
        assert r.status_code == 200, r.text
        assert r.headers["content-type"].startswith("application/json")
        answer = r.json()
        assert answer["model_name"] == "risk-json"
        resp = pb.ModelInferResponse()
        from google.protobuf import json_format

        json_format.ParseDict(answer, resp, descriptor_pool=pb.POOL)
        assert _text(resp) == _http_text(mesh, "risk-json")


def test_grpc_json_refused_without_token_or_scope_and_the_engine_sees_nothing(mesh: Mesh) -> None:
    before = len(mesh.worker.engine.submitted)
    r = httpx.post(mesh.url("/v1/score"), json=_json_request(), timeout=TIMEOUT)
    assert r.status_code == 401, r.text
    r = httpx.post(
        mesh.url("/v1/score"),
        json=_json_request(),
        timeout=TIMEOUT,
        headers=bearer(token("another:scope")),
    )
    assert r.status_code == 403, r.text
    r = httpx.post(
        mesh.url("/v1/evaluate"), timeout=TIMEOUT, json={"prompt": PROMPT, "max_tokens": 6}
    )
    assert r.status_code == 401, r.text
    assert len(mesh.worker.engine.submitted) == before


def test_a_bad_grpc_json_body_is_answered_as_json(mesh: Mesh) -> None:
    r = httpx.post(
        mesh.url("/v1/score"),
        content=json.dumps({"inputs": "nope"}),
        timeout=TIMEOUT,
        headers={**bearer(token(SCOPE)), "content-type": "application/json"},
    )
    assert r.status_code == 400, r.text
