"""The control plane refuses at write time what an agent would refuse, naming the field.

Every case here was stored before and then refused by every agent, which froze routing on
every node at once.
"""

from __future__ import annotations

import grpc
import pytest

from adaptermesh import assignment_rules as rules
from adaptermesh.proto import assignment_pb2
from adaptermesh.proto import control_plane_pb2 as cp_pb2

from .conftest import RO_TOKEN, WO_TOKEN, Harness, creds, shard


async def _seed(h: Harness, n: int = 2) -> None:
    for i in range(n):
        await h.stub.UpsertShard(
            cp_pb2.UpsertShardRequest(shard=shard(f"s{i}", (f"10.0.{i}.1", 8000))), metadata=h.md
        )


def _with(fn) -> cp_pb2.UpsertShardRequest:  # type: ignore[no-untyped-def]
    s = shard("s9", ("10.0.9.1", 8000))
    fn(s)
    return cp_pb2.UpsertShardRequest(shard=s)


def _mark(value: int):  # type: ignore[no-untyped-def]
    def set_mark(s: assignment_pb2.Shard) -> None:
        s.steer.mark.mark = value

    return set_mark


REFUSED = [
    ("UpsertShard", _with(_mark(0)), "shard.steer.mark.mark"),
    ("UpsertShard", _with(lambda s: setattr(s.steer.tunnel, "vni", 0)), "shard.steer.tunnel.vni"),
    (
        "UpsertShard",
        _with(lambda s: setattr(s.steer.tunnel, "vni", 1 << 24)),
        "shard.steer.tunnel.vni",
    ),
    (
        "UpsertShard",
        _with(lambda s: setattr(s.steer.tunnel, "inner_dst_mac", "zz:00:00:00:00:00")),
        "shard.steer.tunnel.inner_dst_mac",
    ),
    (
        "UpsertShard",
        _with(lambda s: setattr(s.steer.tunnel, "remote_ipv4", "999.1.1.1")),
        "shard.steer.tunnel.remote_ipv4",
    ),
    (
        "UpsertShard",
        _with(lambda s: setattr(s.endpoints[0], "address", "999.1.1.1")),
        "shard.endpoints[0].address",
    ),
    (
        "UpsertShard",
        _with(lambda s: setattr(s.endpoints[0], "address", "10.0.0.1:8000")),
        "shard.endpoints[0].address",
    ),
    (
        "UpsertShard",
        _with(lambda s: setattr(s.endpoints[0], "address", "worker.example")),
        "shard.endpoints[0].address",
    ),
    (
        "UpsertShard",
        _with(lambda s: setattr(s.endpoints[0], "address", "fe80::1%eth0")),
        "shard.endpoints[0].address",
    ),
    (
        "UpsertShard",
        _with(lambda s: setattr(s, "service_address", "10.0.0.1")),
        "shard.service_port",
    ),
    (
        "UpsertShard",
        _with(lambda s: s.labels.update({rules.LB_POLICY_LABEL: "random"})),
        f"shard.labels[{rules.LB_POLICY_LABEL}]",
    ),
    (
        "UpsertShard",
        _with(lambda s: s.endpoints[0].adapters.append("")),
        "shard.endpoints[0].adapters[0]",
    ),
    ("PinTenant", cp_pb2.PinTenantRequest(cidr="fe80::1%eth0/128", shard_id="s0"), "cidr"),
    ("PinTenant", cp_pb2.PinTenantRequest(cidr="999.1.1.0/24", shard_id="s0"), "cidr"),
    ("PinTenant", cp_pb2.PinTenantRequest(cidr=" 10.2.0.0/16", shard_id="s0"), "cidr"),
    (
        "UpsertAdapterInstance",
        cp_pb2.UpsertAdapterInstanceRequest(
            instance=cp_pb2.AdapterInstance(
                name="a",
                model_ref=cp_pb2.ModelRef(base_model="m"),
                security=cp_pb2.AdapterSecurity(
                    allowed_cidrs=[f"10.{i // 256}.{i % 256}.0/24" for i in range(300)]
                ),
            )
        ),
        "instance.security.allowed_cidrs",
    ),
    ("ReportLoad", cp_pb2.LoadReport(node_id="n\x1b[2J"), "node_id"),
    ("ReportLoad", cp_pb2.LoadReport(node_id="n", shards=[cp_pb2.ShardTraffic()] * 300), "shards"),
]


