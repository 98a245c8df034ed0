"""Envoy resources for the Assignment's adapter edges (``adaptermesh.adapter_edge``).

Pure builders, called by :mod:`adaptermesh.mesh.snapshot` for each shard listener:

- **Paths.** ``http-json``: the exact path, rewritten to ``/v1/completions``; ``grpc``: the
  service prefix, rewritten to the KServe v2 service ``/inference.GRPCInferenceService/``.
  Both set the adapter header (``x-adapter-id``, which the worker also reads when the body
  names no model) and pick the adapter's holders by subset.
- **Placement.** An adapter placed on other shards is forwarded from this listener to their
  clusters (equal split), whether it is named by path, header or body.
- **Security.** A guarded adapter's routes (path, header, JSON body ``model``, gRPC and
  WebSocket with the header) carry two per-route configs: ``jwt_authn`` requires a valid
  bearer JWT (401 without one or with a bad one) and ``rbac`` requires every scope of the
  adapter in the token's ``scope`` claim (403). Both run in Envoy before any upstream is
  picked, so a refused request never reaches a worker. ``tls`` adds a TLS-only match; the same
  request in plaintext is answered 403 by Envoy. While any adapter is guarded, gRPC and
  WebSocket requests that do not name their adapter in the header are refused (403): their
  bodies (protobuf, WebSocket messages) are not read at the edge, so the header is the name
  the edge checks.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from envoy.config.core.v3 import address_pb2, base_pb2, protocol_pb2
from envoy.config.listener.v3 import listener_components_pb2
from envoy.config.rbac.v3 import rbac_pb2 as rbac_config_pb2
from envoy.config.route.v3 import route_components_pb2
from envoy.extensions.filters.http.ext_proc.v3 import ext_proc_pb2
from envoy.extensions.filters.http.jwt_authn.v3 import config_pb2 as jwt_pb2
from envoy.extensions.filters.http.rbac.v3 import rbac_pb2
from envoy.extensions.filters.listener.tls_inspector.v3 import tls_inspector_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import (
    http_connection_manager_pb2 as hcm_pb2,
)
from envoy.extensions.transport_sockets.tls.v3 import common_pb2 as secret_pb2
from envoy.extensions.transport_sockets.tls.v3 import tls_pb2
from envoy.type.matcher.v3 import metadata_pb2, regex_pb2, string_pb2, value_pb2
from google.protobuf import any_pb2
from google.protobuf.message import Message

from adaptermesh import adapter_edge
from adaptermesh.mesh.transcoder import transcoder_filter

if TYPE_CHECKING:  # the lazy re-export hides the generated types from mypy
    from adaptermesh.proto.adaptermesh.v1 import assignment_pb2

__all__ = [
    "COMPLETIONS_PATH",
    "JSON_CONTENT_TYPES",
    "JWT_FILTER",
    "EdgeAuthOptions",
    "EdgeContext",
    "EdgeTlsOptions",
    "edge_filters",
    "edge_routes",
    "front_filters",
    "grpc_json_paths",
    "needs_body_model",
    "tls_filter_chain",
    "tls_inspector",
    "tls_scheme",
]

COMPLETIONS_PATH = "/v1/completions"
JWT_FILTER = "envoy.filters.http.jwt_authn"
RBAC_FILTER = "envoy.filters.http.rbac"
_EXT_PROC = "envoy.filters.http.ext_proc"
_PROVIDER = "adaptermesh"
_PAYLOAD_KEY = "jwt_payload"
_LB_NAMESPACE = "envoy.lb"


# The content types whose body the listener reads for its "model" (json_to_metadata's
# allow_content_types, set by mesh/snapshot.py from this list). While an adapter is guarded,
# POSTs of any other type (gRPC aside) are refused, so a body cannot name it unread.
JSON_CONTENT_TYPES = (
    "application/json",
    "application/json; charset=utf-8",
    "application/json;charset=utf-8",
    "application/json; charset=UTF-8",
    "application/json;charset=UTF-8",
)


@dataclass(frozen=True)
class EdgeAuthOptions:
    """How the edge verifies bearer tokens: JWTs signed by a key in ``jwks`` (a JWKS JSON
    document; give Envoy public keys only), from ``issuer``, for one of ``audiences`` (empty:
    any). Scopes come from the token's ``scope`` claim (space-separated, RFC 8693)."""

    issuer: str
    jwks: str
    audiences: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        try:
            keys = json.loads(self.jwks).get("keys")
        except (ValueError, AttributeError):
            keys = None
        if not isinstance(keys, list) or not keys:
            raise ValueError("EdgeAuthOptions.jwks: a JWKS document with at least one key")
        if not self.issuer:
            raise ValueError("EdgeAuthOptions.issuer: required")


