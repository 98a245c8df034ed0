"""Envoy's, the agent's ext_proc and the worker's spans join one trace: a real Envoy (its
OpenTelemetry tracer, our snapshot and bootstrap, the ext_proc filter) in front of a real
worker service, all exporting to a real OTLP/gRPC receiver inside the test."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

import pytest
from conftest import TEST_OPTIONS
from mesh_support import LOOPBACK, free_port
from otlp import OtlpReceiver, envoy_and_worker_spans
from waiting import wait_until
from worker_service.fakes import FakeEngine
from worker_service.threaded import port_of, post_completion, threaded_service

from adaptermesh.agent.extproc import ExtProcConfig, ExtProcServer
from adaptermesh.agent.picker import EndpointBook
from adaptermesh.mesh.bootstrap import EnvoyProcess, build_bootstrap
from adaptermesh.mesh.cache import SnapshotCache
from adaptermesh.mesh.server import XdsServer
from adaptermesh.mesh.snapshot import ExtProcOptions, TracingOptions, build_listener
from adaptermesh.proto import assignment_pb2 as ap
from adaptermesh.tracing import Tracing

TRACE = "0af7651916cd43dd8448eb211c80319c"
PARENT = "b7ad6b7169203331"


@pytest.fixture
def traced_mesh() -> Iterator[tuple[int, OtlpReceiver]]:
    receiver = OtlpReceiver()
    otlp_port = receiver.start()
    tracing = Tracing.from_config(
        f"127.0.0.1:{otlp_port}", 1.0, "adaptermesh-worker", schedule_delay_millis=50
    )
    worker = contextlib.ExitStack()
    worker_port = port_of(worker.enter_context(threaded_service(FakeEngine, tracing)))
    agent_tracing = Tracing.from_config(
        f"127.0.0.1:{otlp_port}", 1.0, "adaptermesh-agent", schedule_delay_millis=50
    )
    book = EndpointBook()
    processor = ExtProcServer(book, ExtProcConfig(base_model="tiny-base"), tracing=agent_tracing)
    ext_port = processor.start()
    options = dataclasses.replace(
        TEST_OPTIONS,
        tracing=TracingOptions(sample_percent=100.0),
        ext_proc=ExtProcOptions(max_body_bytes=64 * 1024),
    )
    cache = SnapshotCache(options=options)
    xds = XdsServer(cache)
    xds_port = xds.start()
    port = free_port()
    shard = ap.Shard(
        id="s0",
        index=0,
        weight=10_000,
        state=ap.SHARD_STATE_ACTIVE,
        service_address=LOOPBACK,
        service_port=port,
        endpoints=[ap.Endpoint(address=LOOPBACK, port=worker_port, weight=1)],
    )
    assignment = ap.Assignment(version=1, shards=[shard], reason="test")
    book.set_assignment(assignment)
    cache.set_assignment("node-x", assignment)
    envoy = EnvoyProcess(
        build_bootstrap(
            "node-x",
            xds_port,
            otlp_port=otlp_port,
            ext_proc_port=ext_port,
            initial_fetch_timeout_s=5.0,
        )
    )
    try:
        envoy.start(ready_timeout=20.0)
        yield port, receiver
    finally:
        envoy.cleanup()
        xds.stop(grace=0.1)
        processor.stop()
        worker.close()
        tracing.shutdown()
        agent_tracing.shutdown()
        receiver.stop()


def test_envoy_and_worker_spans_join_one_trace(traced_mesh) -> None:  # type: ignore[no-untyped-def]
    port, receiver = traced_mesh
    wait_until(
        lambda: post_completion(port, {}, "alpha", 3) == 200,
        20,
        0.2,
        what="Envoy routing to the worker",
    )
    assert post_completion(port, {"traceparent": f"00-{TRACE}-{PARENT}-01"}, "alpha", 3) == 200

    envoy, worker = wait_until(
        lambda: envoy_and_worker_spans(receiver, TRACE),
        20,
        0.1,
        what="Envoy's and the worker's spans",
    )
    (root,) = worker
    # The worker's request span is a child of a span Envoy exported, in the caller's trace.
    assert root.parent_span_id in {s.span_id for s in envoy}
    assert any(s.parent_span_id == PARENT for s in envoy)
    children = [s for s in receiver.snapshot() if s.parent_span_id == root.span_id]
    assert {s.name for s in children} == {"queue", "adapter resolution", "prefill", "decode"}
    # The agent's ext_proc decision joins the same trace, under the span of Envoy's call.
    decided = wait_until(
        lambda: [
            s for s in receiver.snapshot() if s.trace_id == TRACE and s.name == "ext_proc decide"
        ],
        20,
        0.1,
        what="the ext_proc decision's span",
    )
    spans = receiver.snapshot()
    assert decided[0].parent_span_id in {
        s.span_id for s in spans if s.service == "adaptermesh-envoy"
    }
    assert decided[0].attributes["adaptermesh.adapter"] == "alpha"
    # A request without a trace context still gets one trace, started by Envoy (100%).
    untraced = {s.trace_id for s in receiver.snapshot() if s.trace_id != TRACE}
    assert untraced


def test_the_listener_carries_the_tracer_only_when_asked() -> None:
    shard = ap.Shard(id="s0", service_address=LOOPBACK, service_port=8080)
    assert not _manager(build_listener(shard, TEST_OPTIONS)).HasField("tracing")
    opts = dataclasses.replace(TEST_OPTIONS, tracing=TracingOptions(sample_percent=5.0))
    tracing = _manager(build_listener(shard, opts)).tracing
    assert tracing.random_sampling.value == 5.0
    assert tracing.provider.name == "envoy.tracers.opentelemetry"
    with pytest.raises(ValueError, match="sample_percent"):
        build_listener(
            shard, dataclasses.replace(TEST_OPTIONS, tracing=TracingOptions(sample_percent=101.0))
        )


def _manager(listener):  # type: ignore[no-untyped-def]
    from envoy.extensions.filters.network.http_connection_manager.v3 import (
        http_connection_manager_pb2 as hcm_pb2,
    )

    m = hcm_pb2.HttpConnectionManager()
    listener.filter_chains[0].filters[0].typed_config.Unpack(m)
    return m