@pytest.mark.parametrize(
    ("method", "request_", "field"),
    REFUSED,
    ids=[f"{r[0]}-{r[2]}-{i}" for i, r in enumerate(REFUSED)],
)
async def test_agent_refusals_are_refused_at_write_time(
    cp: Harness, method: str, request_: object, field: str
) -> None:
    await _seed(cp)
    before = await cp.stub.GetAssignment(cp_pb2.GetAssignmentRequest(), metadata=cp.md)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await getattr(cp.stub, method)(request_, metadata=cp.md)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    assert (err.value.details() or "").startswith(f"{field}: "), err.value.details()
    after = await cp.stub.GetAssignment(cp_pb2.GetAssignmentRequest(), metadata=cp.md)
    assert after == before
    assert len(cp.server.rebalancer.store.list_shards()) == 2


async def test_shards_may_share_a_listener_address(cp: Harness) -> None:
    # One VIP for every shard: each node's Envoy serves only its own shard's listener.
    for i in range(2):
        s = shard(f"s{i}", (f"10.0.{i}.1", 8000))
        s.service_address, s.service_port = "10.9.0.1", 80
        await cp.stub.UpsertShard(cp_pb2.UpsertShardRequest(shard=s), metadata=cp.md)
    a = await cp.stub.GetAssignment(cp_pb2.GetAssignmentRequest(), metadata=cp.md)
    rules.check_assignment(a)
    assert [s.service_port for s in a.shards] == [80, 80]


async def test_a_write_whose_assignment_breaks_a_rule_is_refused_naming_it(cp: Harness) -> None:
    store = cp.server.rebalancer.store
    with store.transaction():  # indices 0..254 taken, 255 quarantined after a delete
        for i in range(rules.MAX_SHARDS):
            store.upsert_shard(
                shard(f"t{i}", (f"10.{i // 250}.{i % 250}.1", 8000)), cp.clock.time()
            )
        store.delete_shard("t255", cp.clock.time())
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await cp.stub.UpsertShard(
            cp_pb2.UpsertShardRequest(shard=shard("late", ("10.99.0.1", 8000))), metadata=cp.md
        )
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    details = err.value.details() or ""
    assert details.startswith("shards["), details
    assert ".index: 256 is out of range" in details, details
    assert details.endswith("(in the Assignment this write would publish)")
    assert store.get_shard("late") is None


async def test_the_257th_shard_is_refused(cp: Harness) -> None:
    store = cp.server.rebalancer.store
    with store.transaction():
        for i in range(rules.MAX_SHARDS):
            store.upsert_shard(shard(f"t{i}", (f"10.{i // 250}.{i % 250}.1", 8000)), 0.0)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await cp.stub.UpsertShard(
            cp_pb2.UpsertShardRequest(shard=shard("one-more", ("10.99.0.1", 8000))), metadata=cp.md
        )
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (err.value.details() or "").startswith("shard: at most 256")
    assert len(store.list_shards()) == rules.MAX_SHARDS


async def test_the_16385th_pin_is_refused(cp: Harness) -> None:
    await _seed(cp, 1)
    store = cp.server.rebalancer.store
    with store.transaction():
        for i in range(rules.MAX_PINS):
            store.add_pin(f"10.{i // 256}.{i % 256}.0/24", "s0", 0.0)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await cp.stub.PinTenant(
            cp_pb2.PinTenantRequest(cidr="11.0.0.0/24", shard_id="s0"), metadata=cp.md
        )
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (err.value.details() or "").startswith("cidr: at most 16384")
    assert len(store.list_pins()) == rules.MAX_PINS


