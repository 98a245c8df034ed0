"""Least privilege (issue 46): a node's credential reports for its own node and nothing more;
ServiceAccount tokens are verified offline; tokens and keys reload without a restart."""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest

from adaptermesh.clock import FakeClock
from adaptermesh.control_plane.auth import TokenFile
from adaptermesh.control_plane.sa_tokens import ServiceAccountPolicy
from adaptermesh.control_plane.server import ControlPlaneServer, ServerConfig
from adaptermesh.proto import control_plane_pb2 as cp_pb2
from adaptermesh.proto import control_plane_pb2_grpc

from . import sa_issuer as sa
from .conftest import StaticSource, creds, instance, shard

OPERATOR = "operator-token-0123456789"
NODE_A = "node-a-token-0123456789ab"
DASHBOARD = "dashboard-token-012345678"
TOKENS = (
    f"{OPERATOR} read,write,rollout operator\n"
    f"{NODE_A} read,report agent-a nodes=node-a\n"
    f"{DASHBOARD} read grafana\n"
)
K1 = sa.SigningKey("k1")
K2 = sa.SigningKey("k2", kind="EC")
FORGER = sa.SigningKey("k1", seed="forger")


@dataclass
class Mesh:
    server: ControlPlaneServer
    stub: Any
    clock: FakeClock
    jwks: Path
    tokens: Path

    def sa_token(self, key: sa.SigningKey = K1, **kw: Any) -> list[tuple[str, str]]:
        return creds(sa.token(key, sa.claims(self.clock.time(), **kw)))

    @property
    def denied(self) -> dict[tuple[str, str], int]:
        return self.server.rebalancer.metrics.denied


def _replace(path: Path, text: str) -> None:
    """Write the file as a Secret volume update does: a new file renamed over the old."""
    tmp = path.with_suffix(".new")
    tmp.write_text(text)
    os.replace(tmp, path)


@pytest.fixture
async def mesh(tmp_path: Path) -> AsyncIterator[Mesh]:
    clock = FakeClock()
    tokens = tmp_path / "tokens"
    tokens.write_text(TOKENS)
    jwks = tmp_path / "jwks.json"
    jwks.write_text(sa.jwks(K1))
    config = ServerConfig(
        state_dir=tmp_path / "state",
        listen="127.0.0.1:0",
        tokens=TokenFile(tokens),
        sa_jwks=jwks,
        service_accounts=ServiceAccountPolicy(
            issuer=sa.ISSUER, allowed=frozenset({(sa.NAMESPACE, sa.SERVICE_ACCOUNT)})
        ),
        rebalance=False,
        synchronous="NORMAL",
    )
    server = ControlPlaneServer(config, source=StaticSource(), clock=clock)
    port = await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    stub = control_plane_pb2_grpc.ControlPlaneStub(channel)
    op = creds(OPERATOR)
    for i in range(2):
        s = shard(f"s{i}", (f"10.0.{i}.1", 8000))
        await stub.UpsertShard(cp_pb2.UpsertShardRequest(shard=s), metadata=op)
    inst = instance("support", "/adapters/support")
    inst.model_ref.base_model = "tiny"
    await stub.UpsertAdapterInstance(
        cp_pb2.UpsertAdapterInstanceRequest(instance=inst), metadata=op
    )
    try:
        yield Mesh(server, stub, clock, jwks, tokens)
    finally:
        await channel.close()
        await server.stop(0)


async def _state(m: Mesh) -> tuple[Any, ...]:
    md = creds(DASHBOARD)
    status = await m.stub.GetStatus(cp_pb2.GetStatusRequest(), metadata=md)
    return (
        (await m.stub.GetAssignment(cp_pb2.GetAssignmentRequest(), metadata=md)).version,
        list((await m.stub.ListShards(cp_pb2.ListShardsRequest(), metadata=md)).shards),
        list((await m.stub.ListOverrides(cp_pb2.ListOverridesRequest(), metadata=md)).overrides),
        list((await m.stub.ListPins(cp_pb2.ListPinsRequest(), metadata=md)).pins),
        list((await m.stub.ListRollouts(cp_pb2.ListRolloutsRequest(), metadata=md)).rollouts),
        [(n.node_id, n.applied_version) for n in status.nodes],
    )


async def _code(call: Any) -> grpc.StatusCode:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call
    return err.value.code()


