"""The gRPC API in process: CRUD, immediate publishing, validation, auth, health, reflection."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from adaptermesh.proto import assignment_pb2
from adaptermesh.proto import control_plane_pb2 as cp_pb2

from .conftest import RO_TOKEN, WO_TOKEN, Harness, creds, shard


async def _seed(h: Harness, n: int = 3) -> None:
    for i in range(n):
        await h.stub.UpsertShard(
            cp_pb2.UpsertShardRequest(shard=shard(f"s{i}", (f"10.0.{i}.1", 8000))), metadata=h.md
        )


async def test_upsert_publishes_and_assigns_stable_dense_indices(cp: Harness) -> None:
    await _seed(cp)
    a = await cp.stub.GetAssignment(cp_pb2.GetAssignmentRequest(), metadata=cp.md)
    assert a.version == 3
    assert sorted(s.index for s in a.shards) == [0, 1, 2]
    assert sum(s.weight for s in a.shards) == 10_000
    assert all(e.weight >= 1 for s in a.shards for e in s.endpoints)
    assert "shard s2 created" in a.reason
    # Updating keeps the index; a no-op update publishes nothing.
    s1 = shard("s1", ("10.0.1.1", 8000), ("10.0.1.2", 8000))
    out = await cp.stub.UpsertShard(cp_pb2.UpsertShardRequest(shard=s1), metadata=cp.md)
    assert out.index == 1
    again = await cp.stub.UpsertShard(cp_pb2.UpsertShardRequest(shard=s1), metadata=cp.md)
    assert again.index == 1
    a2 = await cp.stub.GetAssignment(cp_pb2.GetAssignmentRequest(), metadata=cp.md)
    assert a2.version == 4


async def test_deleted_index_is_quarantined_not_reused(cp: Harness) -> None:
    await _seed(cp)
    await cp.stub.DeleteShard(cp_pb2.DeleteShardRequest(id="s1"), metadata=cp.md)
    out = await cp.stub.UpsertShard(
        cp_pb2.UpsertShardRequest(shard=shard("s9", ("10.0.9.1", 8000))), metadata=cp.md
    )
    assert out.index == 3  # 1 is still held for sticky flows
    cp.clock.step(301)
    out = await cp.stub.UpsertShard(
        cp_pb2.UpsertShardRequest(shard=shard("s10", ("10.0.10.1", 8000))), metadata=cp.md
    )
    assert out.index == 1


async def test_override_publishes_at_once_and_others_renormalise(cp: Harness) -> None:
    await _seed(cp, 4)
    watch = cp.stub.WatchAssignments(cp_pb2.WatchAssignmentsRequest(from_version=4), metadata=cp.md)
    o = await cp.stub.SetOverride(
        cp_pb2.SetOverrideRequest(shard_id="s0", weight=7000, ttl_seconds=60, reason="canary"),
        metadata=cp.md,
    )
    assert o.expires_at.seconds > 0
    a = await asyncio.wait_for(watch.read(), 5)
    watch.cancel()
    assert a.version == 5
    w = {s.id: s.weight for s in a.shards}
    assert w["s0"] == 7000
    assert sum(w.values()) == 10_000
    assert {w["s1"], w["s2"], w["s3"]} == {1000}
    assert "canary" in a.reason
    assert a.overrides[0].shard_id == "s0"
    listed = await cp.stub.ListOverrides(cp_pb2.ListOverridesRequest(), metadata=cp.md)
    assert [x.shard_id for x in listed.overrides] == ["s0"]
    await cp.stub.ClearOverride(cp_pb2.ClearOverrideRequest(shard_id="s0"), metadata=cp.md)
    hist = await cp.stub.ListHistory(cp_pb2.ListHistoryRequest(limit=2), metadata=cp.md)
    assert [r.version for r in hist.records] == [6, 5]
    assert "cleared" in hist.records[0].reason


async def test_override_ttl_expires_on_tick(cp: Harness) -> None:
    await _seed(cp, 2)
    await cp.stub.SetOverride(
        cp_pb2.SetOverrideRequest(shard_id="s0", weight=9000, ttl_seconds=10), metadata=cp.md
    )
    rb = cp.server.rebalancer
    await rb.step()
    assert rb.hub.latest is not None
    assert rb.hub.latest.shards[0].weight == 9000
    cp.clock.step(11)
    await rb.step()
    a = rb.hub.latest
    assert "override expired: s0" in a.reason
    assert not a.overrides
    assert not (
        await cp.stub.ListOverrides(cp_pb2.ListOverridesRequest(), metadata=cp.md)
    ).overrides


async def test_pins_longest_prefix_and_duplicates(cp: Harness) -> None:
    await _seed(cp, 2)
    await cp.stub.PinTenant(
        cp_pb2.PinTenantRequest(cidr="10.1.0.0/16", shard_id="s0"), metadata=cp.md
    )
    await cp.stub.PinTenant(
        cp_pb2.PinTenantRequest(cidr="10.1.2.0/24", shard_id="s1"), metadata=cp.md
    )
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await cp.stub.PinTenant(
            cp_pb2.PinTenantRequest(cidr="10.1.0.0/16", shard_id="s1"), metadata=cp.md
        )
    assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
    assert "cidr" in (err.value.details() or "")
    a = await cp.stub.GetAssignment(cp_pb2.GetAssignmentRequest(), metadata=cp.md)
    assert {(p.cidr, p.shard_id) for p in a.pins} == {("10.1.0.0/16", "s0"), ("10.1.2.0/24", "s1")}
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await cp.stub.DeleteShard(cp_pb2.DeleteShardRequest(id="s1"), metadata=cp.md)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    await cp.stub.UnpinTenant(cp_pb2.UnpinTenantRequest(cidr="10.1.2.0/24"), metadata=cp.md)
    a2 = await cp.stub.GetAssignment(cp_pb2.GetAssignmentRequest(), metadata=cp.md)
    assert a2.version == a.version + 1
    assert "unpin 10.1.2.0/24" in a2.reason


BAD = [
    (
        "SetOverride",
        cp_pb2.SetOverrideRequest(shard_id="s0", weight=10_001),
        grpc.StatusCode.INVALID_ARGUMENT,
        "weight",
    ),
    (
        "SetOverride",
        cp_pb2.SetOverrideRequest(shard_id="s0", weight=2**32 - 1),
        grpc.StatusCode.INVALID_ARGUMENT,
        "weight",
    ),
    (
        "SetOverride",
        cp_pb2.SetOverrideRequest(shard_id="s0", weight=9990),
        grpc.StatusCode.INVALID_ARGUMENT,
        "weight",
    ),
    (
        "SetOverride",
        cp_pb2.SetOverrideRequest(shard_id="nope", weight=10),
        grpc.StatusCode.NOT_FOUND,
        "shard_id",
    ),
    (
        "SetOverride",
        cp_pb2.SetOverrideRequest(shard_id="s0", weight=10, ttl_seconds=10**9),
        grpc.StatusCode.INVALID_ARGUMENT,
        "ttl_seconds",
    ),
    (
        "SetOverride",
        cp_pb2.SetOverrideRequest(shard_id="s0", weight=10, reason="x" * 5000),
        grpc.StatusCode.INVALID_ARGUMENT,
        "reason",
    ),
    (
        "PinTenant",
        cp_pb2.PinTenantRequest(cidr="10.1.0.0/33", shard_id="s0"),
        grpc.StatusCode.INVALID_ARGUMENT,
        "cidr",
    ),
    (
        "PinTenant",
        cp_pb2.PinTenantRequest(cidr="10.1.0.1/16", shard_id="s0"),
        grpc.StatusCode.INVALID_ARGUMENT,
        "cidr",
    ),
    (
        "PinTenant",
        cp_pb2.PinTenantRequest(cidr="10.1.0.0/16", shard_id="zz"),
        grpc.StatusCode.NOT_FOUND,
        "shard_id",
    ),
    (
        "UnpinTenant",
        cp_pb2.UnpinTenantRequest(cidr="10.9.0.0/16"),
        grpc.StatusCode.NOT_FOUND,
        "cidr",
    ),
    ("DeleteShard", cp_pb2.DeleteShardRequest(id="zz"), grpc.StatusCode.NOT_FOUND, "id"),
    (
        "ClearOverride",
        cp_pb2.ClearOverrideRequest(shard_id="s0"),
        grpc.StatusCode.NOT_FOUND,
        "shard_id",
    ),
    (
        "UpsertShard",
        cp_pb2.UpsertShardRequest(shard=shard("Bad Id", ("10.0.0.1", 1))),
        grpc.StatusCode.INVALID_ARGUMENT,
        "shard.id",
    ),
    (
        "UpsertShard",
        cp_pb2.UpsertShardRequest(shard=shard("s5", ("10.0.0.1", 0))),
        grpc.StatusCode.INVALID_ARGUMENT,
        "shard.endpoints[0].port",
    ),
    (
        "UpsertShard",
        cp_pb2.UpsertShardRequest(shard=shard("s5", *[("10.0.0.1", p) for p in range(1, 1100)])),
        grpc.StatusCode.INVALID_ARGUMENT,
        "shard.endpoints",
    ),
    (
        "UpsertShard",
        cp_pb2.UpsertShardRequest(shard=shard("s5", ("10.0.0.1", 80), ("10.0.0.1", 80))),
        grpc.StatusCode.INVALID_ARGUMENT,
        "shard.endpoints[1]",
    ),
    (
        "ListHistory",
        cp_pb2.ListHistoryRequest(limit=5000),
        grpc.StatusCode.INVALID_ARGUMENT,
        "limit",
    ),
    ("ReportLoad", cp_pb2.LoadReport(node_id=""), grpc.StatusCode.INVALID_ARGUMENT, "node_id"),
    (
        "ReportLoad",
        cp_pb2.LoadReport(
            node_id="n", shards=[cp_pb2.ShardTraffic(shard_id="s0", packets_per_s=float("nan"))]
        ),
        grpc.StatusCode.INVALID_ARGUMENT,
        "shards[0].packets_per_s",
    ),
    (
        "UpsertAdapterInstance",
        cp_pb2.UpsertAdapterInstanceRequest(
            instance=cp_pb2.AdapterInstance(
                name="a",
                model_ref=cp_pb2.ModelRef(base_model="m"),
                routes=[cp_pb2.AdapterRoute(shard_id="zz")],
            )
        ),
        grpc.StatusCode.NOT_FOUND,
        "instance.routes[0].shard_id",
    ),
]


@pytest.mark.parametrize(
    ("method", "request_", "code", "field"),
    BAD,
    ids=[f"{b[0]}-{b[3]}-{i}" for i, b in enumerate(BAD)],
)
async def test_bad_input_is_rejected_naming_the_field_and_state_is_unchanged(
    cp: Harness, method: str, request_: object, code: grpc.StatusCode, field: str
) -> None:
    await _seed(cp, 2)
    await cp.stub.PinTenant(
        cp_pb2.PinTenantRequest(cidr="10.1.0.0/16", shard_id="s0"), metadata=cp.md
    )
    before = await cp.stub.GetStatus(cp_pb2.GetStatusRequest(), metadata=cp.md)
    pins = await cp.stub.ListPins(cp_pb2.ListPinsRequest(), metadata=cp.md)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await getattr(cp.stub, method)(request_, metadata=cp.md)
    assert err.value.code() == code, err.value.details()
    assert (err.value.details() or "").startswith(field), err.value.details()
    after = await cp.stub.GetStatus(cp_pb2.GetStatusRequest(), metadata=cp.md)
    assert after.assignment == before.assignment
    assert await cp.stub.ListPins(cp_pb2.ListPinsRequest(), metadata=cp.md) == pins
    assert len((await cp.stub.ListShards(cp_pb2.ListShardsRequest(), metadata=cp.md)).shards) == 2


async def test_oversized_request_is_refused_by_the_transport(cp: Harness) -> None:
    await _seed(cp, 1)
    big = shard("s0", ("10.0.0.1", 8000))
    big.labels["k"] = "v" * (5 * 1024 * 1024)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await cp.stub.UpsertShard(cp_pb2.UpsertShardRequest(shard=big), metadata=cp.md)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    a = await cp.stub.GetAssignment(cp_pb2.GetAssignmentRequest(), metadata=cp.md)
    assert a.version == 1


async def test_auth_unauthenticated_vs_permission_denied(cp: Harness) -> None:
    req = cp_pb2.UpsertShardRequest(shard=shard("s0", ("10.0.0.1", 8000)))
    cases = [
        (None, grpc.StatusCode.UNAUTHENTICATED),
        (creds("not-a-real-token-at-all"), grpc.StatusCode.UNAUTHENTICATED),
        ([("authorization", "Basic abc")], grpc.StatusCode.UNAUTHENTICATED),
        (creds(RO_TOKEN), grpc.StatusCode.PERMISSION_DENIED),
    ]
    for md, code in cases:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await cp.stub.UpsertShard(req, metadata=md)
        assert err.value.code() == code
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await cp.stub.ListShards(cp_pb2.ListShardsRequest(), metadata=creds(WO_TOKEN))
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    stream = cp.stub.WatchAssignments(cp_pb2.WatchAssignmentsRequest())
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stream.read()
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    await cp.stub.UpsertShard(req, metadata=creds(WO_TOKEN))
    assert (await cp.stub.ListShards(cp_pb2.ListShardsRequest(), metadata=creds(RO_TOKEN))).shards
    # A report writes a node row: a read-only token may not send one; agents hold report.
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await cp.stub.ReportLoad(
            cp_pb2.LoadReport(node_id="n1", applied_version=1), metadata=creds(RO_TOKEN)
        )
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    await cp.stub.ReportLoad(
        cp_pb2.LoadReport(node_id="n1", applied_version=1), metadata=creds(WO_TOKEN)
    )


async def test_health_and_reflection_need_no_token(cp: Harness) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    health = health_pb2_grpc.HealthStub(cp.channel)
    resp = await health.Check(health_pb2.HealthCheckRequest(service="adaptermesh.v1.ControlPlane"))
    assert resp.status == health_pb2.HealthCheckResponse.SERVING
    refl = reflection_pb2_grpc.ServerReflectionStub(cp.channel)
    call = refl.ServerReflectionInfo()
    await call.write(reflection_pb2.ServerReflectionRequest(list_services=""))
    answer = await call.read()
    await call.done_writing()
    names = {s.name for s in answer.list_services_response.service}
    assert "adaptermesh.v1.ControlPlane" in names
    assert "grpc.health.v1.Health" in names


async def test_watch_resumes_from_version_and_status_shows_lagging_nodes(cp: Harness) -> None:
    await _seed(cp, 3)
    stream = cp.stub.WatchAssignments(
        cp_pb2.WatchAssignmentsRequest(from_version=0, node_id="n1"), metadata=cp.md
    )
    first = await asyncio.wait_for(stream.read(), 5)
    assert first.version == 3  # the current one first
    resumed = cp.stub.WatchAssignments(
        cp_pb2.WatchAssignmentsRequest(from_version=3), metadata=cp.md
    )
    await cp.stub.PinTenant(
        cp_pb2.PinTenantRequest(cidr="192.0.2.0/24", shard_id="s2"), metadata=cp.md
    )
    assert (await asyncio.wait_for(resumed.read(), 5)).version == 4
    assert (await asyncio.wait_for(stream.read(), 5)).version == 4
    stream.cancel()
    resumed.cancel()
    await cp.stub.ReportLoad(cp_pb2.LoadReport(node_id="n1", applied_version=4), metadata=cp.md)
    await cp.stub.ReportLoad(
        cp_pb2.LoadReport(node_id="n2", applied_version=2, apply_error="map full"), metadata=cp.md
    )
    st = await cp.stub.GetStatus(cp_pb2.GetStatusRequest(), metadata=cp.md)
    assert {(n.node_id, n.applied_version, n.apply_error) for n in st.nodes} == {
        ("n1", 4, ""),
        ("n2", 2, "map full"),
    }
    assert st.assignment.version == 4


async def test_adapter_instances_are_stored_and_listed(cp: Harness) -> None:
    await _seed(cp, 2)
    inst = cp_pb2.AdapterInstance(
        name="support-bot",
        model_ref=cp_pb2.ModelRef(base_model="tiny-llama", adapter_path="/adapters/support"),
        routes=[cp_pb2.AdapterRoute(shard_id="s0", weight=3), cp_pb2.AdapterRoute(shard_id="s1")],
        security=cp_pb2.AdapterSecurity(scopes=["tenant-a"], allowed_cidrs=["10.1.0.0/16"]),
    )
    out = await cp.stub.UpsertAdapterInstance(
        cp_pb2.UpsertAdapterInstanceRequest(instance=inst), metadata=cp.md
    )
    again = await cp.stub.UpsertAdapterInstance(
        cp_pb2.UpsertAdapterInstanceRequest(instance=inst), metadata=cp.md
    )
    assert out.updated_at == again.updated_at  # idempotent
    listed = await cp.stub.ListAdapterInstances(
        cp_pb2.ListAdapterInstancesRequest(), metadata=cp.md
    )
    assert [i.name for i in listed.instances] == ["support-bot"]
    assert listed.instances[0].security.scopes == ["tenant-a"]
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await cp.stub.DeleteShard(cp_pb2.DeleteShardRequest(id="s1"), metadata=cp.md)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    await cp.stub.DeleteAdapterInstance(
        cp_pb2.DeleteAdapterInstanceRequest(name="support-bot"), metadata=cp.md
    )
    assert not (
        await cp.stub.ListAdapterInstances(cp_pb2.ListAdapterInstancesRequest(), metadata=cp.md)
    ).instances


async def test_draining_shard_gets_zero_weight(cp: Harness) -> None:
    await _seed(cp, 2)
    d = shard("s1", ("10.0.1.1", 8000), state=assignment_pb2.SHARD_STATE_DRAINING)
    await cp.stub.UpsertShard(cp_pb2.UpsertShardRequest(shard=d), metadata=cp.md)
    a = await cp.stub.GetAssignment(cp_pb2.GetAssignmentRequest(), metadata=cp.md)
    w = {s.id: (s.weight, s.state) for s in a.shards}
    assert w["s0"] == (10_000, assignment_pb2.SHARD_STATE_ACTIVE)
    assert w["s1"] == (0, assignment_pb2.SHARD_STATE_DRAINING)