async def test_pins_and_overrides_never_outlive_a_drain(cp: Harness) -> None:
    await _seed(cp, 3)
    drained = shard("s2", ("10.0.2.1", 8000), state=assignment_pb2.SHARD_STATE_DRAINING)
    await cp.stub.PinTenant(
        cp_pb2.PinTenantRequest(cidr="10.5.0.0/16", shard_id="s2"), metadata=cp.md
    )
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await cp.stub.UpsertShard(cp_pb2.UpsertShardRequest(shard=drained), metadata=cp.md)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert (err.value.details() or "").startswith("shard.state: ")
    await cp.stub.UnpinTenant(cp_pb2.UnpinTenantRequest(cidr="10.5.0.0/16"), metadata=cp.md)
    await cp.stub.SetOverride(cp_pb2.SetOverrideRequest(shard_id="s2", weight=2000), metadata=cp.md)
    await cp.stub.UpsertShard(cp_pb2.UpsertShardRequest(shard=drained), metadata=cp.md)
    a = await cp.stub.GetAssignment(cp_pb2.GetAssignmentRequest(), metadata=cp.md)
    assert not a.overrides  # the override went with the drain
    rules.check_assignment(a)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await cp.stub.PinTenant(
            cp_pb2.PinTenantRequest(cidr="10.5.0.0/16", shard_id="s2"), metadata=cp.md
        )
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert (err.value.details() or "").startswith("shard_id: ")


async def test_node_rows_are_bounded_per_token(cp: Harness) -> None:
    cp.server.servicer.limits = type(cp.server.servicer.limits)(max_nodes=3)
    for i in range(3):
        await cp.stub.ReportLoad(cp_pb2.LoadReport(node_id=f"n{i}"), metadata=cp.md)
    await cp.stub.ReportLoad(cp_pb2.LoadReport(node_id="n0", applied_version=1), metadata=cp.md)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await cp.stub.ReportLoad(cp_pb2.LoadReport(node_id="n3"), metadata=cp.md)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert (err.value.details() or "").startswith("node_id: at most 3 nodes per token")
    # Another token has its own allowance; one token cannot use up everyone's.
    await cp.stub.ReportLoad(cp_pb2.LoadReport(node_id="n3"), metadata=creds(WO_TOKEN))
    nodes = (await cp.stub.GetStatus(cp_pb2.GetStatusRequest(), metadata=cp.md)).nodes
    assert [n.node_id for n in nodes] == ["n0", "n1", "n2", "n3"]
    assert nodes[0].applied_version == 1


async def test_history_works_with_16384_pins_and_stores_each_pin_list_once(cp: Harness) -> None:
    await _seed(cp, 2)
    store = cp.server.rebalancer.store
    with store.transaction():
        for i in range(rules.MAX_PINS - 1):
            store.add_pin(f"10.{i // 256}.{i % 256}.0/24", "s0", 0.0)
    await cp.stub.PinTenant(
        cp_pb2.PinTenantRequest(cidr="11.0.0.0/24", shard_id="s1"), metadata=cp.md
    )
    for w in (1000, 2000, 3000):  # weight changes: the pins stay the same list
        await cp.stub.SetOverride(
            cp_pb2.SetOverrideRequest(shard_id="s0", weight=w), metadata=cp.md
        )
    latest = await cp.stub.GetAssignment(cp_pb2.GetAssignmentRequest(), metadata=cp.md)
    assert len(latest.pins) == rules.MAX_PINS
    hist = await cp.stub.ListHistory(cp_pb2.ListHistoryRequest(limit=50), metadata=cp.md)
    assert [r.version for r in hist.records][:4] == [latest.version - k for k in range(4)]
    assert all(not r.assignment.pins for r in hist.records)
    assert hist.ByteSize() < 4 << 20
    sets = store._db.execute("SELECT COUNT(*) FROM pin_sets").fetchone()[0]
    assert sets <= 3  # no pins, 16,383 bulk-added... then one list for four versions
    assert store.latest_assignment() == latest
    assert len(store.history(1)[0].pins) == rules.MAX_PINS


