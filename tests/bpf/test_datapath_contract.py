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
