"""Pure builders: an ``Assignment`` becomes a consistent set of Envoy xDS resources.

Nothing here does I/O, reads a clock or logs. :func:`build_snapshot` turns one
``adaptermesh.v1.Assignment`` into a :class:`Snapshot`; :meth:`Snapshot.check_consistent`
verifies the references between the resources before anything is published.

Resources per shard ``<id>`` (every name is ``shard-<id>``):

- **Listener** on ``service_address:service_port``: an HTTP connection manager (HTTP/1.1 and
  HTTP/2 downstream, codec AUTO) that fetches its routes by RDS over ADS.
- **RouteConfiguration**: one route per adapter resident on a serving worker (header
  ``x-adapter-id`` equals the adapter -> subset ``envoy.lb/adapter = <adapter>``), then a
  catch-all route to the whole shard. No total timeout, retries on connect failure.
- **Cluster** (EDS over ADS): weighted round robin (or least request, per shard label),
  HTTP/1.1 or HTTP/2 upstreams, active health checks on ``/health``, outlier detection,
  circuit breakers, subset load balancing on the ``adapter`` key with ``list_as_any`` and an
  ``ANY_ENDPOINT`` fallback, so an adapter that nobody holds gets the whole shard.
- **ClusterLoadAssignment**: one endpoint per worker, ``load_balancing_weight`` >= 1,
  ``health_status`` DRAINING for draining workers, resident adapters as endpoint metadata.
- With ``BuildOptions.grpc_port_offset`` set, a second EDS cluster ``shard-<id>-grpc`` (HTTP/2
  upstreams, gRPC health checks) whose endpoints are the workers at ``port + offset`` (their
  KServe v2 gRPC listener), and routes for ``/inference.GRPCInferenceService/`` to it, placed
  before the HTTP routes and with ext_proc off (the body is protobuf, not JSON).

Per-shard labels override the defaults in :class:`BuildOptions`:
``adaptermesh.io/lb-policy`` = ``round_robin`` | ``least_request`` and
``adaptermesh.io/upstream-protocol`` = ``http1`` | ``http2`` | ``downstream``.

Invalid input raises :class:`AssignmentError`, whose ``field`` names the offending field
(for example ``shards[1].endpoints[0].weight``).
"""

from __future__ import annotations

import functools
import hashlib
import ipaddress
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from envoy.config.cluster.v3 import circuit_breaker_pb2, cluster_pb2, outlier_detection_pb2
from envoy.config.core.v3 import (
    address_pb2,
    base_pb2,
    config_source_pb2,
    grpc_service_pb2,
    health_check_pb2,
    protocol_pb2,
)
from envoy.config.endpoint.v3 import endpoint_components_pb2, endpoint_pb2
from envoy.config.listener.v3 import listener_components_pb2, listener_pb2
from envoy.config.route.v3 import route_components_pb2, route_pb2
from envoy.config.trace.v3 import http_tracer_pb2, opentelemetry_pb2
from envoy.extensions.filters.http.ext_proc.v3 import ext_proc_pb2, processing_mode_pb2
from envoy.extensions.filters.http.json_to_metadata.v3 import json_to_metadata_pb2
from envoy.extensions.filters.http.router.v3 import router_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import (
    http_connection_manager_pb2 as hcm_pb2,
)
from envoy.extensions.retry.host.previous_hosts.v3 import previous_hosts_pb2
from envoy.extensions.upstreams.http.v3 import http_protocol_options_pb2
from envoy.type.matcher.v3 import metadata_pb2, string_pb2, value_pb2
from envoy.type.v3 import percent_pb2
from google.protobuf import any_pb2, duration_pb2, struct_pb2, wrappers_pb2
from google.protobuf.message import Message

from adaptermesh import adapter_edge
from adaptermesh import assignment_rules as rules
from adaptermesh.mesh.edge import (
    JSON_CONTENT_TYPES,
    EdgeAuthOptions,
    EdgeContext,
    EdgeTlsOptions,
    edge_filters,
    edge_routes,
    front_filters,
    needs_body_model,
    tls_filter_chain,
    tls_inspector,
    tls_scheme,
)

if TYPE_CHECKING:  # the lazy re-export hides the generated types from mypy
    from adaptermesh.proto.adaptermesh.v1 import assignment_pb2
else:
    from adaptermesh.proto import assignment_pb2

__all__ = [
    "ADS_TYPE_ORDER",
    "CLUSTER_TYPE",
    "ENDPOINT_TYPE",
    "GRPC_V2_PREFIX",
    "LISTENER_TYPE",
    "ROUTE_TYPE",
    "SERVED_BY_HEADER",
    "WEBSOCKET_PATH",
    "AssignmentError",
    "BuildOptions",
    "ExtProcOptions",
    "InconsistentSnapshotError",
    "Snapshot",
    "build_snapshot",
    "cluster_name",
    "grpc_cluster_name",
    "resource_version",
    "validate_assignment",
]

CLUSTER_TYPE = "type.googleapis.com/envoy.config.cluster.v3.Cluster"
ENDPOINT_TYPE = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment"
LISTENER_TYPE = "type.googleapis.com/envoy.config.listener.v3.Listener"
ROUTE_TYPE = "type.googleapis.com/envoy.config.route.v3.RouteConfiguration"
# On every response a shard listener sends: the shard that answered, so a client (or an
# operator with curl -i) sees where the classifier steered it.
SERVED_BY_HEADER = "x-adaptermesh-served-by"

