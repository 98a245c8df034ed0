"""Versioned per-node xDS state: snapshots, publication, and ACK/NACK status.

Usage (the node agent)::

    cache = SnapshotCache()
    server = XdsServer(cache, port=0); port = server.start()
    version = cache.set_assignment("node-a", assignment)   # build -> check -> publish
    cache.wait_for_version(["node-a"], version, timeout=5)  # optional: block until ACKed
    cache.node_status("node-a")                             # last ACKed version, last NACK

Keys. A snapshot is stored under a *key*; an Envoy node maps to its key with ``node_key``
(default: the node id, so one snapshot per Envoy; pass ``node_key=group_by_cluster`` to share
one snapshot among all Envoys of one ``node.cluster``).

Publication. :meth:`SnapshotCache.set_assignment` validates the Assignment, builds the
snapshot, checks its consistency and only then replaces the key's snapshot and wakes the
streams. Any failure raises (:class:`~adaptermesh.mesh.snapshot.AssignmentError`,
:class:`~adaptermesh.mesh.snapshot.InconsistentSnapshotError`, :class:`StaleVersionError`)
and leaves the last good snapshot in place. A type whose resources did not change keeps its
previous version, so Envoy only receives what changed.

Status. The server reports every push, ACK and NACK here. :meth:`SnapshotCache.status`
returns one :class:`NodeStatus` per Envoy node id: connected streams, the last snapshot
version the node ACKed for every type it subscribes to, and the last NACK with Envoy's error
detail. A type version that a node NACKed is never sent to that node again.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from adaptermesh.assignment_rules import quote
from adaptermesh.mesh.metrics import XdsMetrics, default_metrics
from adaptermesh.mesh.snapshot import (
    BuildOptions,
    InconsistentSnapshotError,
    Snapshot,
    build_snapshot,
)

if TYPE_CHECKING:  # the lazy re-export hides the generated types from mypy
    from adaptermesh.proto.adaptermesh.v1 import assignment_pb2
else:
    from adaptermesh.proto import assignment_pb2

__all__ = [
    "NackRecord",
    "NodeStatus",
    "SnapshotCache",
    "StaleVersionError",
    "TypeStatus",
    "group_by_cluster",
    "node_id_key",
]

log = logging.getLogger(__name__)


class StaleVersionError(ValueError):
    """An Assignment whose ``version`` is not newer than the one already published."""

    def __init__(self, key: str, version: int, current: int) -> None:
        super().__init__(
            f"version: assignment version {version} for {quote(key)} is not newer than the "
            f"published version {current}"
        )
        self.field = "version"


def node_id_key(node: Any) -> str:
    """One snapshot per Envoy node id."""
    return str(node.id)


def group_by_cluster(node: Any) -> str:
    """One snapshot per Envoy ``node.cluster`` (all Envoys of a shard share it)."""
    return str(node.cluster or node.id)


@dataclass(frozen=True)
class NackRecord:
    type_url: str
    version: str
    message: str
    code: int
    at: float  # time.time()


@dataclass(frozen=True)
class TypeStatus:
    sent_version: str | None = None
    acked_version: str | None = None
    nacked_versions: tuple[str, ...] = ()
    pushes: int = 0
    acks: int = 0
    nacks: int = 0


# Node ids come from whoever opens an xDS stream. Nodes with no open stream are kept for the
# status endpoint, the oldest dropped beyond this many; NACK counts carry a node's id as a
# label for this many distinct ids, later ones under "other".
MAX_IDLE_NODES = 256
MAX_NACK_NODE_LABELS = 256


@dataclass(frozen=True)
class NodeStatus:
    """What one Envoy node id has from us.

    ``acked_version`` is the newest snapshot version of which the node ACKed every type it
    subscribes to; ``acked_at`` is when (``time.monotonic()``).
    """

    node_id: str
    key: str
    streams: int = 0
    acked_version: str | None = None
    acked_at: float | None = None
    types: dict[str, TypeStatus] = field(default_factory=dict)
    last_nack: NackRecord | None = None

    def as_dict(self) -> dict[str, Any]:
        """JSON-friendly form for an agent's status endpoint."""
        return {
            "node_id": self.node_id,
            "key": self.key,
            "streams": self.streams,
            "acked_version": self.acked_version,
            "types": {
                t.rsplit(".", 1)[-1]: {
                    "sent_version": s.sent_version,
                    "acked_version": s.acked_version,
                    "nacked_versions": list(s.nacked_versions),
                    "pushes": s.pushes,
                    "acks": s.acks,
                    "nacks": s.nacks,
                }
                for t, s in self.types.items()
            },
            "last_nack": None
            if self.last_nack is None
            else {
                "type": self.last_nack.type_url.rsplit(".", 1)[-1],
                "version": self.last_nack.version,
                "message": self.last_nack.message,
                "code": self.last_nack.code,
                "at": self.last_nack.at,
            },
        }


