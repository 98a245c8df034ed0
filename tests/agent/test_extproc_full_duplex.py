"""The ext_proc processor in Envoy's ``FULL_DUPLEX_STREAMED`` request body mode, over a real gRPC
channel: a body split into chunks at random points gets the routing decision the same body gets
in ``BUFFERED`` mode, every chunk is answered with a streamed body response carrying its bytes
(in order, ``end_of_stream`` on the last), and the headers answer comes first."""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator

import grpc
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from adaptermesh.agent.extproc import SHARD_METADATA_KEY, ExtProcConfig, ExtProcServer
from adaptermesh.agent.picker import EndpointBook
from adaptermesh.worker_scrape import parse_metrics

BASE = "base"
MAX_BODY = 300
Mode = processing_mode_pb2.ProcessingMode

# Three workers: "sql" is on w1's GPU and in w2's CPU cache; w0 is idle and holds nothing.
WORKERS = {
    8001: ("0", "0.1", ""),
    8002: (
        "3",
        "0.5",
        'vllm:lora_adapter_loaded{adapter_name="sql",level="gpu",pinned="false",rank="8"} 1\n',
    ),
    8003: (
        "1",
        "0.2",
        'vllm:lora_adapter_loaded{adapter_name="sql",level="cpu",pinned="false",rank="8"} 1\n',
    ),
}


def _observe_all(book: EndpointBook, workers: dict[int, tuple[str, str, str]] = WORKERS) -> None:
    """Fresh scrapes of every worker (clears the picks counted since the last one)."""
    for port, (waiting, kv, loaded) in workers.items():
        book.observe(
            "10.0.0.1",
            port,
            parse_metrics(
                f"vllm:num_requests_waiting {waiting}\nvllm:kv_cache_usage_perc {kv}\n"
                f"vllm:max_gpu_lora_adapters 2\n{loaded}"
            ),
        )


@pytest.fixture(scope="module")
def processor() -> Iterator[tuple[EndpointBook, ep_grpc.ExternalProcessorStub]]:
    book = EndpointBook()
    book.set_endpoints("pool", [("10.0.0.1", port) for port in WORKERS])
    server = ExtProcServer(book, ExtProcConfig(base_model=BASE, max_body_bytes=MAX_BODY))
    port = server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield book, ep_grpc.ExternalProcessorStub(channel)
    finally:
        channel.close()
        server.stop()


def _headers(full_duplex: bool) -> ep.ProcessingRequest:
    hdrs = ep.HttpHeaders(
        headers=base_pb2.HeaderMap(
            headers=[
                base_pb2.HeaderValue(key=":path", raw_value=b"/v1/completions"),
                base_pb2.HeaderValue(key="x-adapter-id", raw_value=b"client-said"),
            ]
        )
    )
    mode = Mode.FULL_DUPLEX_STREAMED if full_duplex else Mode.BUFFERED
    return ep.ProcessingRequest(
        request_headers=hdrs, protocol_config=ep.ProtocolConfiguration(request_body_mode=mode)
    )


def _exchange(
    stub: ep_grpc.ExternalProcessorStub, messages: list[ep.ProcessingRequest], shard: str | None
) -> list[ep.ProcessingResponse]:
    metadata = [(SHARD_METADATA_KEY, shard)] if shard is not None else []
    return list(stub.Process(iter(messages), metadata=metadata, timeout=10))


def _routing(response: ep.ProcessingResponse) -> tuple[object, ...]:
    """What decides where the request goes: the header mutation, the route-cache flag, the
    dynamic metadata, or the immediate response."""
    if response.HasField("immediate_response"):
        return ("immediate", response.immediate_response.status.code)
    common = (
        response.request_headers.response
        if response.HasField("request_headers")
        else response.request_body.response
    )
    mutation = common.header_mutation
    return (
        sorted((h.header.key, h.header.raw_value) for h in mutation.set_headers),
        sorted(mutation.remove_headers),
        common.clear_route_cache,
        response.dynamic_metadata.SerializeToString(deterministic=True),
    )


