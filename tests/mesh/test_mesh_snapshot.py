"""Pure builders, Assignment validation, snapshot consistency, the cache and the bootstrap."""

from __future__ import annotations

import pytest
from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.core.v3 import health_check_pb2
from envoy.extensions.filters.http.ext_proc.v3 import ext_proc_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import (
    http_connection_manager_pb2 as hcm_pb2,
)
from envoy.extensions.upstreams.http.v3 import http_protocol_options_pb2
from hypothesis import given, settings
from hypothesis import strategies as st

from adaptermesh.mesh.bootstrap import (
    EnvoyError,
    EnvoyProcess,
    build_bootstrap,
    validate_bootstrap,
)
from adaptermesh.mesh.cache import SnapshotCache, StaleVersionError
from adaptermesh.mesh.snapshot import (
    CLUSTER_TYPE,
    ENDPOINT_TYPE,
    LISTENER_TYPE,
    ROUTE_TYPE,
    WEBSOCKET_PATH,
    AssignmentError,
    BuildOptions,
    ExtProcOptions,
    InconsistentSnapshotError,
    Snapshot,
    build_snapshot,
)
from adaptermesh.proto import assignment_pb2 as ap
from adaptermesh.worker.ws import WS_PATH


def _shard(sid: str = "s0", port: int = 20000, **labels: str) -> ap.Shard:
    return ap.Shard(
        id=sid,
        service_address="127.0.0.1",
        service_port=port,
        labels=labels,
        endpoints=[
            ap.Endpoint(address="10.0.0.1", port=8000, weight=3, adapters=["sql", "chat"]),
            ap.Endpoint(address="10.0.0.2", port=8000, weight=1, draining=True, adapters=["legal"]),
        ],
    )


def test_cluster_settings() -> None:
    snap = build_snapshot(ap.Assignment(version=7, shards=[_shard()]))
    cluster = snap.resources[CLUSTER_TYPE]["shard-s0"]
    assert snap.version == "7"
    assert cluster.type == cluster_pb2.Cluster.EDS
    assert cluster.lb_policy == cluster_pb2.Cluster.ROUND_ROBIN
    assert cluster.health_checks[0].http_health_check.path == "/health"
    assert cluster.outlier_detection.consecutive_5xx.value == 5
    assert cluster.circuit_breakers.thresholds[0].max_requests.value == 4096
    assert list(cluster.lb_subset_config.subset_selectors[0].keys) == ["adapter"]
    assert cluster.lb_subset_config.list_as_any
    options = http_protocol_options_pb2.HttpProtocolOptions()
    cluster.typed_extension_protocol_options[
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
    ].Unpack(options)
    assert options.explicit_http_config.HasField("http_protocol_options")


def test_labels_pick_least_request_and_http2() -> None:
    shard = _shard(
        **{"adaptermesh.io/lb-policy": "least_request", "adaptermesh.io/upstream-protocol": "http2"}
    )
    cluster = build_snapshot(ap.Assignment(version=1, shards=[shard])).resources[CLUSTER_TYPE][
        "shard-s0"
    ]
    assert cluster.lb_policy == cluster_pb2.Cluster.LEAST_REQUEST
    options = http_protocol_options_pb2.HttpProtocolOptions()
    cluster.typed_extension_protocol_options[
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
    ].Unpack(options)
    assert options.explicit_http_config.HasField("http2_protocol_options")


