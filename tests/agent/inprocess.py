"""The real control plane in process with the real agent in front of a FakeShardTable and
the real xDS builder, for the end-to-end tests of what one writes and the other applies."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import grpc

from adaptermesh.agent.backends import MeshXds, TableDatapath
from adaptermesh.agent.daemon import Agent, AgentConfig
from adaptermesh.bpf.table import FakeShardTable
from adaptermesh.clock import FakeClock
from adaptermesh.control_plane.auth import load_tokens
from adaptermesh.control_plane.server import ControlPlaneServer, ServerConfig
from adaptermesh.mesh.cache import SnapshotCache
from adaptermesh.proto import assignment_pb2, control_plane_pb2_grpc

TOKEN = "rw-token-inprocess-0123456789abcdef"
MD = [("authorization", f"Bearer {TOKEN}")]


class Mesh:
    def __init__(
        self,
        cp: ControlPlaneServer,
        stub: control_plane_pb2_grpc.ControlPlaneStub,
        agent: Agent,
        table: FakeShardTable,
    ) -> None:
        self.cp, self.stub, self.agent, self.table = cp, stub, agent, table
        self.md = MD

    @property
    def applied(self) -> int:
        """The version the agent's datapath holds (0: none yet)."""
        return self.table.applied_version or 0

    def latest(self) -> assignment_pb2.Assignment:
        a = self.cp.rebalancer.hub.latest
        assert a is not None
        return a

    def latest_version(self) -> int:
        a = self.cp.rebalancer.hub.latest
        return a.version if a is not None else 0


@contextlib.asynccontextmanager
async def inprocess_mesh(tmp_path: Path, node_id: str, **agent: object) -> AsyncIterator[Mesh]:
    """Control plane (no rebalancing: versions move on writes only) and agent, both running;
    ``agent`` adds AgentConfig fields (the ext_proc server, say)."""
    tokens = tmp_path / "tokens"
    # One token for the test's writes and the agent; it reports for this node only.
    tokens.write_text(f"{TOKEN} read,write,rollout,report {node_id} nodes={node_id}\n")
    cp = ControlPlaneServer(
        ServerConfig(
            state_dir=tmp_path / "state",
            listen="127.0.0.1:0",
            tokens=load_tokens(tokens),
            rebalance=False,
            synchronous="NORMAL",
        ),
        clock=FakeClock(),
    )
    port = await cp.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    table = FakeShardTable(maglev_size=251)
    config = AgentConfig(
        node_id=node_id,
        control_plane=f"127.0.0.1:{port}",
        token=TOKEN,
        iface="lo",
        metrics_host="127.0.0.1",
        metrics_port=0,
        state_file=tmp_path / "assignment.pb",
        report_interval_s=0.1,
        backoff_initial_s=0.05,
        backoff_max_s=0.2,
        **agent,  # type: ignore[arg-type]
    )

    async def xds_factory(_config: AgentConfig, _registry: object) -> MeshXds:
        return MeshXds(SnapshotCache(), None, "shard")

    runner = Agent(config, lambda _c: TableDatapath(table), xds_factory)
    stop = asyncio.Event()
    task = asyncio.create_task(runner.run(stop))
    await asyncio.wait_for(runner.started.wait(), 5)
    try:
        yield Mesh(cp, control_plane_pb2_grpc.ControlPlaneStub(channel), runner, table)
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)
        await channel.close()
        await cp.stop(0)


def shard(i: int) -> assignment_pb2.Shard:
    s = assignment_pb2.Shard(id=f"s{i}", service_address="10.200.0.1", service_port=9000 + i)
    s.endpoints.add(address=f"10.0.{i}.1", port=8000)
    s.steer.mark.mark = 0x100 + i
    return s
