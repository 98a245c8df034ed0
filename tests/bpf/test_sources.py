"""Sources that no client has pass untouched and are counted, through BPF_PROG_TEST_RUN.

IPv4 is keyed IPv4-mapped (``::ffff:a.b.c.d``), so without these checks such sources would
hash into the Maglev table, match pins and become sticky flows like real tenants.
"""

from __future__ import annotations

import dataclasses

import pytest
from scapy.layers.inet import IP, UDP
from scapy.layers.inet6 import IPv6
from scapy.layers.l2 import Ether

from adaptermesh.bpf import libbpf
from adaptermesh.bpf.loader import BpfShardTable

from .helpers import S, make_assignment
from .test_prog_run import (
    MARKS,
    TC_ACT_OK,
    counters_delta,
    events,
    expected_maglev,
    shard_of,
)

pytestmark = pytest.mark.root


def _shards() -> list[S]:
    return [S(f"shard-{i}", i, w, ("mark", MARKS[i])) for i, w in enumerate((5000, 3000, 2000))]


def _v4(src: str) -> bytes:
    return bytes(
        Ether(dst="02:00:00:00:00:01", src="02:00:00:00:00:02")
        / IP(src=src, dst="10.79.0.10")
        / UDP(sport=4000, dport=5000)
        / b"x"
    )


def _v6(src: str) -> bytes:
    return bytes(
        Ether(dst="02:00:00:00:00:01", src="02:00:00:00:00:02")
        / IPv6(src=src, dst="fd00:9::1")
        / UDP(sport=4000, dport=5000)
        / b"x"
    )


PASSED = [
    # (source, counter)
    ("0.0.0.0", "martian_source"),  # DHCP discover
    ("0.1.2.3", "martian_source"),  # 0.0.0.0/8
    ("127.0.0.1", "martian_source"),
    ("127.255.255.254", "martian_source"),
    ("224.0.0.1", "martian_source"),
    ("239.255.255.255", "martian_source"),
    ("255.255.255.255", "martian_source"),  # limited broadcast
    ("169.254.1.1", "link_local"),
    ("::", "martian_source"),  # duplicate address detection
    ("::1", "martian_source"),
    ("ff02::1", "martian_source"),
    ("ff05::1:3", "martian_source"),
    ("::ffff:10.50.0.7", "martian_source"),  # IPv4-mapped in an IPv6 header
    ("::ffff:0.0.0.0", "martian_source"),
    ("fe80::1", "link_local"),
]


@pytest.mark.parametrize(("src", "counter"), PASSED)
def test_sources_no_client_has_pass_untouched(fresh: BpfShardTable, src: str, counter: str) -> None:
    # A catch-all pin must not rescue them either: the source check comes first.
    fresh.apply(make_assignment(_shards(), pins={"0.0.0.0/0": "shard-1", "::/0": "shard-2"}))
    events(fresh)
    pkt = _v6(src) if ":" in src else _v4(src)
    before_c, before_s = fresh.read_counters(), fresh.read_stats()
    res = libbpf.prog_test_run(fresh.prog_fd, pkt)
    assert (res.retval, res.mark, res.data) == (TC_ACT_OK, 0, pkt)
    assert counters_delta(before_c, fresh.read_counters()) == {counter: 1}
    assert fresh.read_stats() == before_s
    assert events(fresh) == []


NEIGHBOURS = [
    "1.0.0.1",
    "126.255.255.255",
    "128.0.0.1",
    "169.253.255.255",
    "169.255.0.1",
    "223.255.255.255",
    "240.0.0.1",
    "255.255.255.254",
    "::2",
    "::1:0:0:1",
    "::fffe:a32:7",
    "1::ffff:a32:7",
    "fe00::1",
    "fec0::1",
    "fd00:1::1",
]


@pytest.mark.parametrize("src", NEIGHBOURS)
def test_neighbouring_sources_are_still_steered(fresh: BpfShardTable, src: str) -> None:
    fresh.apply(make_assignment(_shards()))
    pkt = _v6(src) if ":" in src else _v4(src)
    before = fresh.read_counters()
    res = libbpf.prog_test_run(fresh.prog_fd, pkt)
    assert shard_of(res) == expected_maglev(fresh, src)
    assert counters_delta(before, fresh.read_counters()) == {}
    assert [e.reason for e in events(fresh)] == ["maglev"]


def test_the_pass_reason_reaches_the_agent_metrics(fresh: BpfShardTable) -> None:
    from adaptermesh.agent.backends import TableDatapath
    from adaptermesh.agent.metrics import AgentMetrics

    fresh.apply(make_assignment(_shards()))
    dp = TableDatapath(fresh)
    before = dp.read_counters()
    for src in ("0.0.0.0", "127.0.0.1", "::", "ff02::1"):
        libbpf.prog_test_run(fresh.prog_fd, _v6(src) if ":" in src else _v4(src))
    assert dp.read_counters().martian_source - before.martian_source == 4
    counters = dataclasses.asdict(dp.read_counters())  # what the agent's load reporter reads
    metrics = AgentMetrics()
    metrics.bind_rates(dict, lambda: counters)
    value = metrics.registry.get_sample_value(
        "adaptermesh_agent_classifier_passed_packets_total", {"reason": "martian_source"}
    )
    assert value == counters["martian_source"]


@pytest.mark.parametrize("src", [s for s, _ in PASSED] + NEIGHBOURS)
def test_fake_table_passes_and_steers_the_same_sources(fresh: BpfShardTable, src: str) -> None:
    # Contract: agent tests trust FakeShardTable.classify; it must pass, count and steer
    # exactly the sources the BPF program does.
    from adaptermesh.bpf.table import FakeShardTable

    a = make_assignment(_shards())
    fresh.apply(a)
    fake = FakeShardTable(maglev_size=fresh.maglev_size)
    fake.apply(a)
    pkt = _v6(src) if ":" in src else _v4(src)
    before = fresh.read_counters()
    res = libbpf.prog_test_run(fresh.prog_fd, pkt)
    real_delta = counters_delta(before, fresh.read_counters())
    fb = fake.read_counters()
    got = fake.classify(src)
    fake_delta = counters_delta(fb, fake.read_counters())
    assert got == shard_of(res)
    assert fake_delta == real_delta