# Make-before-break order: a cluster and its endpoints exist before a listener or route
# can point at them (Envoy's own ADS sequencing expects CDS -> EDS -> LDS -> RDS).
ADS_TYPE_ORDER: tuple[str, ...] = (CLUSTER_TYPE, ENDPOINT_TYPE, LISTENER_TYPE, ROUTE_TYPE)

LB_POLICY_LABEL = rules.LB_POLICY_LABEL
UPSTREAM_PROTOCOL_LABEL = rules.UPSTREAM_PROTOCOL_LABEL
ADAPTER_METADATA_KEY = "adapter"
_LB_NAMESPACE = "envoy.lb"

_LB_POLICIES = rules.LB_POLICIES
_UPSTREAM_PROTOCOLS = rules.UPSTREAM_PROTOCOLS


# An Assignment field makes an invalid Envoy configuration; ``field`` names it.
AssignmentError = rules.RuleError


class InconsistentSnapshotError(ValueError):
    """A snapshot whose resources reference something that is not in it."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("inconsistent snapshot: " + "; ".join(problems))
        self.problems = problems


@dataclass(frozen=True)
class ExtProcOptions:
    """The listener's ext_proc filter: the agent's processor reads the body's ``model``.

    ``cluster`` is the bootstrap's static cluster of the processor (``build_bootstrap(...,
    ext_proc_port=...)``). The body is sent ``BUFFERED``, bounded by ``max_body_bytes`` (the
    listener's per-connection buffer limit): Envoy answers a longer body 413 itself. ``BUFFERED_PARTIAL``
    would forward it instead, but Envoy may then start routing before the body (and so the
    adapter header) is known: about 5 % of requests from the openai client missed the
    adapter's route in tests/mesh/test_extproc.py. ``failure_mode_allow`` lets requests
    through, unchanged, when the processor is down or slower than ``message_timeout_s``; they
    then take the shard's catch-all route.
    """

    cluster: str = "adaptermesh_extproc"
    # Long-context chat bodies (128k tokens of JSON) stay well under this.
    max_body_bytes: int = 4 << 20
    message_timeout_s: float = 0.2
    failure_mode_allow: bool = True


@dataclass(frozen=True)
class BuildOptions:
    """Knobs of the generated Envoy resources. Defaults suit long streaming LLM responses."""

    lb_policy: str = "round_robin"
    upstream_protocol: str = "http1"
    adapter_header: str = "x-adapter-id"
    connect_timeout_s: float = 2.0
    # Zero disables: a long generation must never be cut off by a total or idle timer; the
    # client's own deadline is the only limit.
    route_timeout_s: float = 0.0
    stream_idle_timeout_s: float = 0.0
    # How long Envoy waits for a client to close a connection it is closing (after a stream
    # reset mid-response, say) before closing it itself. Envoy's default is 1 s, which held a
    # stream whose worker was killed open for 1.02 s (docs/faults.md); 100 ms still lets the
    # client read what was sent.
    delayed_close_timeout_s: float = 0.1
    # Upstream connection pool idle timeout (connections, not streams).
    upstream_idle_timeout_s: float = 300.0
    health_check_path: str = "/health"
    health_check_interval_s: float = 5.0
    health_check_timeout_s: float = 1.0
    # Envoy's default no-traffic interval is 60 s, which would hide a dead idle worker.
    health_check_no_traffic_interval_s: float = 5.0
    healthy_threshold: int = 1
    unhealthy_threshold: int = 3
    retry_on: str = "connect-failure,refused-stream,reset-before-request"
    num_retries: int = 2
    outlier_consecutive_5xx: int = 5
    outlier_interval_s: float = 10.0
    outlier_base_ejection_s: float = 30.0
    outlier_max_ejection_percent: int = 50
    max_connections: int = 4096
    max_pending_requests: int = 4096
    max_requests: int = 4096
    max_retries: int = 64
    # None: no ext_proc filter; routing then needs the client to send the adapter header.
    ext_proc: ExtProcOptions | None = None
    # Route by the body's "model" inside Envoy: the json_to_metadata filter copies it into
    # dynamic metadata and each adapter route also matches it there. No processor hop, but
    # no scoring and no GIE protocol either (docs/ecosystem.md compares the two).
    route_by_body: bool = False
    # None: no gRPC cluster. Otherwise each worker's KServe v2 gRPC port is its HTTP port plus
    # this (1 for the usual 8000 HTTP / 8001 gRPC layout).
    grpc_port_offset: int | None = None
    # Bearer-token verification for adapters with scopes (mesh/edge.py). None: their routes
    # refuse every request (403 from rbac), since no token can be verified.
    edge_auth: EdgeAuthOptions | None = None
    # TLS on the shard listeners beside plaintext (mesh/edge.py); None: plaintext only, and
    # adapters with security.tls refuse every request.
    edge_tls: EdgeTlsOptions | None = None
    # None: no tracing. Otherwise each shard listener starts or joins a W3C trace, sends its
    # spans by OTLP/gRPC to the bootstrap's collector cluster and passes the context on to the
    # worker (and to the ext_proc call); docs/tracing.md.
    tracing: TracingOptions | None = None


@dataclass(frozen=True, slots=True)
class TracingOptions:
    """Envoy's OpenTelemetry tracer on shard listeners. Must stay in sync with
    ``bootstrap.OTLP_CLUSTER`` (the collector's static cluster)."""

    cluster: str = "adaptermesh_otlp"
    # Share of requests that start a trace (0-100); a sampled traceparent is always followed.
    sample_percent: float = 100.0
    service_name: str = "adaptermesh-envoy"


def cluster_name(shard_id: str) -> str:
    """The Envoy cluster (and listener and route configuration) name of a shard."""
    return f"shard-{shard_id}"


def grpc_cluster_name(shard_id: str) -> str:
    """The Envoy cluster of a shard's workers' KServe v2 gRPC listeners."""
    return f"shard-{shard_id}-grpc"


def resource_version(resource: Message) -> str:
    """A content hash of one resource (delta xDS per-resource version)."""
    return hashlib.sha256(resource.SerializeToString(deterministic=True)).hexdigest()[:16]


@dataclass(frozen=True)
class Snapshot:
    """One node's complete xDS state at one version.

    ``resources[type_url][name]`` holds the typed Envoy messages. ``type_versions[type_url]``
    is the version_info sent for that type; the cache carries a type's version forward when
    its resources did not change, so a weight update only pushes EDS.
    """

    version: str
    resources: Mapping[str, Mapping[str, Message]]
    type_versions: Mapping[str, str]
    resource_versions: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    # Each resource packed once, so a push to many Envoys does not re-serialise it.
    packed: Mapping[str, Mapping[str, any_pb2.Any]] = field(default_factory=dict)

    @classmethod
    def create(cls, version: str, resources: Mapping[str, Iterable[Message]]) -> Snapshot:
        """A snapshot from lists of resources; every type gets ``version``."""
        if not version:
            raise ValueError("snapshot version must not be empty")
        by_type: dict[str, dict[str, Message]] = {t: {} for t in ADS_TYPE_ORDER}
        for type_url, listed in resources.items():
            if type_url not in by_type:
                raise ValueError(f"unsupported resource type {rules.quote(type_url)}")
            for item in listed:
                name = _resource_name(item)
                if name in by_type[type_url]:
                    raise InconsistentSnapshotError(
                        [f"duplicate {_short(type_url)} {rules.quote(name)}"]
                    )
                by_type[type_url][name] = item
        hashes: dict[str, dict[str, str]] = {}
        packed: dict[str, dict[str, any_pb2.Any]] = {}
        for type_url, items in by_type.items():
            hashes[type_url], packed[type_url] = {}, {}
            for name, message in items.items():
                data = message.SerializeToString(deterministic=True)
                hashes[type_url][name] = hashlib.sha256(data).hexdigest()[:16]
                packed[type_url][name] = any_pb2.Any(type_url=type_url, value=data)
        return cls(
            version=version,
            resources=by_type,
            type_versions=dict.fromkeys(ADS_TYPE_ORDER, version),
            resource_versions=hashes,
            packed=packed,
        )

    def carry_versions_from(self, previous: Snapshot | None) -> Snapshot:
        """This snapshot, reusing ``previous``'s type version where a type is unchanged."""
        if previous is None:
            return self
        versions = dict(self.type_versions)
        for type_url in ADS_TYPE_ORDER:
            if self.resource_versions.get(type_url) == previous.resource_versions.get(type_url):
                versions[type_url] = previous.type_versions[type_url]
        return Snapshot(self.version, self.resources, versions, self.resource_versions, self.packed)

    def check_consistent(self) -> None:
        """Raise :class:`InconsistentSnapshotError` listing every dangling reference.

        Rules: every listener's RDS name is a route configuration here; every cluster a route
        names is a cluster here; every EDS cluster has a ClusterLoadAssignment and every
        ClusterLoadAssignment belongs to an EDS cluster; every resource sits under its name.
        """
        problems: list[str] = []
        clusters = self.resources.get(CLUSTER_TYPE, {})
        endpoints = self.resources.get(ENDPOINT_TYPE, {})
        listeners = self.resources.get(LISTENER_TYPE, {})
        routes = self.resources.get(ROUTE_TYPE, {})
        for type_url, items in self.resources.items():
            for name, message in items.items():
                if _resource_name(message) != name:
                    problems.append(
                        f"{_short(type_url)} stored as {rules.quote(name)} is named "
                        f"{rules.quote(_resource_name(message))}"
                    )
        for name, listener in listeners.items():
            for route_name in _listener_rds_names(listener):
                if route_name not in routes:
                    problems.append(
                        f"listener {rules.quote(name)} uses missing route configuration {rules.quote(route_name)}"
                    )
        for name, route_config in routes.items():
            for target in _route_clusters(route_config):
                if target not in clusters:
                    problems.append(
                        f"route configuration {rules.quote(name)} names missing cluster {rules.quote(target)}"
                    )
        eds_names: set[str] = set()
        for name, message in clusters.items():
            cluster: Any = message
            if cluster.type == cluster_pb2.Cluster.EDS:
                service = cluster.eds_cluster_config.service_name or name
                eds_names.add(service)
                if service not in endpoints:
                    problems.append(
                        f"EDS cluster {rules.quote(name)} has no endpoints resource {rules.quote(service)}"
                    )
        for name in endpoints:
            if name not in eds_names:
                problems.append(f"endpoints {rules.quote(name)} belong to no EDS cluster")
        if problems:
            raise InconsistentSnapshotError(problems)


def validate_assignment(assignment: assignment_pb2.Assignment) -> None:
    """Raise :class:`AssignmentError` naming the first field Envoy could not accept.

    The rules are the shared Assignment rules (:mod:`adaptermesh.assignment_rules`), per shard
    and across shards (one listener per address and port); the snapshot needs no others.
    """
    seen_ids: set[str] = set()
    seen_listeners: dict[tuple[str, int], str] = {}
    for i, shard in enumerate(assignment.shards):
        where = f"shards[{i}]"
        rules.check_shard(shard, where, weighted=True)
        if shard.id in seen_ids:
            raise AssignmentError(f"{where}.id", f"duplicate shard id {rules.quote(shard.id)}")
        seen_ids.add(shard.id)
        if not shard.service_address:
            continue  # no listener for this shard
        key = (str(ipaddress.ip_address(shard.service_address)), shard.service_port)
        if key in seen_listeners:
            raise AssignmentError(
                f"{where}.service_port",
                f"{shard.service_address}:{shard.service_port} is already the listener of "
                f"shard {rules.quote(seen_listeners[key])}",
            )
        seen_listeners[key] = shard.id
    adapter_edge.check_edges(assignment)


def build_snapshot(
    assignment: assignment_pb2.Assignment,
    version: str | None = None,
    options: BuildOptions | None = None,
) -> Snapshot:
    """Validate ``assignment`` and build its snapshot (version defaults to its ``version``).

    The result has passed :meth:`Snapshot.check_consistent`.
    """
    opts = options or BuildOptions()
    if opts.lb_policy not in _LB_POLICIES:
        raise ValueError(
            f"BuildOptions.lb_policy {rules.quote(opts.lb_policy)} not in {_LB_POLICIES}"
        )
    if opts.upstream_protocol not in _UPSTREAM_PROTOCOLS:
        raise ValueError(
            f"BuildOptions.upstream_protocol {rules.quote(opts.upstream_protocol)} not in "
            f"{_UPSTREAM_PROTOCOLS}"
        )
    validate_assignment(assignment)
    offset = opts.grpc_port_offset
    if offset is not None:
        if offset == 0:
            raise ValueError("BuildOptions.grpc_port_offset 0 would send gRPC to the HTTP port")
        _check_grpc_ports(assignment, offset)
    clusters: list[Message] = []
    endpoints: list[Message] = []
    listeners: list[Message] = []
    routes: list[Message] = []
    # The adapter edges, as bytes: part of the memo keys of listeners and routes.
    edge_key = tuple(e.SerializeToString(deterministic=True) for e in assignment.adapters)
    for shard in assignment.shards:
        # Only EDS changes on a rebalance; the other three come from a memo of their inputs
        # (a shard of 32 adapters costs ~3 ms of route building otherwise).
        labels = tuple(sorted(shard.labels.items()))
        serving = tuple(
            sorted({a for ep in shard.endpoints if not ep.draining for a in ep.adapters})
        )
        clusters.append(cluster_pb2.Cluster.FromString(_cluster_bytes(shard.id, labels, opts)))
        endpoints.append(build_load_assignment(shard))
        if offset is not None:
            clusters.append(
                cluster_pb2.Cluster.FromString(_grpc_cluster_bytes(shard.id, labels, opts))
            )
            endpoints.append(build_load_assignment(shard, grpc_port_offset=offset))
        if not shard.service_address:
            continue  # reachable only through another listener's routes, if any
        listeners.append(
            listener_pb2.Listener.FromString(
                _listener_bytes(shard.id, shard.service_address, shard.service_port, opts, edge_key)
            )
        )
        routes.append(
            route_pb2.RouteConfiguration.FromString(_route_bytes(shard.id, serving, opts, edge_key))
        )
    snapshot = Snapshot.create(
        version if version is not None else str(assignment.version),
        {
            CLUSTER_TYPE: clusters,
            ENDPOINT_TYPE: endpoints,
            LISTENER_TYPE: listeners,
            ROUTE_TYPE: routes,
        },
    )
    snapshot.check_consistent()
    return snapshot


@functools.lru_cache(maxsize=4096)
def _cluster_bytes(shard_id: str, labels: tuple[tuple[str, str], ...], opts: BuildOptions) -> bytes:
    shard = assignment_pb2.Shard(id=shard_id, labels=dict(labels))
    return bytes(build_cluster(shard, opts).SerializeToString(deterministic=True))


def _check_grpc_ports(assignment: assignment_pb2.Assignment, offset: int) -> None:
    for i, shard in enumerate(assignment.shards):
        for j, ep in enumerate(shard.endpoints):
            if not 1 <= ep.port + offset <= 65535:
                raise AssignmentError(
                    f"shards[{i}].endpoints[{j}].port",
                    f"port {ep.port} plus the gRPC port offset {offset} is outside 1..65535",
                )


@functools.lru_cache(maxsize=4096)
def _grpc_cluster_bytes(
    shard_id: str, labels: tuple[tuple[str, str], ...], opts: BuildOptions
) -> bytes:
    shard = assignment_pb2.Shard(id=shard_id, labels=dict(labels))
    return bytes(build_grpc_cluster(shard, opts).SerializeToString(deterministic=True))


def _edges(edge_key: tuple[bytes, ...]) -> list[assignment_pb2.AdapterEdge]:
    return [assignment_pb2.AdapterEdge.FromString(b) for b in edge_key]


@functools.lru_cache(maxsize=4096)
def _listener_bytes(
    shard_id: str, address: str, port: int, opts: BuildOptions, edge_key: tuple[bytes, ...] = ()
) -> bytes:
    shard = assignment_pb2.Shard(id=shard_id, service_address=address, service_port=port)
    listener = build_listener(shard, opts, _edges(edge_key))
    return bytes(listener.SerializeToString(deterministic=True))


@functools.lru_cache(maxsize=4096)
def _route_bytes(
    shard_id: str, adapters: tuple[str, ...], opts: BuildOptions, edge_key: tuple[bytes, ...] = ()
) -> bytes:
    shard = assignment_pb2.Shard(
        id=shard_id, endpoints=[assignment_pb2.Endpoint(adapters=list(adapters))]
    )
    config = build_route_configuration(shard, opts, _edges(edge_key))
    return bytes(config.SerializeToString(deterministic=True))


def build_cluster(shard: assignment_pb2.Shard, opts: BuildOptions) -> cluster_pb2.Cluster:
    """The shard's EDS cluster."""
    name = cluster_name(shard.id)
    policy = shard.labels.get(LB_POLICY_LABEL, opts.lb_policy)
    protocol = shard.labels.get(UPSTREAM_PROTOCOL_LABEL, opts.upstream_protocol)
    cluster = cluster_pb2.Cluster(
        name=name,
        type=cluster_pb2.Cluster.EDS,
        eds_cluster_config=cluster_pb2.Cluster.EdsClusterConfig(eds_config=_ads_source()),
        connect_timeout=_duration(opts.connect_timeout_s),
        lb_policy=(
            cluster_pb2.Cluster.LEAST_REQUEST
            if policy == "least_request"
            else cluster_pb2.Cluster.ROUND_ROBIN
        ),
        health_checks=[
            health_check_pb2.HealthCheck(
                timeout=_duration(opts.health_check_timeout_s),
                interval=_duration(opts.health_check_interval_s),
                no_traffic_interval=_duration(opts.health_check_no_traffic_interval_s),
                healthy_threshold=wrappers_pb2.UInt32Value(value=opts.healthy_threshold),
                unhealthy_threshold=wrappers_pb2.UInt32Value(value=opts.unhealthy_threshold),
                http_health_check=health_check_pb2.HealthCheck.HttpHealthCheck(
                    path=opts.health_check_path
                ),
            )
        ],
        outlier_detection=outlier_detection_pb2.OutlierDetection(
            consecutive_5xx=wrappers_pb2.UInt32Value(value=opts.outlier_consecutive_5xx),
            interval=_duration(opts.outlier_interval_s),
            base_ejection_time=_duration(opts.outlier_base_ejection_s),
            max_ejection_percent=wrappers_pb2.UInt32Value(value=opts.outlier_max_ejection_percent),
        ),
        circuit_breakers=circuit_breaker_pb2.CircuitBreakers(
            thresholds=[
                circuit_breaker_pb2.CircuitBreakers.Thresholds(
                    priority=base_pb2.DEFAULT,
                    max_connections=wrappers_pb2.UInt32Value(value=opts.max_connections),
                    max_pending_requests=wrappers_pb2.UInt32Value(value=opts.max_pending_requests),
                    max_requests=wrappers_pb2.UInt32Value(value=opts.max_requests),
                    max_retries=wrappers_pb2.UInt32Value(value=opts.max_retries),
                ),
            ]
        ),
        lb_subset_config=cluster_pb2.Cluster.LbSubsetConfig(
            fallback_policy=cluster_pb2.Cluster.LbSubsetConfig.ANY_ENDPOINT,
            subset_selectors=[
                cluster_pb2.Cluster.LbSubsetConfig.LbSubsetSelector(keys=[ADAPTER_METADATA_KEY])
            ],
            list_as_any=True,
            # When the whole cluster is in panic, balance over every worker rather than over
            # the adapter's subset. A subset whose only holder died still panics onto that
            # worker: the control plane republishes an unreachable worker without adapters
            # on its next scrape, which removes the subset (docs/control-plane.md).
            panic_mode_any=True,
        ),
    )
    cluster.typed_extension_protocol_options[
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
    ].CopyFrom(_pack(_upstream_protocol_options(protocol, opts)))
    return cluster


def build_grpc_cluster(shard: assignment_pb2.Shard, opts: BuildOptions) -> cluster_pb2.Cluster:
    """The shard's gRPC cluster: the HTTP cluster's balancing, subsets, outlier detection and
    limits, over HTTP/2, health-checked with ``grpc.health.v1``."""
    cluster = build_cluster(shard, opts)
    cluster.name = grpc_cluster_name(shard.id)
    check = cluster.health_checks[0]
    check.ClearField("http_health_check")
    check.grpc_health_check.CopyFrom(health_check_pb2.HealthCheck.GrpcHealthCheck())
    cluster.typed_extension_protocol_options[
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
    ].CopyFrom(_pack(_upstream_protocol_options("http2", opts)))
    return cluster


def build_load_assignment(
    shard: assignment_pb2.Shard, *, grpc_port_offset: int | None = None
) -> endpoint_pb2.ClusterLoadAssignment:
    """The shard's endpoints with weights, DRAINING marks and resident adapters; with
    ``grpc_port_offset``, the same workers' gRPC listeners (for the gRPC cluster)."""
    lb_endpoints = []
    shift = grpc_port_offset or 0
    for ep in shard.endpoints:
        lb = endpoint_components_pb2.LbEndpoint(
            endpoint=endpoint_components_pb2.Endpoint(address=_socket(ep.address, ep.port + shift)),
            load_balancing_weight=wrappers_pb2.UInt32Value(value=ep.weight),
            health_status=health_check_pb2.DRAINING if ep.draining else health_check_pb2.UNKNOWN,
        )
        if ep.adapters:
            lb.metadata.filter_metadata[_LB_NAMESPACE].fields[
                ADAPTER_METADATA_KEY
            ].list_value.CopyFrom(_adapter_list(tuple(sorted(set(ep.adapters)))))
        lb_endpoints.append(lb)
    return endpoint_pb2.ClusterLoadAssignment(
        cluster_name=(
            cluster_name(shard.id) if grpc_port_offset is None else grpc_cluster_name(shard.id)
        ),
        endpoints=[endpoint_components_pb2.LocalityLbEndpoints(lb_endpoints=lb_endpoints)]
        if lb_endpoints
        else [],
    )


@functools.lru_cache(maxsize=4096)
def _adapter_list(adapters: tuple[str, ...]) -> struct_pb2.ListValue:
    # Filling a ListValue item by item runs in Python (~20 us for 32 adapters) and EDS is
    # rebuilt for every endpoint on every rebalance while resident sets rarely change.
    # Callers copy the result, so the cached message is never mutated.
    return struct_pb2.ListValue(values=[struct_pb2.Value(string_value=a) for a in adapters])


def build_listener(
    shard: assignment_pb2.Shard,
    opts: BuildOptions,
    edges: Sequence[assignment_pb2.AdapterEdge] = (),
) -> listener_pb2.Listener:
    """The shard's listener on its service address, routing by RDS; with adapter edges, the
    body's model is read and guarded routes check tokens (mesh/edge.py)."""
    name = cluster_name(shard.id)
    manager = hcm_pb2.HttpConnectionManager(
        stat_prefix=name.replace("-", "_"),
        codec_type=hcm_pb2.HttpConnectionManager.AUTO,
        rds=hcm_pb2.Rds(config_source=_ads_source(), route_config_name=name),
        stream_idle_timeout=_duration(opts.stream_idle_timeout_s),
        delayed_close_timeout=_duration(opts.delayed_close_timeout_s),
        # The worker's WebSocket route (GET /v1/ws): HTTP/1.1 upgrades, and extended CONNECT
        # from HTTP/2 clients (RFC 8441). The zero route and stream idle timeouts above keep a
        # long-lived socket open; the worker's heartbeat pings (20 s) find dead peers, and
        # keep a non-zero stream_idle_timeout_s above 20 s from closing an idle socket.
        upgrade_configs=[hcm_pb2.HttpConnectionManager.UpgradeConfig(upgrade_type="websocket")],
        http2_protocol_options=protocol_pb2.Http2ProtocolOptions(allow_connect=True),
        http_filters=[
            *front_filters(edges, opts.grpc_port_offset is not None),
            *_body_filters(opts, needs_body_model(edges)),
            *_ext_proc_filters(shard.id, opts),
            *edge_filters(edges, opts.edge_auth),
            hcm_pb2.HttpFilter(
                name="envoy.filters.http.router", typed_config=_pack(router_pb2.Router())
            ),
        ],
    )
    if opts.tracing is not None:
        manager.tracing.CopyFrom(_tracing(opts.tracing))

    def chain(tls: bool) -> listener_components_pb2.FilterChain:
        hcm = hcm_pb2.HttpConnectionManager()
        hcm.CopyFrom(manager)
        if any(e.tls for e in edges):
            hcm.scheme_header_transformation.CopyFrom(tls_scheme(tls))
        return listener_components_pb2.FilterChain(
            filters=[
                listener_components_pb2.Filter(
                    name="envoy.filters.network.http_connection_manager", typed_config=_pack(hcm)
                )
            ]
        )

    chains = (
        [chain(False)]
        if opts.edge_tls is None
        else [tls_filter_chain(opts.edge_tls, chain(True)), chain(False)]
    )
    return listener_pb2.Listener(
        name=name,
        address=_socket(shard.service_address, shard.service_port),
        # The ext_proc filter buffers the body within this limit and Envoy answers 413 above
        # it (a route's buffer limit does not bound it: measured in tests/mesh).
        per_connection_buffer_limit_bytes=(
            None
            if opts.ext_proc is None
            else wrappers_pb2.UInt32Value(value=opts.ext_proc.max_body_bytes)
        ),
        filter_chains=chains,
        listener_filters=[] if opts.edge_tls is None else [tls_inspector()],
    )


@functools.lru_cache(maxsize=8)
def _tracing(t: TracingOptions) -> hcm_pb2.HttpConnectionManager.Tracing:
    if not 0.0 <= t.sample_percent <= 100.0:
        raise ValueError(f"tracing.sample_percent: {t.sample_percent} is outside 0-100")
    provider = opentelemetry_pb2.OpenTelemetryConfig(
        grpc_service=grpc_service_pb2.GrpcService(
            envoy_grpc=grpc_service_pb2.GrpcService.EnvoyGrpc(cluster_name=t.cluster)
        ),
        service_name=t.service_name,
    )
    return hcm_pb2.HttpConnectionManager.Tracing(
        random_sampling=percent_pb2.Percent(value=t.sample_percent),
        provider=http_tracer_pb2.Tracing.Http(
            name="envoy.tracers.opentelemetry", typed_config=_pack(provider)
        ),
    )


BODY_METADATA_NAMESPACE = "adaptermesh.body"
# The worker's WebSocket route; must stay in sync with adaptermesh.worker.ws.WS_PATH (the
# mesh sits below the worker, so it cannot import it; tests/mesh/test_mesh_snapshot.py checks).
WEBSOCKET_PATH = "/v1/ws"


def _body_filters(opts: BuildOptions, edges_need_it: bool = False) -> list[hcm_pb2.HttpFilter]:
    if not opts.route_by_body and not edges_need_it:
        return []
    J = json_to_metadata_pb2.JsonToMetadata
    config = J(
        request_rules=J.MatchRules(
            rules=[
                J.Rule(
                    selectors=[J.Selector(key="model")],
                    on_present=J.KeyValuePair(
                        metadata_namespace=BODY_METADATA_NAMESPACE, key="model"
                    ),
                )
            ],
            allow_content_types=list(JSON_CONTENT_TYPES),
        )
    )
    return [
        hcm_pb2.HttpFilter(name="envoy.filters.http.json_to_metadata", typed_config=_pack(config))
    ]


def _ext_proc_filters(shard_id: str, opts: BuildOptions) -> list[hcm_pb2.HttpFilter]:
    ext = opts.ext_proc
    if ext is None:
        return []
    Mode = processing_mode_pb2.ProcessingMode
    config = ext_proc_pb2.ExternalProcessor(
        grpc_service=grpc_service_pb2.GrpcService(
            envoy_grpc=grpc_service_pb2.GrpcService.EnvoyGrpc(cluster_name=ext.cluster),
            # Names the shard: the processor fails open for shard listeners and follows the
            # picker protocol for GIE gateways (agent/extproc.py).
            initial_metadata=[base_pb2.HeaderValue(key="x-adaptermesh-shard", value=shard_id)],
        ),
        failure_mode_allow=ext.failure_mode_allow,
        message_timeout=_duration(ext.message_timeout_s),
        processing_mode=Mode(
            request_header_mode=Mode.SEND,
            response_header_mode=Mode.SKIP,
            request_body_mode=Mode.BUFFERED,
            response_body_mode=Mode.NONE,
            request_trailer_mode=Mode.SKIP,
            response_trailer_mode=Mode.SKIP,
        ),
    )
    return [hcm_pb2.HttpFilter(name="envoy.filters.http.ext_proc", typed_config=_pack(config))]


def build_route_configuration(
    shard: assignment_pb2.Shard,
    opts: BuildOptions,
    edges: Sequence[assignment_pb2.AdapterEdge] = (),
) -> route_pb2.RouteConfiguration:
    """The adapter edges' routes (mesh/edge.py), adapter-affinity routes (one per adapter a
    serving worker holds), then the shard."""
    name = cluster_name(shard.id)
    # Draining workers are unhealthy for the load balancer, so their adapters do not count.
    adapters = sorted({a for ep in shard.endpoints if not ep.draining for a in ep.adapters})
    routes = (
        edge_routes(
            edges,
            EdgeContext(
                shard_id=shard.id,
                adapter_header=opts.adapter_header,
                auth=opts.edge_auth,
                http_action=lambda cluster: _route_action(cluster, opts),
                http_cluster=cluster_name,
                grpc_cluster=None if opts.grpc_port_offset is None else grpc_cluster_name,
                grpc_prefix=GRPC_V2_PREFIX,
                websocket_path=WEBSOCKET_PATH,
                ext_proc=opts.ext_proc is not None,
                body_namespace=BODY_METADATA_NAMESPACE,
                adapter_key=ADAPTER_METADATA_KEY,
            ),
        )
        if edges
        else []
    )
    if opts.grpc_port_offset is not None:
        routes.extend(_grpc_routes(shard.id, adapters, opts))
    for adapter in adapters if opts.route_by_body else ():
        # The body's model first: it decides over a client's header.
        action = _route_action(name, opts)
        action.metadata_match.filter_metadata[_LB_NAMESPACE].fields[
            ADAPTER_METADATA_KEY
        ].string_value = adapter
        routes.append(
            route_components_pb2.Route(
                name=f"body:{adapter}",
                match=route_components_pb2.RouteMatch(
                    prefix="/",
                    dynamic_metadata=[
                        metadata_pb2.MetadataMatcher(
                            filter=BODY_METADATA_NAMESPACE,
                            path=[metadata_pb2.MetadataMatcher.PathSegment(key="model")],
                            value=value_pb2.ValueMatcher(
                                string_match=string_pb2.StringMatcher(exact=adapter)
                            ),
                        )
                    ],
                ),
                route=action,
            )
        )
    if opts.ext_proc is not None:
        routes.extend(_websocket_routes(name, adapters, opts))
    for adapter in adapters:
        action = _route_action(name, opts)
        action.metadata_match.filter_metadata[_LB_NAMESPACE].fields[
            ADAPTER_METADATA_KEY
        ].string_value = adapter
        routes.append(
            route_components_pb2.Route(
                name=f"adapter:{adapter}",
                match=route_components_pb2.RouteMatch(
                    prefix="/",
                    headers=[
                        route_components_pb2.HeaderMatcher(
                            name=opts.adapter_header,
                            string_match=string_pb2.StringMatcher(exact=adapter),
                        )
                    ],
                ),
                route=action,
            )
        )
    routes.append(
        route_components_pb2.Route(
            name="shard",
            match=route_components_pb2.RouteMatch(prefix="/"),
            route=_route_action(name, opts),
        )
    )
    served_by = base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=SERVED_BY_HEADER, value=shard.id),
        append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
    )
    return route_pb2.RouteConfiguration(
        name=name,
        virtual_hosts=[
            route_components_pb2.VirtualHost(
                name=name, domains=["*"], routes=routes, response_headers_to_add=[served_by]
            )
        ],
    )


