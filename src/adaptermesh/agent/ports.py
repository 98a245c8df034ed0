"""What the agent needs from the datapath and from the xDS server, as small Protocols.

The agent's logic (apply, watch, report) reaches the BPF maps and the node's xDS snapshot only
through these two Protocols, so it is tested with in-memory fakes and without root. The real
implementations are thin adapters over ``adaptermesh.bpf`` and ``adaptermesh.mesh``
(``agent/backends.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

from adaptermesh.proto.adaptermesh.v1 import assignment_pb2

__all__ = ["Datapath", "FlowEvent", "ShardCounters", "XdsSink"]


@dataclass(frozen=True, slots=True)
class ShardCounters:
    """Cumulative per-shard counters, summed over CPUs (``am_stats``)."""

    packets: int
    bytes: int
    new_flows: int


@dataclass(frozen=True, slots=True)
class FlowEvent:
    """One ``am_events`` record: a source address got a shard for a new (or re-picked) flow."""

    timestamp_ns: int
    source: str
    shard_index: int
    reason: str
    version: int


class Datapath(Protocol):
    """The node's classifier maps (``adaptermesh.bpf``'s ShardTable, seen by the agent)."""

    def apply(self, assignment: assignment_pb2.Assignment) -> None:
        """Apply atomically; on error raise and leave the maps as they were."""
        ...

    def read_stats(self) -> Mapping[int, ShardCounters]:
        """Cumulative counters by shard index."""
        ...

    def read_counters(self) -> Mapping[str, int]:
        """Cumulative datapath counters: ``ringbuf_failed`` (lost events) and the packets
        passed untouched (``non_ip``, ``malformed``, ``vlan``, ``no_shard``,
        ``steer_failed``, ``link_local``)."""
        ...

    def poll_events(self, callback: Callable[[FlowEvent], None], timeout_ms: int) -> int:
        """Deliver pending ring-buffer events; returns how many were delivered."""
        ...

    def close(self, detach: bool) -> None:
        """Release handles; with ``detach`` also remove the filter and the pinned maps."""
        ...


class XdsSink(Protocol):
    """The node's xDS snapshot cache, fed with whole Assignments."""

    def publish(self, assignment: assignment_pb2.Assignment) -> None:
        """Publish new snapshots; on error raise and keep the last good ones."""
        ...

    async def close(self) -> None:
        """Stop serving xDS (Envoys keep their last config until the agent returns)."""
        ...