bodies = st.one_of(
    st.builds(
        lambda model, prompt: json.dumps({"model": model, "prompt": prompt}).encode(),
        st.sampled_from(("sql", "chat", BASE)),
        st.text(max_size=120),
    ),
    st.builds(
        lambda prompt: json.dumps({"prompt": prompt, "max_tokens": 3}).encode(),
        st.text(max_size=40),
    ),
    st.binary(max_size=80),  # not JSON: forwarded as if it named no model
    st.builds(
        lambda model, pad: json.dumps({"pad": "x" * pad, "model": model}).encode(),
        st.sampled_from(("sql", "chat")),
        st.integers(MAX_BODY - 20, 2 * MAX_BODY),
    ),
)


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(body=bodies, data=st.data(), shard=st.sampled_from((None, "pool")), trailers=st.booleans())
def test_full_duplex_chunks_route_as_the_buffered_body(
    processor: tuple[EndpointBook, ep_grpc.ExternalProcessorStub],
    body: bytes,
    data: st.DataObject,
    shard: str | None,
    trailers: bool,
) -> None:
    book, stub = processor
    cuts = sorted(data.draw(st.lists(st.integers(0, len(body)), max_size=8), label="cuts"))
    edges = [0, *cuts, len(body)]
    chunks = [body[a:b] for a, b in itertools.pairwise(edges)]

    _observe_all(book)
    buffered = _exchange(
        stub,
        [
            _headers(False),
            ep.ProcessingRequest(request_body=ep.HttpBody(body=body, end_of_stream=True)),
        ],
        shard,
    )
    _observe_all(book)
    streamed = [_headers(True)]
    streamed += [
        ep.ProcessingRequest(
            request_body=ep.HttpBody(
                body=chunk, end_of_stream=not trailers and i == len(chunks) - 1
            )
        )
        for i, chunk in enumerate(chunks)
    ]
    if trailers:
        streamed.append(ep.ProcessingRequest(request_trailers=ep.HttpTrailers()))
    duplex = _exchange(stub, streamed, shard)

    # Buffered: an empty headers answer, then the decision on the body answer.
    assert buffered[0].HasField("request_headers")
    assert not buffered[0].request_headers.response.HasField("header_mutation")
    decision = _routing(buffered[-1])
    if decision[0] == "immediate":
        assert _routing(duplex[-1]) == decision
        return
    # Full duplex: the decision on the headers answer, then one streamed answer per chunk.
    assert duplex[0].HasField("request_headers")
    assert _routing(duplex[0]) == decision
    echoes = [
        r.request_body.response.body_mutation.streamed_response
        for r in duplex[1:]
        if r.HasField("request_body")
    ]
    assert [e.body for e in echoes] == chunks
    assert [e.end_of_stream for e in echoes] == [
        not trailers and i == len(chunks) - 1 for i in range(len(chunks))
    ]
    assert duplex[-1].HasField("request_trailers") == trailers


def test_the_pick_follows_residency(
    processor: tuple[EndpointBook, ep_grpc.ExternalProcessorStub],
) -> None:
    book, stub = processor

    workers = dict(WORKERS)

    def pick(model: str, chunks: list[bytes]) -> str:
        _observe_all(book, workers)
        messages = [_headers(True)] + [
            ep.ProcessingRequest(
                request_body=ep.HttpBody(body=c, end_of_stream=i == len(chunks) - 1)
            )
            for i, c in enumerate(chunks)
        ]
        first = _exchange(stub, messages, None)[0]
        got = {
            h.header.key: h.header.raw_value.decode()
            for h in first.request_headers.response.header_mutation.set_headers
        }
        assert got["x-adapter-id"] == model
        return got["x-gateway-destination-endpoint"]

    body = json.dumps({"model": "sql", "prompt": "hello"}).encode()
    # w1 holds "sql" on its GPU (queue 3): it wins over the CPU holder and the idle worker.
    assert pick("sql", [body[:5], body[5:11], body[11:]]) == "10.0.0.1:8002"
    del workers[8002]
    book.set_endpoints("pool", [("10.0.0.1", port) for port in workers])
    try:
        # Without the GPU holder the CPU holder beats the idle worker.
        assert pick("sql", [body[:1], body[1:]]) == "10.0.0.1:8003"
        # An adapter nobody holds goes to the idlest worker.
        chat = json.dumps({"model": "chat"}).encode()
        assert pick("chat", [chat]) == "10.0.0.1:8001"
    finally:
        book.set_endpoints("pool", [("10.0.0.1", port) for port in WORKERS])
