"""One suite, two datapaths: the agent tests' FakeDatapath and the real BPF table (root).

Every Assignment here is accepted by both or refused by both, naming the same field, and a
refused one leaves the applied version where it was. The fake's answers are then the
classifier's, and the agent tests that trust the fake test what a node would do.
"""

from __future__ import annotations

import ipaddress
import itertools
from collections.abc import Callable

import pytest
from agent.fakes import FakeDatapath
from agent.fakes import make_assignment as agent_assignment
from hypothesis import given, settings
from hypothesis import strategies as st

from adaptermesh.bpf import libbpf
from adaptermesh.bpf.loader import BpfShardTable
from adaptermesh.bpf.table import FakeShardTable
from adaptermesh.proto.adaptermesh.v1 import assignment_pb2

from .helpers import next_version

pytestmark = pytest.mark.root

Make = Callable[[int], assignment_pb2.Assignment]


def _valid(v: int) -> assignment_pb2.Assignment:
    return agent_assignment(v, {"a": 6000, "b": 4000}, pins={"10.70.0.0/16": "b"})


def _short_budget(v: int) -> assignment_pb2.Assignment:
    return agent_assignment(v, {"a": 6000, "b": 3000})


def _bad_cidr(v: int) -> assignment_pb2.Assignment:
    return agent_assignment(v, pins={"10.70.0.0/33": "a"})


def _unknown_pin_target(v: int) -> assignment_pb2.Assignment:
    return agent_assignment(v, pins={"10.70.0.0/16": "nope"})


def _duplicate_index(v: int) -> assignment_pb2.Assignment:
    a = agent_assignment(v)
    a.shards[1].index = a.shards[0].index
    return a


def _duplicate_pin(v: int) -> assignment_pb2.Assignment:
    a = agent_assignment(v)
    a.pins.add(cidr="10.70.0.0/16", shard_id="a")
    a.pins.add(cidr="10.70.0.0/16", shard_id="b")
    return a


REFUSED: list[tuple[Make, str]] = [
    (_short_budget, "shards.weight"),
    (_bad_cidr, "pins[0].cidr"),
    (_unknown_pin_target, "pins[0].shard_id"),
    (_duplicate_index, "shards[1].index"),
    (_duplicate_pin, "pins[1].cidr"),
]


@pytest.fixture(params=["fake", "bpf"])
def datapath(request: pytest.FixtureRequest) -> FakeDatapath | BpfShardTable:
    if request.param == "fake":
        return FakeDatapath()
    table: BpfShardTable = request.getfixturevalue("fresh")
    return table


def test_a_valid_assignment_is_applied(datapath: FakeDatapath | BpfShardTable) -> None:
    datapath.apply(_valid(next_version()))


@pytest.mark.parametrize(("make", "field"), REFUSED, ids=[f for _, f in REFUSED])
def test_a_refused_assignment_names_the_field(
    datapath: FakeDatapath | BpfShardTable, make: Make, field: str
) -> None:
    datapath.apply(_valid(next_version()))
    with pytest.raises(ValueError) as refused:
        datapath.apply(make(next_version()))
    assert str(refused.value).startswith(f"{field}:"), refused.value
    # Still serving the valid one: a refusal changes nothing.
    datapath.apply(_valid(next_version()))


def test_fake_table_classifies_like_the_program(fresh: BpfShardTable) -> None:
    # Agent tests trust FakeShardTable.classify: the same packets must land on the same
    # shards as in the BPF program, through pins, a pin to a draining shard, Maglev and the
    # sticky flows that outlive a weight change.
    from adaptermesh.bpf.table import FakeShardTable

    from .helpers import make_assignment as bpf_assignment
    from .test_prog_run import _mark_shards, shard_of, udp4_fast

    pins = {"10.64.1.0/24": "shard-1", "10.64.2.0/24": "shard-2", "10.64.3.7/32": "shard-0"}
    fake = FakeShardTable(maglev_size=fresh.maglev_size)
    srcs = [f"10.64.{k // 100}.{k % 100}" for k in range(400)] + ["10.64.3.7"]

    def compare() -> None:
        for s in srcs:
            assert fake.classify(s) == shard_of(
                libbpf.prog_test_run(fresh.prog_fd, udp4_fast(s))
            ), s

    for weights, draining in (
        ((5000, 3000, 2000), ()),
        ((6000, 4000, 0), (2,)),
        ((1000, 2000, 7000), ()),
    ):
        a = bpf_assignment(_mark_shards(weights, draining), pins=pins)
        fresh.apply(a)
        fake.apply(a)
        compare()


