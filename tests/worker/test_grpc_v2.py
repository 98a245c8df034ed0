"""KServe v2 gRPC on the worker, driven by the real tritonclient gRPC client.

Health, readiness and metadata; greedy ModelInfer tokens equal /v1/completions' on the tiny
model; streaming through ``start_stream`` / ``async_stream_infer``; adapters loaded and
unloaded through the repository calls; every error status; and malformed requests (built with
the client's own messages) answered with INVALID_ARGUMENT naming the field while the server
keeps serving.
"""

from __future__ import annotations

import asyncio
import queue
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc
import httpx
import numpy as np
import pytest
import tritonclient.grpc as tc
import tritonclient.grpc.aio as tca
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException
from worker_service.fakes import FakeEngine, expected_ids, expected_text

from adaptermesh.worker.grpc_v2 import GrpcV2Server
from adaptermesh.worker.service import ServiceConfig, WorkerService, serve

TIMEOUT = 30.0
TOKEN = "s3cret"


@dataclass
class Server:
    http: httpx.AsyncClient
    grpc_url: str
    service: WorkerService
    engine: Any
    client: tca.InferenceServerClient


StartServer = Callable[..., Awaitable[Server]]


@pytest.fixture
async def start_server() -> AsyncIterator[StartServer]:
    cleanups: list[Callable[[], Awaitable[Any]]] = []

    async def start(engine: Any = None, **config: Any) -> Server:
        engine = engine if engine is not None else FakeEngine()
        service = WorkerService(engine, ServiceConfig(**config))
        runner, port = await serve(service, "127.0.0.1", 0)
        server = GrpcV2Server(service)
        gport = await server.start("127.0.0.1", 0)
        http = httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=TIMEOUT)
        client = tca.InferenceServerClient(f"127.0.0.1:{gport}")
        cleanups.extend([client.close, http.aclose, server.stop, runner.cleanup])
        return Server(http, f"127.0.0.1:{gport}", service, engine, client)

    yield start
    for cleanup in cleanups:
        await cleanup()


def text_inputs(prompt: str) -> list[tc.InferInput]:
    tensor = tc.InferInput("text_input", [1], "BYTES")
    tensor.set_data_from_numpy(np.array([prompt.encode()], dtype=np.object_))
    return [tensor]


def text_of(result: Any) -> str:
    out = result.as_numpy("text_output")
    return "" if out is None else out[0].decode()


def ids_of(result: Any) -> list[int]:
    out = result.as_numpy("token_ids")
    return [] if out is None else [int(t) for t in out]


async def test_health_readiness_and_metadata(start_server: StartServer) -> None:
    server = await start_server()
    client = server.client
    assert await client.is_server_live()
    assert await client.is_server_ready()
    assert await client.is_model_ready("tiny-base")
    assert not await client.is_model_ready("alpha")  # not loaded yet
    meta = await client.get_server_metadata(as_json=True)
    assert meta["name"] == "adaptermesh"
    assert "model_repository" in meta["extensions"]
    model = await client.get_model_metadata("tiny-base", as_json=True)
    assert model["platform"] == "adaptermesh"
    assert [i["name"] for i in model["inputs"]] == ["text_input"]
    assert [o["name"] for o in model["outputs"]] == ["text_output", "token_ids"]
    server.service.draining = True
    assert not await client.is_server_ready()
    assert await client.is_server_live()


async def test_model_infer_equals_http_on_the_fake_engine(start_server: StartServer) -> None:
    server = await start_server()
    result = await server.client.infer(
        "tiny-base", text_inputs("a b c"), parameters={"max_tokens": 5, "temperature": 0.0}
    )
    prompt = FakeEngine().tokenize("a b c")
    assert ids_of(result) == expected_ids(prompt, None, 5)
    assert text_of(result) == expected_text(prompt, None, 5)
    params = result.get_response(as_json=True)["parameters"]
    assert params["finish_reason"]["string_param"] == "length"
    assert int(params["completion_tokens"]["int64_param"]) == 5
    http = (
        await server.http.post(
            "/v1/completions",
            json={"model": "tiny-base", "prompt": "a b c", "max_tokens": 5, "temperature": 0},
        )
    ).json()
    assert http["choices"][0]["text"] == text_of(result)