@dataclass(frozen=True)
class EdgeTlsOptions:
    """TLS termination on every shard listener, beside plaintext on the same port (the
    listener tells them apart by the ClientHello): the certificate chain and key files as
    the Envoy process reads them. Adapters with ``security.tls`` are served only over it."""

    cert_chain_file: str
    private_key_file: str

    def __post_init__(self) -> None:
        if not self.cert_chain_file or not self.private_key_file:
            raise ValueError("EdgeTlsOptions: cert_chain_file and private_key_file are required")


def tls_filter_chain(
    tls: EdgeTlsOptions, chain: listener_components_pb2.FilterChain
) -> listener_components_pb2.FilterChain:
    """``chain`` (the plaintext one) behind TLS: matched on a TLS ClientHello, ALPN h2 and
    http/1.1."""
    context = tls_pb2.DownstreamTlsContext(
        common_tls_context=tls_pb2.CommonTlsContext(
            tls_certificates=[
                secret_pb2.TlsCertificate(
                    certificate_chain=base_pb2.DataSource(filename=tls.cert_chain_file),
                    private_key=base_pb2.DataSource(filename=tls.private_key_file),
                )
            ],
            alpn_protocols=["h2", "http/1.1"],
        )
    )
    out = listener_components_pb2.FilterChain()
    out.CopyFrom(chain)
    out.name = "tls"
    out.filter_chain_match.transport_protocol = "tls"
    out.transport_socket.CopyFrom(
        base_pb2.TransportSocket(name="envoy.transport_sockets.tls", typed_config=_pack(context))
    )
    return out


def tls_scheme(tls: bool) -> protocol_pb2.SchemeHeaderTransformation:
    """The scheme a chain's HTTP manager writes over every request's ``:scheme`` before
    routing (what a client sent does not count): a TLS adapter's routes match ``https``."""
    return protocol_pb2.SchemeHeaderTransformation(scheme_to_overwrite="https" if tls else "http")


def tls_inspector() -> listener_components_pb2.ListenerFilter:
    return listener_components_pb2.ListenerFilter(
        name="envoy.filters.listener.tls_inspector",
        typed_config=_pack(tls_inspector_pb2.TlsInspector()),
    )


@dataclass(frozen=True)
class EdgeContext:
    """What the edge builders need from the snapshot builder (which imports this module)."""

    shard_id: str
    adapter_header: str
    auth: EdgeAuthOptions | None
    # cluster name -> a RouteAction to it (timeouts, retries) for HTTP and for gRPC.
    http_action: Callable[[str], route_components_pb2.RouteAction]
    http_cluster: Callable[[str], str]
    grpc_cluster: Callable[[str], str] | None  # None: no gRPC clusters on this mesh
    grpc_prefix: str
    websocket_path: str
    ext_proc: bool
    body_namespace: str
    adapter_key: str


def _pack(message: Message) -> any_pb2.Any:
    packed = any_pb2.Any()
    packed.Pack(message)
    return packed


def needs_body_model(edges: Sequence[assignment_pb2.AdapterEdge]) -> bool:
    """The listener must read the JSON body's ``model`` (guarded or placed adapters)."""
    return any(adapter_edge.guarded(e) or e.shards for e in edges)


