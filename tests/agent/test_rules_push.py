"""Routing rules reach the agents: `ApplyRules` on the real control plane publishes the set in
the Assignment, the real agent compiles it into its ext_proc server (exercised over gRPC), and
the set's source-CIDR-only rules reach the classifier (FakeShardTable) as pins. A carried set
the agent cannot compile keeps the last good one and shows the node DEGRADED."""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from google.protobuf import struct_pb2
from waiting import async_wait_until as wait_until

from adaptermesh.agent.extproc import RULE_SHARD_HEADER, SHARD_METADATA_KEY
from adaptermesh.cli.adapterctl import node_state
from adaptermesh.proto import assignment_pb2, control_plane_pb2

from .inprocess import MD, Mesh, inprocess_mesh, shard

RULES_V1 = {
    "rules": [
        {"name": "tenant-range", "when": 'inCidr(request.source_ip, "10.9.0.0/16")', "shard": "s1"},
        {
            "name": "gold-fin",
            "when": '"x-tier" in request.headers && request.headers["x-tier"] == "gold"'
            ' && adapter.startsWith("fin-")',
            "shard": "s0",
        },
    ]
}
RULES_V2 = {"rules": [RULES_V1["rules"][1]]}


@pytest.fixture
async def mesh(tmp_path: Path) -> AsyncIterator[Mesh]:
    async with inprocess_mesh(
        tmp_path, "node-rules", ext_proc_port=0, base_model="base", picker_scrape_interval_s=60.0
    ) as m:
        yield m


def _ext_proc(port: int, headers: dict[str, str], model: str, source: str) -> dict[str, str]:
    """One request through the agent's ext_proc server; the headers its decision sets."""
    attrs = struct_pb2.Struct()
    attrs.fields["source.address"].string_value = source
    hdrs = ep.HttpHeaders(
        headers=base_pb2.HeaderMap(
            headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in headers.items()]
        )
    )
    body = json.dumps({"model": model, "prompt": "x"}).encode()
    msgs = [
        ep.ProcessingRequest(
            request_headers=hdrs, attributes={"envoy.filters.http.ext_proc": attrs}
        ),
        ep.ProcessingRequest(request_body=ep.HttpBody(body=body, end_of_stream=True)),
    ]
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = ep_grpc.ExternalProcessorStub(channel)
        out = list(stub.Process(iter(msgs), metadata=[(SHARD_METADATA_KEY, "s0")], timeout=10))
    mutation = out[-1].request_body.response.header_mutation
    return {h.header.key: h.header.raw_value.decode() for h in mutation.set_headers}


async def _apply(mesh: Mesh, doc: dict[str, object], reason: str) -> int:
    resp = await mesh.stub.ApplyRules(
        control_plane_pb2.ApplyRulesRequest(document_json=json.dumps(doc), reason=reason),
        metadata=MD,
    )
    return int(resp.rule_set.version)


