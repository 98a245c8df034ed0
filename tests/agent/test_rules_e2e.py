"""The real control plane in process and the real agent (FakeShardTable datapath, the real
xDS builder): what the control plane accepts, the agent applies; what the agent would refuse,
the control plane refuses; an agent that still gets a bad Assignment keeps the last good one
and the control plane shows it DEGRADED."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from waiting import async_wait_until as wait_until

from adaptermesh import assignment_rules as rules
from adaptermesh.cli.adapterctl import node_state
from adaptermesh.proto import assignment_pb2, control_plane_pb2

from .inprocess import Mesh, inprocess_mesh, shard


@pytest.fixture
async def mesh(tmp_path: Path) -> AsyncIterator[Mesh]:
    async with inprocess_mesh(tmp_path, "node-e2e") as m:
        yield m


WRITES_THE_AGENT_REFUSES = [
    ("shard.steer.mark.mark", lambda s: setattr(s.steer.mark, "mark", 0)),
    (
        "shard.steer.redirect.dst_mac",
        lambda s: (
            setattr(s.steer.redirect, "ifindex", 1),
            setattr(s.steer.redirect, "dst_mac", "00:11:22:33:44"),
        ),
    ),
    ("shard.endpoints[0].address", lambda s: setattr(s.endpoints[0], "address", "999.1.1.1")),
    ("shard.service_port", lambda s: setattr(s, "service_port", 0)),
    ("shard.endpoints[0].adapters[0]", lambda s: s.endpoints[0].adapters.append("a\nb")),
]


async def test_writes_the_agent_would_refuse_are_refused_and_the_rest_applied(mesh: Mesh) -> None:
    for i in range(3):
        await mesh.stub.UpsertShard(
            control_plane_pb2.UpsertShardRequest(shard=shard(i)), metadata=mesh.md
        )
    await mesh.stub.PinTenant(
        control_plane_pb2.PinTenantRequest(cidr="fe80::/64", shard_id="s1"), metadata=mesh.md
    )
    await wait_until(lambda: mesh.applied == mesh.latest_version() == 4, what="v4 applied")
    for field, bad in WRITES_THE_AGENT_REFUSES:
        s = shard(1)
        bad(s)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await mesh.stub.UpsertShard(
                control_plane_pb2.UpsertShardRequest(shard=s), metadata=mesh.md
            )
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, field
        assert (err.value.details() or "").startswith(field), err.value.details()
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await mesh.stub.PinTenant(
            control_plane_pb2.PinTenantRequest(cidr="fe80::%eth0/64", shard_id="s2"),
            metadata=mesh.md,
        )
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert mesh.latest_version() == 4
    # Every write that was accepted has been applied by the agent, with no error.
    await mesh.stub.SetOverride(
        control_plane_pb2.SetOverrideRequest(shard_id="s0", weight=5000), metadata=mesh.md
    )
    await wait_until(lambda: mesh.applied == mesh.latest_version() == 5, what="v5 applied")
    assert mesh.agent.applier is not None
    assert mesh.agent.applier.last_error == ""


async def test_a_bad_assignment_keeps_the_last_good_one_and_shows_degraded(mesh: Mesh) -> None:
    for i in range(2):
        await mesh.stub.UpsertShard(
            control_plane_pb2.UpsertShardRequest(shard=shard(i)), metadata=mesh.md
        )
    await wait_until(lambda: mesh.applied == 2, what="v2 applied")
    applier = mesh.agent.applier
    assert applier is not None
    good = applier.current
    assert good is not None
    for n, spoil in enumerate(
        [
            lambda a: setattr(a.shards[0].steer.mark, "mark", 0),
            lambda a: a.pins.add(cidr="fe80::1%eth0/128", shard_id="s0"),
            lambda a: setattr(a.shards[1], "state", assignment_pb2.SHARD_STATE_DRAINING),
        ]
    ):
        bad = assignment_pb2.Assignment()
        bad.CopyFrom(good)
        bad.version = 100 + n
        spoil(bad)
        with pytest.raises(rules.RuleError):
            rules.check_assignment(bad)
        result = applier.apply(bad)
        assert not result.ok
        assert applier.current is good
        assert mesh.table.applied_version == 2
        assert f"version {100 + n}: rules: " in applier.last_error
    assert mesh.agent.status()["apply_error"] == applier.last_error

    async def degraded() -> control_plane_pb2.NodeStatus | None:
        st = await mesh.stub.GetStatus(control_plane_pb2.GetStatusRequest(), metadata=mesh.md)
        for node in st.nodes:
            if node.node_id == "node-e2e" and node_state(node, st.assignment.version) == "DEGRADED":
                return node
        return None

    node = await wait_until(degraded, 5, interval=0.05, what="the node shown as DEGRADED")
    assert node.applied_version == 2
    assert "rules: " in node.apply_error
