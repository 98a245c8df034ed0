"""Routing rules in the agent's ext_proc processor, over a real gRPC channel: the matching
rule's action lands in Envoy's header mutation, or as an immediate response for a reject."""

from __future__ import annotations

import json
from collections.abc import Iterator

import grpc
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from google.protobuf import struct_pb2

from adaptermesh.agent.extproc import (
    RULE_PRIORITY_HEADER,
    RULE_SHARD_HEADER,
    RULE_VERSION_HEADER,
    SHARD_METADATA_KEY,
    ExtProcConfig,
    ExtProcServer,
)
from adaptermesh.agent.picker import EndpointBook
from adaptermesh.rules import Evaluator, compile_rule_set, parse_rule_set

RULES = {
    "rules": [
        {
            "name": "blocked",
            "when": 'inCidr(request.source_ip, "192.0.2.0/24")',
            "reject": {"status": 403, "message": "source blocked"},
        },
        {
            "name": "gold-fin",
            "when": 'request.headers["x-tier"] == "gold" && adapter.startsWith("fin-")',
            "shard": "gold",
        },
        {"name": "acme-v2", "when": 'request.tenant == "acme"', "adapter_version": "2.0.0"},
        {"name": "batch", "when": '"x-batch" in request.headers', "priority": 1},
    ]
}


@pytest.fixture
def processor() -> Iterator[tuple[ExtProcServer, ep_grpc.ExternalProcessorStub]]:
    server = ExtProcServer(EndpointBook(), ExtProcConfig(base_model="base"))
    server.set_rules(Evaluator(compile_rule_set(parse_rule_set(RULES))))
    port = server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield server, ep_grpc.ExternalProcessorStub(channel)
    finally:
        channel.close()
        server.stop()


def _exchange(
    stub: ep_grpc.ExternalProcessorStub,
    headers: dict[str, str],
    model: str,
    source: str | None = None,
) -> list[ep.ProcessingResponse]:
    attrs = {}
    if source is not None:
        s = struct_pb2.Struct()
        s.fields["source.address"].string_value = source
        attrs["envoy.filters.http.ext_proc"] = s
    hdrs = ep.HttpHeaders(
        headers=base_pb2.HeaderMap(
            headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in headers.items()]
        )
    )
    body = json.dumps({"model": model, "prompt": "x"}).encode()
    msgs = [
        ep.ProcessingRequest(request_headers=hdrs, attributes=attrs),
        ep.ProcessingRequest(request_body=ep.HttpBody(body=body, end_of_stream=True)),
    ]
    return list(stub.Process(iter(msgs), metadata=[(SHARD_METADATA_KEY, "s0")], timeout=10))


def _set(resp: ep.ProcessingResponse) -> dict[str, str]:
    mutation = resp.request_body.response.header_mutation
    return {h.header.key: h.header.raw_value.decode() for h in mutation.set_headers}


def test_shard_action_sets_the_shard_header(processor) -> None:  # type: ignore[no-untyped-def]
    server, stub = processor
    out = _exchange(
        stub, {":path": "/v1/completions", "x-tier": "gold"}, "fin-risk", source="10.1.2.3:40000"
    )
    assert _set(out[-1])[RULE_SHARD_HEADER] == "gold"
    assert _set(out[-1])["x-adapter-id"] == "fin-risk"
    assert server.rules is not None
    assert server.rules.stats.matched == 1


def test_version_and_priority_actions(processor) -> None:  # type: ignore[no-untyped-def]
    _, stub = processor
    out = _exchange(stub, {"x-tenant-id": "acme"}, "ops-sum")
    assert _set(out[-1])[RULE_VERSION_HEADER] == "2.0.0"
    out = _exchange(stub, {"x-batch": "1", "x-tier": "gold"}, "ops-sum")
    got = _set(out[-1])
    assert got[RULE_PRIORITY_HEADER] == "1"
    assert RULE_SHARD_HEADER not in got  # gold, but not a fin- adapter


def test_reject_answers_immediately(processor) -> None:  # type: ignore[no-untyped-def]
    _, stub = processor
    out = _exchange(stub, {"x-tier": "gold"}, "fin-risk", source="192.0.2.9:1234")
    immediate = out[-1].immediate_response
    assert out[-1].HasField("immediate_response")
    assert immediate.status.code == 403
    assert immediate.body == b"source blocked"
    # The source comes from x-forwarded-for when Envoy sends no attribute.
    out = _exchange(stub, {"x-forwarded-for": "192.0.2.7, 10.0.0.1"}, "fin-risk")
    assert out[-1].immediate_response.status.code == 403


def test_no_match_and_no_rules_leave_the_request(processor) -> None:  # type: ignore[no-untyped-def]
    server, stub = processor
    out = _exchange(stub, {"x-tier": "silver"}, "fin-risk", source="10.0.0.1:1")
    got = _set(out[-1])
    assert not {RULE_SHARD_HEADER, RULE_VERSION_HEADER, RULE_PRIORITY_HEADER} & set(got)
    server.set_rules(None)
    out = _exchange(stub, {"x-tier": "gold"}, "fin-risk", source="192.0.2.9:1")
    assert not out[-1].HasField("immediate_response")
    assert RULE_SHARD_HEADER not in _set(out[-1])
