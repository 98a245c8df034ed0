"""The xDS server against a real Envoy: config, traffic split, updates, NACK, restart, affinity."""

from __future__ import annotations

import itertools
import math
import threading
import time

import pytest
from conftest import TEST_OPTIONS, Xds
from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.endpoint.v3 import endpoint_pb2
from envoy.config.listener.v3 import listener_pb2
from envoy.config.route.v3 import route_pb2
from google.protobuf import json_format
from mesh_support import (
    EndpointSpec,
    Traffic,
    assignment,
    free_port,
    healthy_hosts,
    send_requests,
    shard,
    wait_routable,
    wait_until,
)

from adaptermesh.mesh.cache import SnapshotCache
from adaptermesh.mesh.snapshot import (
    CLUSTER_TYPE,
    ENDPOINT_TYPE,
    LISTENER_TYPE,
    ROUTE_TYPE,
    Snapshot,
    build_snapshot,
)

pytestmark = pytest.mark.slow


def _dump_section(dump: dict, suffix: str) -> dict:
    for config in dump["configs"]:
        if config["@type"].endswith("." + suffix):
            return config
    return {}


def _parse(message_dict: dict, message_type: type) -> object:
    message = message_type()
    json_format.ParseDict(message_dict, message, ignore_unknown_fields=True)
    return message


def _dynamic_state(envoy) -> dict[str, dict[str, object]]:
    """type -> name -> resource of everything Envoy got over xDS, plus type -> version_info
    for the wildcard types (Envoy keeps per-resource versions of the last *change* only)."""
    dump = envoy.config_dump()
    state: dict[str, dict[str, object]] = {
        t: {} for t in (CLUSTER_TYPE, ENDPOINT_TYPE, LISTENER_TYPE, ROUTE_TYPE)
    }
    clusters = _dump_section(dump, "ClustersConfigDump")
    for item in clusters.get("dynamic_active_clusters", []):
        cluster = _parse(item["cluster"], cluster_pb2.Cluster)
        state[CLUSTER_TYPE][cluster.name] = cluster
    listeners = _dump_section(dump, "ListenersConfigDump")
    for item in listeners.get("dynamic_listeners", []):
        active = item.get("active_state")
        if active:
            listener = _parse(active["listener"], listener_pb2.Listener)
            state[LISTENER_TYPE][listener.name] = listener
    for item in _dump_section(dump, "RoutesConfigDump").get("dynamic_route_configs", []):
        route = _parse(item["route_config"], route_pb2.RouteConfiguration)
        state[ROUTE_TYPE][route.name] = route
    for item in _dump_section(dump, "EndpointsConfigDump").get("dynamic_endpoint_configs", []):
        cla = _parse(item["endpoint_config"], endpoint_pb2.ClusterLoadAssignment)
        state[ENDPOINT_TYPE][cla.cluster_name] = cla
    state["versions"] = {
        CLUSTER_TYPE: clusters.get("version_info"),
        LISTENER_TYPE: listeners.get("version_info"),
    }
    return state


def assert_envoy_matches(envoy, snapshot: Snapshot, check_versions: bool = True) -> None:
    """Envoy holds exactly the snapshot's resources (and, unless told otherwise, reports the
    snapshot's CDS/LDS versions; Envoy keeps its old version_info when a response it
    receives changes nothing, as after a reconnect)."""
    state = _dynamic_state(envoy)
    for type_url, resources in snapshot.resources.items():
        if type_url == ROUTE_TYPE:
            # A removed listener drains for a while and keeps its RDS subscription meanwhile.
            assert set(state[type_url]) >= set(resources), type_url
        else:
            assert set(state[type_url]) == set(resources), type_url
        for name, resource in resources.items():
            got = state[type_url][name]
            if type_url == ENDPOINT_TYPE:
                # Envoy dumps its own view of EDS (defaults filled in): compare what matters.
                assert _endpoints(got) == _endpoints(resource), name
            else:
                assert got == resource, f"{type_url} {name} differs from the snapshot"
    if check_versions:
        for type_url, version in state["versions"].items():
            assert version == snapshot.type_versions[type_url], type_url