def grpc_json_paths(edges: Sequence[assignment_pb2.AdapterEdge]) -> tuple[str, ...]:
    return tuple(sorted(p for e in edges if e.protocol == adapter_edge.GRPC_JSON for p in e.paths))


def front_filters(
    edges: Sequence[assignment_pb2.AdapterEdge], grpc: bool
) -> list[hcm_pb2.HttpFilter]:
    """Filters that go first: the gRPC-JSON transcoder when a grpc-json adapter has paths
    and the mesh serves gRPC (without gRPC, those paths answer 503)."""
    paths = grpc_json_paths(edges)
    return [transcoder_filter(paths)] if paths and grpc else []


def edge_filters(
    edges: Sequence[assignment_pb2.AdapterEdge], auth: EdgeAuthOptions | None
) -> list[hcm_pb2.HttpFilter]:
    """jwt_authn and rbac, placed after the filters that may change the route (body, ext_proc)
    and before the router; both act only where a route's per-route config asks them to."""
    if not any(e.scopes or e.allowed_cidrs for e in edges):
        return []
    filters = []
    if auth is not None and any(e.scopes for e in edges):
        provider = jwt_pb2.JwtProvider(
            issuer=auth.issuer,
            audiences=list(auth.audiences),
            local_jwks=base_pb2.DataSource(inline_string=auth.jwks),
            payload_in_metadata=_PAYLOAD_KEY,
            forward=False,
        )
        config = jwt_pb2.JwtAuthentication(
            providers={_PROVIDER: provider},
            requirement_map={_PROVIDER: jwt_pb2.JwtRequirement(provider_name=_PROVIDER)},
        )
        filters.append(hcm_pb2.HttpFilter(name=JWT_FILTER, typed_config=_pack(config)))
    filters.append(hcm_pb2.HttpFilter(name=RBAC_FILTER, typed_config=_pack(rbac_pb2.RBAC())))
    return filters


def _scope_matcher(scope: str) -> rbac_config_pb2.Principal:
    pattern = rf"(^|.* ){re.escape(scope)}( .*|$)"
    return rbac_config_pb2.Principal(
        metadata=metadata_pb2.MetadataMatcher(
            filter=JWT_FILTER,
            path=[
                metadata_pb2.MetadataMatcher.PathSegment(key=_PAYLOAD_KEY),
                metadata_pb2.MetadataMatcher.PathSegment(key="scope"),
            ],
            value=value_pb2.ValueMatcher(
                string_match=string_pb2.StringMatcher(
                    safe_regex=regex_pb2.RegexMatcher(regex=pattern)
                )
            ),
        )
    )


def _source_matcher(cidrs: Sequence[str]) -> rbac_config_pb2.Principal:
    ranges = []
    for cidr in cidrs:
        address, _, prefix = cidr.partition("/")
        ranges.append(
            rbac_config_pb2.Principal(
                direct_remote_ip=address_pb2.CidrRange(
                    address_prefix=address, prefix_len={"value": int(prefix)}
                )
            )
        )
    return rbac_config_pb2.Principal(or_ids=rbac_config_pb2.Principal.Set(ids=ranges))


def _guard(edge: assignment_pb2.AdapterEdge, ctx: EdgeContext) -> dict[str, any_pb2.Any]:
    """Per-route configs: ext_proc off (the adapter is decided), the token and its scopes,
    the allowed sources (the client's own address: the classifier steers without NAT)."""
    out: dict[str, any_pb2.Any] = {}
    if ctx.ext_proc:
        out[_EXT_PROC] = _pack(ext_proc_pb2.ExtProcPerRoute(disabled=True))
    if not edge.scopes and not edge.allowed_cidrs:
        return out
    if edge.scopes and ctx.auth is not None:
        out[JWT_FILTER] = _pack(jwt_pb2.PerRouteConfig(requirement_name=_PROVIDER))
    ids = [_scope_matcher(s) for s in edge.scopes]
    if edge.allowed_cidrs:
        ids.append(_source_matcher(edge.allowed_cidrs))
    principal = rbac_config_pb2.Principal(and_ids=rbac_config_pb2.Principal.Set(ids=ids))
    policy = rbac_config_pb2.Policy(
        permissions=[rbac_config_pb2.Permission(any=True)], principals=[principal]
    )
    out[RBAC_FILTER] = _pack(
        rbac_pb2.RBACPerRoute(
            rbac=rbac_pb2.RBAC(
                rules=rbac_config_pb2.RBAC(
                    action=rbac_config_pb2.RBAC.ALLOW, policies={f"scopes:{edge.name}": policy}
                )
            )
        )
    )
    return out


