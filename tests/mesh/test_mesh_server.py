"""ADS protocol behaviour with a raw gRPC client: nonces, ACK/NACK, garbage, delta, scale."""

from __future__ import annotations

import time

import grpc
import pytest
from conftest import Xds
from envoy.config.core.v3 import base_pb2
from envoy.service.discovery.v3 import discovery_pb2
from google.rpc import status_pb2
from mesh_support import AdsClient, Backend, EndpointSpec, assignment, shard
from prometheus_client import REGISTRY
from waiting import wait_until

from adaptermesh.mesh.snapshot import CLUSTER_TYPE, ENDPOINT_TYPE, LISTENER_TYPE, ROUTE_TYPE

NODE = base_pb2.Node(id="proto-node", cluster="c")


@pytest.fixture
def workers():
    made = [Backend(f"w{i}") for i in range(3)]
    yield made
    for backend in made:
        backend.close()


def _two_shards(version: int, workers, weight: int = 1):
    return assignment(
        version,
        shard("s0", 20001, [EndpointSpec(workers[0], weight), EndpointSpec(workers[1], 1)]),
        shard("s1", 20002, [EndpointSpec(workers[2], 1)]),
    )


def _req(
    type_url: str,
    *,
    names=(),
    version: str = "",
    nonce: str = "",
    error: str = "",
    node: bool = False,
) -> discovery_pb2.DiscoveryRequest:
    request = discovery_pb2.DiscoveryRequest(
        type_url=type_url, resource_names=list(names), version_info=version, response_nonce=nonce
    )
    if node:
        request.node.CopyFrom(NODE)
    if error:
        request.error_detail.CopyFrom(status_pb2.Status(code=3, message=error))
    return request


