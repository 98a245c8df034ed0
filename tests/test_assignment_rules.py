"""The Assignment rules: one module, each limit once, each refusal naming its field."""

from __future__ import annotations

import pytest

from adaptermesh import assignment_rules as rules
from adaptermesh.bpf import table
from adaptermesh.bpf.table import FakeShardTable
from adaptermesh.mesh import snapshot
from adaptermesh.proto import assignment_pb2 as pb


def good() -> pb.Assignment:
    a = pb.Assignment(version=7, reason="test")
    for i, w in enumerate((6000, 4000, 0)):
        s = a.shards.add(
            id=f"s{i}",
            index=i,
            weight=w,
            state=pb.SHARD_STATE_DRAINING if i == 2 else pb.SHARD_STATE_ACTIVE,
            service_address="10.9.0.1",
            service_port=9000 + i,
        )
        s.endpoints.add(address=f"10.0.{i}.1", port=8000, weight=1)
        s.steer.mark.mark = 0x100 + i
    a.pins.add(cidr="10.1.0.0/16", shard_id="s0")
    a.pins.add(cidr="fe80::/64", shard_id="s1")
    a.overrides.add(shard_id="s0", weight=6000)
    return a


def _shards(n: int):  # type: ignore[no-untyped-def]
    def add(a: pb.Assignment) -> None:
        for i in range(n):
            a.shards.add(id=f"x{i}", index=3 + i, state=pb.SHARD_STATE_DRAINING)

    return add


def _pins(n: int):  # type: ignore[no-untyped-def]
    def add(a: pb.Assignment) -> None:
        for i in range(n):
            a.pins.add(cidr=f"11.{i // 256}.{i % 256}.0/24", shard_id="s0")

    return add


def _big(a: pb.Assignment) -> None:
    """Each part within its own limit, the whole over MAX_ASSIGNMENT_BYTES."""
    for s in a.shards:
        s.endpoints[0].adapters.extend(
            [f"{s.id}-{k:04d}-" + "a" * 248 for k in range(rules.MAX_ADAPTERS_PER_ENDPOINT)]
        )


EXAMPLES = {
    "shards[0].steer.mark.mark": lambda a: setattr(a.shards[0].steer.mark, "mark", 0),
    "shards[0].steer.tunnel.vni": lambda a: (
        setattr(a.shards[0].steer.tunnel, "remote_ipv4", "192.0.2.1"),
        setattr(a.shards[0].steer.tunnel, "vni", 1 << 24),
    ),
    "shards[1].steer.tunnel.vni": lambda a: (
        setattr(a.shards[1].steer.tunnel, "remote_ipv4", "192.0.2.1"),
        setattr(a.shards[1].steer.tunnel, "vni", 0),
    ),
    "shards[0].steer.tunnel.inner_dst_mac": lambda a: (
        setattr(a.shards[0].steer.tunnel, "remote_ipv4", "192.0.2.1"),
        setattr(a.shards[0].steer.tunnel, "vni", 5),
        setattr(a.shards[0].steer.tunnel, "inner_dst_mac", "00:11:22:33:44"),
    ),
    "shards[0].steer.tunnel.remote_ipv4": lambda a: (
        setattr(a.shards[0].steer.tunnel, "remote_ipv4", "999.1.1.1"),
        setattr(a.shards[0].steer.tunnel, "vni", 5),
    ),
    "shards": _shards(rules.MAX_SHARDS - 2),  # 3 + 254 = 257
    "pins": _pins(rules.MAX_PINS - 1),  # 2 + 16,383 = 16,385
    "pins[2].cidr": lambda a: a.pins.add(cidr="fe80::%eth0/64", shard_id="s0"),
    "pins[3].cidr": lambda a: (
        a.pins.add(cidr="10.2.0.0/16", shard_id="s0"),
        a.pins.add(cidr="10.2.0.0/16", shard_id="s1"),
    ),
    "pins[1].shard_id": lambda a: setattr(a.pins[1], "shard_id", "s2"),  # DRAINING
    "overrides[0].shard_id": lambda a: setattr(a.overrides[0], "shard_id", "s2"),
    "shards[1].endpoints[0].address": lambda a: setattr(
        a.shards[1].endpoints[0], "address", "10.0.0.1:8000"
    ),
    "shards[2].endpoints[0].address": lambda a: setattr(
        a.shards[2].endpoints[0], "address", "999.1.1.1"
    ),
    "shards[0].endpoints[0].weight": lambda a: setattr(a.shards[0].endpoints[0], "weight", 0),
    "shards[1].index": lambda a: setattr(a.shards[1], "index", 256),
    "shards[2].weight": lambda a: setattr(a.shards[2], "weight", 5),
    "shards.weight": lambda a: setattr(a.shards[0], "weight", 5000),
    "shards[1].id": lambda a: setattr(a.shards[1], "id", "S1!"),
    "reason": lambda a: setattr(a, "reason", "r" * (rules.MAX_REASON + 1)),
    "assignment": lambda a: _big(a),
}