async def test_greedy_tokens_equal_http_on_the_tiny_model(
    start_server: StartServer, make_engine: Callable[..., Any]
) -> None:
    server = await start_server(make_engine())
    for model in ("tiny", "alpha"):
        body = {"model": model, "prompt": "The quick brown fox", "max_tokens": 8, "temperature": 0}
        http = (await server.http.post("/v1/completions", json=body)).json()
        result = await server.client.infer(
            model, text_inputs(body["prompt"]), parameters={"max_tokens": 8, "temperature": 0.0}
        )
        assert text_of(result) == http["choices"][0]["text"]
        assert len(ids_of(result)) == http["usage"]["completion_tokens"] == 8
        # The ids decode to the same text the HTTP API answered.
        assert server.engine.detokenize(ids_of(result)) == http["choices"][0]["text"]


def stream(
    url: str,
    requests: list[tuple[str, str, dict[str, Any]]],
    metadata: dict[str, str] | None = None,
) -> list[tuple[Any, Any]]:
    """Run ``requests`` on one stream of the synchronous client; (result, error) pairs."""
    got: queue.Queue[tuple[Any, Any]] = queue.Queue()
    client = tc.InferenceServerClient(url)
    finals = 0
    out: list[tuple[Any, Any]] = []
    try:
        client.start_stream(
            callback=lambda result, error: got.put((result, error)), headers=metadata
        )
        for rid, model, params in requests:
            params = dict(params)
            empty_final = bool(params.pop("empty_final", False))
            client.async_stream_infer(
                model,
                text_inputs("x y"),
                request_id=rid,
                parameters=params,
                enable_empty_final_response=empty_final,
            )
        while finals < len(requests):
            result, error = got.get(timeout=TIMEOUT)
            out.append((result, error))
            if error is not None:
                finals += 1
                continue
            p = result.get_response().parameters
            if p["triton_final_response"].bool_param:
                finals += 1
        client.stop_stream()
    finally:
        client.close()
    return out


async def test_stream_yields_one_response_per_token(start_server: StartServer) -> None:
    server = await start_server(FakeEngine(token_delay=0.01))
    out = await asyncio.to_thread(
        stream,
        server.grpc_url,
        [("a", "tiny-base", {"max_tokens": 4}), ("b", "alpha", {"max_tokens": 3})],
    )
    prompt = FakeEngine().tokenize("x y")
    for rid, adapter, n in (("a", None, 4), ("b", "alpha", 3)):
        mine = [r for r, e in out if e is None and r.get_response().id == rid]
        assert len(mine) == n
        assert [i for r in mine for i in ids_of(r)] == expected_ids(prompt, adapter, n)
        assert "".join(text_of(r) for r in mine) == expected_text(prompt, adapter, n)
        last = mine[-1].get_response().parameters
        assert last["finish_reason"].string_param == "length"
        assert [r.get_response().parameters["triton_final_response"].bool_param for r in mine] == [
            False
        ] * (n - 1) + [True]


async def test_stream_error_keeps_the_stream_open(start_server: StartServer) -> None:
    server = await start_server()
    out = await asyncio.to_thread(
        stream,
        server.grpc_url,
        [("bad", "tiny-base", {"max_tokens": "many"}), ("good", "tiny-base", {"max_tokens": 2})],
    )
    errors = [e for _, e in out if e is not None]
    assert len(errors) == 1
    assert "INVALID_ARGUMENT" in str(errors[0])
    assert "parameters[max_tokens]" in str(errors[0])
    assert len([r for r, e in out if e is None]) == 2