def test_endpoints_routes_and_listener() -> None:
    snap = build_snapshot(ap.Assignment(version=1, shards=[_shard()]))
    cla = snap.resources[ENDPOINT_TYPE]["shard-s0"]
    lbs = cla.endpoints[0].lb_endpoints
    assert [lb.load_balancing_weight.value for lb in lbs] == [3, 1]
    assert [lb.health_status for lb in lbs] == [health_check_pb2.UNKNOWN, health_check_pb2.DRAINING]
    adapters = lbs[0].metadata.filter_metadata["envoy.lb"].fields["adapter"].list_value
    assert [v.string_value for v in adapters.values] == ["chat", "sql"]
    routes = snap.resources[ROUTE_TYPE]["shard-s0"].virtual_hosts[0].routes
    # Only adapters of serving workers get an affinity route; the shard route comes last.
    assert [r.name for r in routes] == ["adapter:chat", "adapter:sql", "shard"]
    assert routes[0].match.headers[0].name == "x-adapter-id"
    assert routes[0].route.timeout.ToTimedelta().total_seconds() == 0  # no cut-off
    assert "connect-failure" in routes[0].route.retry_policy.retry_on
    listener = snap.resources[LISTENER_TYPE]["shard-s0"]
    assert listener.address.socket_address.port_value == 20000
    manager = hcm_pb2.HttpConnectionManager()
    listener.filter_chains[0].filters[0].typed_config.Unpack(manager)
    assert manager.rds.route_config_name == "shard-s0"
    assert manager.stream_idle_timeout.ToTimedelta().total_seconds() == 0
    # A stream whose worker dies mid-response ends for the client within 100 ms of the reset
    # (Envoy's default delayed close is 1 s; docs/faults.md).
    assert manager.delayed_close_timeout.ToTimedelta().total_seconds() == 0.1


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (lambda a: setattr(a.shards[0], "id", "bad id!"), "shards[0].id"),
        (lambda a: a.shards.append(a.shards[0]), "shards[1].id"),
        (
            lambda a: setattr(a.shards[0], "service_address", "localhost"),
            "shards[0].service_address",
        ),
        (lambda a: setattr(a.shards[0], "service_port", 0), "shards[0].service_port"),
        (lambda a: setattr(a.shards[0].endpoints[1], "weight", 0), "shards[0].endpoints[1].weight"),
        (lambda a: setattr(a.shards[0].endpoints[0], "port", 70000), "shards[0].endpoints[0].port"),
        (
            lambda a: setattr(a.shards[0].endpoints[0], "address", "x"),
            "shards[0].endpoints[0].address",
        ),
        (
            lambda a: a.shards[0].endpoints[0].adapters.append(""),
            "shards[0].endpoints[0].adapters[2]",
        ),
        (
            lambda a: a.shards[0].labels.update({"adaptermesh.io/lb-policy": "random"}),
            "shards[0].labels[adaptermesh.io/lb-policy]",
        ),
        (lambda a: a.shards.append(_shard("s1", 20000)), "shards[1].service_port"),
    ],
)
def test_invalid_assignment_names_the_field(mutate, field) -> None:
    assignment = ap.Assignment(version=1, shards=[_shard()])
    mutate(assignment)
    with pytest.raises(AssignmentError) as info:
        build_snapshot(assignment)
    assert info.value.field == field
    assert field in str(info.value)


def test_consistency_catches_dangling_references() -> None:
    snap = build_snapshot(ap.Assignment(version=1, shards=[_shard("a", 1), _shard("b", 2)]))
    resources = {t: list(r.values()) for t, r in snap.resources.items()}
    no_cla = dict(resources, **{ENDPOINT_TYPE: resources[ENDPOINT_TYPE][:1]})
    with pytest.raises(InconsistentSnapshotError, match="no endpoints resource 'shard-b'"):
        Snapshot.create("2", no_cla).check_consistent()
    no_cluster = dict(resources, **{CLUSTER_TYPE: resources[CLUSTER_TYPE][:1]})
    with pytest.raises(InconsistentSnapshotError) as info:
        Snapshot.create("2", no_cluster).check_consistent()
    assert any("missing cluster 'shard-b'" in p for p in info.value.problems)
    assert any("belong to no EDS cluster" in p for p in info.value.problems)
    no_route = dict(resources, **{ROUTE_TYPE: resources[ROUTE_TYPE][1:]})
    with pytest.raises(InconsistentSnapshotError, match="missing route configuration 'shard-a'"):
        Snapshot.create("2", no_route).check_consistent()


