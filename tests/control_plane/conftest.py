"""Fixtures: an in-process control plane on an ephemeral 127.0.0.1 port, with tokens."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import grpc
import pytest

from adaptermesh.clock import FakeClock
from adaptermesh.control_plane.auth import load_tokens
from adaptermesh.control_plane.metrics_source import Target
from adaptermesh.control_plane.policy import WorkerObservation
from adaptermesh.control_plane.server import ControlPlaneServer, ServerConfig
from adaptermesh.proto import assignment_pb2, control_plane_pb2, control_plane_pb2_grpc

RW_TOKEN = "rw-token-0123456789abcdef"
RO_TOKEN = "ro-token-0123456789abcdef"
WO_TOKEN = "wo-token-0123456789abcdef"
# The operator token holds every scope and may report for any node, so the hostile-input
# suites reach every handler with one token (tests/control_plane/test_access.py holds the
# scopes to the callers that need them).
TOKENS_TEXT = f"""# test tokens
{RW_TOKEN} read,write,rollout,report operator nodes=*
{RO_TOKEN} read viewer
{WO_TOKEN} write,rollout,report writer-only nodes=*
"""


class StaticSource:
    """A load source that returns whatever the test put in ``workers`` (unknown otherwise)."""

    def __init__(self) -> None:
        self.workers: dict[str, WorkerObservation] = {}
        self.calls = 0

    async def collect(self, targets: Sequence[Target], now: float) -> dict[str, WorkerObservation]:
        self.calls += 1
        return {
            t.key: self.workers.get(t.key, WorkerObservation(t.address, t.port, known=False))
            for t in targets
        }


def write_tokens(path: Path) -> Path:
    path.write_text(TOKENS_TEXT)
    return path


def creds(token: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {token}")]


def shard(sid: str, *endpoints: tuple[str, int], state: int = 0) -> assignment_pb2.Shard:
    s = assignment_pb2.Shard(id=sid, state=state or assignment_pb2.SHARD_STATE_ACTIVE)
    for addr, port in endpoints:
        s.endpoints.add(address=addr, port=port)
    s.steer.tunnel.remote_ipv4 = "192.0.2.10"
    s.steer.tunnel.vni = 100
    return s


class Harness:
    def __init__(
        self,
        server: ControlPlaneServer,
        channel: grpc.aio.Channel,
        source: StaticSource,
        clock: FakeClock,
    ) -> None:
        self.server = server
        self.channel = channel
        self.stub = control_plane_pb2_grpc.ControlPlaneStub(channel)
        self.source = source
        self.clock = clock
        self.md = creds(RW_TOKEN)


@pytest.fixture
async def cp(tmp_path: Path) -> AsyncIterator[Harness]:
    source = StaticSource()
    clock = FakeClock()
    config = ServerConfig(
        state_dir=tmp_path / "state",
        listen="127.0.0.1:0",
        tokens=load_tokens(write_tokens(tmp_path / "tokens")),
        rebalance=False,
        synchronous="NORMAL",
    )
    server = ControlPlaneServer(config, source=source, clock=clock)
    port = await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield Harness(server, channel, source, clock)
    finally:
        await channel.close()
        await server.stop(0)


def instance(name: str, path: str = "", **placement: object) -> control_plane_pb2.AdapterInstance:
    """An AdapterInstance with these ``placement`` fields (lists extend repeated ones)."""
    inst = control_plane_pb2.AdapterInstance(name=name)
    inst.model_ref.adapter_path = path
    for k, v in placement.items():
        if isinstance(v, list):
            getattr(inst.placement, k).extend(v)
        else:
            setattr(inst.placement, k, v)
    return inst