def test_good_passes_every_rule_set() -> None:
    a = good()
    a.shards[1].service_port = 9000  # a shared VIP:port is fine (one shard per Envoy)
    rules.check_assignment(a)
    for s in a.shards:  # what each shard's Envoy gets (xds_group "shard")
        snapshot.validate_assignment(pb.Assignment(version=a.version, shards=[s]))
    FakeShardTable(maglev_size=251).apply(a)


@pytest.mark.parametrize("field", sorted(EXAMPLES))
def test_each_example_is_refused_naming_its_field(field: str) -> None:
    a = good()
    EXAMPLES[field](a)
    with pytest.raises(rules.RuleError) as info:
        rules.check_assignment(a)
    assert info.value.field == field, str(info.value)
    assert str(info.value).startswith(f"{field}: ")


def test_one_copy_of_each_limit_and_one_error_type() -> None:
    assert table.AM_MAX_SHARDS is rules.MAX_SHARDS or table.AM_MAX_SHARDS == rules.MAX_SHARDS
    assert table.AM_MAX_PINS == rules.MAX_PINS
    assert table.WEIGHT_BUDGET == rules.WEIGHT_BUDGET
    assert table.AssignmentError is rules.RuleError
    assert snapshot.AssignmentError is rules.RuleError


@pytest.mark.parametrize("cidr", ["fe80::1%eth0/128", "10.0.0.0/8 ", "10.0.0.1/8", "999.1.1.0/24"])
def test_the_datapath_parses_cidrs_by_the_shared_rule(cidr: str) -> None:
    a = good()
    a.pins.add(cidr=cidr, shard_id="s0")
    with pytest.raises(rules.RuleError) as info:
        FakeShardTable(maglev_size=251).apply(a)
    assert info.value.field == "pins[2].cidr"
    with pytest.raises(ValueError):  # ipaddress words it
        rules.cidr_network(cidr)


def test_normalise_cidr_gives_one_spelling_per_prefix() -> None:
    assert rules.normalise_cidr("fe80:0::/64") == rules.normalise_cidr("fe80::/64")
    with pytest.raises(rules.RuleError, match="zone"):
        rules.normalise_cidr("fe80::1%eth0/128")


def test_a_shard_as_written_needs_steering_or_a_service() -> None:
    bare = pb.Shard(id="s0", state=pb.SHARD_STATE_ACTIVE)
    bare.endpoints.add(address="10.0.0.1", port=8000, weight=1)
    with pytest.raises(rules.RuleError) as err:
        rules.check_shard(bare, "shard")
    assert err.value.field == "shard.steer"
    # As published (stored before this rule): still carried, so agents keep applying it.
    rules.check_shard(bare, "shards[0]", published=True)
    with_service = pb.Shard()
    with_service.CopyFrom(bare)
    with_service.service_address, with_service.service_port = "10.96.0.10", 8080
    rules.check_shard(with_service, "shard")
    steered = pb.Shard()
    steered.CopyFrom(bare)
    steered.steer.mark.mark = 7
    rules.check_shard(steered, "shard")


def test_long_input_is_quoted_as_a_prefix_and_its_length() -> None:
    with pytest.raises(rules.RuleError) as err:
        rules.normalise_cidr("1" * 1_000_000, "cidr")
    assert len(str(err.value)) < 400
    assert "(1000000 characters)" in str(err.value)
