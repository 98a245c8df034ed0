"""The real datapath and xDS sink behind the agent's Protocols.

xDS keys. The agent publishes one snapshot per shard under the key ``shard-<id>``, holding
only that shard's listener, routes, cluster and endpoints; an Envoy picks its shard with its
bootstrap ``node.cluster`` (``--service-cluster``). Shards may therefore share one service
address (a VIP that every shard's node owns), which is what kernel steering needs: the
classifier picks the shard, not the destination address. With ``xds_group="node"`` every
Envoy instead gets one snapshot with all shards (one Envoy per node in front of all local
shards); service addresses must then be distinct.

Every snapshot is built and checked before any is published, so a refused Assignment leaves
every key on its last good snapshot.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry

from adaptermesh.agent.daemon import AgentConfig
from adaptermesh.bpf.table import (
    Attachable,
    Attachment,
    DatapathCounters,
    FlowEvent,
    FlowLookup,
    ShardStats,
    ShardTable,
)
from adaptermesh.mesh.cache import SnapshotCache
from adaptermesh.mesh.edge import EdgeAuthOptions, EdgeTlsOptions
from adaptermesh.mesh.metrics import XdsMetrics
from adaptermesh.mesh.server import XdsServer
from adaptermesh.mesh.snapshot import (
    BuildOptions,
    ExtProcOptions,
    TracingOptions,
    build_snapshot,
    cluster_name,
)
from adaptermesh.proto.adaptermesh.v1 import assignment_pb2

__all__ = [
    "NODE_KEY",
    "AttachedDatapath",
    "MeshXds",
    "TableDatapath",
    "bpf_datapath",
    "mesh_xds",
    "shard_assignment",
]

_log = logging.getLogger(__name__)

NODE_KEY = "node"


def shard_assignment(
    assignment: assignment_pb2.Assignment, shard_id: str | None
) -> assignment_pb2.Assignment:
    """The part of ``assignment`` one shard's Envoy needs (all of it for ``None``)."""
    part = assignment_pb2.Assignment()
    part.CopyFrom(assignment)
    if shard_id is None:
        return part
    del part.shards[:]
    part.shards.extend(s for s in assignment.shards if s.id == shard_id)
    # Adapters placed on other shards are forwarded to those shards' workers: their clusters
    # come along, without a listener of their own here.
    placed = {p for e in assignment.adapters if shard_id not in e.shards for p in e.shards}
    for edge in part.adapters:
        if shard_id in edge.shards:  # served here: this listener needs no other holder
            del edge.shards[:]
            edge.shards.append(shard_id)
    for s in assignment.shards:
        if s.id in placed and s.id != shard_id:
            other = part.shards.add()
            other.CopyFrom(s)
            other.ClearField("service_address")
            other.ClearField("service_port")
    # Pins and overrides steer the classifier, not Envoy.
    del part.pins[:]
    del part.overrides[:]
    return part


class MeshXds:
    def __init__(self, cache: SnapshotCache, server: XdsServer | None, group: str) -> None:
        if group not in ("shard", "node"):
            raise ValueError(f"xds_group: {group!r} is not 'shard' or 'node'")
        self.cache = cache
        self.server = server
        self.group = group
        self._keys: set[str] = set()

    def _parts(self, assignment: assignment_pb2.Assignment) -> dict[str, Any]:
        if self.group == "node":
            return {NODE_KEY: shard_assignment(assignment, None)}
        parts = {cluster_name(s.id): shard_assignment(assignment, s.id) for s in assignment.shards}
        # A shard that left the Assignment gets an empty snapshot, so its Envoy drops the
        # listener instead of serving a shard the control plane no longer has.
        for key in self._keys - parts.keys():
            empty = assignment_pb2.Assignment(version=assignment.version, reason="shard removed")
            parts[key] = empty
        return parts

    def publish(self, assignment: assignment_pb2.Assignment) -> None:
        parts = self._parts(assignment)
        # Check every key before publishing any, so a bad Assignment changes nothing.
        built = {}
        for key, part in parts.items():
            try:
                built[key] = build_snapshot(part, options=self.cache.options)
            except ValueError as exc:
                raise ValueError(f"{key}: {exc}") from exc
        for key, part in parts.items():
            self.cache.set_assignment(key, part, snapshot=built[key])
        self._keys = {k for k, p in parts.items() if len(p.shards) > 0}

    async def close(self) -> None:
        if self.server is not None:
            self.server.stop()

    def status(self) -> dict[str, Any]:
        return {node: st.as_dict() for node, st in self.cache.status().items()}


