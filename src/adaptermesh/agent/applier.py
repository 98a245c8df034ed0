"""Applies Assignments to the datapath and the xDS snapshot as one step.

Order: the shared Assignment rules first (the same module the control plane checks every
write and every publish with), then the BPF maps (the datapath validates what only this node
knows, such as interface names, before it touches a map), then the xDS
snapshot. If the snapshot is refused, the maps are put back to the last good Assignment, so
the two never disagree. A refused version is remembered and never retried; the last good
Assignment keeps serving, and the error is reported to the control plane.

While the datapath is gone (``hold``: its interface, filter or pins, see agent/liveness.py),
a new Assignment is kept, not applied, and reported as not applied with the reason; ``replay``
applies it (or the current one again) once the datapath is back, and ``release`` ends the hold.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from adaptermesh import adapter_edge
from adaptermesh import assignment_rules as rules
from adaptermesh.agent.metrics import AgentMetrics
from adaptermesh.agent.ports import Datapath, XdsSink
from adaptermesh.agent.state import AssignmentStore
from adaptermesh.clock import Clock, SystemClock
from adaptermesh.proto.adaptermesh.v1 import assignment_pb2

__all__ = ["Applier", "ApplyResult"]

_log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ApplyResult:
    version: int
    ok: bool
    error: str = ""
    skipped: bool = False


class Applier:
    def __init__(
        self,
        datapath: Datapath,
        xds: XdsSink,
        metrics: AgentMetrics,
        store: AssignmentStore | None = None,
        clock: Clock | None = None,
    ) -> None:
        self._datapath = datapath
        self._xds = xds
        self._metrics = metrics
        self._store = store or AssignmentStore(None)
        self._clock: Clock = clock or SystemClock()
        self.current: assignment_pb2.Assignment | None = None
        self.last_error = ""
        self.rejected_version = 0
        self.received_version = 0
        self.listeners: list[Callable[[assignment_pb2.Assignment], None]] = []
        # Why the datapath cannot take an Assignment now ("": it can), and the newest one
        # received meanwhile. The watch and the liveness monitor call in from two threads.
        self.held = ""
        self.pending: assignment_pb2.Assignment | None = None
        self._held_error = False
        self._lock = threading.RLock()

    @property
    def applied_version(self) -> int:
        return self.current.version if self.current is not None else 0

    def reconcile(self) -> ApplyResult | None:
        """On start: re-apply the cached Assignment, so maps and xDS agree before any watch.

        The maps may already hold it (a restart keeps the pins); applying it again is
        idempotent and repairs a map that someone edited by hand.
        """
        cached = self._store.load()
        if cached is None:
            return None
        _log.info("reconciling with cached assignment version %d", cached.version)
        return self.apply(cached, persist=False)

    def apply(self, assignment: assignment_pb2.Assignment, persist: bool = True) -> ApplyResult:
        with self._lock:
            return self._apply(assignment, persist)

    def hold(self, reason: str) -> None:
        """The datapath is gone: keep new Assignments instead of applying them."""
        with self._lock:
            if self.held == reason:
                return
            self.held = reason
            self.last_error = (
                f"version {self.pending.version} not applied: datapath: {reason}"
                if self.pending is not None
                else f"datapath: {reason}"
            )[: rules.MAX_APPLY_ERROR]
            self._held_error = True
            self._metrics.apply_error.set(1)

    def replay(self) -> ApplyResult | None:
        """Write the held Assignment, or the current one again, to a datapath that is back
        (a new interface may have new indices for redirect targets); None: nothing to write."""
        with self._lock:
            pending, self.pending = self.pending, None
            if pending is not None and pending.version > self.applied_version:
                held, self.held = self.held, ""
                try:
                    return self._apply(pending, persist=True)
                finally:
                    self.held = held
            current = self.current
            if current is None:
                return None
            try:
                self._datapath.apply(current)
            except Exception as exc:
                _log.exception("could not replay assignment %d", current.version)
                return ApplyResult(current.version, ok=False, error=f"datapath: replay: {exc}")
            return ApplyResult(current.version, ok=True)

    def release(self) -> None:
        """The datapath is back: apply again as Assignments come."""
        with self._lock:
            self.held = ""
            if self._held_error:
                self._held_error = False
                self.last_error = ""
                self._metrics.apply_error.set(0)

    def _apply(self, assignment: assignment_pb2.Assignment, persist: bool) -> ApplyResult:
        version = assignment.version
        self.received_version = max(self.received_version, version)
        self._metrics.received_version.set(self.received_version)
        if version <= self.applied_version or version == self.rejected_version:
            # Versions only grow; an old or already-refused one is a replay after a reconnect.
            self._metrics.applies.labels("stale").inc()
            return ApplyResult(version, ok=True, skipped=True)
        started = time.perf_counter()
        try:
            rules.check_assignment(assignment)
            adapter_edge.check_edges(assignment)
        except rules.RuleError as exc:
            return self._reject(assignment, f"rules: {exc}")
        if self.held:
            # Never reported applied without a datapath to apply it to.
            if self.pending is None or version > self.pending.version:
                self.pending = assignment
            self.last_error = f"version {version} not applied: datapath: {self.held}"[
                : rules.MAX_APPLY_ERROR
            ]
            self._held_error = True
            self._metrics.applies.labels("held").inc()
            self._metrics.apply_error.set(1)
            _log.warning("holding assignment version %d: datapath: %s", version, self.held)
            return ApplyResult(version, ok=False, error=self.last_error)
        try:
            self._datapath.apply(assignment)
        except Exception as exc:
            return self._reject(assignment, f"datapath: {exc}")
        try:
            self._xds.publish(assignment)
        except Exception as exc:
            self._rollback_datapath()
            return self._reject(assignment, f"xds: {exc}")
        self._metrics.apply_seconds.observe(time.perf_counter() - started)
        self.current = assignment
        self.last_error = ""
        self._held_error = False
        self._metrics.applies.labels("ok").inc()
        self._metrics.applied_version.set(version)
        self._metrics.apply_error.set(0)
        self._metrics.last_apply_timestamp.set(self._clock.time())
        self._metrics.set_shards({s.index: (s.id, s.weight) for s in assignment.shards})
        if persist:
            try:
                self._store.save(assignment)
            except OSError as exc:
                # Serving is unaffected; only a restart would start from an older cache.
                _log.warning("could not cache assignment %d: %s", version, exc)
        _log.info(
            "applied assignment version %d (%d shards, %d pins): %s",
            version,
            len(assignment.shards),
            len(assignment.pins),
            assignment.reason or "-",
        )
        for listener in self.listeners:
            listener(assignment)
        return ApplyResult(version, ok=True)

    def _rollback_datapath(self) -> None:
        if self.current is None:
            return
        try:
            self._datapath.apply(self.current)
        except Exception:
            # The maps validated this Assignment before; failing now means the kernel side is
            # broken, which the datapath_attached gauge and /healthz report.
            _log.exception("could not restore assignment %d to the datapath", self.current.version)

    def _reject(self, assignment: assignment_pb2.Assignment, error: str) -> ApplyResult:
        self.rejected_version = assignment.version
        # Reported in every LoadReport and shown by `adapterctl status`; bounded so the
        # control plane never refuses the report that carries it.
        self.last_error = f"version {assignment.version}: {error}"[: rules.MAX_APPLY_ERROR]
        self._metrics.applies.labels("error").inc()
        self._metrics.apply_error.set(1)
        _log.error(
            "rejected assignment version %d (still serving %d): %s",
            assignment.version,
            self.applied_version,
            error,
        )
        return ApplyResult(assignment.version, ok=False, error=self.last_error)
