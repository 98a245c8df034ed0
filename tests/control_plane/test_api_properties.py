"""Property tests for the gRPC API: random well-typed and ill-typed requests.

Each request gets OK or a refusal with a client-side code (INVALID_ARGUMENT for a bad value;
NOT_FOUND, ALREADY_EXISTS or FAILED_PRECONDITION where the value is fine but the state says
no), never INTERNAL, UNKNOWN or a crash, and after every refusal the state is what it was.
Every Assignment the control plane publishes passes the agent's rules.
"""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from adaptermesh import assignment_rules as rules
from adaptermesh.proto import control_plane_pb2 as cp_pb2
from adaptermesh.proto import control_plane_pb2_grpc

from .conftest import RW_TOKEN, Harness, creds, shard
from .strategies import messages

SETTINGS = settings(
    max_examples=50,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
STATE_CODES = {
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.ALREADY_EXISTS,
    grpc.StatusCode.FAILED_PRECONDITION,
}
WRITES = {
    "UpsertShard": cp_pb2.UpsertShardRequest,
    "SetOverride": cp_pb2.SetOverrideRequest,
    "PinTenant": cp_pb2.PinTenantRequest,
    "UnpinTenant": cp_pb2.UnpinTenantRequest,
    "UpsertAdapterInstance": cp_pb2.UpsertAdapterInstanceRequest,
    "Apply": cp_pb2.ApplyRequest,
    "ReportLoad": cp_pb2.LoadReport,
    "ListHistory": cp_pb2.ListHistoryRequest,
}
MD = creds(RW_TOKEN)


def _state(stub: Any) -> tuple[object, ...]:
    return (
        stub.GetAssignment(cp_pb2.GetAssignmentRequest(), metadata=MD).SerializeToString(),
        stub.ListShards(cp_pb2.ListShardsRequest(), metadata=MD).SerializeToString(),
        stub.ListPins(cp_pb2.ListPinsRequest(), metadata=MD).SerializeToString(),
        stub.ListOverrides(cp_pb2.ListOverridesRequest(), metadata=MD).SerializeToString(),
        stub.ListAdapterInstances(
            cp_pb2.ListAdapterInstancesRequest(), metadata=MD
        ).SerializeToString(),
        tuple(
            (n.node_id, n.applied_version, n.apply_error)
            for n in stub.GetStatus(cp_pb2.GetStatusRequest(), metadata=MD).nodes
        ),
    )


def _call(channel: grpc.Channel, method: str, body: bytes) -> tuple[grpc.StatusCode, str]:
    fn = channel.unary_unary(f"/adaptermesh.v1.ControlPlane/{method}")
    try:
        fn(body, metadata=MD, timeout=10)
    except grpc.RpcError as exc:
        return exc.code(), exc.details() or ""
    return grpc.StatusCode.OK, ""


async def _run(cp: Harness, body: Any) -> None:
    for i in range(2):
        await cp.stub.UpsertShard(
            cp_pb2.UpsertShardRequest(shard=shard(f"s{i}", (f"10.0.{i}.1", 8000))), metadata=MD
        )
    await asyncio.to_thread(body, cp.server.port)


def _check(channel: grpc.Channel, stub: Any, method: str, payload: bytes) -> None:
    before = _state(stub)
    code, details = _call(channel, method, payload)
    assert (
        code == grpc.StatusCode.OK
        or code == grpc.StatusCode.INVALID_ARGUMENT
        or (code in STATE_CODES and method != "ReportLoad")
    ), (method, code, details)
    if code != grpc.StatusCode.OK:
        assert ": " in details, details  # names the field
        assert _state(stub) == before, (method, details)
    latest = stub.GetAssignment(cp_pb2.GetAssignmentRequest(), metadata=MD)
    rules.check_assignment(latest)  # what was accepted, every agent accepts


async def test_random_well_typed_requests(cp: Harness) -> None:
    def body(port: int) -> None:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = control_plane_pb2_grpc.ControlPlaneStub(channel)

            @SETTINGS
            @given(data=st.data(), method=st.sampled_from(sorted(WRITES)))
            def prop(data: st.DataObject, method: str) -> None:
                msg = data.draw(messages(WRITES[method]))
                _check(channel, stub, method, msg.SerializeToString())

            prop()

    await _run(cp, body)


async def test_random_ill_typed_requests(cp: Harness) -> None:
    def body(port: int) -> None:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = control_plane_pb2_grpc.ControlPlaneStub(channel)

            @SETTINGS
            @given(
                method=st.sampled_from(sorted(WRITES)),
                raw=st.one_of(
                    st.binary(max_size=64),
                    # A string field holding bytes that are not UTF-8.
                    st.builds(
                        lambda tag, junk: bytes([tag, len(junk)]) + junk,
                        st.sampled_from([0x0A, 0x12, 0x22]),
                        st.binary(min_size=1, max_size=8).map(lambda b: b"\xff" + b),
                    ),
                ),
            )
            def prop(method: str, raw: bytes) -> None:
                _check(channel, stub, method, raw)

            prop()

    await _run(cp, body)


async def test_random_shards_accepted_at_write_time_pass_the_agents_rules(cp: Harness) -> None:
    """Steered toward valid shards: most are accepted, and each accepted one publishes."""

    def body(port: int) -> None:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = control_plane_pb2_grpc.ControlPlaneStub(channel)

            @SETTINGS
            @given(
                i=st.integers(0, 40),
                eps=st.lists(
                    st.tuples(
                        st.sampled_from(["10.1.0.1", "10.1.0.2", "fd00::1", "999.0.0.1"]),
                        st.sampled_from([0, 80, 8000, 65535, 65536]),
                    ),
                    max_size=3,
                ),
                steer=st.sampled_from(["tunnel", "mark", "redirect", "none"]),
                value=st.sampled_from([0, 1, 5, (1 << 24) - 1, 1 << 24, 2**32 - 1]),
                mac=st.sampled_from(["", "02:00:00:00:00:01", "02:00:00:00:00", "x"]),
            )
            def prop(i: int, eps: list[tuple[str, int]], steer: str, value: int, mac: str) -> None:
                s = cp_pb2.UpsertShardRequest().shard
                s.id = f"p{i}"
                for addr, p in eps:
                    ep = s.endpoints.add(address=addr)
                    ep.port = min(p, 2**32 - 1)
                if steer == "tunnel":
                    s.steer.tunnel.remote_ipv4 = "192.0.2.1"
                    s.steer.tunnel.vni = value
                    s.steer.tunnel.inner_dst_mac = mac
                elif steer == "mark":
                    s.steer.mark.mark = value
                elif steer == "redirect":
                    s.steer.redirect.ifindex = value
                    s.steer.redirect.dst_mac = mac
                _check(
                    channel,
                    stub,
                    "UpsertShard",
                    cp_pb2.UpsertShardRequest(shard=s).SerializeToString(),
                )
                try:
                    rules.check_shard(s, "shard")
                    valid = True
                except rules.RuleError:
                    valid = False
                code, _ = _call(
                    channel, "UpsertShard", cp_pb2.UpsertShardRequest(shard=s).SerializeToString()
                )
                # The API refuses exactly what the rules refuse (no second rule set).
                assert (code == grpc.StatusCode.OK) == valid, (code, s)

            prop()

    await _run(cp, body)
