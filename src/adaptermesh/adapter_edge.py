"""The AdapterInstance's edge contract: paths, protocol, security and placement.

One owner for these rules: the control plane checks an AdapterInstance with
:func:`check_instance` when it is written, turns it into the Assignment's ``AdapterEdge`` with
:func:`edge_of`, and the rebalancer (before it publishes), the agent (before it applies) and
the snapshot builder all check the published edges with :func:`check_edges`. So an edge that
an Envoy would refuse is never stored. docs/adapter-instance.md describes what each field
does at the edge.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import TYPE_CHECKING

from adaptermesh.assignment_rules import (
    MAX_ADAPTER_NAME,
    MAX_ALLOWED_CIDRS,
    MAX_SHARDS,
    RuleError,
    normalise_cidr,
    quote,
)

if TYPE_CHECKING:  # the lazy re-export hides the generated types from mypy
    from adaptermesh.proto.adaptermesh.v1 import assignment_pb2, control_plane_pb2
else:
    from adaptermesh.proto import assignment_pb2, control_plane_pb2

__all__ = [
    "GRPC_SERVICE_RE",
    "MAX_EDGES",
    "MAX_PATHS",
    "MAX_REPLICAS",
    "MAX_SCOPES",
    "PROTOCOLS",
    "RESERVED_PATHS",
    "SCOPE_RE",
    "check_edges",
    "check_instance",
    "check_path",
    "edge_of",
    "edges_of",
    "guarded",
    "protocol_of",
]

HTTP_JSON = "http-json"
GRPC = "grpc"
GRPC_JSON = "grpc-json"
PROTOCOLS = (HTTP_JSON, GRPC, GRPC_JSON)

MAX_PATHS = 32  # per adapter
MAX_SCOPES = 64  # per adapter
MAX_REPLICAS = 1024
MAX_EDGES = 4096  # adapters with an edge contract in one Assignment
MAX_PATH = 256

# Token scopes: what an OAuth 2 "scope" claim item may hold here (no spaces: the claim is a
# space-separated list).
SCOPE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9:._/-]{0,127}$")
# An HTTP path of plain segments: no query, no fragment, no empty, "." or ".." segment, no
# percent-encoding (Envoy matches the path as sent, so an encoded twin would miss the route).
_SEGMENT = r"[A-Za-z0-9_~-][A-Za-z0-9._~-]*"
_HTTP_PATH_RE = re.compile(rf"^(/{_SEGMENT})+$")
# A gRPC service prefix, "/package.Service/": calls to it reach the adapter's KServe v2
# service (same messages, the client's own service name).
GRPC_SERVICE_RE = re.compile(r"^/[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*/$")
# Paths the mesh routes itself: an AdapterInstance cannot take them over.
RESERVED_PATHS = (
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/models",
    "/v1/load_lora_adapter",
    "/v1/unload_lora_adapter",
    "/v1/ws",
    "/health",
    "/metrics",
)
_RESERVED_PREFIXES = ("/inference.GRPCInferenceService/", "/grpc.", "/v2/")
_SHARD_ID_RE = re.compile(r"^[a-z0-9]([a-z0-9._-]{0,61}[a-z0-9])?$")


def protocol_of(value: str) -> str:
    """The protocol an empty field means."""
    return value or HTTP_JSON


def check_path(path: str, protocol: str, field: str) -> None:
    """A route path that ``protocol`` can serve, outside the mesh's own paths."""
    if not path:
        raise RuleError(field, "required")
    if len(path) > MAX_PATH:
        raise RuleError(field, f"at most {MAX_PATH} characters")
    if protocol == GRPC:
        if not GRPC_SERVICE_RE.match(path):
            raise RuleError(
                field,
                f"{quote(path)}: a grpc route is a service prefix such as '/credit.risk.v2.Inference/'",
            )
    elif not _HTTP_PATH_RE.match(path):
        raise RuleError(
            field,
            f"{quote(path)}: a path of plain segments such as '/v1/evaluate' "
            "(no query, trailing slash, '.', '..' or percent-encoding)",
        )
    if path in RESERVED_PATHS or path.startswith(_RESERVED_PREFIXES):
        raise RuleError(field, f"{quote(path)} is one of the mesh's own paths")


def _check_protocol(value: str, field: str) -> str:
    protocol = protocol_of(value)
    if protocol not in PROTOCOLS:
        raise RuleError(field, f"{quote(value)} is not one of {', '.join(PROTOCOLS)}")
    return protocol


def _check_scopes(scopes: Iterable[str], field: str) -> None:
    seen: set[str] = set()
    for i, scope in enumerate(scopes):
        if i >= MAX_SCOPES:
            raise RuleError(field, f"at most {MAX_SCOPES}")
        if not SCOPE_RE.match(scope):
            raise RuleError(f"{field}[{i}]", f"{quote(scope)} must match {SCOPE_RE.pattern}")
        if scope in seen:
            raise RuleError(f"{field}[{i}]", f"duplicate scope {quote(scope)}")
        seen.add(scope)


def _check_shard_list(ids: Iterable[str], known: set[str] | None, field: str) -> list[str]:
    out: list[str] = []
    for i, shard_id in enumerate(ids):
        if i >= MAX_SHARDS:
            raise RuleError(field, f"at most {MAX_SHARDS}")
        if not _SHARD_ID_RE.match(shard_id):
            raise RuleError(f"{field}[{i}]", f"{quote(shard_id)} is not a shard id")
        if known is not None and shard_id not in known:
            raise RuleError(f"{field}[{i}]", f"no shard {quote(shard_id)}")
        if shard_id in out:
            raise RuleError(f"{field}[{i}]", f"duplicate shard {quote(shard_id)}")
        out.append(shard_id)
    return out