_ids = st.from_regex(r"[a-z0-9]([a-z0-9-]{0,9}[a-z0-9])?", fullmatch=True)
_adapters = st.lists(st.sampled_from(["a", "b", "c", "sql", "chat"]), max_size=3)
_endpoints = st.lists(
    st.builds(
        lambda last, port, weight, draining, adapters: ap.Endpoint(
            address=f"10.0.0.{last}", port=port, weight=weight, draining=draining, adapters=adapters
        ),
        st.integers(1, 254),
        st.integers(1, 65535),
        st.integers(1, 10_000),
        st.booleans(),
        _adapters,
    ),
    max_size=6,
    unique_by=lambda e: (e.address, e.port),
)


@st.composite
def assignments(draw: st.DrawFn) -> ap.Assignment:
    ids = draw(st.lists(_ids, min_size=0, max_size=6, unique=True))
    ports = draw(st.lists(st.integers(1, 65535), min_size=len(ids), max_size=len(ids), unique=True))
    return ap.Assignment(
        version=draw(st.integers(1, 2**63)),
        shards=[
            ap.Shard(id=i, service_address="127.0.0.1", service_port=p, endpoints=draw(_endpoints))
            for i, p in zip(ids, ports, strict=True)
        ],
    )


@settings(max_examples=150, deadline=None)
@given(assignments())
def test_every_valid_assignment_builds_a_consistent_snapshot(assignment: ap.Assignment) -> None:
    snap = build_snapshot(assignment)
    snap.check_consistent()
    names = {f"shard-{s.id}" for s in assignment.shards}
    for type_url in (CLUSTER_TYPE, ENDPOINT_TYPE, LISTENER_TYPE, ROUTE_TYPE):
        assert set(snap.resources[type_url]) == names
    for shard in assignment.shards:
        cla = snap.resources[ENDPOINT_TYPE][f"shard-{shard.id}"]
        weights = [lb.load_balancing_weight.value for g in cla.endpoints for lb in g.lb_endpoints]
        assert weights == [e.weight for e in shard.endpoints]
        assert all(w >= 1 for w in weights)
        routes = snap.resources[ROUTE_TYPE][f"shard-{shard.id}"].virtual_hosts[0].routes
        serving = {a for e in shard.endpoints if not e.draining for a in e.adapters}
        assert len(routes) == len(serving) + 1
        assert routes[-1].name == "shard"


@settings(max_examples=60, deadline=None)
@given(assignments(), assignments())
def test_cache_carries_versions_of_unchanged_types(first, second) -> None:
    cache = SnapshotCache()
    second.version = first.version + 1
    v1 = cache.set_assignment("k", first)
    cache.set_assignment("k", second)
    s1, s2 = build_snapshot(first), cache.get_snapshot("k")
    for type_url in s2.type_versions:
        if s1.resource_versions[type_url] == s2.resource_versions[type_url]:
            assert s2.type_versions[type_url] == v1
        else:
            assert s2.type_versions[type_url] == str(second.version)


def test_cache_refuses_bad_input_and_keeps_the_last_good() -> None:
    cache = SnapshotCache()
    good = ap.Assignment(version=5, shards=[_shard()])
    assert cache.set_assignment("k", good) == "5"
    assert cache.set_assignment("k", good) == "5"  # same content again: no-op
    bad = ap.Assignment(version=6, shards=[_shard()])
    bad.shards[0].endpoints[0].weight = 0
    with pytest.raises(AssignmentError, match=r"shards\[0\].endpoints\[0\].weight"):
        cache.set_assignment("k", bad)
    with pytest.raises(StaleVersionError, match="version"):
        cache.set_assignment("k", ap.Assignment(version=4, shards=[]))
    assert cache.get_snapshot("k").version == "5"
    snap = cache.get_snapshot("k")
    broken = {t: list(r.values()) for t, r in snap.resources.items()}
    broken[ENDPOINT_TYPE] = []
    with pytest.raises(InconsistentSnapshotError):
        cache.set_snapshot("k", Snapshot.create("6", broken))
    assert cache.get_snapshot("k") is snap
    assert not cache.wait_for_version(["nobody"], "5", 0.05)


