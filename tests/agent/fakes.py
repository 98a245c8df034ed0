"""In-memory stand-ins for the datapath, the xDS cache and the control plane."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Mapping

import grpc

from adaptermesh.agent.ports import DatapathCounters, FlowEvent, ShardStats
from adaptermesh.bpf.table import Attachment, validate_assignment
from adaptermesh.proto.adaptermesh.v1 import (
    assignment_pb2,
    control_plane_pb2,
    control_plane_pb2_grpc,
)


def make_assignment(
    version: int,
    weights: Mapping[str, int] | None = None,
    pins: Mapping[str, str] | None = None,
    reason: str = "test",
) -> assignment_pb2.Assignment:
    weights = weights if weights is not None else {"a": 5000, "b": 5000}
    a = assignment_pb2.Assignment(version=version, reason=reason)
    for index, (shard_id, weight) in enumerate(sorted(weights.items())):
        shard = a.shards.add(
            id=shard_id,
            index=index,
            weight=weight,
            state=assignment_pb2.SHARD_STATE_ACTIVE,
            service_address="10.0.0.1",
            service_port=8000 + index,
        )
        shard.endpoints.add(address="127.0.0.1", port=9000 + index, weight=1)
        shard.steer.mark.mark = 100 + index
    for cidr, shard_id in (pins or {}).items():
        a.pins.add(cidr=cidr, shard_id=shard_id)
    return a


class FakeDatapath:
    """Checks an Assignment with the classifier loader's own rules (``bpf.table``) and keeps
    it; tests/bpf/test_datapath_contract.py holds it to the real table's answers."""

    def __init__(self) -> None:
        self.applied: list[int] = []
        self.current: assignment_pb2.Assignment | None = None
        self.counters: dict[int, ShardStats] = {}
        self.pending_events: list[FlowEvent] = []
        self.closed: bool | None = None
        self.fail_next = False
        self.lost = 0
        self.sticky: dict[str, int] = {}  # source -> shard index, as am_flows holds it

    def apply(self, assignment: assignment_pb2.Assignment) -> None:
        if self.fail_next:
            self.fail_next = False
            raise OSError("bpf_map_update_batch: EPERM")
        # A node with every interface and a VXLAN device: what the maps themselves refuse.
        validate_assignment(assignment, resolve_ifname=lambda _name: 1, vxlan_ifindex=1)
        self.current = assignment
        self.applied.append(assignment.version)

    @property
    def applied_version(self) -> int | None:
        return self.applied[-1] if self.applied else None

    def read_stats(self) -> dict[int, ShardStats]:
        return dict(self.counters)

    def lookup_flow(self, source: str) -> int | None:
        return self.sticky.get(source)

    def read_counters(self) -> DatapathCounters:
        return DatapathCounters(ringbuf_failed=self.lost)

    def poll_events(self, callback: Callable[[FlowEvent], None], timeout_ms: int = 0) -> int:
        events, self.pending_events = self.pending_events, []
        for event in events:
            callback(event)
        if not events:
            # Behave like a blocking poll so the poller thread does not spin.
            import time

            time.sleep(min(timeout_ms, 20) / 1000)
        return len(events)

    def close(self, detach: bool) -> None:
        self.closed = detach


class FakeXds:
    def __init__(self) -> None:
        self.published: list[int] = []
        self.current: assignment_pb2.Assignment | None = None
        self.reject_versions: set[int] = set()
        self.closed = False

    def publish(self, assignment: assignment_pb2.Assignment) -> None:
        if assignment.version in self.reject_versions:
            raise ValueError("listeners[0]: route names unknown cluster shard-x")
        self.current = assignment
        self.published.append(assignment.version)

    async def close(self) -> None:
        self.closed = True


class FakeControlPlane(control_plane_pb2_grpc.ControlPlaneServicer):
    """Streams whatever ``publish`` gets; records watch requests and load reports."""

    def __init__(self, token: str | None = None) -> None:
        self.token = token
        self.current: assignment_pb2.Assignment | None = None
        self.watch_requests: list[control_plane_pb2.WatchAssignmentsRequest] = []
        self.reports: list[control_plane_pb2.LoadReport] = []
        self._subscribers: list[asyncio.Queue[assignment_pb2.Assignment]] = []

    def publish(self, assignment: assignment_pb2.Assignment) -> None:
        self.current = assignment
        for queue in self._subscribers:
            queue.put_nowait(assignment)

    async def _check(self, context: grpc.aio.ServicerContext) -> None:
        if self.token is None:
            return
        md = dict(context.invocation_metadata() or ())
        if md.get("authorization") != f"Bearer {self.token}":
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "bad token")

    async def WatchAssignments(self, request, context):
        await self._check(context)
        self.watch_requests.append(request)
        queue: asyncio.Queue[assignment_pb2.Assignment] = asyncio.Queue()
        self._subscribers.append(queue)
        try:
            if self.current is not None and self.current.version > request.from_version:
                yield self.current
            while True:
                yield await queue.get()
        finally:
            self._subscribers.remove(queue)

    async def ReportLoad(self, request, context):
        await self._check(context)
        self.reports.append(request)
        return control_plane_pb2.ReportLoadResponse()


class ControlPlaneServer:
    """A fake control plane that can be stopped and started again on the same port."""

    def __init__(self, servicer: FakeControlPlane, port: int = 0) -> None:
        self.servicer = servicer
        self.port = port
        self._server: grpc.aio.Server | None = None

    async def start(self) -> None:
        server = grpc.aio.server()
        control_plane_pb2_grpc.add_ControlPlaneServicer_to_server(self.servicer, server)
        self.port = server.add_insecure_port(f"127.0.0.1:{self.port}")
        await server.start()
        self._server = server

    async def stop(self) -> None:
        if self._server is not None:
            await self._server.stop(grace=None)
            self._server = None

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"


class FakeAttachedDatapath(FakeDatapath):
    """A FakeDatapath on an interface that tests can take away (``interface = False``), strip
    of its filter or pins, and give back; ``calls`` records applies and re-attaches in order."""

    def __init__(self) -> None:
        super().__init__()
        self.interface = True
        self.filter = True
        self.unpinned: tuple[str, ...] = ()
        self.calls: list[str] = []

    def apply(self, assignment: assignment_pb2.Assignment) -> None:
        super().apply(assignment)
        self.calls.append(f"apply {assignment.version}")

    def inspect(self) -> Attachment:
        return Attachment(
            interface=self.interface, filter=self.interface and self.filter, unpinned=self.unpinned
        )

    def reattach(self) -> None:
        if not self.interface:
            raise ValueError("ifname: no interface 'lo'")
        self.filter, self.unpinned = True, ()
        self.calls.append("reattach")

    def watch_links(self, wake: Callable[[], None], stop: threading.Event) -> None:
        stop.wait()