def _endpoints(cla) -> list[tuple]:
    return sorted(
        (
            lb.endpoint.address.socket_address.address,
            lb.endpoint.address.socket_address.port_value,
            # Envoy reports live health there, so health is checked through /clusters.
            lb.load_balancing_weight.value,
            json_format.MessageToJson(lb.metadata, sort_keys=True),
        )
        for group in cla.endpoints
        for lb in group.lb_endpoints
    )


def _wait_healthy(envoy, cluster: str, ports: list[int]) -> None:
    wait_until(
        lambda: [p for p, _ in healthy_hosts(envoy, cluster)] == sorted(ports),
        10,
        what=f"{cluster} hosts {ports} healthy",
    )


def test_envoy_config_matches_snapshot(xds: Xds, start_envoy, backends) -> None:
    b = backends(4)
    a = assignment(
        1,
        shard("s0", free_port(), [EndpointSpec(b[0], 3, ("a1",)), EndpointSpec(b[1], 1)]),
        shard("s1", free_port(), [EndpointSpec(b[2], 2), EndpointSpec(b[3], 1, draining=True)]),
    )
    version = xds.cache.set_assignment("node-cfg", a)
    envoy = start_envoy("node-cfg")
    assert xds.cache.wait_for_version(["node-cfg"], version, 10)
    assert_envoy_matches(envoy, xds.cache.get_snapshot("node-cfg"))
    eds_health = {
        h["address"]["socket_address"]["port_value"]: h["health_status"].get("eds_health_status")
        for c in envoy.clusters()["cluster_statuses"]
        if c["name"] == "shard-s1"
        for h in c["host_statuses"]
    }
    assert eds_health[b[3].port] == "DRAINING"
    assert eds_health[b[2].port] != "DRAINING"

    # A weight change pushes only EDS; the dump follows, the other types keep version 1.
    a.version = 2
    a.shards[0].endpoints[1].weight = 7
    version = xds.cache.set_assignment("node-cfg", a)
    assert xds.cache.wait_for_version(["node-cfg"], version, 10)
    snapshot = xds.cache.get_snapshot("node-cfg")
    assert snapshot.type_versions[CLUSTER_TYPE] == "1"
    assert snapshot.type_versions[ENDPOINT_TYPE] == "2"
    assert_envoy_matches(envoy, snapshot)

    # Removing a shard removes its listener and cluster from Envoy.
    del a.shards[1]
    a.version = 3
    version = xds.cache.set_assignment("node-cfg", a)
    assert xds.cache.wait_for_version(["node-cfg"], version, 10)
    wait_until(
        lambda: set(_dynamic_state(envoy)[LISTENER_TYPE]) == {"shard-s0"},
        10,
        what="listener removal",
    )
    assert_envoy_matches(envoy, xds.cache.get_snapshot("node-cfg"))


def _binomial_ok(counts: dict[str, int], weights: dict[str, int], n: int) -> list[str]:
    """Each backend's count lies within 4 standard deviations of n * w / sum(w)."""
    total_weight = sum(weights.values())
    problems = []
    for name, weight in weights.items():
        p = weight / total_weight
        expected, sigma = n * p, math.sqrt(n * p * (1 - p))
        if abs(counts.get(name, 0) - expected) > 4 * sigma:
            problems.append(f"{name}: {counts.get(name, 0)} vs {expected:.0f} ± {4 * sigma:.0f}")
    return problems