FORBIDDEN = [
    ("SetOverride", cp_pb2.SetOverrideRequest(shard_id="s0", weight=9000, reason="mine")),
    ("PinTenant", cp_pb2.PinTenantRequest(cidr="10.9.0.0/16", shard_id="s1")),
    ("DeleteShard", cp_pb2.DeleteShardRequest(id="s1")),
    (
        "StartRollout",
        cp_pb2.StartRolloutRequest(
            spec=cp_pb2.RolloutSpec(
                adapter="support", to_version="2", steps_percent=[50, 100], interval_seconds=60
            )
        ),
    ),
]


@pytest.mark.parametrize("kind", ["tokens-file", "serviceaccount"])
async def test_a_node_credential_reports_for_its_own_node_and_changes_nothing_else(
    mesh: Mesh, kind: str
) -> None:
    md = creds(NODE_A) if kind == "tokens-file" else mesh.sa_token()
    await mesh.stub.ReportLoad(cp_pb2.LoadReport(node_id="node-a", applied_version=1), metadata=md)
    # It watches and reads like any agent.
    assert (await mesh.stub.GetAssignment(cp_pb2.GetAssignmentRequest(), metadata=md)).version
    before = await _state(mesh)
    assert before[-1] == [("node-a", 1)]

    report = cp_pb2.LoadReport(node_id="node-b", applied_version=1)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await mesh.stub.ReportLoad(report, metadata=md)
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert (err.value.details() or "").startswith("node_id: ")
    assert "node-b" in (err.value.details() or "")
    for method, request in FORBIDDEN:
        code = await _code(getattr(mesh.stub, method)(request, metadata=md))
        assert code == grpc.StatusCode.PERMISSION_DENIED, method
    assert await _state(mesh) == before

    assert mesh.denied[("ReportLoad", "node_binding")] == 1
    for method, _ in FORBIDDEN:
        assert mesh.denied[(method, "scope")] == 1, method
    scrape = mesh.server.rebalancer.metrics.render().decode()
    assert 'adaptermesh_cp_denied_total{method="ReportLoad",reason="node_binding"} 1.0' in scrape
    # Each refusal is audited with the caller the credential proved.
    rows = (await mesh.stub.ListAudit(cp_pb2.ListAuditRequest(), metadata=creds(OPERATOR))).records
    refused = [r for r in rows if r.outcome == "PERMISSION_DENIED"]
    assert sorted(r.method for r in refused) == sorted(["ReportLoad"] + [m for m, _ in FORBIDDEN])
    caller = "token:agent-a" if kind == "tokens-file" else "sa:adaptermesh/am-agent@node-a"
    assert {r.caller for r in refused} == {caller}


async def test_the_operator_and_dashboard_tokens_hold_what_they_need(mesh: Mesh) -> None:
    # The operator cannot pose as a node; the dashboard reads and nothing more.
    report = cp_pb2.LoadReport(node_id="node-a")
    assert await _code(mesh.stub.ReportLoad(report, metadata=creds(OPERATOR))) == (
        grpc.StatusCode.PERMISSION_DENIED
    )
    for method, request in FORBIDDEN:
        code = await _code(getattr(mesh.stub, method)(request, metadata=creds(DASHBOARD)))
        assert code == grpc.StatusCode.PERMISSION_DENIED, method
    await mesh.stub.SetOverride(FORBIDDEN[0][1], metadata=creds(OPERATOR))


def _bad_tokens(m: Mesh) -> dict[str, tuple[str, str]]:
    now = m.clock.time()
    good = sa.claims(now)
    tampered = sa.token(K1, good).split(".")
    tampered[1] = sa.b64url(
        json.dumps({**good, "kubernetes.io": {"node": {"name": "node-b"}}}).encode()
    )
    return {
        "forged": (sa.token(FORGER, good), "bad_signature"),
        "tampered": (".".join(tampered), "bad_signature"),
        "expired": (sa.token(K1, sa.claims(now, age=700)), "expired"),
        "wrong-audience": (sa.token(K1, sa.claims(now, aud=["kubernetes"])), "wrong_audience"),
        "wrong-issuer": (sa.token(K1, sa.claims(now, iss="https://evil.test")), "wrong_issuer"),
        "unknown-key": (sa.token(K2, good), "unknown_key"),
        "long-lived": (sa.token(K1, sa.claims(now, lifetime=365 * 86400)), "long_lived"),
    }