def _node_key_for(group: str) -> Callable[[Any], str]:
    if group == "node":
        return lambda _node: NODE_KEY
    # Envoys name their shard in node.cluster; one without it falls back to its node id.
    return lambda node: str(node.cluster or node.id)


async def mesh_xds(config: AgentConfig, registry: CollectorRegistry | None = None) -> MeshXds:
    metrics = XdsMetrics(registry=registry) if registry is not None else None
    # With the agent's ext_proc server on, every shard listener reads the body's model.
    options = BuildOptions(
        route_by_body=config.route_by_body,
        ext_proc=None
        if config.ext_proc_port is None
        else ExtProcOptions(max_body_bytes=config.ext_proc_max_body_bytes),
        edge_auth=None
        if config.edge_jwks is None or config.edge_issuer is None
        else EdgeAuthOptions(config.edge_issuer, config.edge_jwks, config.edge_audiences),
        edge_tls=None
        if config.edge_tls_cert is None or config.edge_tls_key is None
        else EdgeTlsOptions(config.edge_tls_cert, config.edge_tls_key),
        grpc_port_offset=config.grpc_port_offset,
        tracing=None
        if config.envoy_trace_percent is None
        else TracingOptions(sample_percent=config.envoy_trace_percent),
    )
    cache = SnapshotCache(
        node_key=_node_key_for(config.xds_group), metrics=metrics, options=options
    )
    server = XdsServer(cache, host=config.xds_host, port=config.xds_port, metrics=metrics)
    server.start()
    return MeshXds(cache, server, config.xds_group)


class TableDatapath:
    """A ``adaptermesh.bpf.table.ShardTable`` (the kernel one or the fake) as the agent's
    Datapath: the table itself, plus what closing it means on this node."""

    def __init__(self, table: ShardTable, closer: Callable[[bool], None] | None = None) -> None:
        self.table = table
        self._closer = closer

    @property
    def applied_version(self) -> int | None:
        return self.table.applied_version

    def apply(self, assignment: assignment_pb2.Assignment) -> None:
        self.table.apply(assignment)

    def read_stats(self) -> dict[int, ShardStats]:
        return self.table.read_stats()

    def read_counters(self) -> DatapathCounters:
        return self.table.read_counters()

    def poll_events(self, callback: Callable[[FlowEvent], None], timeout_ms: int = 0) -> int:
        return self.table.poll_events(callback, timeout_ms)

    def lookup_flow(self, source: str) -> int | None:
        """The table's sticky flow for ``source``, when the table keeps one it can read."""
        return self.table.lookup_flow(source) if isinstance(self.table, FlowLookup) else None

    def close(self, detach: bool) -> None:
        if self._closer is not None:
            self._closer(detach)


class AttachedDatapath(TableDatapath):
    """A TableDatapath whose table is attached to an interface, so it can be lost and
    attached again (the agent's liveness monitor watches it: agent/liveness.py)."""

    def __init__(
        self, table: ShardTable, attachable: Attachable, closer: Callable[[bool], None]
    ) -> None:
        super().__init__(table, closer)
        self._attachable = attachable

    def inspect(self) -> Attachment:
        return self._attachable.inspect()

    def reattach(self) -> None:
        self._attachable.reattach()

    def watch_links(self, wake: Callable[[], None], stop: threading.Event) -> None:
        self._attachable.watch_links(wake, stop)


def bpf_datapath(config: AgentConfig) -> AttachedDatapath:
    """Compile and load the classifier, reuse the pinned maps, attach to ``config.iface``.

    A restarted agent swaps its program into the same filter slot with one netlink replace
    and keeps the pinned maps (sticky flows, counters, the live Maglev table).
    """
    from adaptermesh.bpf.loader import BpfShardTable

    table = BpfShardTable(
        ifname=config.iface, pin_dir=str(config.pin_dir), vxlan_dev=config.vxlan_dev
    )
    try:
        table.attach()
    except BaseException:
        table.discard()  # a failed start leaves no pins of its own behind
        raise

    def close(detach: bool) -> None:
        # --detach is an uninstall: remove the filter and the pinned maps.
        table.close(detach=detach, unpin=detach)

    return AttachedDatapath(table, table, close)
