"""The AdapterInstance edge rules (adapter_edge) and the Envoy resources built from them
(mesh/edge.py through mesh/snapshot.py): valid edges always make a consistent snapshot,
hostile ones are refused with a RuleError naming the field, never anything else."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from adaptermesh import adapter_edge
from adaptermesh.agent.backends import shard_assignment
from adaptermesh.assignment_rules import RuleError
from adaptermesh.mesh.edge import EdgeAuthOptions
from adaptermesh.mesh.snapshot import ROUTE_TYPE, BuildOptions, build_snapshot
from adaptermesh.proto import assignment_pb2 as ap
from adaptermesh.proto import control_plane_pb2 as cp

SHARDS = ("a", "b", "c")
JWKS = (
    '{"keys": [{"kty": "oct", "alg": "HS256", "k": "a2tra2tra2tra2tra2tra2tra2tra2tra2tra2tra2s"}]}'
)
OPTIONS = BuildOptions(grpc_port_offset=1, edge_auth=EdgeAuthOptions("https://iss", JWKS))


def _assignment(*edges: ap.AdapterEdge) -> ap.Assignment:
    shards = [
        ap.Shard(
            id=s,
            index=i,
            weight=10_000 if i == 0 else 0,
            state=ap.SHARD_STATE_ACTIVE if i == 0 else ap.SHARD_STATE_DRAINING,
            service_address="10.0.0.1",
            service_port=8080 + i,
            endpoints=[ap.Endpoint(address="10.1.0.1", port=8000 + i, weight=1)],
        )
        for i, s in enumerate(SHARDS)
    ]
    return ap.Assignment(version=1, shards=shards, adapters=list(edges))


segment = st.from_regex(r"\A[a-z0-9_~-][a-z0-9._~-]{0,8}\Z")
http_path = st.lists(segment, min_size=1, max_size=4).map(lambda s: "/x-" + "/".join(s))
grpc_path = st.from_regex(r"\A[a-z][a-z0-9_]{0,6}(\.[A-Z][a-z0-9]{0,6}){1,2}\Z").map(
    lambda s: f"/{s}/"
)
scope = st.from_regex(r"\A[a-z][a-z0-9:._/-]{0,20}\Z")


@st.composite
def edges(draw: st.DrawFn) -> list[ap.AdapterEdge]:
    n = draw(st.integers(1, 4))
    used: set[str] = set()
    out = []
    for i in range(n):
        protocol = draw(st.sampled_from(adapter_edge.PROTOCOLS))
        paths = draw(
            st.lists(grpc_path if protocol == "grpc" else http_path, max_size=3, unique=True)
        )
        paths = [
            p
            for p in paths
            if p not in used and not any(p.startswith(u) or u.startswith(p) for u in used)
        ]
        used.update(paths)
        out.append(
            ap.AdapterEdge(
                name=f"adapter-{i}",
                protocol=protocol,
                paths=paths,
                scopes=draw(st.lists(scope, max_size=3, unique=True)),
                tls=draw(st.booleans()),
                shards=draw(st.lists(st.sampled_from(SHARDS), max_size=2, unique=True)),
                allowed_cidrs=draw(
                    st.lists(
                        st.sampled_from(["10.0.0.0/8", "192.0.2.0/24"]), max_size=2, unique=True
                    )
                ),
            )
        )
    return out


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(edges())
def test_valid_edges_make_a_consistent_snapshot_for_every_shard(
    drawn: list[ap.AdapterEdge],
) -> None:
    a = _assignment(*drawn)
    adapter_edge.check_edges(a)
    build_snapshot(a, options=OPTIONS)  # checks its own consistency
    for shard in SHARDS:
        part = shard_assignment(a, shard)
        snap = build_snapshot(part, options=OPTIONS)
        names = [
            r.name
            for v in snap.resources[ROUTE_TYPE][f"shard-{shard}"].virtual_hosts
            for r in v.routes
        ]
        for e in drawn:
            for p in e.paths:
                assert f"path:{p}" in names


@given(st.text(max_size=40), st.sampled_from(adapter_edge.PROTOCOLS))
def test_any_path_is_accepted_or_refused_naming_the_field(path: str, protocol: str) -> None:
    try:
        adapter_edge.check_path(path, protocol, "routes[0].path")
    except RuleError as exc:
        field = exc.field
        assert field == "routes[0].path"
    else:
        assert path.startswith("/")
        assert "//" not in path
        assert "?" not in path
        assert "%" not in path
        assert "/../" not in path + "/"


@pytest.mark.parametrize(
    ("path", "protocol"),
    [
        ("/v1/completions", "http-json"),
        ("/v1/ws", "http-json"),
        ("/health", "grpc-json"),
        ("/inference.GRPCInferenceService/", "grpc"),
        ("/v1/evaluate/", "http-json"),
        ("/v1/../admin", "http-json"),
        ("/v1/./x", "http-json"),
        ("/v1//x", "http-json"),
        ("/v1/x?y=1", "http-json"),
        ("/v1/%65val", "http-json"),
        ("v1/x", "http-json"),
        ("/v1/evaluate", "grpc"),
        ("/credit.v2.Svc", "grpc"),
        ("", "http-json"),
        ("/" + "a" * 300, "http-json"),
    ],
)
def test_hostile_paths_are_refused(path: str, protocol: str) -> None:
    with pytest.raises(RuleError) as exc:
        adapter_edge.check_path(path, protocol, "p")
    assert exc.value.field == "p"


@given(
    st.builds(
        ap.AdapterEdge,
        name=st.text(max_size=20),
        protocol=st.text(max_size=12),
        paths=st.lists(st.text(max_size=12), max_size=3),
        scopes=st.lists(st.text(max_size=12), max_size=3),
        shards=st.lists(st.text(max_size=6), max_size=3),
        allowed_cidrs=st.lists(st.text(max_size=20), max_size=2),
    )
)
def test_hostile_edges_are_refused_naming_the_field(edge: ap.AdapterEdge) -> None:
    try:
        adapter_edge.check_edges(_assignment(edge))
    except RuleError as exc:
        field = exc.field
        assert field.startswith("adapters[0].")
    else:
        build_snapshot(_assignment(edge), options=OPTIONS)


def test_paths_are_unique_across_adapters() -> None:
    a = _assignment(
        ap.AdapterEdge(name="x", paths=["/v1/evaluate"]),
        ap.AdapterEdge(name="y", paths=["/v1/evaluate"]),
    )
    with pytest.raises(RuleError, match="already reaches adapter 'x'") as exc:
        adapter_edge.check_edges(a)
    assert exc.value.field == "adapters[1].paths[0]"


def test_placement_names_shards_of_the_assignment() -> None:
    with pytest.raises(RuleError) as exc:
        adapter_edge.check_edges(_assignment(ap.AdapterEdge(name="x", shards=["zz"])))
    assert exc.value.field == "adapters[0].shards[0]"


def _instance(**kw: object) -> cp.AdapterInstance:
    inst = cp.AdapterInstance(name="credit-risk-v2", model_ref=cp.ModelRef(base_model="m"))
    for key, value in kw.items():
        if key == "routes":
            inst.routes.extend(value)  # type: ignore[arg-type]
        else:
            getattr(inst, key).CopyFrom(value) if not isinstance(value, str) else setattr(
                inst, key, value
            )
    return inst


@pytest.mark.parametrize(
    ("inst", "field"),
    [
        (_instance(protocol="soap"), "instance.protocol"),
        (_instance(routes=[cp.AdapterRoute(shard_id="a", path="/v1/x")]), "instance.routes[0]"),
        (_instance(routes=[cp.AdapterRoute(path="/v1/x", weight=2)]), "instance.routes[0].weight"),
        (
            _instance(routes=[cp.AdapterRoute(path="/v1/x"), cp.AdapterRoute(path="/v1/x")]),
            "instance.routes[1].path",
        ),
        (_instance(placement=cp.AdapterPlacement(shards=["zz"])), "instance.placement.shards[0]"),
        (
            _instance(placement=cp.AdapterPlacement(shards=["a"], pinned_shards=["b"])),
            "instance.placement.pinned_shards[0]",
        ),
        (
            _instance(
                placement=cp.AdapterPlacement(shards=["a"]), routes=[cp.AdapterRoute(shard_id="b")]
            ),
            "instance.routes[0].shard_id",
        ),
        (_instance(placement=cp.AdapterPlacement(replicas=5000)), "instance.placement.replicas"),
        (_instance(security=cp.AdapterSecurity(scopes=["a b"])), "instance.security.scopes[0]"),
        (
            _instance(protocol="grpc", routes=[cp.AdapterRoute(path="/v1/evaluate")]),
            "instance.routes[0].path",
        ),
    ],
)
def test_bad_instances_are_refused_naming_the_field(inst: cp.AdapterInstance, field: str) -> None:
    with pytest.raises(RuleError) as exc:
        adapter_edge.check_instance(inst, set(SHARDS))
    assert exc.value.field == field


def test_a_plain_instance_asks_nothing_of_the_edge() -> None:
    assert adapter_edge.edge_of(_instance(routes=[cp.AdapterRoute(shard_id="a")])) is None
    edge = adapter_edge.edge_of(
        _instance(
            protocol="grpc-json",
            routes=[cp.AdapterRoute(path="/v1/evaluate")],
            security=cp.AdapterSecurity(scopes=["s"], tls=True, allowed_cidrs=["10.0.0.0/8"]),
            placement=cp.AdapterPlacement(shards=["b"]),
        )
    )
    assert edge == ap.AdapterEdge(
        name="credit-risk-v2",
        protocol="grpc-json",
        paths=["/v1/evaluate"],
        scopes=["s"],
        tls=True,
        shards=["b"],
        allowed_cidrs=["10.0.0.0/8"],
    )


def test_a_shard_part_carries_the_placement_shards_without_their_listeners() -> None:
    a = _assignment(ap.AdapterEdge(name="x", shards=["c"]))
    part = shard_assignment(a, "a")
    assert [(s.id, s.service_port) for s in part.shards] == [("a", 8080), ("c", 0)]
    assert [s.id for s in shard_assignment(a, "c").shards] == ["c"]
