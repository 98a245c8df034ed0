"""Real UDP and TCP traffic through the classifier in network namespaces."""

from __future__ import annotations

import ipaddress
import itertools
from collections import Counter
from collections.abc import Iterator

import pytest

from adaptermesh.bpf import maglev
from adaptermesh.bpf.loader import BpfShardTable
from adaptermesh.bpf.table import addr16
from adaptermesh_testkit.netns import NodeTopology, UdpReceiver

from .helpers import S, make_assignment
from .traffic import HttpServer, http_get, inject, raw_udp_frames, receivers, send_udp, settle

pytestmark = pytest.mark.root

_ports = itertools.count(5101)


def mark_shards(topo: NodeTopology, weights: tuple[int, ...]) -> list[S]:
    return [
        S(f"shard-{s.index}", s.index, w, ("mark", s.mark))
        for s, w in zip(topo.shards, weights, strict=True)
    ]


def tunnel_shards(topo: NodeTopology, weights: tuple[int, ...]) -> list[S]:
    return [
        S(f"shard-{s.index}", s.index, w, ("tunnel", s.addr, s.vni, s.vxlan_mac))
        for s, w in zip(topo.shards, weights, strict=True)
    ]


@pytest.fixture
def rx(topo: NodeTopology) -> Iterator[list[UdpReceiver]]:
    rs = receivers(topo, next(_ports))
    try:
        yield rs
    finally:
        for r in rs:
            r.close()


@pytest.fixture(scope="module")
def http(topo: NodeTopology) -> Iterator[int]:
    servers = [HttpServer(s.ns, topo.vip, 8080, f"shard-{s.index}") for s in topo.shards]
    try:
        yield 8080
    finally:
        for srv in servers:
            srv.close()


def where(rx: list[UdpReceiver]) -> dict[str, list[int]]:
    """source address -> shards that received its datagrams."""
    out: dict[str, list[int]] = {}
    for i, r in enumerate(rx):
        for src, _ in r.received:
            out.setdefault(src, []).append(i)
    return out


def test_pins_and_mark_steering_with_udp_and_tcp(
    fresh: BpfShardTable, topo: NodeTopology, rx: list[UdpReceiver], http: int
) -> None:
    t1, t2, t3 = topo.tenant_addrs
    fresh.apply(
        make_assignment(
            mark_shards(topo, (5000, 3000, 2000)),
            pins={"10.77.0.0/24": "shard-1", f"{t3}/32": "shard-2"},
        )
    )
    port = rx[0].sock.getsockname()[1]
    for src in (t1, t2, t3):
        send_udp(topo, src, port, [b"a", b"b", b"c"])
    settle(rx, 9)
    assert where(rx) == {t1: [1, 1, 1], t2: [1, 1, 1], t3: [2, 2, 2]}
    assert http_get(topo, t1, http) == (200, "shard-1")
    assert http_get(topo, t3, http) == (200, "shard-2")


def test_unpinned_sources_spread_by_weight(
    fresh: BpfShardTable, topo: NodeTopology, rx: list[UdpReceiver]
) -> None:
    weights = (5000, 3000, 2000)
    fresh.apply(make_assignment(mark_shards(topo, weights)))
    n = 2000
    sources = [str(ipaddress.IPv4Address("10.90.0.0") + k) for k in range(n)]
    inject(topo, raw_udp_frames(topo, sources, rx[0].sock.getsockname()[1]))
    settle(rx, n)
    got = where(rx)
    assert len(got) == n
    assert all(len(v) == 1 for v in got.values())
    counts = Counter(v[0] for v in got.values())
    for i, w in enumerate(weights):
        # Stated tolerance: 4 percentage points (about 3.5 standard deviations at n = 2000).
        assert abs(counts[i] / n - w / 10_000) <= 0.04, counts
    stats = fresh.read_stats()
    assert sum(stats[i].new_flows for i in range(3)) >= n


def test_weight_change_moves_only_new_flows(
    fresh: BpfShardTable, topo: NodeTopology, rx: list[UdpReceiver]
) -> None:
    port = rx[0].sock.getsockname()[1]
    fresh.apply(make_assignment(mark_shards(topo, (5000, 3000, 2000))))
    old = [str(ipaddress.IPv4Address("10.91.0.0") + k) for k in range(600)]
    inject(topo, raw_udp_frames(topo, old, port))
    settle(rx, len(old))
    first = {src: v[0] for src, v in where(rx).items()}
    assert len(first) == len(old)

    fresh.apply(make_assignment(mark_shards(topo, (1000, 2000, 7000))))
    live = fresh.active_table()
    would_move = [
        s
        for s in old
        if live[maglev.source_hash(addr16(ipaddress.IPv4Address(s))) % fresh.maglev_size]
        != first[s]
    ]
    assert len(would_move) > 100  # the table really changed under these flows

    for r in rx:
        r.received.clear()
    new = [str(ipaddress.IPv4Address("10.92.0.0") + k) for k in range(600)]
    inject(topo, raw_udp_frames(topo, old + new, port))
    settle(rx, len(old) + len(new))
    after = where(rx)
    assert all(after[s] == [first[s]] for s in old)  # existing flows stayed
    new_counts = Counter(after[s][0] for s in new)
    assert new_counts[2] / len(new) > 0.55  # new flows follow the new weights (70%)


def test_tunnel_mode_end_to_end_http_and_udp(
    fresh: BpfShardTable, topo: NodeTopology, rx: list[UdpReceiver], http: int
) -> None:
    t1, t2, t3 = topo.tenant_addrs
    fresh.apply(
        make_assignment(
            tunnel_shards(topo, (4000, 3000, 3000)),
            pins={f"{t1}/32": "shard-0", f"{t2}/32": "shard-2"},
        )
    )
    assert http_get(topo, t1, http) == (200, "shard-0")
    assert http_get(topo, t2, http) == (200, "shard-2")
    port = rx[0].sock.getsockname()[1]
    send_udp(topo, t3, port, [b"x"] * 5)
    settle(rx, 5)
    live = fresh.active_table()
    want = live[maglev.source_hash(addr16(ipaddress.IPv4Address(t3))) % fresh.maglev_size]
    assert where(rx) == {t3: [want] * 5}
    assert fresh.read_counters().steer_failed == 0


def test_redirect_mode_delivers_to_the_shard(
    fresh: BpfShardTable, topo: NodeTopology, rx: list[UdpReceiver]
) -> None:
    shards = [
        S(f"shard-{s.index}", s.index, w, ("redirect", s.node_if, s.mac))
        for s, w in zip(topo.shards, (3400, 3300, 3300), strict=True)
    ]
    t1 = topo.tenant_addrs[0]
    fresh.apply(make_assignment(shards, pins={f"{t1}/32": "shard-1"}))
    send_udp(topo, t1, rx[0].sock.getsockname()[1], [b"r"] * 3)
    settle(rx, 3)
    assert where(rx) == {t1: [1, 1, 1]}
