"""The committed generated modules must match what grpcio-tools makes from the .proto files."""

from __future__ import annotations

from pathlib import Path

from adaptermesh.proto import assignment_pb2, control_plane_pb2
from adaptermesh.proto.generate import PROTO_ROOT, generate


def test_generated_modules_are_fresh(tmp_path: Path) -> None:
    written = generate(tmp_path)
    assert written, "no modules generated"
    committed = PROTO_ROOT / "adaptermesh" / "v1"
    for fresh in written:
        current = committed / fresh.name
        assert current.exists(), f"{current.name} is missing: run `make proto`"
        assert current.read_bytes() == fresh.read_bytes(), (
            f"{current.name} is stale: run `make proto` and commit the result"
        )


def test_assignment_round_trip() -> None:
    a = assignment_pb2.Assignment(version=7, reason="test")
    shard = a.shards.add(id="s1", index=0, weight=10_000, state=assignment_pb2.SHARD_STATE_ACTIVE)
    shard.endpoints.add(address="10.0.0.1", port=8000, weight=1, adapters=["a"])
    shard.steer.tunnel.remote_ipv4 = "192.0.2.1"
    shard.steer.tunnel.vni = 42
    a.pins.add(cidr="10.1.0.0/16", shard_id="s1")
    a.overrides.add(shard_id="s1", weight=10_000, reason="hold")
    b = assignment_pb2.Assignment.FromString(a.SerializeToString())
    assert b == a
    assert b.shards[0].steer.WhichOneof("target") == "tunnel"
    req = control_plane_pb2.SetOverrideRequest(shard_id="s1", weight=5000, ttl_seconds=60)
    assert control_plane_pb2.SetOverrideRequest.FromString(req.SerializeToString()) == req
