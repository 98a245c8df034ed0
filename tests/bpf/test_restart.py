"""Kill the loader while traffic flows and start a new one: nothing lost or misrouted."""

from __future__ import annotations

import ipaddress
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from waiting import wait_until

from adaptermesh.bpf import maglev
from adaptermesh.bpf.table import addr16, validate_assignment
from adaptermesh_testkit.netns import NodeTopology

from .helpers import S, make_assignment
from .traffic import inject, raw_udp_frames, receivers, send_udp, settle

pytestmark = [pytest.mark.root, pytest.mark.slow]

HERE = Path(__file__).parent


class Loader:
    def __init__(self, topo: NodeTopology, pin_dir: Path, assignment_file: Path) -> None:
        env = dict(os.environ, PYTHONPATH=str(HERE.parent.parent / "src"))
        self.proc = subprocess.Popen(
            [
                sys.executable,
                str(HERE / "loader_proc.py"),
                topo.node_tenant_if,
                str(pin_dir),
                topo.node_ns,
                topo.vxlan_dev,
                str(assignment_file),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        self.lines: list[str] = []

    def wait_ready(self, timeout: float = 60) -> None:
        assert self.proc.stdout is not None
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            line = self.proc.stdout.readline()
            if not line:
                raise AssertionError(f"loader died: {self.proc.stderr.read()}")  # type: ignore[union-attr]
            self.lines.append(line.strip())
            if line.strip() == "ready":
                return
        raise AssertionError("loader not ready")

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)


@pytest.fixture
def loaders() -> Iterator[list[Loader]]:
    started: list[Loader] = []
    try:
        yield started
    finally:
        for ld in started:
            ld.kill()


def test_restart_while_traffic_flows_loses_and_misroutes_nothing(
    small_topo: NodeTopology, pin_dir: Path, tmp_path: Path, loaders: list[Loader]
) -> None:
    topo = small_topo
    s0, s1 = topo.shards
    a = make_assignment(
        [
            S("shard-0", 0, 5000, ("tunnel", s0.addr, s0.vni, s0.vxlan_mac)),
            S("shard-1", 1, 5000, ("mark", s1.mark)),
        ],
        pins={f"{topo.tenant_addrs[2]}/32": "shard-1"},
    )
    path = tmp_path / "assignment.pb"
    path.write_bytes(a.SerializeToString())
    plan = validate_assignment(a, vxlan_ifindex=1)
    table = maglev.build_table(plan.backends)

    def expected(src: str) -> int:
        if src == topo.tenant_addrs[2]:
            return 1
        return table[maglev.source_hash(addr16(ipaddress.IPv4Address(src))) % len(table)]

    rx = receivers(topo, 6001)
    first = Loader(topo, pin_dir, path)
    loaders.append(first)
    first.wait_ready()

    raw_sources = [str(ipaddress.IPv4Address("10.93.0.0") + k) for k in range(40)]
    frames = raw_udp_frames(topo, raw_sources, 6001)
    stop = threading.Event()
    sent: dict[str, int] = {}

    rounds = [0]  # what the sender has sent, for the waits below

    def traffic() -> None:
        seq = 0
        while not stop.is_set():
            for src in topo.tenant_addrs:
                send_udp(topo, src, 6001, [f"{src}:{seq}".encode()])
                sent[src] = sent.get(src, 0) + 1
            inject(topo, frames, pace_every=0)
            for src in raw_sources:
                sent[src] = sent.get(src, 0) + 1
            seq += 1
            rounds[0] = seq
            time.sleep(0.005)

    def more_traffic(what: str) -> None:
        start = rounds[0]
        wait_until(lambda: rounds[0] >= start + 50, 10, what=f"50 rounds of traffic {what}")

    sender = threading.Thread(target=traffic, daemon=True)
    sender.start()
    try:
        more_traffic("through the first loader")
        first.kill()  # the filter and the pinned maps outlive it
        more_traffic("with no loader running")
        second = Loader(topo, pin_dir, path)
        loaders.append(second)
        second.wait_ready()  # compiles, reuses the pins, replaces the filter in place
        more_traffic("through the second loader")
    finally:
        stop.set()
        sender.join(timeout=10)
    total = sum(sent.values())
    settle(rx, total, timeout=10)
    try:
        got: dict[str, list[int]] = {}
        for i, r in enumerate(rx):
            for src, _ in r.received:
                got.setdefault(src, []).append(i)
    finally:
        for r in rx:
            r.close()
    assert total > 1000
    misrouted = {s: v for s, v in got.items() if set(v) != {expected(s)}}
    assert misrouted == {}
    assert {s: len(v) for s, v in got.items()} == sent  # every packet, exactly once
    assert {expected(s) for s in got} == {0, 1}  # both tunnel and mark shards carried traffic
    resumed = next(line for line in second.lines if line.startswith("resumed"))
    assert f"version={a.version}" in resumed
    assert int(resumed.split("packets=")[1]) > 0  # counters survived the restart
