"""Pin updates: the incremental pin diff against an independent model of am_pins.

The root tests drive a real BpfShardTable (not attached to any interface) through random
sequences of pin lists, valid and invalid, and compare the map's content with the expected
set after every step. The others check the fast CIDR parser against ipaddress.
"""

from __future__ import annotations

import ipaddress
import os
import secrets
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from adaptermesh.bpf.loader import BpfShardTable
from adaptermesh.bpf.table import (
    AssignmentError,
    FakeShardTable,
    _fast_pin_key,
    lpm_key,
    validate_assignment,
)
from adaptermesh.proto import assignment_pb2 as pb

from .helpers import S, make_assignment

# Prefixes with more than one spelling, so a pin can leave under one and come back under
# another (the same LPM key).
PREFIXES: list[tuple[str, ...]] = [
    ("10.1.0.0/16",),
    ("10.1.2.0/24",),
    ("10.1.2.3/32",),
    ("192.0.2.0/24",),
    ("0.0.0.0/0",),
    ("fd00::/64", "fd00:0::/64", "FD00::/64"),
    ("fd00:0:0:1::/64", "fd00:0:0:1:0:0:0:0/64"),
    ("2001:db8::/32",),
    ("::ffff:10.9.0.0/112", "::ffff:a09:0/112"),
    ("::/0",),
] + [(f"172.20.{k}.0/24",) for k in range(20)]
SHARD_IDS = ("s0", "s1", "s2")


def shards(index_base: int = 0) -> list[S]:
    return [
        S(sid, index_base + i, (5000, 3000, 2000)[i], ("mark", 0x300 + i))
        for i, sid in enumerate(SHARD_IDS)
    ]


def key_of(cidr: str) -> tuple[int, bytes]:
    return lpm_key(ipaddress.ip_network(cidr, strict=True))


@st.composite
def pin_lists(draw: st.DrawFn) -> list[tuple[str, str]]:
    """A valid pin list: distinct prefixes, any spelling, any order, any shard."""
    chosen = draw(st.lists(st.sampled_from(range(len(PREFIXES))), unique=True, max_size=25))
    return [(draw(st.sampled_from(PREFIXES[i])), draw(st.sampled_from(SHARD_IDS))) for i in chosen]


BREAKERS = {
    "cidr": ("10.1.0.0/33", "cidr"),
    "host_bits": ("10.1.2.3/16", "cidr"),
    "garbage": ("not-a-cidr", "cidr"),
    "unknown_shard": ("198.51.100.0/24", "shard_id"),
    "duplicate": (None, "cidr"),
}


def broken(pins: list[tuple[str, str]], how: str, at: int) -> tuple[list[tuple[str, str]], str]:
    """``pins`` with one bad pin inserted at ``at``; returns the list and the field named."""
    cidr, which = BREAKERS[how]
    sid = "ghost" if how == "unknown_shard" else "s0"
    if how == "duplicate":
        # the same prefix as an existing pin, in another spelling where there is one
        if not pins:
            pins = [("10.1.0.0/16", "s1")]
        first = pins[0][0]
        spellings = next(p for p in PREFIXES if first in p)
        cidr = spellings[-1] if spellings[-1] != first else first
        at = max(at, 1)
    at = min(at, len(pins))
    assert cidr is not None
    return [*pins[:at], (cidr, sid), *pins[at:]], f"pins[{at}].{which}"


def assignment(pins: list[tuple[str, str]], index_base: int = 0) -> pb.Assignment:
    a = make_assignment(shards(index_base))
    for cidr, sid in pins:
        a.pins.add(cidr=cidr, shard_id=sid)
    return a


def expected(pins: list[tuple[str, str]], index_base: int = 0) -> dict[tuple[int, bytes], int]:
    index = {sid: index_base + i for i, sid in enumerate(SHARD_IDS)}
    return {key_of(c): index[s] for c, s in pins}


@pytest.fixture(scope="module")
def pin_table() -> Iterator[BpfShardTable]:
    if os.geteuid() != 0:
        pytest.skip("needs root")
    path = Path(f"/sys/fs/bpf/amb-test-{secrets.token_hex(4)}")
    tb = BpfShardTable("lo", pin_dir=str(path), maglev_size=251)
    try:
        yield tb
    finally:
        tb.close(unpin=True)
        shutil.rmtree(path, ignore_errors=True)


step = st.tuples(
    pin_lists(),
    st.sampled_from([None, *BREAKERS]),  # None: a valid step
    st.integers(0, 30),  # where the bad pin goes
    st.sampled_from(["delta", "renumber", "other_table", "no_batch_delete"]),
)


@pytest.mark.root
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps=st.lists(step, min_size=1, max_size=8))
def test_am_pins_matches_the_pin_list_after_every_apply(
    pin_table: BpfShardTable,
    steps: list[tuple[list[tuple[str, str]], str | None, int, str]],
) -> None:
    tb = pin_table
    base = 0
    tb.apply(assignment([], base))  # start empty
    assert tb.read_pins() == {}
    want: dict[tuple[int, bytes], int] = {}
    for pins, bad, at, twist in steps:
        if twist == "renumber":
            base = 3 - base  # shard indices move: the pins' targets all change
        elif twist == "other_table":
            # another table validates other pins in between: the delta base is not ours
            FakeShardTable(maglev_size=251).apply(assignment(pins[::-1][:3]))
        tb._batch_delete = twist != "no_batch_delete"
        if bad is None:
            tb.apply(assignment(pins, base))
            want = expected(pins, base)
        else:
            bad_pins, field = broken(pins, bad, at)
            before = tb.applied_version
            with pytest.raises(AssignmentError) as info:
                tb.apply(assignment(bad_pins, base))
            assert info.value.field == field
            assert tb.applied_version == before
            if twist == "renumber":
                base = 3 - base  # that apply never happened
        assert tb.read_pins() == want
    tb._batch_delete = True


