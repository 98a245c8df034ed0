"""The whole agent (watch, apply, report, HTTP) against a fake control plane over real gRPC."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections.abc import AsyncIterator, Iterator
from ipaddress import ip_address
from pathlib import Path

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families
from waiting import async_wait_until as wait_until

from adaptermesh.agent.daemon import Agent, AgentConfig
from adaptermesh.agent.ports import FlowEvent, ShardStats
from adaptermesh.agent.state import AssignmentStore

from .conftest import TOKEN
from .fakes import FakeDatapath, FakeXds, make_assignment


@pytest.fixture
def dead_address() -> Iterator[str]:
    """An address where nothing answers: a port bound (kept, so no one else takes it) but not
    listening, so a connection is refused at once."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield f"127.0.0.1:{s.getsockname()[1]}"


class Harness:
    def __init__(self, tmp_path: Path, target: str, token: str | None = TOKEN, detach=False):
        self.dp = FakeDatapath()
        self.xds = FakeXds()
        self.config = AgentConfig(
            node_id="node-t",
            control_plane=target,
            token=token,
            iface="lo",
            metrics_host="127.0.0.1",
            metrics_port=0,
            state_file=tmp_path / "assignment.pb",
            report_interval_s=0.2,
            backoff_initial_s=0.05,
            backoff_max_s=0.4,
            detach=detach,
        )

        async def xds_factory(_config: AgentConfig, _registry) -> FakeXds:
            return self.xds

        self.agent = Agent(self.config, lambda _c: self.dp, xds_factory)
        self.stop = asyncio.Event()
        self.task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self.task = asyncio.create_task(self.agent.run(self.stop))
        await asyncio.wait_for(self.agent.started.wait(), 5)

    async def close(self) -> None:
        self.stop.set()
        if self.task is not None:
            await asyncio.wait_for(self.task, 10)

    async def get(self, path: str) -> tuple[int, str]:
        url = f"http://127.0.0.1:{self.agent.http_port}{path}"
        async with aiohttp.ClientSession() as s, s.get(url) as r:
            return r.status, await r.text()


@contextlib.asynccontextmanager
async def running(h: Harness) -> AsyncIterator[Harness]:
    await h.start()
    try:
        yield h
    finally:
        await h.close()


async def test_applies_streamed_assignments_and_reports_version_and_traffic(tmp_path, cp):
    cp.servicer.publish(make_assignment(1))
    async with running(Harness(tmp_path, cp.target)) as h:
        await wait_until(lambda: h.dp.applied == [1], what="v1 applied")
        assert h.xds.published == [1]
        await wait_until(
            lambda: any(r.applied_version == 1 for r in cp.servicer.reports), what="report v1"
        )
        # Traffic: counters grow and the ring buffer says which source went where.
        h.dp.counters = {0: ShardStats(0, 0, 0), 1: ShardStats(0, 0, 0)}
        # Two more reports: at least one sampled the zero counters.
        seen = len(cp.servicer.reports)
        await wait_until(lambda: len(cp.servicer.reports) >= seen + 2, what="a zero sample")
        h.dp.counters = {0: ShardStats(1000, 150_000, 20), 1: ShardStats(10, 900, 1)}
        h.dp.pending_events = [
            FlowEvent(1, ip_address(f"10.9.0.{i}"), 0, "maglev", 1) for i in range(5)
        ]

        def traffic_reported() -> bool:
            for r in cp.servicer.reports:
                by_id = {s.shard_id: s for s in r.shards}
                if "a" in by_id and by_id["a"].packets_per_s > 0 and by_id["a"].active_flows == 5:
                    return True
            return False

        await wait_until(traffic_reported, what="traffic in a report")
        last = next(r for r in reversed(cp.servicer.reports) if r.shards)
        assert last.node_id == "node-t"
        a = {s.shard_id: s for s in last.shards}["a"]
        assert a.bytes_per_s > a.packets_per_s > 0
        assert a.new_flows_per_s > 0

        status, body = await h.get("/flows?source=10.9.0.3")
        assert status == 200
        assert '"shard_id": "a"' in body
        assert '"10.9.0.3"' in body
        assert "10.9.0.4" not in body
        # A flow that stayed sticky past the event window: only the flow table knows it.
        h.dp.sticky["10.9.7.7"] = 1
        status, body = await h.get("/flows?source=10.9.7.7")
        assert status == 200
        flows = json.loads(body)["flows"]
        assert flows == [{"source": "10.9.7.7", "shard_index": 1, "shard_id": "b", "age_s": None}]
        status, body = await h.get("/flows?source=10.9.7.8")
        assert json.loads(body)["flows"] == []
        status, body = await h.get("/flows")
        assert "10.9.7.7" not in body  # the listing is the window's flows only

        cp.servicer.publish(make_assignment(2, {"a": 2000, "b": 8000}, reason="rebalance"))
        await wait_until(lambda: h.dp.applied == [1, 2], what="v2 applied")
        await wait_until(lambda: cp.servicer.reports[-1].applied_version == 2, what="report v2")
        assert cp.servicer.watch_requests[0].node_id == "node-t"