def test_weighted_split_follows_eds_weights(xds: Xds, start_envoy, backends) -> None:
    b = backends(3)
    port = free_port()
    weights = {b[0].name: 1, b[1].name: 2, b[2].name: 5}
    xds.cache.set_assignment(
        "node-split",
        assignment(1, shard("s0", port, [EndpointSpec(x, weights[x.name]) for x in b])),
    )
    envoy = start_envoy("node-split")
    _wait_healthy(envoy, "shard-s0", [x.port for x in b])
    wait_routable(port, set(weights))

    n = 3000
    traffic = Traffic()
    threads = [
        threading.Thread(target=send_requests, args=(port, n // 3), kwargs={"traffic": traffic})
        for _ in range(3)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert traffic.errors == []
    assert traffic.total == n
    assert _binomial_ok(traffic.counts, weights, n) == [], traffic.counts


def test_twenty_weight_updates_under_load_drop_nothing(xds: Xds, start_envoy, backends) -> None:
    b = backends(3)
    port = free_port()
    a = assignment(1, shard("s0", port, [EndpointSpec(x, 1) for x in b]))
    xds.cache.set_assignment("node-load", a)
    envoy = start_envoy("node-load")
    _wait_healthy(envoy, "shard-s0", [x.port for x in b])

    stop = threading.Event()
    traffic = Traffic()
    clients = [
        threading.Thread(
            target=send_requests, args=(port, 10**9), kwargs={"traffic": traffic, "stop": stop}
        )
        for _ in range(3)
    ]
    for c in clients:
        c.start()
    try:
        totals = []
        for i in range(20):
            a.version = 2 + i
            for j, ep in enumerate(a.shards[0].endpoints):
                ep.weight = 1 + (i + j) % 5 * 3
            version = xds.cache.set_assignment("node-load", a)
            assert xds.cache.wait_for_version(["node-load"], version, 10)
            totals.append(traffic.total)
            wait_until(
                lambda: traffic.total > totals[-1], 10, what="requests served after the update"
            )
    finally:
        stop.set()
        for c in clients:
            c.join()
    assert traffic.errors == []
    # Traffic flowed throughout: requests completed between every pair of updates.
    assert all(later > earlier for earlier, later in itertools.pairwise(totals))
    assert xds.cache.node_status("node-load").acked_version == "21"
    assert envoy.stats("upstream_rq_5xx").get("cluster.shard-s0.upstream_rq_5xx", 0) == 0


def test_nack_keeps_last_good_config(xds: Xds, start_envoy, backends) -> None:
    b = backends(2)
    port = free_port()
    xds.cache.set_assignment(
        "node-nack",
        assignment(1, shard("s0", port, [EndpointSpec(b[0], 1), EndpointSpec(b[1], 1)])),
    )
    envoy = start_envoy("node-nack")
    _wait_healthy(envoy, "shard-s0", [b[0].port, b[1].port])
    good = xds.cache.get_snapshot("node-nack")

    # Endpoint weight 0 passes our reference checks but Envoy's validation rejects it.
    bad = build_snapshot(
        assignment(2, shard("s0", port, [EndpointSpec(b[0], 1)])), options=TEST_OPTIONS
    )
    bad.resources[ENDPOINT_TYPE]["shard-s0"].endpoints[0].lb_endpoints[
        0
    ].load_balancing_weight.value = 0
    xds.cache.set_snapshot(
        "node-nack", Snapshot.create("2", {t: list(r.values()) for t, r in bad.resources.items()})
    )

    def nacked() -> bool:
        status = xds.cache.node_status("node-nack")
        return status is not None and status.last_nack is not None

    wait_until(nacked, 10, what="the NACK")
    status = xds.cache.node_status("node-nack")
    assert status.last_nack.version == "2"
    assert status.last_nack.type_url == ENDPOINT_TYPE
    assert "load_balancing_weight" in status.last_nack.message
    assert status.acked_version == "1"
    assert status.types[ENDPOINT_TYPE].acked_version == "1"
    assert status.as_dict()["last_nack"]["version"] == "2"

    # The last good config keeps serving both backends.
    traffic = send_requests(port, 200)
    assert traffic.errors == []
    assert set(traffic.counts) == {b[0].name, b[1].name}
    cla = _dynamic_state(envoy)[ENDPOINT_TYPE]["shard-s0"]
    assert _endpoints(cla) == _endpoints(good.resources[ENDPOINT_TYPE]["shard-s0"])
    # The rejected version is not sent again.
    time.sleep(0.5)
    assert xds.cache.node_status("node-nack").types[ENDPOINT_TYPE].pushes == 2

    # The next change gets a new version and is accepted.
    version = xds.cache.set_assignment(
        "node-nack",
        assignment(3, shard("s0", port, [EndpointSpec(b[0], 2), EndpointSpec(b[1], 1)])),
    )
    assert xds.cache.wait_for_version(["node-nack"], version, 10)
    assert_envoy_matches(envoy, xds.cache.get_snapshot("node-nack"))


def test_server_restart_keeps_serving_and_resyncs(xds: Xds, start_envoy, backends) -> None:
    b = backends(3)
    port = free_port()
    a = assignment(1, shard("s0", port, [EndpointSpec(b[0], 1), EndpointSpec(b[1], 1)]))
    xds.cache.set_assignment("node-restart", a)
    envoy = start_envoy("node-restart")
    _wait_healthy(envoy, "shard-s0", [b[0].port, b[1].port])

    xds.server.stop()
    traffic = send_requests(port, 200)
    assert traffic.errors == []
    assert set(traffic.counts) == {b[0].name, b[1].name}

    # A fresh server (and cache, as after an agent restart) with a newer assignment.
    cache = SnapshotCache(options=TEST_OPTIONS)
    a.version = 2
    a.shards[0].endpoints.add(address="127.0.0.1", port=b[2].port, weight=1)
    version = cache.set_assignment("node-restart", a)
    xds.restart(cache)
    assert cache.wait_for_version(["node-restart"], version, 15)
    assert_envoy_matches(envoy, cache.get_snapshot("node-restart"), check_versions=False)
    _wait_healthy(envoy, "shard-s0", [x.port for x in b])
    wait_routable(port, {x.name for x in b})
    traffic = send_requests(port, 300)
    assert traffic.errors == []
    assert set(traffic.counts) == {x.name for x in b}


def test_adapter_affinity_routes_by_header(xds: Xds, start_envoy, backends) -> None:
    b = backends(4)
    port = free_port()
    xds.cache.set_assignment(
        "node-aff",
        assignment(
            1,
            shard(
                "s0",
                port,
                [
                    EndpointSpec(b[0], 1, ("sql", "chat")),
                    EndpointSpec(b[1], 1, ("chat",)),
                    EndpointSpec(b[2], 1, ("code",)),
                    EndpointSpec(b[3], 1, ("legal",), draining=True),
                ],
            ),
        ),
    )
    envoy = start_envoy("node-aff")
    _wait_healthy(envoy, "shard-s0", [b[0].port, b[1].port, b[2].port])
    wait_routable(port, {b[0].name, b[1].name, b[2].name})

    def backends_for(headers: dict[str, str]) -> set[str]:
        traffic = send_requests(port, 90, headers)
        assert traffic.errors == []
        return set(traffic.counts)

    assert backends_for({"x-adapter-id": "sql"}) == {b[0].name}
    assert backends_for({"x-adapter-id": "chat"}) == {b[0].name, b[1].name}
    assert backends_for({"x-adapter-id": "code"}) == {b[2].name}
    # Nobody serving holds it (only a draining worker does): the whole shard.
    assert backends_for({"x-adapter-id": "legal"}) == {b[0].name, b[1].name, b[2].name}
    assert backends_for({"x-adapter-id": "unknown"}) == {b[0].name, b[1].name, b[2].name}
    assert backends_for({}) == {b[0].name, b[1].name, b[2].name}


def test_delta_xds_envoy(xds: Xds, start_envoy, backends) -> None:
    b = backends(3)
    a = assignment(
        1,
        shard("s0", free_port(), [EndpointSpec(b[0], 1), EndpointSpec(b[1], 2)]),
        shard("s1", free_port(), [EndpointSpec(b[2], 1)]),
    )
    version = xds.cache.set_assignment("node-delta", a)
    envoy = start_envoy("node-delta", delta=True)
    assert xds.cache.wait_for_version(["node-delta"], version, 10)
    assert_envoy_matches(envoy, xds.cache.get_snapshot("node-delta"))

    a.version = 2
    a.shards[0].endpoints[0].weight = 9
    version = xds.cache.set_assignment("node-delta", a)
    assert xds.cache.wait_for_version(["node-delta"], version, 10)
    assert_envoy_matches(envoy, xds.cache.get_snapshot("node-delta"))

    a.version = 3
    del a.shards[1]
    version = xds.cache.set_assignment("node-delta", a)
    assert xds.cache.wait_for_version(["node-delta"], version, 10)
    wait_until(
        lambda: set(_dynamic_state(envoy)[CLUSTER_TYPE]) == {"shard-s0"},
        10,
        what="cluster removal over delta xDS",
    )
    assert set(_dynamic_state(envoy)[LISTENER_TYPE]) == {"shard-s0"}
    traffic = send_requests(a.shards[0].service_port, 100)
    assert traffic.errors == []
