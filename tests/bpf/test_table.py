"""Assignment validation and the FakeShardTable (no root needed)."""

from __future__ import annotations

import pytest

from adaptermesh.bpf.table import AssignmentError, FakeShardTable, ShardTable
from adaptermesh.proto import assignment_pb2 as pb

from .helpers import S, make_assignment


def good() -> pb.Assignment:
    return make_assignment(
        [
            S("a", 0, 5000, ("mark", 0x100)),
            S("b", 1, 5000, ("mark", 0x101)),
            S("c", 2, 0, ("mark", 0x102), draining=True),
        ],
        pins={"10.1.0.0/16": "a"},
    )


def mutate(fn: object) -> pb.Assignment:
    a = good()
    fn(a)  # type: ignore[operator]
    return a


BAD = {
    "shards[1].index": lambda a: setattr(a.shards[1], "index", 0),
    "shards[0].index": lambda a: setattr(a.shards[0], "index", 256),
    "shards[1].id": lambda a: setattr(a.shards[1], "id", "a"),
    "shards.weight": lambda a: setattr(a.shards[0], "weight", 4000),
    "shards[0].weight": lambda a: setattr(a.shards[0], "weight", 10001),
    "shards[2].state": lambda a: setattr(a.shards[2], "state", pb.SHARD_STATE_UNSPECIFIED),
    "pins[0].cidr": lambda a: setattr(a.pins[0], "cidr", "10.1.0.0/33"),
    "pins[1].shard_id": lambda a: a.pins.add(cidr="10.2.0.0/16", shard_id="nope"),
    "pins[1].cidr": lambda a: a.pins.add(cidr="10.1.0.0/16", shard_id="b"),
    "overrides[0].shard_id": lambda a: a.overrides.add(shard_id="ghost", weight=1),
    "shards[0].steer.mark.mark": lambda a: setattr(a.shards[0].steer.mark, "mark", 0),
    "shards[0].steer.tunnel": lambda a: (
        setattr(a.shards[0].steer.tunnel, "remote_ipv4", "10.0.0.1"),
        setattr(a.shards[0].steer.tunnel, "vni", 5),
    ),
    "shards[0].steer.tunnel.remote_ipv4": lambda a: setattr(
        a.shards[0].steer.tunnel, "remote_ipv4", "300.1.1.1"
    ),
    "shards[0].steer.redirect.ifname": lambda a: setattr(
        a.shards[0].steer.redirect, "ifname", "nosuchif"
    ),
    "shards[0].steer.redirect.dst_mac": lambda a: (
        setattr(a.shards[0].steer.redirect, "ifindex", 3),
        setattr(a.shards[0].steer.redirect, "dst_mac", "zz:00:00:00:00:00"),
    ),
    "shards": lambda a: [
        a.shards.add(id=f"x{i}", index=3 + i, state=pb.SHARD_STATE_DRAINING) for i in range(300)
    ],
}


@pytest.mark.parametrize("field", sorted(BAD))
def test_bad_assignment_names_the_field_and_changes_nothing(field: str) -> None:
    fake = FakeShardTable(maglev_size=251)
    fake.apply(good())
    before = (fake.plan, list(fake.table), fake.applied_version)
    bad = mutate(BAD[field])
    bad.version = 10**6
    with pytest.raises(AssignmentError) as info:
        fake.apply(bad)
    assert info.value.field == field
    assert str(info.value).startswith(f"{field}: ")
    assert (fake.plan, list(fake.table), fake.applied_version) == before


def test_cidr_with_host_bits_is_invalid() -> None:
    a = good()
    a.pins[0].cidr = "10.1.2.3/16"
    with pytest.raises(ValueError, match=r"pins\[0\]\.cidr"):
        FakeShardTable(maglev_size=251).apply(a)


def test_version_may_repeat_but_never_go_back() -> None:
    fake = FakeShardTable(maglev_size=251)
    a = good()
    fake.apply(a)
    fake.apply(a)
    older = good()
    older.version = a.version - 1
    with pytest.raises(AssignmentError, match=r"^version: "):
        fake.apply(older)


def test_fake_follows_the_classifier_decision_order() -> None:
    fake = FakeShardTable(maglev_size=251)
    assert isinstance(fake, ShardTable)
    fake.apply(good())
    assert fake.classify("10.1.2.3") == 0  # pinned
    src = next(f"10.9.0.{k}" for k in range(256) if fake.classify(f"10.9.0.{k}") == 1)
    # drain shard b: its sticky flow is re-picked onto a, never kept on b
    fake.apply(make_assignment([S("a", 0, 10000), S("b", 1, 0, draining=True)]))
    assert fake.classify(src) == 0
    events: list[object] = []
    fake.poll_events(events.append)
    assert [e.reason for e in events][-1] == "repick"  # type: ignore[attr-defined]
    assert fake.read_stats()[0].new_flows >= 2


def test_empty_assignment_is_valid_and_steers_nothing() -> None:
    fake = FakeShardTable(maglev_size=251)
    fake.apply(pb.Assignment(version=1))
    assert fake.classify("10.0.0.1") is None


def test_a_redirect_by_name_is_resolved_on_every_apply() -> None:
    """Validated shards are remembered by content, but an interface name may stop existing."""
    fake = FakeShardTable(maglev_size=251, interfaces={"amb-eth9": 7})
    a = make_assignment([S("a", 0, 10000, ("redirect", "amb-eth9", ""))])
    fake.apply(a)
    assert fake.plan is not None
    assert fake.plan.shards[0].steer.ifindex == 7
    fake.interfaces.clear()
    a.version += 1
    with pytest.raises(AssignmentError) as info:
        fake.apply(a)
    assert info.value.field == "shards[0].steer.redirect.ifname"
