"""The chart's tracing, run as rendered: a real Envoy started from the chart's bootstrap and
its container's node flags, the agent's own xDS backend configured by the chart's agent
arguments, and a worker service traced as the chart's worker arguments say, all exporting to
a real OTLP/gRPC receiver. Envoy's spans and the worker's join one trace."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from envoy.config.bootstrap.v3 import bootstrap_pb2
from google.protobuf import json_format
from otlp import OtlpReceiver, envoy_and_worker_spans
from waiting import wait_until
from worker_service.fakes import FakeEngine
from worker_service.threaded import port_of, post_completion, threaded_service

from adaptermesh.agent import cli as agent_cli
from adaptermesh.agent.backends import mesh_xds
from adaptermesh.mesh.bootstrap import EnvoyProcess, validate_bootstrap
from adaptermesh.proto import assignment_pb2 as ap
from adaptermesh.tracing import Tracing
from adaptermesh.worker import cli as worker_cli

from .chart import Obj, containers, find, render

LOOPBACK = "127.0.0.1"
TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT = "00f067aa0ba902b7"


def _container(objs: list[Obj], name: str) -> dict[str, Any]:
    (c,) = [c for _, c in containers(objs) if c["name"] == name]
    return c


def _bootstrap(objs: list[Obj], xds_port: int) -> bootstrap_pb2.Bootstrap:
    """The chart's bootstrap as Envoy's message; only the ports of this test's processes are
    changed (the xDS server's, bound to port 0, and the admin port, which Envoy picks)."""
    doc = yaml.safe_load(find(objs, "ConfigMap", "-envoy").doc["data"]["envoy.yaml"])
    (xds,) = [c for c in doc["static_resources"]["clusters"] if c["name"] == "adaptermesh_xds"]
    xds["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"][
        "socket_address"
    ]["port_value"] = xds_port
    doc["admin"]["address"]["socket_address"]["port_value"] = 0
    return json_format.ParseDict(doc, bootstrap_pb2.Bootstrap())


def _node_flags(objs: list[Obj]) -> tuple[str, ...]:
    """Envoy's --service-node/--service-cluster, as the chart's envoy container passes them."""
    args = [str(a).replace("$(NODE_NAME)", "node-1") for a in _container(objs, "envoy")["args"]]
    out: list[str] = []
    for flag in ("--service-node", "--service-cluster"):
        out += [flag, args[args.index(flag) + 1]]
    return tuple(out)


def _free_port() -> int:
    # Envoy binds the listener port an Assignment names; it takes no inherited socket.
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return int(s.getsockname()[1])


@pytest.fixture
def chart_mesh(tmp_path: Path) -> Iterator[tuple[int, OtlpReceiver]]:
    receiver = OtlpReceiver()
    otlp_port = receiver.start()
    objs = render({"tracing": {"enabled": True, "otlpEndpoint": f"{LOOPBACK}:{otlp_port}"}})
    token = tmp_path / "token"
    token.write_text("t" * 32)
    agent_args = [
        a if not str(a).startswith("--token-file=") else f"--token-file={token}"
        for a in _container(objs, "agent")["args"][1:]
    ]
    config = agent_cli.config_from_args(agent_cli.build_parser().parse_args(agent_args))
    assert config.envoy_trace_percent == 100.0
    mesh = asyncio.run(mesh_xds(dataclasses.replace(config, xds_port=0)))
    assert mesh.server is not None
    worker_args = worker_cli.build_parser().parse_args(_container(objs, "worker")["args"][1:])
    tracing = Tracing.from_config(
        worker_args.otlp_endpoint,
        worker_args.trace_sample_ratio,
        "adaptermesh-worker",
        schedule_delay_millis=50,
    )
    worker = contextlib.ExitStack()
    worker_port = port_of(worker.enter_context(threaded_service(FakeEngine, tracing)))
    port = _free_port()
    mesh.publish(
        ap.Assignment(
            version=1,
            reason="test",
            shards=[
                ap.Shard(
                    id="s0",
                    index=0,
                    weight=10_000,
                    state=ap.SHARD_STATE_ACTIVE,
                    service_address=LOOPBACK,
                    service_port=port,
                    endpoints=[ap.Endpoint(address=LOOPBACK, port=worker_port, weight=1)],
                )
            ],
        )
    )
    assert mesh.server.port is not None
    envoy = EnvoyProcess(_bootstrap(objs, mesh.server.port), extra_args=_node_flags(objs))
    try:
        envoy.start(ready_timeout=20.0)
        yield port, receiver
    finally:
        envoy.cleanup()
        mesh.server.stop()
        worker.close()
        tracing.shutdown()
        receiver.stop()


def test_envoy_and_worker_spans_join_one_trace(chart_mesh: tuple[int, OtlpReceiver]) -> None:
    port, receiver = chart_mesh
    wait_until(
        lambda: post_completion(port, {}, "tiny-base") == 200,
        20,
        0.2,
        what="Envoy routing to the worker",
    )
    assert post_completion(port, {"traceparent": f"00-{TRACE}-{PARENT}-01"}, "tiny-base") == 200

    envoy, worker = wait_until(
        lambda: envoy_and_worker_spans(receiver, TRACE),
        20,
        0.1,
        what="Envoy's and the worker's spans",
    )
    (request,) = worker
    assert request.parent_span_id in {s.span_id for s in envoy}
    assert any(s.parent_span_id == PARENT for s in envoy)

    # The first request carried no context: Envoy (100% from sampleRatio 1.0) started its
    # trace, and the worker's span joined it.
    def started_by_envoy() -> bool:
        spans = receiver.snapshot()
        envoy_traces = {
            s.trace_id for s in spans if s.service == "adaptermesh-envoy" and s.trace_id != TRACE
        }
        return any(s.name == "worker completion" and s.trace_id in envoy_traces for s in spans)

    wait_until(started_by_envoy, 20, 0.1, what="a trace Envoy started, joined by the worker")


def test_the_traced_bootstrap_validates_with_real_envoy() -> None:
    """A collector named by DNS, as in a cluster, with ext_proc beside it."""
    objs = render(
        {
            "tracing": {"enabled": True, "otlpEndpoint": "otel-collector.observability.svc:4317"},
            "extProc": {"enabled": True},
        }
    )
    bootstrap = _bootstrap(objs, 18000)
    bootstrap.node.id = "node-1"  # the container's --service-node
    validate_bootstrap(bootstrap)