def _websocket_routes(
    name: str, adapters: list[str], opts: BuildOptions
) -> list[route_components_pb2.Route]:
    """The worker's WebSocket path without the ext_proc filter: it buffers the request body,
    and an upgrade's body never ends, so the handshake would stall (measured in
    tests/mesh/test_ws_envoy.py). Each message names its own model, so there is no body to
    route by; the adapter header still picks holders."""
    return _routes_without_ext_proc("ws", name, adapters, opts, {"path": WEBSOCKET_PATH})


GRPC_V2_PREFIX = "/inference.GRPCInferenceService/"


def _grpc_routes(
    shard_id: str, adapters: list[str], opts: BuildOptions
) -> list[route_components_pb2.Route]:
    """KServe v2 gRPC calls to the shard's gRPC cluster. The model name is inside the
    protobuf body, so ext_proc (which reads JSON) is off for them; the adapter header still
    picks the adapter's holders."""
    return _routes_without_ext_proc("grpc", grpc_cluster_name(shard_id), adapters, opts,
                                    {"prefix": GRPC_V2_PREFIX})  # fmt: skip


def _routes_without_ext_proc(
    kind: str, cluster: str, adapters: list[str], opts: BuildOptions, match: dict[str, str]
) -> list[route_components_pb2.Route]:
    """One route per adapter (matched by the adapter header, to that adapter's holders) and
    one for the rest, all on ``match`` (a path or prefix), with ext_proc off when it runs."""
    skip = (
        {"envoy.filters.http.ext_proc": _pack(ext_proc_pb2.ExtProcPerRoute(disabled=True))}
        if opts.ext_proc is not None
        else {}
    )
    routes = []
    for adapter in [*adapters, None]:
        action = _route_action(cluster, opts)
        headers = []
        if adapter is not None:
            action.metadata_match.filter_metadata[_LB_NAMESPACE].fields[
                ADAPTER_METADATA_KEY
            ].string_value = adapter
            headers = [
                route_components_pb2.HeaderMatcher(
                    name=opts.adapter_header, string_match=string_pb2.StringMatcher(exact=adapter)
                )
            ]
        routes.append(
            route_components_pb2.Route(
                name=kind if adapter is None else f"{kind}:{adapter}",
                match=route_components_pb2.RouteMatch(headers=headers, **match),
                route=action,
                typed_per_filter_config=skip,
            )
        )
    return routes