@pytest.mark.root
def test_a_small_change_to_many_pins_writes_only_the_change(pin_table: BpfShardTable) -> None:
    tb = pin_table
    pins = [
        (f"172.{16 + k // 65536}.{k // 256 % 256}.{k % 256}/32", SHARD_IDS[k % 3])
        for k in range(10_000)
    ]
    tb.apply(assignment(pins))
    assert len(tb.read_pins()) == 10_000
    nxt = list(pins)
    for k in range(0, 30):  # moved to another shard
        nxt[k] = (nxt[k][0], SHARD_IDS[(k + 1) % 3])
    for k in range(30, 60):  # a new CIDR in place of an old one
        nxt[k] = (f"100.64.0.{k}/32", nxt[k][1])
    del nxt[100:140]  # removed
    nxt[5000:5000] = [(f"100.65.0.{k}/32", "s2") for k in range(40)]  # added mid-list
    tb.apply(assignment(nxt))
    la = tb.last_apply
    assert la is not None
    assert (la.pins_written, la.pins_deleted) == (30 + 30 + 40, 30 + 40)
    assert tb.read_pins() == expected(nxt)
    tb.apply(assignment(nxt))  # unchanged: no pin work at all
    la = tb.last_apply
    assert la is not None
    assert (la.pins_written, la.pins_deleted) == (0, 0)
    tb.apply(assignment([]))
    assert tb.read_pins() == {}


def test_validated_pins_match_a_fresh_walk_through_any_sequence() -> None:
    """The delta path's result equals the plain pin-by-pin parse, whatever came before."""

    @settings(max_examples=40, deadline=None)
    @given(seq=st.lists(st.tuples(pin_lists(), st.booleans()), min_size=1, max_size=6))
    def run(seq: list[tuple[list[tuple[str, str]], bool]]) -> None:
        prev: dict[tuple[int, bytes], int] | None = None
        for pins, renumber in seq:
            base = 3 if renumber else 0
            plan = validate_assignment(assignment(pins, base))
            assert plan.pins == expected(pins, base)
            d = plan.pins_delta
            if d is not None:
                assert prev is None or d.base is prev
                rebuilt = {k: v for k, v in d.base.items() if k not in d.deletes}
                rebuilt.update(d.upserts)
                assert rebuilt == plan.pins
                assert not set(d.deletes) & set(plan.pins)
            prev = plan.pins

    run()


_V4 = st.tuples(*[st.integers(0, 255)] * 4).map(lambda t: ".".join(map(str, t)))
_V6 = st.lists(st.integers(0, 0xFFFF), min_size=8, max_size=8).map(
    lambda g: str(ipaddress.IPv6Address(":".join(f"{x:x}" for x in g)))
)
_NOISE = st.text(alphabet="0123456789abcdefABCDEF:./ x%", max_size=20)
_CIDRS = st.one_of(
    st.tuples(st.one_of(_V4, _V6), st.integers(0, 140)).map(lambda t: f"{t[0]}/{t[1]}"),
    st.tuples(_V4, st.integers(0, 32)).map(
        lambda t: f"{ipaddress.ip_network(f'{t[0]}/{t[1]}', strict=False)}"
    ),
    st.tuples(_V6, st.integers(0, 128)).map(
        lambda t: f"{ipaddress.ip_network(f'{t[0]}/{t[1]}', strict=False)}"
    ),
    _NOISE,
    st.sampled_from(
        [
            "010.1.0.0/16",
            "10.1.0.0/016",
            "10.1.0.0/255.255.0.0",
            "1.2.3/8",
            "::ffff:1.2.3.0/120",
            "fd00::/64 ",
            "fd00::%eth0/64",
            "1.2.3.4/٣",
        ]
    ),
)


@settings(max_examples=400, deadline=None)
@given(cidr=_CIDRS)
def test_fast_cidr_parser_agrees_with_ipaddress(cidr: str) -> None:
    fast = _fast_pin_key(cidr)
    try:
        slow: tuple[int, bytes] | None = key_of(cidr)
    except ValueError:
        slow = None
    if fast is not None:  # where the fast path answers, it gives ipaddress' answer
        assert fast == slow
    if slow is None:
        assert fast is None


@pytest.mark.root
@pytest.mark.parametrize("size", [10, 400])  # below and above the helper-thread threshold
def test_a_failed_pin_write_is_reported_and_the_next_apply_is_exact(
    pin_table: BpfShardTable, size: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    tb = pin_table
    first = [(f"198.18.{k // 256}.{k % 256}/32", "s1") for k in range(size)]
    tb.apply(assignment(first))
    second = [(f"198.19.{k // 256}.{k % 256}/32", "s2") for k in range(size)]

    def refuse(keys: list[tuple[int, bytes]]) -> None:
        raise OSError(5, "injected delete failure")

    monkeypatch.setattr(tb, "_delete_pins", refuse)
    with pytest.raises(OSError, match="injected"):
        tb.apply(assignment(second))
    monkeypatch.undo()
    # the upserts went in, the deletes did not: the loader re-read the map ...
    assert tb.read_pins() == expected(first) | expected(second)
    tb.apply(assignment(second))  # ... so this apply removes exactly the leftovers
    assert tb.read_pins() == expected(second)
    tb.apply(assignment([]))