async def test_applied_rules_reach_the_ext_proc_and_the_classifier(mesh: Mesh) -> None:
    # Rules written before any shard ride in the first Assignment the shards publish.
    assert await _apply(mesh, RULES_V1, "tenant range and gold tier") == 1
    for i in range(2):
        await mesh.stub.UpsertShard(
            control_plane_pb2.UpsertShardRequest(shard=shard(i)), metadata=MD
        )
    agent = mesh.agent
    await wait_until(
        lambda: (
            agent.rule_sync.version == 1
            and agent.ext_proc is not None
            and agent.ext_proc.rules is not None
        ),
        what="rules v1 installed",
    )
    assert agent.ext_proc is not None
    port = agent.ext_proc.port
    latest = mesh.latest()
    assert latest.routing_rules.version == 1
    assert [(p.cidr, p.shard_id) for p in latest.pins] == [("10.9.0.0/16", "s1")]
    await wait_until(lambda: mesh.table.applied_version == latest.version, what="pins applied")
    index = {s.id: s.index for s in latest.shards}
    # The CIDR rule steers in the classifier; the header rule in the processor.
    assert mesh.table.classify("10.9.4.4") == index["s1"]
    got = await asyncio.to_thread(_ext_proc, port, {"x-tier": "gold"}, "fin-risk", "10.1.2.3:4000")
    assert got[RULE_SHARD_HEADER] == "s0"
    got = await asyncio.to_thread(_ext_proc, port, {}, "ops", "10.9.4.5:4000")
    assert got[RULE_SHARD_HEADER] == "s1"  # the processor agrees with the pin

    # A new version replaces both: the pin goes, the CIDR rule stops matching.
    assert await _apply(mesh, RULES_V2, "drop the tenant range") == 2
    await wait_until(lambda: agent.rule_sync.version == 2, what="rules v2 installed")
    assert not mesh.latest().pins
    await wait_until(
        lambda: mesh.table.plan is not None and not mesh.table.plan.pins,
        what="pin removed from the classifier",
    )
    got = await asyncio.to_thread(_ext_proc, port, {}, "ops", "10.9.4.5:4000")
    assert RULE_SHARD_HEADER not in got
    # Re-applying the live set publishes nothing.
    before = mesh.latest().version
    assert await _apply(mesh, RULES_V2, "again") == 2
    assert mesh.latest().version == before


async def test_a_set_the_agent_cannot_compile_keeps_the_last_good_one(mesh: Mesh) -> None:
    await mesh.stub.UpsertShard(control_plane_pb2.UpsertShardRequest(shard=shard(0)), metadata=MD)
    await _apply(mesh, RULES_V2, "gold tier")
    agent = mesh.agent
    await wait_until(
        lambda: (
            agent.rule_sync.version == 1
            and agent.ext_proc is not None
            and agent.ext_proc.rules is not None
        ),
        what="rules v1 installed",
    )
    assert agent.ext_proc is not None
    assert agent.applier is not None
    good = agent.ext_proc.rules
    # The control plane refuses a set that does not compile, naming the rule and position.
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await _apply(mesh, {"rules": [{"name": "bad", "when": "tier == 1", "shard": "s0"}]}, "x")
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "rule 'bad' at 1:1" in (err.value.details() or "")
    # An Assignment carrying such a set anyway (another control plane's, a corrupt cache):
    # the rest applies, the rules stay at the last good set, and the node shows DEGRADED.
    bad = assignment_pb2.Assignment()
    bad.CopyFrom(agent.applier.current)
    bad.version += 10
    text = '{"rules":[{"name":"bad","when":"tier == 1","shard":"s0"}]}'
    bad.routing_rules.CopyFrom(
        assignment_pb2.RoutingRules(
            version=9, document_json=text, digest=hashlib.sha256(text.encode()).digest()
        )
    )
    result = await asyncio.to_thread(agent.applier.apply, bad)
    assert result.ok
    assert agent.ext_proc.rules is good
    assert agent.rule_sync.version == 1
    assert "routing rules version 9: rule 'bad' at 1:1" in agent.rule_sync.error
    assert agent.status()["routing_rules"]["error"] == agent.rule_sync.error

    async def degraded() -> control_plane_pb2.NodeStatus | None:
        st = await mesh.stub.GetStatus(control_plane_pb2.GetStatusRequest(), metadata=MD)
        for node in st.nodes:
            if (
                node.node_id == "node-rules"
                and node_state(node, node.applied_version) == "DEGRADED"
            ):
                return node
        return None

    node = await wait_until(degraded, 5, interval=0.05, what="the node shown as DEGRADED")
    assert "routing rules version 9" in node.apply_error
    # A bad envelope (digest mismatch) is refused with the whole Assignment by the shared rules.
    worse = assignment_pb2.Assignment()
    worse.CopyFrom(bad)
    worse.version += 1
    worse.routing_rules.digest = b"\0" * 32
    result = await asyncio.to_thread(agent.applier.apply, worse)
    assert not result.ok
    assert "routing_rules.digest" in result.error