async def test_stream_with_empty_final_response(start_server: StartServer) -> None:
    server = await start_server()
    out = await asyncio.to_thread(
        stream, server.grpc_url, [("r", "tiny-base", {"max_tokens": 3, "empty_final": True})]
    )
    got = [r.get_response() for r, e in out if e is None]
    assert len(got) == 4
    assert [g.parameters["triton_final_response"].bool_param for g in got] == [
        False,
        False,
        False,
        True,
    ]
    assert not got[-1].outputs
    assert got[-1].parameters["finish_reason"].string_param == "length"


async def test_load_and_unload_an_adapter_through_the_repository(
    start_server: StartServer,
) -> None:
    server = await start_server(admin_token=TOKEN)
    client = server.client
    auth = {"authorization": f"Bearer {TOKEN}"}
    with pytest.raises(InferenceServerException) as exc:
        await client.load_model("custom")
    assert exc.value.status() == "StatusCode.UNAUTHENTICATED"
    with pytest.raises(InferenceServerException) as exc:
        await client.load_model("custom", headers={"authorization": "Bearer nope"})
    assert exc.value.status() == "StatusCode.PERMISSION_DENIED"
    await client.load_model("custom", headers=auth, config='{"lora_path": "ok/custom"}')
    assert await client.is_model_ready("custom")
    index = await client.get_model_repository_index(as_json=True)
    assert {m["name"] for m in index["models"]} == {"tiny-base", "custom"}
    result = await client.infer("custom", text_inputs("a"), parameters={"max_tokens": 3})
    assert ids_of(result) == expected_ids(FakeEngine().tokenize("a"), "custom", 3)
    await client.unload_model("custom", headers=auth)
    assert not await client.is_model_ready("custom")
    with pytest.raises(InferenceServerException) as exc:
        await client.unload_model("custom", headers=auth)
    assert exc.value.status() == "StatusCode.NOT_FOUND"
    with pytest.raises(InferenceServerException) as exc:
        await client.load_model("other", headers=auth, config='{"lora_path": "missing"}')
    assert exc.value.status() == "StatusCode.NOT_FOUND"
    with pytest.raises(InferenceServerException) as exc:
        await client.load_model("other", headers=auth, config="not json")
    assert exc.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert "parameters[config]" in exc.value.message()


async def test_error_statuses(start_server: StartServer) -> None:
    server = await start_server(max_running=1, max_waiting_per_tenant=0, max_waiting_total=0)
    client = server.client

    async def status(model: str, **kw: Any) -> tuple[str, str]:
        with pytest.raises(InferenceServerException) as exc:
            await client.infer(model, text_inputs("a"), **kw)
        return exc.value.status(), exc.value.message()

    code, message = await status("nobody")
    assert code == "StatusCode.NOT_FOUND"
    assert "model_name" in message
    with pytest.raises(InferenceServerException) as exc:
        await client.get_model_metadata("nobody")
    assert exc.value.status() == "StatusCode.NOT_FOUND"
    code, message = await status("tiny-base", parameters={"temperature": -1.0})
    assert code == "StatusCode.INVALID_ARGUMENT"
    assert "parameters[temperature]" in message
    code, message = await status("tiny-base", parameters={"bogus": 1})
    assert code == "StatusCode.INVALID_ARGUMENT"
    assert "parameters[bogus]" in message
    code, message = await status("tiny-base", parameters={"max_tokens": 10_000})
    assert code == "StatusCode.INVALID_ARGUMENT"
    assert "parameters[max_tokens]" in message
    # Overload: one slot, no queue; a slow request holds the slot.
    server.engine.token_delay = 0.05
    slow = asyncio.create_task(
        client.infer("tiny-base", text_inputs("a"), parameters={"max_tokens": 20})
    )
    await asyncio.sleep(0.2)
    code, message = await status("tiny-base", parameters={"max_tokens": 1})
    assert code == "StatusCode.RESOURCE_EXHAUSTED"
    await slow
    server.service.draining = True
    code, _ = await status("tiny-base")
    assert code == "StatusCode.UNAVAILABLE"