def _metric(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def _subscribe_all(client: AdsClient) -> dict[str, discovery_pb2.DiscoveryResponse]:
    """Open CDS/LDS (wildcard) and EDS/RDS for both shards; ACK everything."""
    got = {}
    client.send(_req(CLUSTER_TYPE, node=True))
    client.send(_req(LISTENER_TYPE))
    for _ in range(2):
        response = client.recv()
        got[response.type_url] = response
    client.send(_req(ENDPOINT_TYPE, names=["shard-s0", "shard-s1"]))
    client.send(_req(ROUTE_TYPE, names=["shard-s0", "shard-s1"]))
    for _ in range(2):
        response = client.recv()
        got[response.type_url] = response
    for response in got.values():
        client.send(
            _req(
                response.type_url,
                names=["shard-s0", "shard-s1"]
                if response.type_url in (ENDPOINT_TYPE, ROUTE_TYPE)
                else (),
                version=response.version_info,
                nonce=response.nonce,
            )
        )
    return got


def test_sotw_ack_then_push_only_what_changed(xds: Xds, workers) -> None:
    xds.cache.set_assignment("proto-node", _two_shards(1, workers))
    client = AdsClient(xds.port)
    try:
        got = _subscribe_all(client)
        assert {t: len(r.resources) for t, r in got.items()} == {
            CLUSTER_TYPE: 2,
            LISTENER_TYPE: 2,
            ENDPOINT_TYPE: 2,
            ROUTE_TYPE: 2,
        }
        assert all(r.version_info == "1" for r in got.values())
        assert xds.cache.wait_for_version(["proto-node"], "1", 5)

        xds.cache.set_assignment("proto-node", _two_shards(2, workers, weight=4))
        response = client.recv()
        assert response.type_url == ENDPOINT_TYPE
        assert response.version_info == "2"
        client.expect_silence(0.3)  # nothing else changed
        client.send(
            _req(ENDPOINT_TYPE, names=["shard-s0", "shard-s1"], version="2", nonce=response.nonce)
        )
        assert xds.cache.wait_for_version(["proto-node"], "2", 5)
        status = xds.cache.node_status("proto-node")
        assert status.streams == 1
        assert status.types[CLUSTER_TYPE].acked_version == "1"
    finally:
        client.close()


def test_stale_nonce_is_ignored_and_resource_names_filter(xds: Xds, workers) -> None:
    xds.cache.set_assignment("proto-node", _two_shards(1, workers))
    client = AdsClient(xds.port)
    try:
        client.send(_req(ENDPOINT_TYPE, names=["shard-s1"], node=True))
        first = client.recv()
        assert [r.type_url for r in first.resources] == [ENDPOINT_TYPE]
        assert len(first.resources) == 1
        before = _metric("adaptermesh_xds_stale_nonces_total")
        client.send(_req(ENDPOINT_TYPE, names=["shard-s0", "shard-s1"], nonce="not-ours"))
        client.expect_silence(0.3)
        assert _metric("adaptermesh_xds_stale_nonces_total") == before + 1
        # The real nonce with new names gets both.
        client.send(
            _req(ENDPOINT_TYPE, names=["shard-s0", "shard-s1"], version="1", nonce=first.nonce)
        )
        assert len(client.recv().resources) == 2
    finally:
        client.close()


def test_nack_is_recorded_and_the_version_never_resent(xds: Xds, workers) -> None:
    xds.cache.set_assignment("proto-node", _two_shards(1, workers))
    client = AdsClient(xds.port)
    try:
        client.send(_req(CLUSTER_TYPE, node=True))
        first = client.recv()
        client.send(_req(CLUSTER_TYPE, version="1", nonce=first.nonce))
        xds.cache.set_assignment(
            "proto-node", assignment(2, shard("s0", 20001, [EndpointSpec(workers[0], 1)]))
        )
        second = client.recv()
        assert second.version_info == "2"
        before = _metric("adaptermesh_xds_nacks_total", type="Cluster", node="proto-node")
        client.send(_req(CLUSTER_TYPE, version="1", nonce=second.nonce, error="bad cluster"))
        client.expect_silence(0.3)
        status = xds.cache.node_status("proto-node")
        assert status.last_nack.version == "2"
        assert status.last_nack.message == "bad cluster"
        assert status.types[CLUSTER_TYPE].acked_version == "1"
        assert status.types[CLUSTER_TYPE].nacked_versions == ("2",)
        assert (
            _metric("adaptermesh_xds_nacks_total", type="Cluster", node="proto-node") == before + 1
        )
    finally:
        client.close()

    # A reconnect does not get the rejected version again...
    client = AdsClient(xds.port)
    try:
        client.send(_req(CLUSTER_TYPE, version="1", node=True))
        client.expect_silence(0.3)
        # ...but the next version arrives.
        xds.cache.set_assignment("proto-node", _two_shards(3, workers))
        assert client.recv().version_info == "3"
    finally:
        client.close()


def test_reconnect_resumes_with_the_current_version(xds: Xds, workers) -> None:
    xds.cache.set_assignment("proto-node", _two_shards(1, workers))
    client = AdsClient(xds.port)
    client.send(_req(CLUSTER_TYPE, node=True))
    client.send(_req(CLUSTER_TYPE, version="1", nonce=client.recv().nonce))
    client.close()
    xds.cache.set_assignment("proto-node", _two_shards(2, workers, weight=3))
    client = AdsClient(xds.port)
    try:
        client.send(_req(CLUSTER_TYPE, version="1", node=True))
        response = client.recv()
        assert response.version_info == "1"  # clusters did not change in version 2
        assert len(response.resources) == 2
    finally:
        client.close()


def test_unknown_type_gets_one_empty_answer(xds: Xds, workers) -> None:
    xds.cache.set_assignment("proto-node", _two_shards(1, workers))
    client = AdsClient(xds.port)
    weird = "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.Secret"
    try:
        before = _metric("adaptermesh_xds_unknown_type_requests_total")
        client.send(_req(weird, names=["x"], node=True))
        response = client.recv()
        assert response.type_url == weird
        assert list(response.resources) == []
        client.send(_req(weird, names=["x"], version=response.version_info, nonce=response.nonce))
        client.expect_silence(0.3)
        assert _metric("adaptermesh_xds_unknown_type_requests_total") == before + 1
        # The stream still serves real types.
        client.send(_req(CLUSTER_TYPE))
        assert len(client.recv().resources) == 2
    finally:
        client.close()


@pytest.mark.parametrize(
    ("request_", "detail"),
    [
        (discovery_pb2.DiscoveryRequest(type_url=CLUSTER_TYPE), "node.id"),
        (discovery_pb2.DiscoveryRequest(node=NODE), "type_url"),
    ],
)
def test_protocol_violations_close_only_that_stream(xds: Xds, workers, request_, detail) -> None:
    xds.cache.set_assignment("proto-node", _two_shards(1, workers))
    bad = AdsClient(xds.port)
    try:
        bad.send(request_)
        assert bad.recv() is None
        assert bad.error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert detail in bad.error.details()
    finally:
        bad.close()
    _assert_server_alive(xds)


def test_undecodable_bytes_close_only_that_stream(xds: Xds, workers) -> None:
    xds.cache.set_assignment("proto-node", _two_shards(1, workers))
    bad = AdsClient(xds.port, raw=True)
    try:
        bad.send(b"\xff\xff\xff\xff garbage that is no protobuf")
        assert bad.recv() is None
        assert bad.error.code() == grpc.StatusCode.INVALID_ARGUMENT
    finally:
        bad.close()
    _assert_server_alive(xds)


def _assert_server_alive(xds: Xds) -> None:
    client = AdsClient(xds.port)
    try:
        client.send(_req(CLUSTER_TYPE, node=True))
        assert len(client.recv().resources) == 2
    finally:
        client.close()


def _dreq(
    type_url: str, *, subscribe=(), unsubscribe=(), nonce="", error="", node=False, initial=None
) -> discovery_pb2.DeltaDiscoveryRequest:
    request = discovery_pb2.DeltaDiscoveryRequest(
        type_url=type_url,
        resource_names_subscribe=list(subscribe),
        resource_names_unsubscribe=list(unsubscribe),
        response_nonce=nonce,
        initial_resource_versions=initial or {},
    )
    if node:
        request.node.CopyFrom(NODE)
    if error:
        request.error_detail.CopyFrom(status_pb2.Status(code=3, message=error))
    return request


def test_delta_sends_changes_and_removals(xds: Xds, workers) -> None:
    xds.cache.set_assignment("proto-node", _two_shards(1, workers))
    client = AdsClient(xds.port, delta=True)
    try:
        client.send(_dreq(CLUSTER_TYPE, node=True))
        first = client.recv()
        assert sorted(r.name for r in first.resources) == ["shard-s0", "shard-s1"]
        client.send(_dreq(CLUSTER_TYPE, nonce=first.nonce))
        client.send(_dreq(ENDPOINT_TYPE, subscribe=["shard-s0"]))
        eds = client.recv()
        assert [r.name for r in eds.resources] == ["shard-s0"]
        client.send(_dreq(ENDPOINT_TYPE, nonce=eds.nonce))

        # A weight change on s1 (not subscribed) sends nothing; on s0 only s0.
        changed = _two_shards(2, workers)
        changed.shards[1].endpoints[0].weight = 5
        xds.cache.set_assignment("proto-node", changed)
        client.expect_silence(0.3)
        changed = _two_shards(3, workers, weight=7)
        changed.shards[1].endpoints[0].weight = 5
        xds.cache.set_assignment("proto-node", changed)
        update = client.recv()
        assert update.type_url == ENDPOINT_TYPE
        assert [r.name for r in update.resources] == ["shard-s0"]
        client.send(_dreq(ENDPOINT_TYPE, nonce=update.nonce))
        assert xds.cache.wait_for_version(["proto-node"], "3", 5)

        # Dropping shard s1 removes its cluster.
        xds.cache.set_assignment(
            "proto-node",
            assignment(
                4, shard("s0", 20001, [EndpointSpec(workers[0], 7), EndpointSpec(workers[1], 1)])
            ),
        )
        removal = client.recv()
        assert removal.type_url == CLUSTER_TYPE
        assert list(removal.removed_resources) == ["shard-s1"]
        assert list(removal.resources) == []
        # NACK in delta is recorded too.
        client.send(_dreq(CLUSTER_TYPE, nonce=removal.nonce, error="no"))

        def nack_recorded() -> bool:
            status = xds.cache.node_status("proto-node")
            return status is not None and status.last_nack is not None

        wait_until(nack_recorded, 5, what="the delta NACK recorded")
        assert xds.cache.node_status("proto-node").last_nack.message == "no"
    finally:
        client.close()


def test_delta_reconnect_with_known_versions_sends_only_the_difference(xds: Xds, workers) -> None:
    xds.cache.set_assignment("proto-node", _two_shards(1, workers))
    snapshot = xds.cache.get_snapshot("proto-node")
    known = dict(snapshot.resource_versions[CLUSTER_TYPE])
    known["shard-gone"] = "abc"
    client = AdsClient(xds.port, delta=True)
    try:
        client.send(_dreq(CLUSTER_TYPE, node=True, initial=known))
        response = client.recv()
        assert list(response.resources) == []
        assert list(response.removed_resources) == ["shard-gone"]
    finally:
        client.close()


def test_many_streams_and_a_stuck_one(xds: Xds, workers) -> None:
    """Fifty streams all get an update while one stream never reads its big responses."""
    big = assignment(
        1,
        *[
            shard(
                f"big{i}",
                21000 + i,
                [
                    EndpointSpec(workers[j % 3], 1, tuple(f"adapter-{i}-{k}" for k in range(40)))
                    for j in range(3)
                ],
            )
            for i in range(150)
        ],
    )
    for i in range(3):
        big.shards[0].endpoints[i].port = workers[i].port
    xds.cache.set_assignment("stuck", big)
    stuck_channel = grpc.insecure_channel(f"127.0.0.1:{xds.port}")
    stuck_call = stuck_channel.stream_stream(
        "/envoy.service.discovery.v3.AggregatedDiscoveryService/StreamAggregatedResources",
        request_serializer=lambda m: m.SerializeToString(),
        response_deserializer=discovery_pb2.DiscoveryResponse.FromString,
    )
    stuck_node = base_pb2.Node(id="stuck")
    requests = [
        discovery_pb2.DiscoveryRequest(node=stuck_node, type_url=t)
        for t in (CLUSTER_TYPE, LISTENER_TYPE)
    ]
    stuck = stuck_call(iter(requests))  # never iterated: its responses pile up unread
    clients = []
    try:
        for i in range(50):
            xds.cache.set_assignment(f"n{i}", _two_shards(1, workers))
            client = AdsClient(xds.port)
            client.send(
                discovery_pb2.DiscoveryRequest(
                    node=base_pb2.Node(id=f"n{i}"), type_url=CLUSTER_TYPE
                )
            )
            clients.append(client)
        for client in clients:
            first = client.recv()
            client.send(_req(CLUSTER_TYPE, version="1", nonce=first.nonce))
        for _ in range(3):
            big.version += 1
            for s in big.shards:
                s.endpoints[0].weight += 1
            xds.cache.set_assignment("stuck", big)
        start = time.monotonic()
        for i in range(50):
            changed = _two_shards(2, workers)
            changed.shards[0].labels["adaptermesh.io/lb-policy"] = "least_request"
            xds.cache.set_assignment(f"n{i}", changed)
        for client in clients:
            assert client.recv(5).version_info == "2"
        assert time.monotonic() - start < 5
    finally:
        for client in clients:
            client.close()
        stuck.cancel()
        stuck_channel.close()