async def test_keeps_last_assignment_while_control_plane_is_away_then_resumes(tmp_path, cp):
    cp.servicer.publish(make_assignment(1))
    async with running(Harness(tmp_path, cp.target)) as h:
        await wait_until(lambda: h.agent.watcher.connected, what="connected")
        await cp.stop()
        await wait_until(lambda: not h.agent.watcher.connected, what="disconnect noticed")
        await wait_until(lambda: len(h.agent.watcher.sleeps) >= 4, what="several retries")
        # Nothing was withdrawn while the control plane was away.
        assert h.dp.current.version == 1
        assert h.xds.current.version == 1
        assert h.dp.closed is None
        assert not h.xds.closed
        status, body = await h.get("/healthz")
        assert status == 200
        assert '"control_plane_connected": false' in body
        # Backoff grew (each delay is drawn from [ceiling/2, ceiling]).
        sleeps = h.agent.watcher.sleeps
        assert max(sleeps) > sleeps[0]
        assert max(sleeps) <= 0.4

        cp.servicer.publish(make_assignment(2, {"a": 9000, "b": 1000}))
        await cp.start()  # same port
        await wait_until(lambda: h.dp.applied == [1, 2], timeout=5, what="v2 after return")
        # It resumed from the version it had applied, not from scratch.
        assert cp.servicer.watch_requests[-1].from_version == 1
        value = h.agent.metrics.registry.get_sample_value
        assert value("adaptermesh_agent_watch_reconnects_total") >= 4
        assert value("adaptermesh_agent_watch_errors_total", {"code": "UNAVAILABLE"}) >= 1


async def test_bad_assignment_is_reported_and_the_last_good_one_serves(tmp_path, cp):
    cp.servicer.publish(make_assignment(1))
    async with running(Harness(tmp_path, cp.target)) as h:
        await wait_until(lambda: h.dp.applied == [1])
        cp.servicer.publish(make_assignment(2, pins={"10.0.0.0/33": "a"}))
        await wait_until(
            lambda: any(r.apply_error for r in cp.servicer.reports), what="error report"
        )
        report = next(r for r in cp.servicer.reports if r.apply_error)
        assert report.applied_version == 1
        assert "version 2" in report.apply_error
        assert "pins[0].cidr" in report.apply_error
        assert h.dp.current.version == 1
        assert h.xds.current.version == 1
        cp.servicer.publish(make_assignment(3, {"a": 10_000}))
        await wait_until(lambda: h.dp.applied == [1, 3])
        await wait_until(lambda: cp.servicer.reports[-1].apply_error == "")


