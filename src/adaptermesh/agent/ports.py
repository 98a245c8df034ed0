"""What the agent needs from the datapath and from the xDS server, as small Protocols.

The agent's logic (apply, watch, report) reaches the BPF maps and the node's xDS snapshot only
through these two Protocols, so it is tested with in-memory fakes and without root. The real
implementations are thin adapters over ``adaptermesh.bpf`` and ``adaptermesh.mesh``
(``agent/backends.py``).
"""

from __future__ import annotations

from typing import Protocol

from adaptermesh.bpf.table import DatapathCounters, FlowEvent, ShardStats, ShardTable
from adaptermesh.proto.adaptermesh.v1 import assignment_pb2

__all__ = ["Datapath", "DatapathCounters", "FlowEvent", "ShardStats", "XdsSink"]


class Datapath(ShardTable, Protocol):
    """The node's classifier maps: ``adaptermesh.bpf``'s ShardTable (apply, stats, counters,
    new-flow events, the applied version), and how the agent lets go of them."""

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