def _targets(edge: assignment_pb2.AdapterEdge, shard_id: str) -> list[str]:
    if not edge.shards or shard_id in edge.shards:
        return [shard_id]
    return list(edge.shards)


def _action(
    edge: assignment_pb2.AdapterEdge, ctx: EdgeContext, cluster_of: Callable[[str], str]
) -> route_components_pb2.RouteAction:
    targets = [cluster_of(t) for t in _targets(edge, ctx.shard_id)]
    action = ctx.http_action(targets[0])
    if len(targets) > 1:
        action.ClearField("cluster")
        action.weighted_clusters.CopyFrom(
            route_components_pb2.WeightedCluster(
                clusters=[
                    route_components_pb2.WeightedCluster.ClusterWeight(name=c, weight={"value": 1})
                    for c in targets
                ]
            )
        )
    action.metadata_match.filter_metadata[_LB_NAMESPACE].fields[
        ctx.adapter_key
    ].string_value = edge.name
    return action


def _refusal(
    name: str, match: route_components_pb2.RouteMatch, status: int, body: str
) -> route_components_pb2.Route:
    return route_components_pb2.Route(
        name=name,
        match=match,
        direct_response=route_components_pb2.DirectResponseAction(
            status=status, body=base_pb2.DataSource(inline_string=body)
        ),
    )


def _routes_for(
    edge: assignment_pb2.AdapterEdge,
    name: str,
    match: route_components_pb2.RouteMatch,
    action: route_components_pb2.RouteAction | None,
    ctx: EdgeContext,
    set_header: bool,
) -> list[route_components_pb2.Route]:
    """The route, TLS-only when the adapter asks for it (then plaintext is refused)."""
    routes = []
    if action is None:  # the protocol is not served on this mesh
        return [
            _refusal(
                name,
                match,
                503,
                f"adapter {edge.name}: {edge.protocol} is not served by this mesh\n",
            )
        ]
    route = route_components_pb2.Route(
        name=name, match=match, route=action, typed_per_filter_config=_guard(edge, ctx)
    )
    if set_header:
        route.request_headers_to_add.append(
            base_pb2.HeaderValueOption(
                header=base_pb2.HeaderValue(key=ctx.adapter_header, value=edge.name),
                append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
            )
        )
    if edge.tls:
        route.match.headers.append(
            route_components_pb2.HeaderMatcher(
                name=":scheme", string_match=string_pb2.StringMatcher(exact="https")
            )
        )
        routes.append(route)
        plain = route_components_pb2.RouteMatch()
        plain.CopyFrom(match)
        routes.append(
            _refusal(f"{name}:plaintext", plain, 403, f"adapter {edge.name} requires TLS\n")
        )
    else:
        routes.append(route)
    return routes


def _header(ctx: EdgeContext, value: str) -> route_components_pb2.HeaderMatcher:
    return route_components_pb2.HeaderMatcher(
        name=ctx.adapter_header, string_match=string_pb2.StringMatcher(exact=value)
    )


