"""The agent runs the ext_proc server when asked: flags, start-up, its picker fed from the
applied Assignment, and the shard listeners built with the filter."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc

sys.path.insert(0, str(Path(__file__).parents[1]))

from agent.fakes import ControlPlaneServer, FakeControlPlane, FakeDatapath, FakeXds, make_assignment
from waiting import async_wait_until

from adaptermesh.agent.backends import mesh_xds
from adaptermesh.agent.cli import build_parser, config_from_args
from adaptermesh.agent.daemon import Agent, AgentConfig

TOKEN = "agent-secret"


def test_cli_flags_reach_the_config() -> None:
    args = build_parser().parse_args(
        [
            "--node-id",
            "n",
            "--control-plane",
            "cp:1",
            "--iface",
            "lo",
            "--ext-proc-port",
            "18001",
            "--base-model",
            "llama",
            "--ext-proc-max-body-bytes",
            "1024",
        ]
    )
    config = config_from_args(args)
    assert (config.ext_proc_port, config.base_model, config.ext_proc_max_body_bytes) == (
        18001,
        "llama",
        1024,
    )
    plain = config_from_args(
        build_parser().parse_args(["--node-id", "n", "--control-plane", "cp:1", "--iface", "lo"])
    )
    assert plain.ext_proc_port is None
    assert not plain.route_by_body
    native = config_from_args(
        build_parser().parse_args(
            ["--node-id", "n", "--control-plane", "cp:1", "--iface", "lo", "--route-by-body"]
        )
    )
    assert native.route_by_body


async def test_mesh_xds_adds_the_filter_only_when_ext_proc_is_on() -> None:
    on = await mesh_xds(
        AgentConfig(
            node_id="n",
            control_plane="x:1",
            xds_port=0,
            ext_proc_port=18001,
            ext_proc_max_body_bytes=2048,
        )
    )
    off = await mesh_xds(AgentConfig(node_id="n", control_plane="x:1", xds_port=0))
    native = await mesh_xds(
        AgentConfig(node_id="n", control_plane="x:1", xds_port=0, route_by_body=True)
    )
    try:
        assert on.cache.options.ext_proc is not None
        assert on.cache.options.ext_proc.max_body_bytes == 2048
        assert off.cache.options.ext_proc is None
        assert not off.cache.options.route_by_body
        assert native.cache.options.route_by_body
        assert native.cache.options.ext_proc is None
    finally:
        await on.close()
        await off.close()
        await native.close()


def _process(port: int, shard: str, body: bytes) -> list[ep.ProcessingResponse]:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = ep_grpc.ExternalProcessorStub(channel)
        requests = [
            ep.ProcessingRequest(
                request_headers=ep.HttpHeaders(headers=base_pb2.HeaderMap(), end_of_stream=False)
            ),
            ep.ProcessingRequest(request_body=ep.HttpBody(body=body, end_of_stream=True)),
        ]
        return list(
            stub.Process(iter(requests), metadata=[("x-adaptermesh-shard", shard)], timeout=5)
        )


async def test_agent_serves_ext_proc_from_its_applied_assignment(tmp_path: Path) -> None:
    cp = ControlPlaneServer(FakeControlPlane(token=TOKEN))
    await cp.start()
    cp.servicer.publish(make_assignment(1))
    dp, xds = FakeDatapath(), FakeXds()

    async def xds_factory(_config: AgentConfig, _registry: object) -> FakeXds:
        return xds

    config = AgentConfig(
        node_id="node-t",
        control_plane=cp.target,
        token=TOKEN,
        iface="lo",
        metrics_host="127.0.0.1",
        metrics_port=0,
        state_file=tmp_path / "a.pb",
        ext_proc_port=0,
        base_model="base",
        picker_scrape_interval_s=0.05,
    )
    agent = Agent(config, lambda _c: dp, xds_factory)
    stop = asyncio.Event()
    task = asyncio.create_task(agent.run(stop))
    try:
        await async_wait_until(
            lambda: agent.ext_proc is not None and agent.ext_proc.port != 0 and dp.applied,
            10,
            what="the agent serving ext_proc",
        )
        assert agent.ext_proc is not None
        port = agent.ext_proc.port

        # Shard "a" has one worker, 127.0.0.1:9000, in make_assignment.
        async def picked() -> dict[str, str] | None:
            replies = await asyncio.to_thread(_process, port, "a", b'{"model": "sql"}')
            headers = {
                h.header.key: h.header.raw_value.decode()
                for h in replies[1].request_body.response.header_mutation.set_headers
            }
            return headers if "x-gateway-destination-endpoint" in headers else None

        headers = await async_wait_until(picked, 5, interval=0.05, what="an endpoint picked")
        assert headers == {
            "x-adapter-id": "sql",
            "x-gateway-destination-endpoint": "127.0.0.1:9000",
        }
        replies = await asyncio.to_thread(_process, port, "a", b'{"model": "base"}')
        mutation = replies[1].request_body.response.header_mutation
        assert list(mutation.remove_headers) == ["x-adapter-id"]
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)
        await cp.stop()
    assert agent.ext_proc is None