def test_bootstrap_passes_envoy_validate() -> None:
    validate_bootstrap(build_bootstrap("node-a", 18000))
    validate_bootstrap(build_bootstrap("node-b", 18000, delta=True, admin_port=0))
    with pytest.raises(ValueError, match="node_id"):
        build_bootstrap("", 18000)


def test_envoy_validate_reports_a_broken_bootstrap() -> None:
    bootstrap = build_bootstrap("node-a", 18000)
    bootstrap.static_resources.clusters[0].connect_timeout.seconds = -1
    with pytest.raises(EnvoyError, match="validate"):
        validate_bootstrap(bootstrap)


def test_envoy_process_start_failure_is_reported_and_cleaned_up() -> None:
    envoy = EnvoyProcess(build_bootstrap("node-a", 18000), extra_args=("--no-such-flag",))
    with pytest.raises(EnvoyError, match="exited"):
        envoy.start(ready_timeout=10)
    assert not envoy.running
    envoy.cleanup()


def test_a_shard_without_a_service_address_gets_no_listener() -> None:
    # The control plane accepts a shard without a listener (steered in the kernel, served by
    # its workers' own ports); refusing it here would freeze every node's xDS.
    bare = _shard("s1")
    bare.service_address, bare.service_port = "", 0
    snap = build_snapshot(ap.Assignment(version=1, shards=[_shard("s0"), bare]))
    assert set(snap.resources[CLUSTER_TYPE]) == {"shard-s0", "shard-s1"}
    assert set(snap.resources[ENDPOINT_TYPE]) == {"shard-s0", "shard-s1"}
    assert set(snap.resources[LISTENER_TYPE]) == {"shard-s0"}
    assert set(snap.resources[ROUTE_TYPE]) == {"shard-s0"}
    half = _shard("s2")
    half.service_port = 0
    with pytest.raises(AssignmentError) as info:
        build_snapshot(ap.Assignment(version=1, shards=[half]))
    assert info.value.field == "shards[0].service_port"


def _manager(snap: Snapshot, shard_id: str = "s0") -> hcm_pb2.HttpConnectionManager:
    manager = hcm_pb2.HttpConnectionManager()
    snap.resources[LISTENER_TYPE][f"shard-{shard_id}"].filter_chains[0].filters[
        0
    ].typed_config.Unpack(manager)
    return manager


@pytest.mark.parametrize(
    "options",
    [
        BuildOptions(),
        BuildOptions(route_by_body=True),
        BuildOptions(ext_proc=ExtProcOptions()),
    ],
)
def test_every_listener_upgrades_websockets_without_cutting_them(options: BuildOptions) -> None:
    snap = build_snapshot(
        ap.Assignment(version=1, shards=[_shard(), _shard("s1", 20001)]), options=options
    )
    for sid in ("s0", "s1"):
        manager = _manager(snap, sid)
        assert [u.upgrade_type for u in manager.upgrade_configs] == ["websocket"]
        # Not disabled per upgrade, and HTTP/2 clients may use extended CONNECT (RFC 8441).
        assert not manager.upgrade_configs[0].HasField("enabled")
        assert manager.http2_protocol_options.allow_connect
        assert manager.stream_idle_timeout.ToTimedelta().total_seconds() == 0
        routes = snap.resources[ROUTE_TYPE][f"shard-{sid}"].virtual_hosts[0].routes
        assert routes
        for route in routes:
            assert route.route.timeout.ToTimedelta().total_seconds() == 0, route.name
            assert not route.route.upgrade_configs  # the listener's upgrade applies


