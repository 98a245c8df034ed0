"""The agent exports each new-flow ring-buffer event keyed by the flow: a JSON log line and a
span in the flow's own trace, through a real OTLP/gRPC receiver, with the fake datapath and a
fake control plane over real gRPC."""

from __future__ import annotations

import asyncio
import json
import logging
from ipaddress import ip_address
from pathlib import Path

import pytest
from otlp import OtlpReceiver
from waiting import async_wait_until as wait_until

from adaptermesh.agent.cli import build_parser, config_from_args
from adaptermesh.agent.daemon import Agent, AgentConfig
from adaptermesh.agent.flowlog import FlowExporter, flow_trace_id
from adaptermesh.agent.ports import FlowEvent
from adaptermesh.tracing import Tracing

from .conftest import TOKEN
from .fakes import ControlPlaneServer, FakeDatapath, FakeXds, make_assignment

EVENTS = [
    FlowEvent(0, ip_address("10.9.0.1"), 0, "maglev", 1),
    FlowEvent(0, ip_address("10.9.0.2"), 1, "pin", 1),
    FlowEvent(0, ip_address("10.9.0.1"), 1, "repick", 1),
]


async def _run_agent(tmp_path: Path, cp: ControlPlaneServer, **extra: object) -> None:
    dp, xds = FakeDatapath(), FakeXds()
    config = AgentConfig(
        node_id="node-f",
        control_plane=cp.target,
        token=TOKEN,
        iface="lo",
        metrics_host="127.0.0.1",
        metrics_port=0,
        state_file=tmp_path / "assignment.pb",
        report_interval_s=0.2,
        backoff_initial_s=0.05,
        backoff_max_s=0.4,
        **extra,
    )  # type: ignore[arg-type]

    async def xds_factory(_config: AgentConfig, _registry: object) -> FakeXds:
        return xds

    agent = Agent(config, lambda _c: dp, xds_factory)
    stop = asyncio.Event()
    task = asyncio.create_task(agent.run(stop))
    try:
        await asyncio.wait_for(agent.started.wait(), 5)
        cp.servicer.publish(make_assignment(1))
        await wait_until(lambda: dp.applied == [1], what="v1 applied")
        dp.pending_events = list(EVENTS)
        await wait_until(lambda: agent.tracker.events_total == len(EVENTS), what="events")
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)  # shuts tracing down: its spans are flushed


async def test_each_new_flow_is_a_log_line_and_a_span_in_the_flows_trace(
    tmp_path: Path, cp: ControlPlaneServer, caplog: pytest.LogCaptureFixture
) -> None:
    receiver = OtlpReceiver()
    port = receiver.start()
    try:
        with caplog.at_level(logging.INFO, logger="adaptermesh.flows"):
            await _run_agent(tmp_path, cp, flow_events="both", otlp_endpoint=f"127.0.0.1:{port}")
        lines = [
            json.loads(r.getMessage()) for r in caplog.records if r.name == "adaptermesh.flows"
        ]
        assert [
            (x["flow"], x["shard"], x["shard_index"], x["reason"], x["version"]) for x in lines
        ] == [
            ("10.9.0.1", "a", 0, "maglev", 1),
            ("10.9.0.2", "b", 1, "pin", 1),
            ("10.9.0.1", "b", 1, "repick", 1),
        ]
        assert all(x["node"] == "node-f" and x["ts_ns"] > 0 for x in lines)
        spans = await wait_until(
            lambda: (
                len(s := [x for x in receiver.snapshot() if x.name == "classifier flow"]) >= 3 and s
            ),
            10,
            0.05,
            what="three flow spans",
        )
    finally:
        receiver.stop()
    assert all(s.service == "adaptermesh-agent" for s in spans)
    by_flow: dict[str, list[str]] = {}
    for s in spans:
        flow = str(s.attributes["adaptermesh.flow"])
        assert s.trace_id == f"{flow_trace_id(flow):032x}"  # keyed by the flow
        by_flow.setdefault(flow, []).append(str(s.attributes["adaptermesh.reason"]))
    assert sorted(by_flow["10.9.0.1"]) == ["maglev", "repick"]
    assert by_flow["10.9.0.2"] == ["pin"]
    pin = next(s for s in spans if s.attributes["adaptermesh.reason"] == "pin")
    assert pin.attributes["adaptermesh.shard"] == "b"
    assert pin.attributes["adaptermesh.version"] == 1


async def test_off_by_default(
    tmp_path: Path, cp: ControlPlaneServer, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="adaptermesh.flows"):
        await _run_agent(tmp_path, cp)
    assert not [r for r in caplog.records if r.name == "adaptermesh.flows"]


def test_spans_need_tracing_and_the_ratio_applies_per_flow() -> None:
    with pytest.raises(ValueError, match="flow_events: 'span' needs tracing"):
        FlowExporter("span", Tracing.off(), "n", dict)
    with pytest.raises(ValueError, match="flow_events: 'loud' is not one of"):
        FlowExporter("loud", Tracing.off(), "n", dict)  # type: ignore[arg-type]
    args = build_parser().parse_args(
        ["--node-id", "n", "--control-plane", "h:1", "--iface", "lo", "--flow-events", "span"]
    )
    with pytest.raises(SystemExit, match="--flow-events span needs --otlp-endpoint"):
        config_from_args(args)

    class Capture:
        def __init__(self) -> None:
            self.spans: list[object] = []

        def export(self, spans: object) -> object:
            from opentelemetry.sdk.trace.export import SpanExportResult

            self.spans.extend(spans)  # type: ignore[call-overload]
            return SpanExportResult.SUCCESS

        def shutdown(self) -> None:
            pass

        def force_flush(self, timeout_millis: int = 0) -> bool:
            return True

    sink = Capture()
    tracing = Tracing.from_config(None, 1.0, "t", exporter=sink)  # type: ignore[arg-type]
    none = FlowExporter("span", tracing, "n", dict, sample_ratio=0.0)
    half = FlowExporter("span", tracing, "n", dict, sample_ratio=0.5)
    sources = [ip_address(f"10.1.{i // 250}.{i % 250}") for i in range(400)]
    for src in sources:
        for exporter in (none, half):
            exporter(FlowEvent(0, src, 0, "maglev", 1))
            exporter(FlowEvent(0, src, 1, "repick", 1))
    assert none.traced == 0
    # A flow is traced whole or not at all; about half of them are.
    assert half.traced % 2 == 0
    assert 300 < half.traced < 500
    tracing.shutdown()
