"""Every response a shard listener sends names the shard that answered it."""

from __future__ import annotations

from adaptermesh.mesh.snapshot import SERVED_BY_HEADER, BuildOptions, build_route_configuration
from adaptermesh.proto import assignment_pb2


def test_each_shard_names_itself_on_its_responses() -> None:
    for sid in ("s0", "gold"):
        shard = assignment_pb2.Shard(id=sid, service_address="10.0.0.1", service_port=8080)
        shard.endpoints.add(address="10.0.1.1", port=8000, adapters=["a"])
        (vhost,) = build_route_configuration(shard, BuildOptions()).virtual_hosts
        added = [(h.header.key, h.header.value) for h in vhost.response_headers_to_add]
        assert added == [(SERVED_BY_HEADER, sid)]