def _route_action(cluster: str, opts: BuildOptions) -> route_components_pb2.RouteAction:
    return route_components_pb2.RouteAction(
        cluster=cluster,
        timeout=_duration(opts.route_timeout_s),
        retry_policy=route_components_pb2.RetryPolicy(
            retry_on=opts.retry_on,
            num_retries=wrappers_pb2.UInt32Value(value=opts.num_retries),
            retry_host_predicate=[
                route_components_pb2.RetryPolicy.RetryHostPredicate(
                    name="envoy.retry_host_predicates.previous_hosts",
                    typed_config=_pack(previous_hosts_pb2.PreviousHostsPredicate()),
                )
            ],
            host_selection_retry_max_attempts=3,
        ),
    )


# Extended CONNECT upstream carries a client's WebSocket to an HTTP/2 worker.
_UPSTREAM_HTTP2 = protocol_pb2.Http2ProtocolOptions(allow_connect=True)


def _upstream_protocol_options(
    protocol: str, opts: BuildOptions
) -> http_protocol_options_pb2.HttpProtocolOptions:
    Options = http_protocol_options_pb2.HttpProtocolOptions
    common = protocol_pb2.HttpProtocolOptions(idle_timeout=_duration(opts.upstream_idle_timeout_s))
    if protocol == "http2":
        return Options(
            common_http_protocol_options=common,
            explicit_http_config=Options.ExplicitHttpConfig(http2_protocol_options=_UPSTREAM_HTTP2),
        )
    if protocol == "downstream":
        return Options(
            common_http_protocol_options=common,
            use_downstream_protocol_config=Options.UseDownstreamHttpConfig(
                http_protocol_options=protocol_pb2.Http1ProtocolOptions(),
                http2_protocol_options=_UPSTREAM_HTTP2,
            ),
        )
    return Options(
        common_http_protocol_options=common,
        explicit_http_config=Options.ExplicitHttpConfig(
            http_protocol_options=protocol_pb2.Http1ProtocolOptions()
        ),
    )