# -- FakeShardTable.classify against the program, on drawn assignments and sources ----------

_BUDGET = 10_000


@st.composite
def _weights(draw: st.DrawFn) -> tuple[tuple[int, int, int], tuple[int, ...]]:
    """Three shards' weights and the draining ones (weight 0); ACTIVE weights sum to the budget."""
    draining = tuple(sorted(draw(st.sets(st.integers(0, 2), max_size=2))))
    active = [i for i in range(3) if i not in draining]
    cuts = sorted(
        draw(st.lists(st.integers(0, _BUDGET), min_size=len(active) - 1, max_size=len(active) - 1))
    )
    shares = [b - a for a, b in itertools.pairwise([0, *cuts, _BUDGET])]
    weights = [0, 0, 0]
    for i, w in zip(active, shares, strict=True):
        weights[i] = w
    return (weights[0], weights[1], weights[2]), draining


_networks = st.one_of(
    st.tuples(st.ip_addresses(v=4, network="10.0.0.0/8"), st.integers(8, 32)),
    st.tuples(st.ip_addresses(v=6, network="fd00::/16"), st.integers(16, 128)),
).map(lambda t: ipaddress.ip_network(f"{t[0]}/{t[1]}", strict=False))


def _inside(draw: st.DrawFn, net: ipaddress.IPv4Network | ipaddress.IPv6Network) -> str:
    return str(net.network_address + draw(st.integers(0, net.num_addresses - 1)))


def _packet(src: str) -> bytes:
    from scapy.layers.inet import IP, UDP
    from scapy.layers.inet6 import IPv6
    from scapy.layers.l2 import Ether

    ip = IP(src=src, dst="10.79.0.10") if ":" not in src else IPv6(src=src, dst="fd00:9::1")
    return bytes(
        Ether(dst="02:00:00:00:00:01", src="02:00:00:00:00:02")
        / ip
        / UDP(sport=4000, dport=5000)
        / b"payload"
    )


@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_fake_table_classifies_drawn_traffic_like_the_program(
    table: BpfShardTable, data: st.DataObject
) -> None:
    # Assignments in sequence (so sticky flows meet weight changes, drains and new pins),
    # sources anywhere (martian, link-local, IPv4, IPv6) and inside the pins: the program
    # and the fake pick the same shard for every packet and report the same new flows.
    from .helpers import make_assignment as bpf_assignment
    from .test_prog_run import _mark_shards, shard_of

    table.clear_flows()
    table.poll_events(lambda _e: None, 0)
    fake = FakeShardTable(maglev_size=table.maglev_size)
    for _ in range(data.draw(st.integers(1, 3), label="assignments")):
        weights, draining = data.draw(_weights(), label="weights, draining")
        nets = data.draw(st.lists(_networks, max_size=4, unique=True), label="pins")
        pins = {str(net): f"shard-{data.draw(st.integers(0, 2))}" for net in nets}
        a = bpf_assignment(_mark_shards(weights, draining), pins=pins)
        table.apply(a)
        fake.apply(a)
        sources = data.draw(
            st.lists(st.one_of(st.ip_addresses(v=4), st.ip_addresses(v=6)), max_size=12),
            label="sources",
        )
        srcs = [str(s) for s in sources] + [_inside(data.draw, n) for n in nets]
        srcs += srcs[: data.draw(st.integers(0, len(srcs)), label="repeats")]
        for s in srcs:
            got = shard_of(libbpf.prog_test_run(table.prog_fd, _packet(s)))
            assert fake.classify(s) == got, (s, weights, draining, pins)
        assert _new_flows(table) == _new_flows(fake)


def _new_flows(datapath: BpfShardTable | FakeShardTable) -> list[tuple[str, int, str]]:
    out: list[tuple[str, int, str]] = []
    datapath.poll_events(lambda e: out.append((str(e.source), e.shard, e.reason)), 0)
    return out
