"""One suite, two datapaths: the agent tests' FakeDatapath and the real BPF table (root).

Every Assignment here is accepted by both or refused by both, naming the same field, and a
refused one leaves the applied version where it was. The fake's answers are then the
classifier's, and the agent tests that trust the fake test what a node would do.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from agent.fakes import FakeDatapath
from agent.fakes import make_assignment as agent_assignment

from adaptermesh.bpf import libbpf
from adaptermesh.bpf.loader import BpfShardTable
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
            assert fake.classify(s) == shard_of(libbpf.prog_test_run(fresh.prog_fd,
                                                                   udp4_fast(s))), s

    for weights, draining in (((5000, 3000, 2000), ()), ((6000, 4000, 0), (2,)),
                              ((1000, 2000, 7000), ())):
        a = bpf_assignment(_mark_shards(weights, draining), pins=pins)
        fresh.apply(a)
        fake.apply(a)
        compare()
