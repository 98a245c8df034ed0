"""How the datapath treats pins whose prefix covers the IPv4-mapped space (::ffff:0:0/96).

IPv4 sources are keyed ``::ffff:a.b.c.d``, so such a pin is also an IPv4 pin. The Assignment
rules are to refuse these pins at write time; until then these tests pin down what the
classifier does with one (docs/classifier.md, "Pins that cover the IPv4-mapped space").
"""

from __future__ import annotations

import pytest
from scapy.layers.inet import IP, UDP
from scapy.layers.inet6 import IPv6
from scapy.layers.l2 import Ether

from adaptermesh.bpf import libbpf
from adaptermesh.bpf.loader import BpfShardTable

from .helpers import S, make_assignment
from .test_prog_run import MARKS, counters_delta, events, expected_maglev, shard_of

pytestmark = pytest.mark.root


def _shards() -> list[S]:
    return [S(f"shard-{i}", i, w, ("mark", MARKS[i])) for i, w in enumerate((5000, 3000, 2000))]


def _run(table: BpfShardTable, src: str) -> int | None:
    if ":" in src:
        pkt = bytes(Ether() / IPv6(src=src, dst="fd00:9::1") / UDP() / b"x")
    else:
        pkt = bytes(Ether() / IP(src=src, dst="10.79.0.10") / UDP() / b"x")
    return shard_of(libbpf.prog_test_run(table.prog_fd, pkt))


def test_v4_mapped_slash_96_is_an_ipv4_catch_all(fresh: BpfShardTable) -> None:
    # ::ffff:0:0/96 is the very key 0.0.0.0/0 has (prefixlen 96): every IPv4 source matches.
    fresh.apply(make_assignment(_shards(), pins={"::ffff:0:0/96": "shard-2"}))
    assert set(fresh.read_pins()) == {(96, bytes(10) + b"\xff\xff" + bytes(4))}
    for src in ("10.50.0.7", "192.0.2.1", "203.0.113.9"):
        assert _run(fresh, src) == 2
    assert {e.reason for e in events(fresh)} == {"pin"}
    # IPv6 sources are untouched by it.
    for src in ("fd00:2::77", "2001:db8::1"):
        assert _run(fresh, src) == expected_maglev(fresh, src)


def test_v4_mapped_prefix_is_the_same_as_the_ipv4_spelling(fresh: BpfShardTable) -> None:
    fresh.apply(make_assignment(_shards(), pins={"::ffff:10.50.0.0/112": "shard-1"}))
    assert set(fresh.read_pins()) == {(112, bytes(10) + b"\xff\xff" + bytes([10, 50, 0, 0]))}
    assert _run(fresh, "10.50.3.4") == 1
    assert _run(fresh, "10.51.0.1") == expected_maglev(fresh, "10.51.0.1")


def test_slash_1_pins_all_ipv4_and_half_the_ipv6_space(fresh: BpfShardTable) -> None:
    # ::/1 (first bit 0) holds ::ffff:0:0/96 and 2000::/3: IPv4 and global unicast IPv6 alike.
    fresh.apply(make_assignment(_shards(), pins={"::/1": "shard-0", "10.60.7.0/24": "shard-2"}))
    for src in ("10.50.0.7", "192.0.2.1", "2001:db8::1", "2600::5"):
        assert _run(fresh, src) == 0
    assert _run(fresh, "10.60.7.1") == 2  # a longer IPv4 pin still wins
    for src in ("fd00:2::77", "8000::1"):  # first bit 1: outside ::/1
        assert _run(fresh, src) == expected_maglev(fresh, src)


def test_mapped_ipv6_sources_cannot_borrow_an_ipv4_pin(fresh: BpfShardTable) -> None:
    # An IPv6 header carrying ::ffff:10.50.0.7 has the IPv4 tenant's key; it is never steered.
    fresh.apply(make_assignment(_shards(), pins={"10.50.0.0/16": "shard-2"}))
    events(fresh)
    before = fresh.read_counters()
    assert _run(fresh, "::ffff:10.50.0.7") is None
    assert counters_delta(before, fresh.read_counters()) == {"martian_source": 1}
    assert events(fresh) == []
    assert _run(fresh, "10.50.0.7") == 2