@dataclass
class _Entry:
    snapshot: Snapshot
    assignment_version: int | None
    published_at: float


Watcher = Callable[[], None]


class SnapshotCache:
    """Thread-safe map key -> current :class:`Snapshot`, plus per-node ACK/NACK status."""

    def __init__(
        self,
        *,
        options: BuildOptions | None = None,
        node_key: Callable[[Any], str] = node_id_key,
        metrics: XdsMetrics | None = None,
    ) -> None:
        self.options = options or BuildOptions()
        self.node_key = node_key
        self.metrics = metrics or default_metrics()
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)
        self._entries: dict[str, _Entry] = {}
        self._watchers: dict[str, dict[int, Watcher]] = {}
        self._next_watch = 0
        self._nodes: dict[str, NodeStatus] = {}
        self._nack_labels: set[str] = set()

    # -- publication ---------------------------------------------------------------------

    def set_assignment(
        self,
        key: str,
        assignment: assignment_pb2.Assignment,
        *,
        snapshot: Snapshot | None = None,
    ) -> str:
        """Build, check and publish ``assignment`` for ``key``; return the snapshot version.

        Re-publishing the same version with the same content is a no-op. Raises on invalid
        input, an inconsistent snapshot or a version that is not newer; the previous snapshot
        then stays. A caller that already built the snapshot (``build_snapshot(assignment,
        options=cache.options)``, e.g. to check several keys before publishing any) passes it
        as ``snapshot`` so it is not built twice.
        """
        with self._lock:
            current = self._entries.get(key)
        try:
            if snapshot is None:
                snapshot = build_snapshot(assignment, options=self.options)
            if current is not None and current.assignment_version is not None:
                if (
                    assignment.version == current.assignment_version
                    and snapshot.resource_versions == current.snapshot.resource_versions
                ):
                    return current.snapshot.version
                if assignment.version <= current.assignment_version:
                    raise StaleVersionError(key, assignment.version, current.assignment_version)
        except ValueError as exc:
            self.metrics.publishes.labels("rejected").inc()
            log.warning("refused assignment %s for %s: %s", assignment.version, key, exc)
            raise
        return self._publish(key, snapshot, assignment.version)

    def set_snapshot(self, key: str, snapshot: Snapshot) -> str:
        """Publish a ready-made snapshot after checking its consistency.

        Its version must differ from the current one (the same content is a no-op).
        """
        with self._lock:
            current = self._entries.get(key)
        try:
            snapshot.check_consistent()
            if current is not None and snapshot.version == current.snapshot.version:
                if snapshot.resource_versions == current.snapshot.resource_versions:
                    return snapshot.version
                raise ValueError(
                    f"version: snapshot version {quote(snapshot.version)} for {quote(key)} "
                    "is already published with other content"
                )
        except (ValueError, InconsistentSnapshotError) as exc:
            self.metrics.publishes.labels("rejected").inc()
            log.warning("refused snapshot %s for %s: %s", snapshot.version, key, exc)
            raise
        return self._publish(key, snapshot, None)

    def _publish(self, key: str, snapshot: Snapshot, assignment_version: int | None) -> str:
        with self._lock:
            current = self._entries.get(key)
            snapshot = snapshot.carry_versions_from(current.snapshot if current else None)
            self._entries[key] = _Entry(snapshot, assignment_version, time.monotonic())
            watchers = list(self._watchers.get(key, {}).values())
            self._changed.notify_all()
        self.metrics.publishes.labels("published").inc()
        for wake in watchers:
            wake()
        return snapshot.version

    def get_snapshot(self, key: str) -> Snapshot | None:
        with self._lock:
            entry = self._entries.get(key)
            return entry.snapshot if entry else None

    def published_at(self, key: str) -> float | None:
        """``time.monotonic()`` when the key's current snapshot was published."""
        with self._lock:
            entry = self._entries.get(key)
            return entry.published_at if entry else None

    def clear(self, key: str) -> None:
        """Forget a key's snapshot (its streams keep what they have)."""
        with self._lock:
            self._entries.pop(key, None)

    def keys(self) -> list[str]:
        with self._lock:
            return sorted(self._entries)

    def watch(self, key: str, wake: Watcher) -> Callable[[], None]:
        """Call ``wake()`` (from the publishing thread) after each publish for ``key``."""
        with self._lock:
            handle = self._next_watch
            self._next_watch += 1
            self._watchers.setdefault(key, {})[handle] = wake

        def cancel() -> None:
            with self._lock:
                self._watchers.get(key, {}).pop(handle, None)

        return cancel

    # -- status --------------------------------------------------------------------------

    def status(self) -> dict[str, NodeStatus]:
        """A copy of every known node's status, keyed by node id."""
        with self._lock:
            return dict(self._nodes)

    def node_status(self, node_id: str) -> NodeStatus | None:
        with self._lock:
            return self._nodes.get(node_id)

    def wait_for_version(self, node_ids: Iterable[str], version: str, timeout: float) -> bool:
        """Block until every node ACKed ``version`` on all its types; False on timeout."""
        wanted = list(node_ids)
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                if all(self._acked(n, version) for n in wanted):
                    return True
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._changed.wait(left)

    def _acked(self, node_id: str, version: str) -> bool:
        status = self._nodes.get(node_id)
        return status is not None and status.acked_version == version

    def rejected_versions(self, node_id: str, type_url: str) -> tuple[str, ...]:
        with self._lock:
            status = self._nodes.get(node_id)
            if status is None or type_url not in status.types:
                return ()
            return status.types[type_url].nacked_versions

    # Called by the server (any thread).

    def stream_opened(self, node_id: str, key: str) -> None:
        with self._lock:
            status = self._nodes.pop(node_id, None) or NodeStatus(node_id=node_id, key=key)
            self._nodes[node_id] = replace(status, key=key, streams=status.streams + 1)

    def stream_closed(self, node_id: str) -> None:
        with self._lock:
            status = self._nodes.get(node_id)
            if status is not None:
                self._nodes[node_id] = replace(status, streams=max(0, status.streams - 1))
            self._drop_idle_nodes()

    def _drop_idle_nodes(self) -> None:
        """Keep at most MAX_IDLE_NODES nodes without an open stream, the oldest go first
        (a dict keeps insertion order, and a node re-enters it when it reconnects)."""
        idle = [n for n, status in self._nodes.items() if status.streams == 0]
        for node_id in idle[: max(0, len(idle) - MAX_IDLE_NODES)]:
            del self._nodes[node_id]

    def record_sent(self, node_id: str, type_url: str, version: str) -> None:
        with self._lock:
            self._update_type(
                node_id, type_url, lambda s: replace(s, sent_version=version, pushes=s.pushes + 1)
            )

    def record_ack(self, node_id: str, type_url: str, version: str) -> None:
        with self._lock:
            self._update_type(
                node_id, type_url, lambda s: replace(s, acked_version=version, acks=s.acks + 1)
            )
            status = self._nodes.get(node_id)
            entry = self._entries.get(status.key) if status else None
            self._changed.notify_all()
        self.metrics.acks.labels(type_url.rsplit(".", 1)[-1]).inc()
        if (
            entry is not None
            and entry.snapshot.type_versions.get(type_url) == version
            and entry.snapshot.version == version
        ):
            self.metrics.update_to_ack.labels(type_url.rsplit(".", 1)[-1]).observe(
                time.monotonic() - entry.published_at
            )

    def record_in_sync(self, node_id: str, version: str) -> None:
        with self._lock:
            status = self._nodes.get(node_id)
            if status is not None and status.acked_version != version:
                self._nodes[node_id] = replace(
                    status, acked_version=version, acked_at=time.monotonic()
                )
                self._changed.notify_all()

    def record_nack(
        self, node_id: str, type_url: str, version: str, message: str, code: int
    ) -> None:
        nack = NackRecord(type_url, version, message, code, time.time())
        with self._lock:
            self._update_type(
                node_id,
                type_url,
                lambda s: replace(
                    s,
                    nacks=s.nacks + 1,
                    nacked_versions=(*s.nacked_versions, version)[-16:]
                    if version not in s.nacked_versions
                    else s.nacked_versions,
                ),
            )
            self._nodes[node_id] = replace(self._nodes[node_id], last_nack=nack)
            self._changed.notify_all()
        with self._lock:
            if node_id not in self._nack_labels and len(self._nack_labels) < MAX_NACK_NODE_LABELS:
                self._nack_labels.add(node_id)
            label = node_id if node_id in self._nack_labels else "other"
        self.metrics.nacks.labels(type_url.rsplit(".", 1)[-1], label).inc()
        log.error(
            "Envoy %s rejected %s version %s: %s",
            node_id,
            type_url.rsplit(".", 1)[-1],
            version,
            message,
        )

    def _update_type(
        self, node_id: str, type_url: str, change: Callable[[TypeStatus], TypeStatus]
    ) -> None:
        status = self._nodes.get(node_id) or NodeStatus(node_id=node_id, key=node_id)
        types = dict(status.types)
        types[type_url] = change(types.get(type_url, TypeStatus()))
        self._nodes[node_id] = replace(status, types=types)
