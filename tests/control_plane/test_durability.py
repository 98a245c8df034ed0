"""Acknowledged writes survive ``kill -9``: the server runs as a subprocess and is killed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from waiting import wait_until

from adaptermesh.proto import control_plane_pb2 as cp_pb2
from adaptermesh.proto import control_plane_pb2_grpc

from .conftest import RW_TOKEN, creds, shard, write_tokens

pytestmark = pytest.mark.slow


class Proc:
    def __init__(self, state: Path, tokens: Path) -> None:
        self.p = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "adaptermesh.control_plane.cli",
                "--state-dir",
                str(state),
                "--listen",
                "127.0.0.1:0",
                "--tokens-file",
                str(tokens),
                "--interval",
                "0.2",
                "--log-level",
                "WARNING",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert self.p.stdout is not None
        line = self.p.stdout.readline()
        if not line.startswith("listening on"):
            self.p.kill()
            raise AssertionError(
                f"server did not start: {line!r} {self.p.stderr.read() if self.p.stderr else ''}"
            )
        self.addr = line.split()[-1]
        self.channel = grpc.insecure_channel(self.addr)
        self.stub = control_plane_pb2_grpc.ControlPlaneStub(self.channel)

    def kill9(self) -> None:
        os.kill(self.p.pid, signal.SIGKILL)
        self.p.wait(10)
        self.channel.close()

    def stop(self) -> None:
        if self.p.poll() is None:
            self.p.terminate()
            try:
                self.p.wait(10)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait(5)
        self.channel.close()
        for f in (self.p.stdout, self.p.stderr):
            if f is not None:
                f.close()


@pytest.fixture
def procs() -> Iterator[list[Proc]]:
    started: list[Proc] = []
    yield started
    for p in started:
        p.stop()


def test_acknowledged_writes_survive_kill_9(tmp_path: Path, procs: list[Proc]) -> None:
    state, tokens = tmp_path / "state", write_tokens(tmp_path / "tokens")
    md = creds(RW_TOKEN)
    first = Proc(state, tokens)
    procs.append(first)
    for i in range(3):
        first.stub.UpsertShard(
            cp_pb2.UpsertShardRequest(shard=shard(f"s{i}", (f"10.0.{i}.1", 8000))), metadata=md
        )
    first.stub.SetOverride(
        cp_pb2.SetOverrideRequest(shard_id="s1", weight=6000, ttl_seconds=3600, reason="hold"),
        metadata=md,
    )
    inst = cp_pb2.AdapterInstance(
        name="a1",
        model_ref=cp_pb2.ModelRef(base_model="m"),
        routes=[cp_pb2.AdapterRoute(shard_id="s0")],
    )
    first.stub.UpsertAdapterInstance(
        cp_pb2.UpsertAdapterInstanceRequest(instance=inst), metadata=md
    )

    # Pins written as fast as possible while the process is killed: every acknowledged one
    # must be there after the restart.
    acked: list[str] = []
    stop = threading.Event()

    def writer() -> None:
        n = 0
        while not stop.is_set():
            cidr = f"10.{100 + n // 256}.{n % 256}.0/24"
            try:
                first.stub.PinTenant(
                    cp_pb2.PinTenantRequest(cidr=cidr, shard_id=f"s{n % 3}"), metadata=md, timeout=2
                )
            except grpc.RpcError:
                return
            acked.append(cidr)
            n += 1

    t = threading.Thread(target=writer)
    t.start()
    wait_until(lambda: len(acked) >= 20 or not t.is_alive(), 10, what="acknowledged writes")
    last_version_seen = first.stub.GetAssignment(cp_pb2.GetAssignmentRequest(), metadata=md).version
    first.kill9()
    stop.set()
    t.join(10)
    assert len(acked) > 5, "the writer made too little progress to prove anything"

    second = Proc(state, tokens)
    procs.append(second)
    pins = {p.cidr for p in second.stub.ListPins(cp_pb2.ListPinsRequest(), metadata=md).pins}
    missing = [c for c in acked if c not in pins]
    assert not missing, f"{len(missing)} acknowledged pins lost, e.g. {missing[:3]}"
    shards = second.stub.ListShards(cp_pb2.ListShardsRequest(), metadata=md).shards
    assert {(s.id, s.index) for s in shards} == {("s0", 0), ("s1", 1), ("s2", 2)}
    overrides = second.stub.ListOverrides(cp_pb2.ListOverridesRequest(), metadata=md).overrides
    assert [(o.shard_id, o.weight, o.reason) for o in overrides] == [("s1", 6000, "hold")]
    assert [
        i.name
        for i in second.stub.ListAdapterInstances(
            cp_pb2.ListAdapterInstancesRequest(), metadata=md
        ).instances
    ] == ["a1"]
    current = second.stub.GetAssignment(cp_pb2.GetAssignmentRequest(), metadata=md)
    assert current.version >= last_version_seen
    assert {p.cidr for p in current.pins} >= set(acked)
    # Versions keep increasing across the restart, and history survived.
    second.stub.UnpinTenant(cp_pb2.UnpinTenantRequest(cidr=acked[0]), metadata=md)
    after = second.stub.GetAssignment(cp_pb2.GetAssignmentRequest(), metadata=md)
    assert after.version > current.version
    hist = second.stub.ListHistory(cp_pb2.ListHistoryRequest(limit=1000), metadata=md).records
    versions = [r.version for r in hist]
    assert versions == sorted(versions, reverse=True)
    assert len(set(versions)) == len(versions)
    assert any("override s1=6000" in r.reason for r in hist)