async def test_restart_serves_the_cached_assignment_before_the_control_plane_answers(
    tmp_path, dead_address
):
    AssignmentStore(tmp_path / "assignment.pb").save(make_assignment(4, pins={"10.2.0.0/24": "b"}))
    dead = dead_address
    async with running(Harness(tmp_path, dead)) as h:
        assert h.dp.applied == [4]
        assert h.xds.published == [4]
        assert (await h.get("/readyz"))[0] == 200
        status, body = await h.get("/status")
        assert status == 200
        assert '"applied_version": 4' in body
        assert "10.2.0.0/24" in body


async def test_not_ready_until_something_is_applied(tmp_path, dead_address):
    async with running(Harness(tmp_path, dead_address)) as h:
        assert (await h.get("/readyz"))[0] == 503
        assert (await h.get("/healthz"))[0] == 200


@pytest.mark.parametrize("detach", [False, True])
async def test_graceful_stop_leaves_the_datapath_unless_detach(tmp_path, cp, detach):
    cp.servicer.publish(make_assignment(1))
    h = Harness(tmp_path, cp.target, detach=detach)
    async with running(h):
        await wait_until(lambda: h.dp.applied == [1])
    assert h.dp.closed is detach
    assert h.xds.closed
    assert h.agent.metrics.registry.get_sample_value("adaptermesh_agent_datapath_attached") == 0


async def test_bad_token_shows_as_unauthenticated(tmp_path, cp):
    async with running(Harness(tmp_path, cp.target, token="wrong")) as h:
        await wait_until(lambda: "UNAUTHENTICATED" in h.agent.watcher.last_error, what="auth error")
        assert h.dp.applied == []
        await wait_until(lambda: "UNAUTHENTICATED" in h.agent.reporter.last_error)


async def test_metrics_endpoint_exposes_every_agent_series(tmp_path, cp):
    cp.servicer.publish(make_assignment(1))
    async with running(Harness(tmp_path, cp.target)) as h:
        h.dp.counters = {0: ShardStats(5, 500, 1)}
        h.dp.pending_events = [FlowEvent(1, ip_address("10.9.0.1"), 0, "maglev", 1)]
        await wait_until(lambda: h.dp.applied == [1])
        await wait_until(lambda: h.agent.tracker.events_total == 1)
        await wait_until(lambda: 0 in h.agent.tracker.last())
        status, text = await h.get("/metrics")
    assert status == 200
    families = list(text_string_to_metric_families(text))
    names = {s.name for f in families for s in f.samples}
    family_names = {f.name for f in families}
    documented = set(
        line.split("`")[1]
        for line in (Path(__file__).parents[2] / "docs" / "metrics.md").read_text().splitlines()
        if line.startswith("| `adaptermesh_agent_")
    )
    assert documented, "docs/metrics.md lists the agent's series"
    for name in documented:
        assert name.removesuffix("_total") in family_names, name
    exported = {f.name for f in families if f.name.startswith("adaptermesh_agent_")}
    assert {n for n in exported if not n.endswith("_created")} == {
        n.removesuffix("_total") for n in documented
    }, "every exported series is documented"
    assert "adaptermesh_agent_shard_packets_total" in names
    assert "adaptermesh_agent_flow_events_total" in names


async def test_agent_listener_has_the_shared_guards(tmp_path, cp):
    # The daemon serves through httpserve.serve_app: oversized headers get the JSON 431 there
    # (a plain aiohttp runner answers 400 text), and a stalled client is cut at the deadline.
    async with running(Harness(tmp_path, cp.target)) as h:
        reader, writer = await asyncio.open_connection("127.0.0.1", h.agent.http_port)
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 40_000 + b"\r\n\r\n")
        await writer.drain()
        head = await asyncio.wait_for(reader.read(4096), 5)
        writer.close()
        assert head.split(b" ", 2)[1] == b"431", head[:80]
        assert b"application/json" in head
        status, _ = await h.get("/healthz")
        assert status == 200