async def test_apply_is_all_or_nothing(cp: Harness) -> None:
    await _seed(cp, 2)
    before = await cp.stub.GetAssignment(cp_pb2.GetAssignmentRequest(), metadata=cp.md)
    bad = shard("s8", ("10.0.8.1", 8000))
    bad.steer.mark.mark = 0
    bad.steer.mark.mark = 0
    req = cp_pb2.ApplyRequest(
        shards=[shard("s7", ("10.0.7.1", 8000)), bad],
        pins=[assignment_pb2.Pin(cidr="10.7.0.0/16", shard_id="s7")],
    )
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await cp.stub.Apply(req, metadata=cp.md)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (err.value.details() or "").startswith("shards[1].steer.mark.mark: ")
    assert await cp.stub.GetAssignment(cp_pb2.GetAssignmentRequest(), metadata=cp.md) == before
    assert [s.id for s in cp.server.rebalancer.store.list_shards()] == ["s0", "s1"]
    # A later object may depend on an earlier one; a pin may move; one Assignment for it all.
    del req.shards[1]
    req.pins.add(cidr="10.8.0.0/16", shard_id="s0")
    resp = await cp.stub.Apply(req, metadata=cp.md)
    assert resp.version == before.version + 1
    assert resp.changes == 3
    moved = cp_pb2.ApplyRequest(pins=[assignment_pb2.Pin(cidr="10.8.0.0/16", shard_id="s7")])
    resp = await cp.stub.Apply(moved, metadata=cp.md)
    pins = await cp.stub.ListPins(cp_pb2.ListPinsRequest(), metadata=cp.md)
    assert {(p.cidr, p.shard_id) for p in pins.pins} == {
        ("10.7.0.0/16", "s7"),
        ("10.8.0.0/16", "s7"),
    }


async def test_node_rows_are_bounded_in_all_and_expire(cp: Harness) -> None:
    limits = type(cp.server.servicer.limits)(max_node_rows=3, node_ttl_s=600)
    cp.server.servicer.limits = limits
    await cp.stub.ReportLoad(cp_pb2.LoadReport(node_id="n0"), metadata=cp.md)
    await cp.stub.ReportLoad(cp_pb2.LoadReport(node_id="n1"), metadata=creds(WO_TOKEN))
    await cp.stub.ReportLoad(cp_pb2.LoadReport(node_id="n2"), metadata=cp.md)
    # Every token together: the table is full, whichever token brings a new node.
    for token in (cp.md, creds(WO_TOKEN)):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await cp.stub.ReportLoad(cp_pb2.LoadReport(node_id="n3"), metadata=token)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert (err.value.details() or "").startswith("node_id: at most 3 nodes")
    await cp.stub.ReportLoad(cp_pb2.LoadReport(node_id="n0", applied_version=2), metadata=cp.md)
    # n1 and n2 fall silent; n0 keeps reporting. After the TTL their rows go, and make room.
    cp.clock.step(400)
    await cp.stub.ReportLoad(cp_pb2.LoadReport(node_id="n0", applied_version=3), metadata=cp.md)
    cp.clock.step(300)
    await cp.stub.ReportLoad(cp_pb2.LoadReport(node_id="n3"), metadata=cp.md)
    nodes = (await cp.stub.GetStatus(cp_pb2.GetStatusRequest(), metadata=cp.md)).nodes
    assert [(n.node_id, n.applied_version) for n in nodes] == [("n0", 3), ("n3", 0)]


async def test_a_read_token_cannot_grow_the_node_table(cp: Harness) -> None:
    for i in range(5):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await cp.stub.ReportLoad(
                cp_pb2.LoadReport(node_id=f"made-up-{i}"), metadata=creds(RO_TOKEN)
            )
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert not (await cp.stub.GetStatus(cp_pb2.GetStatusRequest(), metadata=cp.md)).nodes


async def test_a_shard_without_steering_or_service_is_refused(cp: Harness) -> None:
    bare = cp_pb2.UpsertShardRequest(shard=assignment_pb2.Shard(id="s0"))
    bare.shard.endpoints.add(address="10.0.0.1", port=8000)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await cp.stub.UpsertShard(bare, metadata=cp.md)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (err.value.details() or "").startswith("shard.steer: a shard needs steering")
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await cp.stub.Apply(cp_pb2.ApplyRequest(shards=[bare.shard]), metadata=cp.md)
    assert (err.value.details() or "").startswith("shards[0].steer: ")
    assert not (await cp.stub.ListShards(cp_pb2.ListShardsRequest(), metadata=cp.md)).shards
    # A service listener alone is a way in (the shard's Envoy serves it).
    bare.shard.service_address, bare.shard.service_port = "10.96.0.10", 8080
    await cp.stub.UpsertShard(bare, metadata=cp.md)
    assert [
        s.id for s in (await cp.stub.ListShards(cp_pb2.ListShardsRequest(), metadata=cp.md)).shards
    ] == ["s0"]
