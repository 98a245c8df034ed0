"""AdapterInstance edge fields through the control plane: `adapterctl apply -f` of
deploy/examples/credit-risk-v2.yaml publishes its edge in the Assignment (every field), the
write checks name the field and store nothing, and deleting the instance or a shard its
placement names behaves."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
import yaml

from adaptermesh.proto import assignment_pb2 as ap
from adaptermesh.proto import control_plane_pb2 as cp
from adaptermesh.proto import control_plane_pb2_grpc as cpg

from .conftest import RW_TOKEN
from .test_adapterctl import run, server

__all__ = ["server"]  # the fixture, used by name

pytestmark = pytest.mark.slow

EXAMPLE = Path(__file__).parents[2] / "deploy" / "examples" / "credit-risk-v2.yaml"
SHARDS = """\
kind: Shard
metadata: {name: shard-a}
spec: {endpoints: ["10.0.5.1:8000"], steer: {mark: 5}, service: {address: 10.96.0.10, port: 8080}}
---
kind: Shard
metadata: {name: shard-b}
spec: {endpoints: ["10.0.6.1:8000"], steer: {mark: 6}, service: {address: 10.96.0.10, port: 8080}}
"""


def _stub(target: str) -> tuple[cpg.ControlPlaneStub, list[tuple[str, str]]]:
    channel = grpc.insecure_channel(target)
    return cpg.ControlPlaneStub(channel), [("authorization", f"Bearer {RW_TOKEN}")]


def _apply(server: str, tmp_path: Path, text: str, name: str = "f.yaml") -> object:
    f = tmp_path / name
    f.write_text(text)
    return run(server, "apply", "-f", str(f))


def test_apply_of_the_example_publishes_every_field(server: str, tmp_path: Path) -> None:
    r = _apply(server, tmp_path, SHARDS + "---\n" + EXAMPLE.read_text())
    assert r.exit_code == 0, r.output
    assert "Pin/10.40.0.0/16 create" in r.output
    stub, md = _stub(server)
    (inst,) = stub.ListAdapterInstances(cp.ListAdapterInstancesRequest(), metadata=md).instances
    assert inst.protocol == "grpc-json"
    assert inst.model_ref.adapter_path == "/adapters/risk/credit-risk-v2"
    assert [(r.path, r.shard_id) for r in inst.routes] == [("/v1/evaluate", ""), ("", "shard-b")]
    assert inst.placement == cp.AdapterPlacement(
        shards=["shard-b"], replicas=2, preload=True, pinned_shards=["shard-b"]
    )
    assert inst.security.tls
    a = stub.GetAssignment(cp.GetAssignmentRequest(), metadata=md)
    assert list(a.adapters) == [
        ap.AdapterEdge(
            name="credit-risk-v2",
            protocol="grpc-json",
            paths=["/v1/evaluate"],
            scopes=["risk:evaluate", "tenant-acme"],
            tls=True,
            shards=["shard-b"],
            allowed_cidrs=["10.40.0.0/16", "10.20.0.0/16"],
        )
    ]
    assert [(p.cidr, p.shard_id) for p in a.pins] == [("10.40.0.0/16", "shard-b")]
    # Idempotent, and what `get` prints applies back unchanged.
    again = _apply(server, tmp_path, EXAMPLE.read_text(), "again.yaml")
    assert "0 change(s) applied" in again.output, again.output
    got = run(server, "get", "adapters")
    assert got.exit_code == 0, got.output
    back = _apply(server, tmp_path, got.output, "back.yaml")
    assert "0 change(s) applied" in back.output, back.output
    # Deleting the instance publishes an Assignment without its edge.
    before = a.version
    stub.DeleteAdapterInstance(cp.DeleteAdapterInstanceRequest(name="credit-risk-v2"), metadata=md)
    a = stub.GetAssignment(cp.GetAssignmentRequest(), metadata=md)
    assert a.version > before
    assert list(a.adapters) == []


def _doc(**spec: object) -> str:
    base = {"modelRef": {"baseModel": "m"}, "adapter": {"path": "x"}}
    return yaml.safe_dump(
        {
            "apiVersion": "adaptermesh.io/v1alpha1",
            "kind": "AdapterInstance",
            "metadata": {"name": "bad-one"},
            "spec": base | spec,
        }
    )


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"placement": {"shards": ["shard-z"]}}, "instances[0].placement.shards[0]: no shard"),
        ({"routes": [{"path": "/v1/completions"}]}, "instances[0].routes[0].path"),
        ({"protocol": "soap"}, "instances[0].protocol"),
        ({"protocol": "grpc", "routes": [{"path": "/v1/evaluate"}]}, "instances[0].routes[0].path"),
        ({"routes": [{"path": "/v1/x", "shard": "shard-a"}]}, "a path route has only a path"),
        (
            {"placement": {"shards": ["shard-a"]}, "routes": [{"shard": "shard-b"}]},
            "instances[0].routes[0].shard_id",
        ),
        ({"security": {"tls": "yes"}}, "spec.security.tls: expected true or false"),
    ],
)
def test_bad_edge_fields_are_refused_and_nothing_is_stored(
    server: str, tmp_path: Path, spec: dict[str, object], message: str
) -> None:
    assert _apply(server, tmp_path, SHARDS).exit_code == 0
    r = _apply(server, tmp_path, _doc(**spec), "bad.yaml")
    assert r.exit_code != 0
    assert message in " ".join(r.output.split()), r.output
    stub, md = _stub(server)
    assert (
        list(stub.ListAdapterInstances(cp.ListAdapterInstancesRequest(), metadata=md).instances)
        == []
    )


def test_a_path_belongs_to_one_instance_and_placed_shards_stay(server: str, tmp_path: Path) -> None:
    assert _apply(server, tmp_path, SHARDS + "---\n" + EXAMPLE.read_text()).exit_code == 0
    other = _doc(routes=[{"path": "/v1/evaluate"}]).replace("bad-one", "other")
    r = _apply(server, tmp_path, other, "other.yaml")
    assert r.exit_code != 0
    assert "already reaches adapter instance 'credit-risk-v2'" in " ".join(r.output.split())
    stub, md = _stub(server)
    for pin in ("10.40.0.0/16",):
        stub.UnpinTenant(cp.UnpinTenantRequest(cidr=pin), metadata=md)
    with pytest.raises(grpc.RpcError) as exc:
        stub.DeleteShard(cp.DeleteShardRequest(id="shard-b"), metadata=md)
    assert exc.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "credit-risk-v2" in (exc.value.details() or "")


def test_an_edge_before_any_shard_is_published_with_the_first_shard(
    server: str, tmp_path: Path
) -> None:
    doc = _doc(routes=[{"path": "/v1/evaluate"}], security={"scopes": ["s"]})
    r = _apply(server, tmp_path, doc, "early.yaml")
    assert r.exit_code == 0, r.output
    stub, md = _stub(server)
    with pytest.raises(grpc.RpcError) as exc:
        stub.GetAssignment(cp.GetAssignmentRequest(), metadata=md)
    assert exc.value.code() == grpc.StatusCode.NOT_FOUND
    assert _apply(server, tmp_path, SHARDS).exit_code == 0
    a = stub.GetAssignment(cp.GetAssignmentRequest(), metadata=md)
    assert [(e.name, list(e.paths)) for e in a.adapters] == [("bad-one", ["/v1/evaluate"])]