def edge_routes(
    edges: Sequence[assignment_pb2.AdapterEdge], ctx: EdgeContext
) -> list[route_components_pb2.Route]:
    """Routes placed before the shard's own: paths, then the guarded or placed adapters by
    body, gRPC header, WebSocket header and header, then the refusals for unnamed gRPC and
    WebSocket requests while any adapter is guarded."""
    RM = route_components_pb2.RouteMatch
    routes: list[route_components_pb2.Route] = []
    for edge in edges:
        for path in edge.paths:
            if edge.protocol == adapter_edge.GRPC:
                action = None if ctx.grpc_cluster is None else _action(edge, ctx, ctx.grpc_cluster)
                if action is not None:
                    action.prefix_rewrite = ctx.grpc_prefix
                routes += _routes_for(edge, f"path:{path}", RM(prefix=path), action, ctx, True)
            elif edge.protocol == adapter_edge.GRPC_JSON:
                # The transcoder has already made it a ModelInfer call on this route.
                action = None if ctx.grpc_cluster is None else _action(edge, ctx, ctx.grpc_cluster)
                routes += _routes_for(edge, f"path:{path}", RM(path=path), action, ctx, True)
            else:
                action = _action(edge, ctx, ctx.http_cluster)
                action.prefix_rewrite = COMPLETIONS_PATH
                routes += _routes_for(edge, f"path:{path}", RM(path=path), action, ctx, True)
    if any(adapter_edge.guarded(e) for e in edges):
        # The body is read for the model only when it is JSON (json_to_metadata's content
        # types); the worker parses any body as JSON, so another content type could name a
        # guarded adapter unseen. POSTs other than JSON and gRPC are refused instead.
        accepted = "|".join(re.escape(t) for t in JSON_CONTENT_TYPES)
        other = route_components_pb2.HeaderMatcher(
            name="content-type",
            invert_match=True,
            treat_missing_header_as_empty=True,
            string_match=string_pb2.StringMatcher(
                safe_regex=regex_pb2.RegexMatcher(
                    regex=rf"^({accepted}|application/grpc([+][a-z]+)?)$"
                )
            ),
        )
        post = route_components_pb2.HeaderMatcher(
            name=":method", string_match=string_pb2.StringMatcher(exact="POST")
        )
        routes.append(
            _refusal(
                "edge:content-type",
                RM(prefix="/", headers=[post, other]),
                415,
                "send the request body as application/json\n",
            )
        )
    named = [e for e in edges if adapter_edge.guarded(e) or e.shards]
    for edge in named:
        body = RM(
            prefix="/",
            dynamic_metadata=[
                metadata_pb2.MetadataMatcher(
                    filter=ctx.body_namespace,
                    path=[metadata_pb2.MetadataMatcher.PathSegment(key="model")],
                    value=value_pb2.ValueMatcher(
                        string_match=string_pb2.StringMatcher(exact=edge.name)
                    ),
                )
            ],
        )
        routes += _routes_for(
            edge, f"edge-body:{edge.name}", body, _action(edge, ctx, ctx.http_cluster), ctx, False
        )
        if ctx.grpc_cluster is not None:
            routes += _routes_for(
                edge,
                f"edge-grpc:{edge.name}",
                RM(prefix=ctx.grpc_prefix, headers=[_header(ctx, edge.name)]),
                _action(edge, ctx, ctx.grpc_cluster),
                ctx,
                False,
            )
        routes += _routes_for(
            edge,
            f"edge-ws:{edge.name}",
            RM(path=ctx.websocket_path, headers=[_header(ctx, edge.name)]),
            _action(edge, ctx, ctx.http_cluster),
            ctx,
            False,
        )
        routes += _routes_for(
            edge,
            f"edge:{edge.name}",
            RM(prefix="/", headers=[_header(ctx, edge.name)]),
            _action(edge, ctx, ctx.http_cluster),
            ctx,
            False,
        )
    if any(adapter_edge.guarded(e) for e in edges):
        unnamed = route_components_pb2.HeaderMatcher(
            name=ctx.adapter_header, present_match=True, invert_match=True
        )
        text = f"name the adapter in the {ctx.adapter_header} header\n"
        if ctx.grpc_cluster is not None:
            routes.append(
                _refusal(
                    "edge-grpc:unnamed", RM(prefix=ctx.grpc_prefix, headers=[unnamed]), 403, text
                )
            )
        routes.append(
            _refusal("edge-ws:unnamed", RM(path=ctx.websocket_path, headers=[unnamed]), 403, text)
        )
    return routes