@pytest.mark.parametrize(
    "case",
    [
        "forged",
        "tampered",
        "expired",
        "wrong-audience",
        "wrong-issuer",
        "unknown-key",
        "long-lived",
    ],
)
async def test_a_bad_serviceaccount_token_is_unauthenticated(mesh: Mesh, case: str) -> None:
    token, reason = _bad_tokens(mesh)[case]
    before = await _state(mesh)
    for method, request in (
        ("ReportLoad", cp_pb2.LoadReport(node_id="node-a")),
        ("GetAssignment", cp_pb2.GetAssignmentRequest()),
    ):
        code = await _code(getattr(mesh.stub, method)(request, metadata=creds(token)))
        assert code == grpc.StatusCode.UNAUTHENTICATED, method
        assert mesh.denied[(method, reason)] == 1
    assert await _state(mesh) == before


async def test_a_service_account_that_is_not_allowed_is_refused(mesh: Mesh) -> None:
    md = mesh.sa_token(service_account="default")
    code = await _code(mesh.stub.ReportLoad(cp_pb2.LoadReport(node_id="node-a"), metadata=md))
    assert code == grpc.StatusCode.PERMISSION_DENIED
    assert mesh.denied[("ReportLoad", "service_account")] == 1
    # A token without the node claim (Kubernetes before 1.30) reads, but reports for no node.
    md = mesh.sa_token(node=None)
    assert (await mesh.stub.GetAssignment(cp_pb2.GetAssignmentRequest(), metadata=md)).version
    code = await _code(mesh.stub.ReportLoad(cp_pb2.LoadReport(node_id="node-a"), metadata=md))
    assert code == grpc.StatusCode.PERMISSION_DENIED


async def test_a_rotated_signing_key_is_picked_up_without_a_restart(mesh: Mesh) -> None:
    report = cp_pb2.LoadReport(node_id="node-a")
    new = mesh.sa_token(K2)
    assert await _code(mesh.stub.ReportLoad(report, metadata=new)) == (
        grpc.StatusCode.UNAUTHENTICATED
    )
    # The issuer publishes its new key beside the old one, then retires the old one.
    _replace(mesh.jwks, sa.jwks(K1, K2))
    await mesh.stub.ReportLoad(report, metadata=new)
    await mesh.stub.ReportLoad(report, metadata=mesh.sa_token(K1))
    _replace(mesh.jwks, sa.jwks(K2))
    await mesh.stub.ReportLoad(report, metadata=new)
    old = mesh.sa_token(K1)
    assert await _code(mesh.stub.ReportLoad(report, metadata=old)) == (
        grpc.StatusCode.UNAUTHENTICATED
    )
    # A broken JWKS is not taken: the last good keys stay in force.
    _replace(mesh.jwks, '{"keys": [')
    await mesh.stub.ReportLoad(report, metadata=new)


async def test_the_tokens_file_reloads_without_a_restart(mesh: Mesh) -> None:
    report = cp_pb2.LoadReport(node_id="node-c")
    node_c = "node-c-token-0123456789ab"
    assert await _code(mesh.stub.ReportLoad(report, metadata=creds(node_c))) == (
        grpc.StatusCode.UNAUTHENTICATED
    )
    _replace(mesh.tokens, TOKENS + f"{node_c} read,report agent-c nodes=node-c\n")
    await mesh.stub.ReportLoad(report, metadata=creds(node_c))
    # Node A's token is revoked: refused at once.
    _replace(mesh.tokens, TOKENS.replace(f"{NODE_A} read,report agent-a nodes=node-a\n", ""))
    code = await _code(
        mesh.stub.ReportLoad(cp_pb2.LoadReport(node_id="node-a"), metadata=creds(NODE_A))
    )
    assert code == grpc.StatusCode.UNAUTHENTICATED
    # A file that does not parse (a report token without nodes=) keeps the last good table.
    _replace(mesh.tokens, f"{NODE_A} read,report agent-a\n")
    assert mesh.server.authenticator is not None
    code = await _code(
        mesh.stub.ReportLoad(cp_pb2.LoadReport(node_id="node-a"), metadata=creds(NODE_A))
    )
    assert code == grpc.StatusCode.UNAUTHENTICATED
    await mesh.stub.GetAssignment(cp_pb2.GetAssignmentRequest(), metadata=creds(OPERATOR))
    tokens = mesh.server.config.tokens
    assert isinstance(tokens, TokenFile)
    assert tokens.reload_failures == 1