async def test_a_huge_model_name_is_quoted_short(start_server: StartServer) -> None:
    # The status message stays far below the client's metadata limit, so the client sees the
    # refusal meant for it (not RESOURCE_EXHAUSTED) with a short message naming the field.
    server = await start_server()
    name = "m" * 200_000
    with pytest.raises(InferenceServerException) as exc:
        await server.client.infer(name, text_inputs("a"))
    assert exc.value.status() in ("StatusCode.NOT_FOUND", "StatusCode.INVALID_ARGUMENT")
    assert "model_name" in exc.value.message() or "name" in exc.value.message()
    assert len(exc.value.message()) < 1024


async def test_client_cancel_cancels_the_engine_sequence(start_server: StartServer) -> None:
    server = await start_server(FakeEngine(token_delay=0.05))
    call = asyncio.create_task(
        server.client.infer("tiny-base", text_inputs("a"), parameters={"max_tokens": 100})
    )
    while not server.engine.running:
        await asyncio.sleep(0.01)
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    for _ in range(200):
        if server.engine.cancelled:
            break
        await asyncio.sleep(0.01)
    assert server.engine.cancelled


# ------------------------------------------------------------------- malformed requests
def _tensor(name: str, datatype: str, shape: list[int], raw: bytes) -> tuple[Any, bytes]:
    return service_pb2.ModelInferRequest.InferInputTensor(
        name=name, datatype=datatype, shape=shape
    ), raw


GOOD_RAW = b"\x03\x00\x00\x00a b"
MALFORMED = st.one_of(
    st.tuples(st.just("datatype"), st.sampled_from(["FP32", "INT32", "BOOL", "bytes", ""])),
    st.tuples(
        st.just("shape"),
        st.lists(st.integers(-2, 4), max_size=3).filter(lambda s: s not in ([1], [1, 1])),
    ),
    st.tuples(st.just("missing"), st.none()),
    st.tuples(
        st.just("name"), st.text(min_size=1, max_size=10).filter(lambda n: n != "text_input")
    ),
    st.tuples(
        st.just("parameter"),
        st.text(min_size=1, max_size=12).filter(
            lambda n: (
                n
                not in {
                    "max_tokens",
                    "top_k",
                    "seed",
                    "temperature",
                    "top_p",
                    "min_p",
                    "presence_penalty",
                    "frequency_penalty",
                    "repetition_penalty",
                    "stop",
                    "timeout",
                    "triton_enable_empty_final_response",
                }
            )
        ),
    ),
    st.tuples(st.just("parameter_type"), st.sampled_from(["max_tokens", "temperature", "stop"])),
    st.tuples(
        st.just("raw"),
        st.binary(max_size=6).filter(lambda b: b[:4] != b"\x01\x00\x00\x00" or len(b) != 5),
    ),
)


def malformed_request(kind: str, value: Any) -> tuple[service_pb2.ModelInferRequest, str]:
    request = service_pb2.ModelInferRequest(model_name="tiny-base")
    name, datatype, shape, raw = "text_input", "BYTES", [1], GOOD_RAW
    field = "inputs[text_input]"
    if kind == "datatype":
        datatype, field = value, "inputs[text_input].datatype"
    elif kind == "shape":
        shape, field = value, "inputs[text_input].shape"
    elif kind == "name":
        name, field = value, "inputs[0].name"
    elif kind == "raw":
        raw, field = value, "inputs[text_input].contents"
    elif kind == "parameter":
        request.parameters[value].int64_param = 1
        field = f"parameters[{value}]"
    elif kind == "parameter_type":
        if value == "stop":
            request.parameters[value].int64_param = 3
        else:
            request.parameters[value].string_param = "3"
        field = f"parameters[{value}]"
    if kind != "missing":
        request.inputs.add(name=name, datatype=datatype, shape=shape)
        request.raw_input_contents.append(raw)
    return request, field


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(case=MALFORMED)
async def test_malformed_requests_name_the_field(
    start_server: StartServer, case: tuple[str, Any]
) -> None:
    server = await _shared(start_server)
    request, field = malformed_request(*case)
    async with grpc.aio.insecure_channel(server.grpc_url) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            await stub.ModelInfer(request, timeout=TIMEOUT)
        assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT, exc.value.details()
        assert field in (exc.value.details() or ""), (field, exc.value.details())
        good = service_pb2.ModelInferRequest(model_name="tiny-base")
        good.inputs.add(name="text_input", datatype="BYTES", shape=[1])
        good.raw_input_contents.append(GOOD_RAW)
        good.parameters["max_tokens"].int64_param = 2
        answer = await stub.ModelInfer(good, timeout=TIMEOUT)
        assert len(answer.raw_output_contents) == 2


