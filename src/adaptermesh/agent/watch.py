"""The control-plane side of the agent: the WatchAssignments stream and the ReportLoad loop.

The watch resumes from the applied version after every failure, with exponential backoff and
jitter, and never touches the applied state on a disconnect: the node keeps serving its last
Assignment for as long as the control plane is away.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
from collections.abc import Callable, Sequence
from pathlib import Path

import grpc
from google.protobuf.timestamp_pb2 import Timestamp

from adaptermesh import assignment_rules as rules
from adaptermesh.agent.applier import Applier
from adaptermesh.agent.load import LoadTracker, ShardRates
from adaptermesh.agent.metrics import AgentMetrics
from adaptermesh.agent.ports import Datapath
from adaptermesh.backoff import Backoff
from adaptermesh.clock import Clock, SystemClock
from adaptermesh.proto.adaptermesh.v1 import control_plane_pb2, control_plane_pb2_grpc

__all__ = ["AssignmentWatcher", "BearerFile", "LoadReporter", "Token", "auth_metadata"]

_log = logging.getLogger(__name__)


class BearerFile:
    """A bearer token kept in a file and re-read when the file changes: the kubelet rotates a
    projected ServiceAccount token in place, and an agent that kept the first one would be
    refused once it expires. A file that turns empty or unreadable keeps the last token."""

    def __init__(self, path: Path, token: str) -> None:
        self.path = path
        self._token = token
        self._signature = self._stat()

    def _stat(self) -> tuple[int, int, int, int] | None:
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size)

    def token(self) -> str:
        signature = self._stat()
        if signature is not None and signature != self._signature:
            self._signature = signature
            try:
                text = self.path.read_text().strip()
            except OSError as exc:
                _log.warning("token file %s: %s; keeping the last token", self.path, exc)
            else:
                if text:
                    self._token = text
        return self._token


Token = str | BearerFile | None


def auth_metadata(token: Token) -> Sequence[tuple[str, str]]:
    value = token.token() if isinstance(token, BearerFile) else token
    return (("authorization", f"Bearer {value}"),) if value else ()


class AssignmentWatcher:
    """Keeps one WatchAssignments stream open and hands every Assignment to the applier."""

    def __init__(
        self,
        stub: control_plane_pb2_grpc.ControlPlaneStub,
        node_id: str,
        applier: Applier,
        metrics: AgentMetrics,
        token: Token = None,
        backoff: Backoff | None = None,
        on_applied: Callable[[], None] | None = None,
        # A stream that lived this long counts as healthy: the next failure starts the
        # backoff from its initial delay again.
        healthy_after_s: float = 5.0,
        clock: Clock | None = None,
    ) -> None:
        self._stub = stub
        self._node_id = node_id
        self._applier = applier
        self._metrics = metrics
        self._token = token
        self.backoff = backoff or Backoff()
        self._on_applied = on_applied
        self._healthy_after_s = healthy_after_s
        self._clock: Clock = clock or SystemClock()
        self.connected = False
        self.last_error = ""
        self.sleeps: list[float] = []  # recent backoff delays, for /status and tests

    async def run(self) -> None:
        first = True
        while True:
            if not first:
                self._metrics.reconnects.inc()
            first = False
            opened = self._clock.monotonic()
            try:
                await self._stream_once()
                self.last_error = "stream ended by the control plane"
            except grpc.aio.AioRpcError as exc:
                self.last_error = f"{exc.code().name}: {exc.details()}"
                self._metrics.watch_errors.labels(exc.code().name).inc()
            finally:
                self.connected = False
                self._metrics.connected.set(0)
            if self._clock.monotonic() - opened >= self._healthy_after_s:
                self.backoff.reset()
            delay = self.backoff.next()
            self.sleeps = [*self.sleeps[-9:], delay]
            _log.warning(
                "control plane watch lost (%s); serving version %d, retrying in %.2fs",
                self.last_error,
                self._applier.applied_version,
                delay,
            )
            await self._clock.sleep(delay)

    async def _stream_once(self) -> None:
        request = control_plane_pb2.WatchAssignmentsRequest(
            from_version=self._applier.applied_version, node_id=self._node_id
        )
        call = self._stub.WatchAssignments(request, metadata=auth_metadata(self._token))
        try:
            # wait_for_connection() would block forever on an unreachable server; the first
            # read fails fast instead and the backoff takes over.
            async for assignment in call:
                if not self.connected:
                    self.connected = True
                    self._metrics.connected.set(1)
                    self.backoff.reset()
                    _log.info("watching assignments from %s", self._node_id)
                # Off the event loop: the datapath may block (netlink, map batches).
                result = await asyncio.to_thread(self._applier.apply, assignment)
                if not result.skipped and self._on_applied is not None:
                    self._on_applied()
        finally:
            call.cancel()


class LoadReporter:
    """Reports the applied version and per-shard traffic facts every ``interval_s``."""

    def __init__(
        self,
        stub: control_plane_pb2_grpc.ControlPlaneStub,
        node_id: str,
        applier: Applier,
        datapath: Datapath,
        tracker: LoadTracker,
        metrics: AgentMetrics,
        token: Token = None,
        interval_s: float = 2.0,
        timeout_s: float = 2.0,
        clock: Clock | None = None,
        extra_error: Callable[[], str] | None = None,
    ) -> None:
        self._stub = stub
        self._node_id = node_id
        self._applier = applier
        # An error the applier does not own (a refused routing-rule set) reported the same way.
        self._extra_error = extra_error or (lambda: "")
        self._datapath = datapath
        self._tracker = tracker
        self._metrics = metrics
        self._token = token
        self.interval_s = interval_s
        self._timeout_s = timeout_s
        self._clock: Clock = clock or SystemClock()
        self._wake = asyncio.Event()
        self.last_error = ""

    def poke(self) -> None:
        """Report now (after an apply) instead of waiting for the next interval."""
        self._wake.set()

    def sample(self) -> dict[int, ShardRates]:
        self._tracker.counters = dataclasses.asdict(self._datapath.read_counters())
        return self._tracker.update(self._datapath.read_stats(), self._clock.monotonic())

    def build_report(self, rates: dict[int, ShardRates]) -> control_plane_pb2.LoadReport:
        names = {}
        if self._applier.current is not None:
            names = {s.index: s.id for s in self._applier.current.shards}
        observed = Timestamp()
        observed.GetCurrentTime()
        report = control_plane_pb2.LoadReport(
            node_id=self._node_id,
            applied_version=self._applier.applied_version,
            observed_at=observed,
            apply_error=(self._applier.last_error or self._extra_error())[: rules.MAX_APPLY_ERROR],
        )
        for index, r in sorted(rates.items()):
            if index not in names:
                continue  # counters for an index no shard uses any more
            report.shards.add(
                shard_id=names[index],
                packets_per_s=r.packets_per_s,
                bytes_per_s=r.bytes_per_s,
                new_flows_per_s=r.new_flows_per_s,
                active_flows=r.active_flows,
            )
        return report

    async def report_once(self, resample: bool = True) -> bool:
        # A report right after an apply reuses the last rates: a sample over a few
        # milliseconds would be mostly noise.
        if resample or not self._tracker.last():
            rates = await asyncio.to_thread(self.sample)
        else:
            rates = self._tracker.last()
        try:
            await self._stub.ReportLoad(
                self.build_report(rates),
                metadata=auth_metadata(self._token),
                timeout=self._timeout_s,
            )
        except grpc.aio.AioRpcError as exc:
            self.last_error = f"{exc.code().name}: {exc.details()}"
            self._metrics.reports.labels("error").inc()
            return False
        self.last_error = ""
        self._metrics.reports.labels("ok").inc()
        return True

    async def run(self) -> None:
        next_sample = self._clock.monotonic()
        while True:
            now = self._clock.monotonic()
            resample = now >= next_sample
            if resample:
                next_sample = now + self.interval_s
            await self.report_once(resample)
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(
                    self._wake.wait(), max(0.0, next_sample - self._clock.monotonic())
                )