def _ads_source() -> config_source_pb2.ConfigSource:
    return config_source_pb2.ConfigSource(
        ads=config_source_pb2.AggregatedConfigSource(),
        resource_api_version=config_source_pb2.V3,
    )


def _socket(address: str, port: int) -> address_pb2.Address:
    return address_pb2.Address(
        socket_address=address_pb2.SocketAddress(
            address=address, port_value=port, protocol=address_pb2.SocketAddress.TCP
        )
    )


def _duration(seconds: float) -> duration_pb2.Duration:
    whole = int(seconds)
    return duration_pb2.Duration(seconds=whole, nanos=round((seconds - whole) * 1e9))


def _pack(message: Message) -> any_pb2.Any:
    packed = any_pb2.Any()
    packed.Pack(message)
    return packed


def _resource_name(message: Message) -> str:
    if isinstance(message, endpoint_pb2.ClusterLoadAssignment):
        return str(message.cluster_name)
    name: Any = getattr(message, "name", None)
    if not isinstance(name, str):
        raise TypeError(f"{type(message).__name__} is not an xDS resource")
    return name


def _short(type_url: str) -> str:
    return type_url.rsplit(".", 1)[-1]


def _listener_rds_names(listener: listener_pb2.Listener) -> list[str]:
    names = []
    for chain in listener.filter_chains:
        for flt in chain.filters:
            if flt.typed_config.Is(hcm_pb2.HttpConnectionManager.DESCRIPTOR):
                manager = hcm_pb2.HttpConnectionManager()
                flt.typed_config.Unpack(manager)
                if manager.HasField("rds"):
                    names.append(manager.rds.route_config_name)
    return names


def _route_clusters(route_config: route_pb2.RouteConfiguration) -> list[str]:
    names = []
    for host in route_config.virtual_hosts:
        for route in host.routes:
            if not route.HasField("route"):
                continue
            action = route.route
            if action.cluster:
                names.append(action.cluster)
            names.extend(c.name for c in action.weighted_clusters.clusters)
    return names