_SHARED: dict[int, Server] = {}


async def _shared(start_server: StartServer) -> Server:
    # One server per test (the fixture's), reused by every Hypothesis example.
    key = id(start_server)
    if key not in _SHARED:
        _SHARED.clear()
        _SHARED[key] = await start_server()
    return _SHARED[key]


async def test_run_worker_serves_grpc_and_reports_not_serving_on_drain() -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from adaptermesh.worker.cli import build_parser, run_worker

    assert build_parser().parse_args(["--model", "m", "--adapter-root", "r"]).grpc_port is None
    assert (
        build_parser()
        .parse_args(["--model", "m", "--adapter-root", "r", "--grpc-port", "8001"])
        .grpc_port
        == 8001
    )
    engine = FakeEngine(token_delay=0.02)
    stop = asyncio.Event()
    ports: list[int] = []
    seen: dict[str, Any] = {}

    async def drive() -> None:
        while not ports:
            await asyncio.sleep(0.01)
        url = f"127.0.0.1:{ports[0]}"
        client = tca.InferenceServerClient(url)
        try:
            result = await client.infer("tiny-base", text_inputs("a"), parameters={"max_tokens": 2})
            seen["ids"] = ids_of(result)
            slow = asyncio.create_task(
                client.infer("tiny-base", text_inputs("a"), parameters={"max_tokens": 20})
            )
            while not engine.running:
                await asyncio.sleep(0.01)
            stop.set()
            async with grpc.aio.insecure_channel(url) as channel:
                health_stub = health_pb2_grpc.HealthStub(channel)
                for _ in range(100):
                    answer = await health_stub.Check(health_pb2.HealthCheckRequest())
                    if answer.status == health_pb2.HealthCheckResponse.NOT_SERVING:
                        seen["not_serving"] = True
                        break
                    await asyncio.sleep(0.01)
            seen["slow"] = len(ids_of(await slow))  # the drain lets it finish
        finally:
            await client.close()

    task = asyncio.create_task(drive())
    assert await run_worker(
        engine,
        ServiceConfig(drain_timeout_s=10),
        "127.0.0.1",
        0,
        stop=stop,
        grpc_port=0,
        on_grpc_ready=ports.append,
    )
    await task
    assert seen == {
        "ids": expected_ids(FakeEngine().tokenize("a"), None, 2),
        "not_serving": True,
        "slow": 20,
    }


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(junk=st.binary(min_size=1, max_size=40))
async def test_undecodable_bytes_are_invalid_argument(
    start_server: StartServer, junk: bytes
) -> None:
    try:
        service_pb2.ModelInferRequest.FromString(junk)
    except Exception:
        pass
    else:
        return  # these bytes happen to be a valid message
    server = await _shared(start_server)
    async with grpc.aio.insecure_channel(server.grpc_url) as channel:
        unary = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            await unary(junk, timeout=TIMEOUT)
        assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "request: is not a valid ModelInferRequest" in (exc.value.details() or "")
        streaming = channel.stream_stream("/inference.GRPCInferenceService/ModelStreamInfer")
        call = streaming(iter([junk]), timeout=TIMEOUT)
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            async for _ in call:
                pass
        assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert await server.client.is_server_live()
