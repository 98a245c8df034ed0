"""The control plane's /metrics: served on --metrics-port, parsed by prometheus_client's parser."""

from __future__ import annotations

import asyncio
import re
import socket
from pathlib import Path

import grpc
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from adaptermesh.clock import FakeClock
from adaptermesh.control_plane import cli
from adaptermesh.control_plane.auth import load_tokens
from adaptermesh.control_plane.metrics import PREFIX, publish_cause
from adaptermesh.control_plane.policy import WorkerObservation
from adaptermesh.control_plane.server import ControlPlaneServer, ServerConfig
from adaptermesh.proto import control_plane_pb2 as cp_pb2
from adaptermesh.proto import control_plane_pb2_grpc

from .conftest import RW_TOKEN, StaticSource, creds, shard, write_tokens

DOC = Path(__file__).resolve().parents[2] / "docs" / "control-plane.md"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


async def test_metrics_endpoint_serves_state_and_counters(tmp_path: Path) -> None:
    source, clock = StaticSource(), FakeClock()
    port = _free_port()
    config = ServerConfig(
        state_dir=tmp_path / "state",
        listen="127.0.0.1:0",
        tokens=load_tokens(write_tokens(tmp_path / "tokens")),
        rebalance=False,
        synchronous="NORMAL",
        metrics_port=port,
    )
    server = ControlPlaneServer(config, source=source, clock=clock)
    grpc_port = await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}")
    stub = control_plane_pb2_grpc.ControlPlaneStub(channel)
    md = creds(RW_TOKEN)
    try:
        for i in range(3):
            await stub.UpsertShard(
                cp_pb2.UpsertShardRequest(shard=shard(f"s{i}", (f"10.0.{i}.1", 8000))), metadata=md
            )
        await stub.SetOverride(
            cp_pb2.SetOverrideRequest(shard_id="s0", weight=5000, reason="canary"), metadata=md
        )
        for i in (1, 2):
            source.workers[f"10.0.{i}.1:8000"] = WorkerObservation(
                f"10.0.{i}.1",
                8000,
                True,
                running=4,
                kv_cache_usage=0.3 * i,
                latency_s=0.1,
                tokens_per_s=100.0,
            )
        await server.rebalancer.step()
        await stub.ReportLoad(cp_pb2.LoadReport(node_id="n1", applied_version=4), metadata=md)
        await stub.ReportLoad(
            cp_pb2.LoadReport(node_id="n2", applied_version=2, apply_error="x"), metadata=md
        )
        stream = stub.WatchAssignments(cp_pb2.WatchAssignmentsRequest(from_version=0), metadata=md)
        await asyncio.wait_for(stream.read(), 5)
        async with httpx.AsyncClient(trust_env=False) as client:
            resp = await client.get(f"http://127.0.0.1:{port}/metrics", timeout=5)
        stream.cancel()
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/plain")
        got = _samples(resp.text)
        version = server.rebalancer.hub.latest.version  # type: ignore[union-attr]
        assert got[(PREFIX + "assignment_version", ())] == version
        weights = {
            dict(k[1])["shard"]: v for k, v in got.items() if k[0] == PREFIX + "shard_weight"
        }
        assert weights["s0"] == 5000
        assert sum(weights.values()) == 10_000
        assert got[(PREFIX + "shard_known", (("shard", "s0"),))] == 0
        assert got[(PREFIX + "shard_known", (("shard", "s1"),))] == 1
        assert (PREFIX + "shard_utilization", (("shard", "s0"),)) not in got  # unknown: absent
        assert got[(PREFIX + "shard_utilization", (("shard", "s2"),))] > 0
        assert got[(PREFIX + "shard_workers", (("shard", "s0"), ("state", "unknown")))] == 1
        assert got[(PREFIX + "rebalance_steps_total", ())] == 1
        assert got[(PREFIX + "rebalance_failures_total", ())] == 0
        assert got[(PREFIX + "publishes_total", (("reason", "shard"),))] == 3
        assert got[(PREFIX + "publishes_total", (("reason", "override"),))] == 1
        assert got[(PREFIX + "decision_duration_seconds_count", ())] == 1
        assert got[(PREFIX + "rebalance_step_duration_seconds_count", ())] == 1
        assert got[(PREFIX + "watch_streams", ())] == 1
        assert got[(PREFIX + "node_applied_version", (("node", "n1"),))] == 4
        assert got[(PREFIX + "node_version_lag", (("node", "n2"),))] == version - 2
        assert got[(PREFIX + "node_apply_error", (("node", "n2"),))] == 1
        assert got[(PREFIX + "node_apply_error", (("node", "n1"),))] == 0
        assert (PREFIX + "node_report_age_seconds", (("node", "n1"),)) in got
        assert got[(PREFIX + "worker_scrape_errors_total", ())] == 0

        # Every series in the docs' table is served, and every served series is documented.
        documented = set(
            re.findall(r"^\| `(adaptermesh_control_plane_[a-z_]+)` \|", DOC.read_text(), re.M)
        )
        families = {f.name for f in text_string_to_metric_families(resp.text)}
        # (prometheus_client adds a *_created family per histogram: its start time.)
        served = {n for n in families if n.startswith(PREFIX) and not n.endswith("_created")}
        assert documented == served
    finally:
        await channel.close()
        await server.stop(0)
    # Stopped: the port is free again.
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def test_publish_causes_are_a_small_fixed_set() -> None:
    assert publish_cause("override s0=7000, ttl 60s: canary") == "override"
    assert publish_cause("override on s0 cleared") == "override"
    assert (
        publish_cause("override expired: s0; rebalance: 100 parts moved (...)")
        == "override_expired"
    )
    assert publish_cause("pin 10.1.0.0/16 -> s0") == "pin"
    assert publish_cause("unpin 10.1.0.0/16") == "pin"
    assert publish_cause("shard s1 created") == "shard"
    assert publish_cause("shard set changed; endpoint set changed") == "shard_set"
    assert publish_cause("rebalance: 640 parts moved (a 1->2)") == "rebalance"
    assert publish_cause("endpoint weights moved by up to 30") == "endpoint_weights"
    assert publish_cause("anything an operator typed") == "other"


def test_metrics_port_flag() -> None:
    p = cli.build_parser()
    base = ["--state-dir", "/tmp/x", "--no-auth"]
    assert p.parse_args(base).metrics_port == 0
    assert p.parse_args([*base, "--metrics-port", "9090"]).metrics_port == 9090
    with pytest.raises(SystemExit):
        p.parse_args([*base, "--metrics-port", "70000"])
