"""Frames of 4 KB and more are steered exactly like small packets, in real traffic.

GSO/GRO super-frames and jumbo frames may reach the classifier with little more than the
Ethernet header in the skb's linear part (the rest in page fragments): that is what a NIC
driver that builds fragment-only skbs, a tap device or a packet socket with a virtio-net
header (``hdr_len`` short) hands the stack. Such a frame is reproduced here by sending through
a PACKET_VNET_HDR socket: for a frame of a page or more it allocates a linear part of only the
Ethernet header. GRO would pull the headers back into the linear part, so it stays off on the
classifier's interface except in the TSO/GRO transfer.

Topology: bpf.netns.NodeTopology with two shards and 9000-byte MTUs on every veth.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import ipaddress
import os
import secrets
import select
import shutil
import socket
import struct
import subprocess
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from scapy.layers.inet import IP, UDP
from scapy.layers.inet6 import IPv6
from scapy.layers.l2 import Ether

from adaptermesh.bpf import maglev
from adaptermesh.bpf.loader import BpfShardTable
from adaptermesh.bpf.table import ShardStats, addr16
from adaptermesh_testkit.netns import NodeTopology, UdpReceiver, inside, ip, socket_in, sysctl

from .helpers import S, make_assignment
from .traffic import inject, receivers, settle

pytestmark = pytest.mark.root

MTU = 9000
SOL_PACKET, PACKET_VNET_HDR = 263, 15
VNET_HDR = bytes(10)  # struct virtio_net_hdr: no GSO, no checksum offload, hdr_len 0
TUNSETIFF, IFF_TAP, IFF_NO_PI = 0x400454CA, 0x0002, 0x1000
TRANSFER = 8 << 20


@dataclass
class Jumbo:
    topo: NodeTopology
    table: BpfShardTable
    tenant_mac: str = ""
    ports: Iterator[int] = field(default_factory=lambda: iter(range(5301, 5400)))


def _ethtool(ns: str, *args: str) -> str:
    return subprocess.run(
        ["ip", "netns", "exec", ns, "ethtool", *args], capture_output=True, text=True, check=True
    ).stdout


def _mac(ns: str, dev: str) -> str:
    out = ip("-o", "link", "show", dev, ns=ns).split()
    return out[out.index("link/ether") + 1]


@pytest.fixture(scope="module")
def jumbo() -> Iterator[Jumbo]:
    if os.geteuid() != 0:
        pytest.skip("needs root")
    topo = NodeTopology(prefix=f"amj{secrets.token_hex(2)}", n_shards=2)
    pin_dir = Path(f"/sys/fs/bpf/amb-test-{secrets.token_hex(4)}")
    table: BpfShardTable | None = None
    try:
        topo.create()
        ip("link", "set", topo.tenant_if, "mtu", str(MTU), ns=topo.tenant_ns)
        ip("link", "set", topo.node_tenant_if, "mtu", str(MTU), ns=topo.node_ns)
        for s in topo.shards:
            ip("link", "set", s.node_if, "mtu", str(MTU), ns=topo.node_ns)
            ip("link", "set", f"{topo.prefix}e{s.index}", "mtu", str(MTU), ns=s.ns)
        _ethtool(topo.node_ns, "-K", topo.node_tenant_if, "gro", "off")
        # Replies reach the tenant on its veth while the tap transfer leaves through the tap.
        for key in ("all", "default", topo.tenant_if):
            sysctl(topo.tenant_ns, f"net.ipv4.conf.{key}.rp_filter", "0")
        table = BpfShardTable(
            topo.node_tenant_if, pin_dir=str(pin_dir), vxlan_dev=topo.vxlan_dev, netns=topo.node_ns
        )
        table.attach()
        yield Jumbo(topo, table, _mac(topo.tenant_ns, topo.tenant_if))
    finally:
        if table is not None:
            table.close(detach=True, unpin=True)
        shutil.rmtree(pin_dir, ignore_errors=True)
        topo.destroy()


def _mark_shards(topo: NodeTopology) -> list[S]:
    return [S(f"shard-{s.index}", s.index, 5000, ("mark", s.mark)) for s in topo.shards]


def _want(table: BpfShardTable, src: str) -> int:
    slot = maglev.source_hash(addr16(ipaddress.ip_address(src))) % table.maglev_size
    return table.active_table()[slot]


def _delta(before: dict[int, ShardStats], after: dict[int, ShardStats]) -> dict[int, ShardStats]:
    out = {}
    for k, a in after.items():
        b = before.get(k, ShardStats())
        d = ShardStats(
            a.packets - b.packets,
            a.bytes - b.bytes,
            a.new_flows - b.new_flows,
            a.events_dropped - b.events_dropped,
        )
        if d != ShardStats():
            out[k] = d
    return out


class ShortLinearSender:
    """Frames onto the tenant's veth whose skb holds only the Ethernet header linearly once
    the frame is a page or more (af_packet's allocation for a virtio-net header)."""

    def __init__(self, j: Jumbo) -> None:
        self.j = j
        self.sock = socket_in(j.topo.tenant_ns, socket.AF_PACKET, socket.SOCK_RAW)
        self.sock.setsockopt(SOL_PACKET, PACKET_VNET_HDR, 1)
        self.sock.bind((j.topo.tenant_if, 0))

    def send(self, frame: bytes) -> None:
        dst = bytes.fromhex(self.j.topo.node_tenant_mac.replace(":", ""))
        src = bytes.fromhex(self.j.tenant_mac.replace(":", ""))
        self.sock.send(VNET_HDR + dst + src + frame[12:])

    def close(self) -> None:
        self.sock.close()


@contextlib.contextmanager
def _receivers(j: Jumbo, port: int) -> Iterator[list[UdpReceiver]]:
    rx = receivers(j.topo, port)
    try:
        yield rx
    finally:
        for r in rx:
            r.close()


def test_jumbo_udp_with_a_short_linear_part_is_steered_like_small(jumbo: Jumbo) -> None:
    topo, table = jumbo.topo, jumbo.table
    table.apply(make_assignment(_mark_shards(topo)))
    table.clear_flows()
    port = next(jumbo.ports)
    sources = [f"10.93.0.{k}" for k in range(1, 41)]
    want = {s: _want(table, s) for s in sources}
    assert set(want.values()) == {0, 1}
    sender = ShortLinearSender(jumbo)
    before_c, before_s = table.read_counters(), table.read_stats()
    with _receivers(jumbo, port) as rx:
        big = [
            bytes(
                Ether()
                / IP(src=s, dst=topo.vip, ttl=16)
                / UDP(sport=40000, dport=port)
                / (b"J" * 8000)
            )
            for s in sources
        ]
        try:
            for f in big:
                sender.send(f)
        finally:
            sender.close()
        settle(rx, len(sources))
        got = {src: i for i, r in enumerate(rx) for src, _ in r.received}
        assert got == want
        assert all(len(data) == 2048 for r in rx for _, data in r.received)  # truncated reads
        # The same sources as small packets: same shards, and sticky now.
        for r in rx:
            r.received.clear()
        inject(
            topo,
            [
                bytes(
                    Ether(dst=topo.node_tenant_mac)
                    / IP(src=s, dst=topo.vip, ttl=16)
                    / UDP(sport=40000, dport=port)
                    / b"s"
                )
                for s in sources
            ],
        )
        settle(rx, len(sources))
        assert {src: i for i, r in enumerate(rx) for src, _ in r.received} == want
    c = table.read_counters()
    assert (c.malformed, c.non_ip) == (before_c.malformed, before_c.non_ip)
    d = _delta(before_s, table.read_stats())
    for i in (0, 1):
        n = sum(1 for s in sources if want[s] == i)
        assert d[i].packets == 2 * n
        assert d[i].new_flows == n
        assert d[i].bytes == n * (len(big[0]) + 14 + 28 + 1)


def test_jumbo_ipv6_with_a_short_linear_part_is_classified(jumbo: Jumbo) -> None:
    # The node namespace has IPv6 off, so only the decision is checked (stats and events).
    topo, table = jumbo.topo, jumbo.table
    table.apply(make_assignment(_mark_shards(topo), pins={"fd00:77::/64": "shard-1"}))
    table.clear_flows()
    table.poll_events(lambda _e: None, 0)
    sources = ["fd00:77::5", *(f"fd00:93::{k:x}" for k in range(1, 21))]
    want = {s: 1 if s.startswith("fd00:77:") else _want(table, s) for s in sources}
    before_c, before_s = table.read_counters(), table.read_stats()
    sender = ShortLinearSender(jumbo)
    try:
        for s in sources:
            sender.send(
                bytes(Ether() / IPv6(src=s, dst="fd00:9::1") / UDP(dport=9) / (b"6" * 8000))
            )
    finally:
        sender.close()
    events: list[tuple[str, int]] = []
    for _ in range(50):
        table.poll_events(lambda e: events.append((str(e.source), e.shard)), 20)
        if len(events) >= len(sources):
            break
    assert dict(events) == want
    assert table.read_counters().malformed == before_c.malformed
    d = _delta(before_s, table.read_stats())
    assert {i: v.packets for i, v in d.items()} == {
        i: sum(1 for s in sources if want[s] == i) for i in set(want.values())
    }


class TcpSink:
    """One TCP listener per shard on VIP:port; each connection's byte count and digest are
    sent back, and the shard that took it is recorded."""

    def __init__(self, topo: NodeTopology, port: int) -> None:
        self.got: list[tuple[int, str, int]] = []  # (shard, peer, bytes)
        self.socks = []
        self.threads = []
        for s in topo.shards:
            ls = socket_in(s.ns, socket.AF_INET, socket.SOCK_STREAM)
            ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            ls.bind((topo.vip, port))
            ls.listen(4)
            ls.settimeout(0.2)
            self.socks.append(ls)
        self._stop = threading.Event()
        for i, ls in enumerate(self.socks):
            t = threading.Thread(target=self._serve, args=(i, ls), daemon=True)
            t.start()
            self.threads.append(t)

    def _serve(self, index: int, ls: socket.socket) -> None:
        while not self._stop.is_set():
            try:
                conn, (peer, _) = ls.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with conn:
                conn.settimeout(20)
                h, n = hashlib.sha256(), 0
                try:
                    while chunk := conn.recv(1 << 16):
                        h.update(chunk)
                        n += len(chunk)
                    conn.sendall(f"{n} {h.hexdigest()}".encode())
                except OSError:  # a stalled transfer: the client's assertion reports it
                    pass
                self.got.append((index, peer, n))

    def close(self) -> None:
        self._stop.set()
        for t in self.threads:
            t.join(timeout=2)
        for ls in self.socks:
            ls.close()


def _transfer(topo: NodeTopology, src: str, port: int, payload: bytes) -> str:
    s = socket_in(topo.tenant_ns, socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.settimeout(20)
        s.bind((src, 0))
        s.connect((topo.vip, port))
        s.sendall(payload)
        s.shutdown(socket.SHUT_WR)
        reply = b""
        while chunk := s.recv(4096):
            reply += chunk
    finally:
        s.close()
    return reply.decode()


def _check_transfer(jumbo: Jumbo, src: str, want: int, min_frame: int) -> None:
    topo, table = jumbo.topo, jumbo.table
    port = next(jumbo.ports)
    payload = secrets.token_bytes(TRANSFER)
    sink = TcpSink(topo, port)
    before_c, before_s = table.read_counters(), table.read_stats()
    try:
        reply = _transfer(topo, src, port, payload)
    finally:
        sink.close()
    assert reply == f"{TRANSFER} {hashlib.sha256(payload).hexdigest()}"  # every byte arrived
    assert sink.got == [(want, src, TRANSFER)]
    d = _delta(before_s, table.read_stats())
    assert set(d) == {want}  # nothing of this flow went anywhere else
    assert d[want].bytes > TRANSFER
    assert d[want].bytes / d[want].packets > min_frame  # large frames really went through
    c = table.read_counters()
    assert (c.malformed, c.no_shard) == (before_c.malformed, before_c.no_shard)


def test_tcp_transfer_with_tso_and_gro_is_steered_like_small(jumbo: Jumbo) -> None:
    topo, table = jumbo.topo, jumbo.table
    _ethtool(topo.tenant_ns, "-K", topo.tenant_if, "tso", "on", "gso", "on")
    _ethtool(topo.node_ns, "-K", topo.node_tenant_if, "gro", "on")
    try:
        assert "generic-receive-offload: on" in _ethtool(topo.node_ns, "-k", topo.node_tenant_if)
        t1, t2, _ = topo.tenant_addrs
        table.apply(make_assignment(_mark_shards(topo), pins={f"{t2}/32": "shard-1"}))
        table.clear_flows()
        _check_transfer(jumbo, t1, _want(table, t1), 4096)  # Maglev
        _check_transfer(jumbo, t2, 1, 4096)  # pinned
    finally:
        _ethtool(topo.node_ns, "-K", topo.node_tenant_if, "gro", "off")


@contextlib.contextmanager
def _tap_relay(jumbo: Jumbo, src: str) -> Iterator[None]:
    """Route the tenant's traffic to the VIP through a tap device whose frames a relay thread
    writes to the tenant's veth through a ShortLinearSender (jumbo frames, headers in the
    fragments). Replies come back on the veth as usual."""
    topo = jumbo.topo
    name = f"{topo.prefix}tp"
    with inside(topo.tenant_ns):
        fd = os.open("/dev/net/tun", os.O_RDWR)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TAP | IFF_NO_PI))
    ip("link", "set", name, "mtu", str(MTU), "up", ns=topo.tenant_ns)
    sysctl(topo.tenant_ns, f"net.ipv4.conf.{name}.rp_filter", "0")
    ip(
        "neigh",
        "add",
        topo.vip,
        "lladdr",
        topo.node_tenant_mac,
        "dev",
        name,
        "nud",
        "permanent",
        ns=topo.tenant_ns,
    )
    ip("route", "add", f"{topo.vip}/32", "dev", name, "src", src, ns=topo.tenant_ns)
    sender = ShortLinearSender(jumbo)
    stop = threading.Event()

    def relay() -> None:
        while not stop.is_set():
            r, _, _ = select.select([fd], [], [], 0.1)
            if not r:
                continue
            frame = os.read(fd, 65536)
            if frame[12:14] == b"\x08\x00":
                sender.send(frame)

    t = threading.Thread(target=relay, daemon=True)
    t.start()
    try:
        yield
    finally:
        stop.set()
        t.join(timeout=2)
        sender.close()
        ip("route", "del", f"{topo.vip}/32", "dev", name, ns=topo.tenant_ns, check=False)
        os.close(fd)


def test_tcp_transfer_of_jumbo_frames_with_headers_in_fragments(jumbo: Jumbo) -> None:
    topo, table = jumbo.topo, jumbo.table
    t3 = topo.tenant_addrs[2]
    table.apply(make_assignment(_mark_shards(topo)))
    table.clear_flows()
    with _tap_relay(jumbo, t3):
        _check_transfer(jumbo, t3, _want(table, t3), 4096)