@pytest.mark.parametrize("protocol", ["http2", "downstream"])
def test_http2_upstreams_carry_websockets_as_extended_connect(protocol: str) -> None:
    shard = _shard(**{"adaptermesh.io/upstream-protocol": protocol})
    cluster = build_snapshot(ap.Assignment(version=1, shards=[shard])).resources[CLUSTER_TYPE][
        "shard-s0"
    ]
    options = http_protocol_options_pb2.HttpProtocolOptions()
    cluster.typed_extension_protocol_options[
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
    ].Unpack(options)
    h2 = (
        options.explicit_http_config.http2_protocol_options
        if protocol == "http2"
        else options.use_downstream_protocol_config.http2_protocol_options
    )
    assert h2.allow_connect


def test_websocket_path_is_the_workers() -> None:
    assert WEBSOCKET_PATH == WS_PATH


def test_with_ext_proc_the_websocket_path_skips_the_body_buffering_filter() -> None:
    snap = build_snapshot(
        ap.Assignment(version=1, shards=[_shard()]), options=BuildOptions(ext_proc=ExtProcOptions())
    )
    routes = snap.resources[ROUTE_TYPE]["shard-s0"].virtual_hosts[0].routes
    # Before every other route, so an upgrade never reaches a route that runs ext_proc.
    assert [r.name for r in routes][:3] == ["ws:chat", "ws:sql", "ws"]
    assert [r.name for r in routes][3:] == ["adapter:chat", "adapter:sql", "shard"]
    for route in routes[:3]:
        assert route.match.path == WEBSOCKET_PATH
        per_route = ext_proc_pb2.ExtProcPerRoute()
        assert route.typed_per_filter_config["envoy.filters.http.ext_proc"].Unpack(per_route)
        assert per_route.disabled
    assert routes[0].match.headers[0].string_match.exact == "chat"
    assert (
        routes[0].route.metadata_match.filter_metadata["envoy.lb"].fields["adapter"].string_value
        == "chat"
    )
    assert not routes[2].match.headers
    assert not routes[2].route.HasField("metadata_match")
    # Without ext_proc nothing buffers the body, and the routes are unchanged.
    plain = build_snapshot(ap.Assignment(version=1, shards=[_shard()]))
    assert [r.name for r in plain.resources[ROUTE_TYPE]["shard-s0"].virtual_hosts[0].routes] == [
        "adapter:chat",
        "adapter:sql",
        "shard",
    ]


def test_node_table_and_nack_labels_stay_bounded_whatever_node_ids_connect() -> None:
    from prometheus_client import CollectorRegistry

    from adaptermesh.mesh.cache import MAX_IDLE_NODES, MAX_NACK_NODE_LABELS
    from adaptermesh.mesh.metrics import XdsMetrics

    registry = CollectorRegistry()
    cache = SnapshotCache(metrics=XdsMetrics(registry))
    cache.stream_opened("envoy-kept", "s0")  # an Envoy that stays connected throughout
    for i in range(3 * MAX_IDLE_NODES):
        node = f"made-up-{i}"
        cache.stream_opened(node, "s0")
        cache.record_nack(node, "type.googleapis.com/x.Cluster", "1", "bad", 3)
        cache.stream_closed(node)
    nodes = cache.status()
    assert "envoy-kept" in nodes
    assert len(nodes) <= MAX_IDLE_NODES + 1
    assert f"made-up-{3 * MAX_IDLE_NODES - 1}" in nodes  # the newest idle nodes stay
    labels = {
        sample.labels["node"]
        for metric in registry.collect()
        if metric.name == "adaptermesh_xds_nacks"
        for sample in metric.samples
        if "node" in sample.labels
    }
    assert len(labels) <= MAX_NACK_NODE_LABELS + 1
    assert "other" in labels