def check_instance(
    inst: control_plane_pb2.AdapterInstance, shard_ids: set[str], field: str = "instance"
) -> None:
    """The edge fields of one AdapterInstance against the shards that exist.

    Routes: each has a ``shard_id`` or a ``path``, not both. Shard routes and pinned shards
    lie inside ``placement.shards`` when that is set.
    """
    protocol = _check_protocol(inst.protocol, f"{field}.protocol")
    paths: set[str] = set()
    for i, route in enumerate(inst.routes):
        where = f"{field}.routes[{i}]"
        if route.path and route.shard_id:
            raise RuleError(where, "a route has a shard_id or a path, not both")
        if route.path:
            if route.weight:
                raise RuleError(f"{where}.weight", "a path route has no weight")
            check_path(route.path, protocol, f"{where}.path")
            if route.path in paths:
                raise RuleError(f"{where}.path", f"duplicate path {quote(route.path)}")
            paths.add(route.path)
    if len(paths) > MAX_PATHS:
        raise RuleError(f"{field}.routes", f"at most {MAX_PATHS} paths")
    _check_scopes(inst.security.scopes, f"{field}.security.scopes")
    pw = f"{field}.placement"
    allowed = _check_shard_list(inst.placement.shards, shard_ids, f"{pw}.shards")
    pinned = _check_shard_list(inst.placement.pinned_shards, shard_ids, f"{pw}.pinned_shards")
    if inst.placement.replicas > MAX_REPLICAS:
        raise RuleError(f"{pw}.replicas", f"{inst.placement.replicas} is above {MAX_REPLICAS}")
    if allowed:
        for i, shard_id in enumerate(pinned):
            if shard_id not in allowed:
                raise RuleError(
                    f"{pw}.pinned_shards[{i}]", f"{quote(shard_id)} is not in placement.shards"
                )
        for i, route in enumerate(inst.routes):
            if route.shard_id and route.shard_id not in allowed:
                raise RuleError(
                    f"{field}.routes[{i}].shard_id",
                    f"{quote(route.shard_id)} is not in placement.shards {allowed}",
                )


def edge_of(inst: control_plane_pb2.AdapterInstance) -> assignment_pb2.AdapterEdge | None:
    """What the edge enforces for ``inst``; None when it asks nothing of the edge."""
    edge = assignment_pb2.AdapterEdge(
        name=inst.name,
        protocol=protocol_of(inst.protocol),
        paths=[r.path for r in inst.routes if r.path],
        scopes=list(inst.security.scopes),
        tls=inst.security.tls,
        shards=list(inst.placement.shards),
        allowed_cidrs=[normalise_cidr(c) for c in inst.security.allowed_cidrs],
    )
    if (
        edge.protocol == HTTP_JSON
        and not edge.paths
        and not edge.scopes
        and not edge.tls
        and not edge.shards
        and not edge.allowed_cidrs
    ):
        return None
    return edge


def edges_of(
    instances: Iterable[control_plane_pb2.AdapterInstance],
) -> list[assignment_pb2.AdapterEdge]:
    """The Assignment's edges, in name order."""
    edges = [e for e in map(edge_of, instances) if e is not None]
    return sorted(edges, key=lambda e: e.name)


def guarded(edge: assignment_pb2.AdapterEdge) -> bool:
    """Requests for the adapter need a token (scopes), TLS or an allowed source."""
    return bool(edge.scopes) or edge.tls or bool(edge.allowed_cidrs)


def check_edges(assignment: assignment_pb2.Assignment) -> None:
    """The Assignment's edges: names, protocols, paths unique across adapters, scopes, and
    placement shards that the Assignment has."""
    if len(assignment.adapters) > MAX_EDGES:
        raise RuleError("adapters", f"at most {MAX_EDGES}, got {len(assignment.adapters)}")
    shard_ids = {s.id for s in assignment.shards}
    names: dict[str, int] = {}
    owners: dict[str, str] = {}
    for i, edge in enumerate(assignment.adapters):
        field = f"adapters[{i}]"
        if not 0 < len(edge.name) <= MAX_ADAPTER_NAME or not edge.name.isprintable():
            raise RuleError(f"{field}.name", f"1..{MAX_ADAPTER_NAME} printable characters")
        if edge.name in names:
            raise RuleError(
                f"{field}.name",
                f"duplicate adapter {quote(edge.name)} (also adapters[{names[edge.name]}])",
            )
        names[edge.name] = i
        protocol = _check_protocol(edge.protocol, f"{field}.protocol")
        if len(edge.paths) > MAX_PATHS:
            raise RuleError(f"{field}.paths", f"at most {MAX_PATHS}")
        for j, path in enumerate(edge.paths):
            check_path(path, protocol, f"{field}.paths[{j}]")
            if path in owners:
                raise RuleError(
                    f"{field}.paths[{j}]",
                    f"{quote(path)} already reaches adapter {quote(owners[path])}",
                )
            owners[path] = edge.name
        _check_scopes(edge.scopes, f"{field}.scopes")
        _check_shard_list(edge.shards, shard_ids, f"{field}.shards")
        if len(edge.allowed_cidrs) > MAX_ALLOWED_CIDRS:
            raise RuleError(f"{field}.allowed_cidrs", f"at most {MAX_ALLOWED_CIDRS}")
        for j, cidr in enumerate(edge.allowed_cidrs):
            normalise_cidr(cidr, f"{field}.allowed_cidrs[{j}]")
